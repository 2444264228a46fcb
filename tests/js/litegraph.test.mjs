import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { graphFromSpec } from "../../web/lib/graph.js";
import { inputLinkOf, linkOf, liteGraphView, nodeClass, outputTargetsOf } from "../../web/lib/litegraph.js";
import { buildEstimatePayload } from "../../web/lib/payload.js";
import { WAN_FILE, wanGraph } from "./fixtures/graphs.mjs";
import { fakeLiteGraph } from "./fixtures/litegraph.mjs";

describe("liteGraphView", () => {
  for (const kind of ["current", "map", "getLink", "object", "private"]) {
    it(`gives the same payload as the plain spec (links as ${kind})`, () => {
      const spec = wanGraph();
      const lg = fakeLiteGraph(spec, kind);
      const viaLiteGraph = buildEstimatePayload(liteGraphView(lg), 3, { vramGib: 24 });
      const viaSpec = buildEstimatePayload(graphFromSpec(spec), 3, { vramGib: 24 });
      assert.deepEqual(viaLiteGraph, viaSpec);
      assert.equal(viaLiteGraph.payload.model_file, WAN_FILE);
    });
  }

  it("reads links through getInputLink / getOutputNodes, never the deprecated input.link / output.links", () => {
    const lg = fakeLiteGraph(wanGraph(), "current");
    const view = liteGraphView(lg);
    for (const id of lg.nodes.keys()) view.node(id);
    assert.deepEqual(view.node(5).outputs[0].links, [{ target: 3, slot: 1 }, { target: 7, slot: 1 }]);
    assert.deepEqual(view.node(3).inputs[0].link, { origin: 2, slot: 0 });
    assert.deepEqual(lg.deprecations, []);
  });

  it("finds a subgraph node's inputs in the graph's links (its getInputLink means something else)", () => {
    const lg = fakeLiteGraph(wanGraph(), "current");
    const est = lg.getNodeById(3);
    est.isSubgraphNode = () => true;
    est.getInputLink = () => ({ origin_id: 999, origin_slot: 0 });
    assert.deepEqual(inputLinkOf(lg, est, 0), lg.links.get(est.inputs[0]._link));
    assert.equal(inputLinkOf(lg, est, 7), null);
    assert.deepEqual(lg.deprecations, []);
  });

  it("lists each target input once, also when a node takes one output twice", () => {
    const lg = fakeLiteGraph([
      { id: 1, type: "A", outputs: [{ name: "LATENT", type: "LATENT" }] },
      { id: 2, type: "B", inputs: [{ name: "x", type: "LATENT", from: [1, 0] }, { name: "y", type: "LATENT", from: [1, 0] }] },
    ], "current");
    assert.deepEqual(outputTargetsOf(lg, lg.getNodeById(1), 0), [{ target: 2, slot: 0 }, { target: 2, slot: 1 }]);
    assert.deepEqual(outputTargetsOf(lg, lg.getNodeById(2), 0), []);
    const detached = lg.getNodeById(2);
    detached.getInputLink = () => { throw new Error("NullGraphError"); };
    assert.equal(inputLinkOf(lg, detached, 0), null);
  });

  it("leaves out the panel widget and keeps the first of duplicate names", () => {
    const lg = fakeLiteGraph([{ id: 1, type: "X", widgets: { a: 1 } }]);
    const n = lg.getNodeById(1);
    n.widgets.push({ name: "wan_sage_panel", value: "" }, { name: "a", value: 2 }, null, { value: 3 });
    const v = liteGraphView(lg, "wan_sage_panel").node(1);
    assert.deepEqual(v.widgets, { a: 1 });
  });

  it("maps links of inputs and outputs and tolerates dangling ids", () => {
    const lg = fakeLiteGraph(wanGraph());
    lg.getNodeById(7).outputs[0].links = [999];
    const view = liteGraphView(lg);
    assert.deepEqual(view.node(3).inputs[0].link, { origin: 2, slot: 0 });
    assert.deepEqual(view.node(5).outputs[0].links, [{ target: 3, slot: 1 }, { target: 7, slot: 1 }]);
    assert.deepEqual(view.node(7).outputs[0].links, []);
    assert.equal(view.node(42), null);
    assert.equal(view.node(3), view.node(3), "cached per view");
  });

  it("uses comfyClass, then type; linkOf handles null ids and graphs", () => {
    assert.equal(nodeClass({ comfyClass: "A", type: "B" }), "A");
    assert.equal(nodeClass({ type: "B" }), "B");
    assert.equal(nodeClass(null), "");
    assert.equal(linkOf({ links: new Map() }, null), null);
    assert.equal(linkOf(null, 1), null);
    assert.equal(linkOf({ links: new Map() }, 5), null);
  });
});
