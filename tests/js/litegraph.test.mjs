import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { graphFromSpec } from "../../web/lib/graph.js";
import { linkOf, liteGraphView, nodeClass } from "../../web/lib/litegraph.js";
import { buildEstimatePayload } from "../../web/lib/payload.js";
import { WAN_FILE, wanGraph } from "./fixtures/graphs.mjs";
import { fakeLiteGraph } from "./fixtures/litegraph.mjs";

describe("liteGraphView", () => {
  for (const kind of ["map", "getLink", "object", "private"]) {
    it(`gives the same payload as the plain spec (links as ${kind})`, () => {
      const spec = wanGraph();
      const lg = fakeLiteGraph(spec, kind);
      const viaLiteGraph = buildEstimatePayload(liteGraphView(lg), 3, { vramGb: 24 });
      const viaSpec = buildEstimatePayload(graphFromSpec(spec), 3, { vramGb: 24 });
      assert.deepEqual(viaLiteGraph, viaSpec);
      assert.equal(viaLiteGraph.payload.model_file, WAN_FILE);
    });
  }

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
