import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  findInput, graphFromSpec, latentSource, loaderFile, modelChain, originOf, targetsOf, widgetValue,
} from "../../web/lib/graph.js";
import { GGUF_FILE, WAN_FILE, wanGraph } from "./fixtures/graphs.mjs";

const ids = (nodes) => nodes.map((n) => n.id);

describe("graphFromSpec", () => {
  it("derives output links from the inputs", () => {
    const g = graphFromSpec(wanGraph());
    assert.deepEqual(g.node(5).outputs[0].links, [{ target: 3, slot: 1 }, { target: 7, slot: 1 }]);
    assert.deepEqual(g.node(3).inputs[0].link, { origin: 2, slot: 0 });
    assert.equal(g.node(99), null);
  });
});

describe("modelChain", () => {
  it("walks MODEL links back to the loader and forward past the estimator", () => {
    const g = graphFromSpec(wanGraph());
    const c = modelChain(g, g.node(3));
    assert.equal(c.modelFile, WAN_FILE);
    assert.equal(c.loader.type, "UNETLoader");
    assert.deepEqual(ids(c.upstream), [2]);
    assert.deepEqual(ids(c.downstream), [4, 6, 7], "every MODEL consumer, the sampler included");
    assert.equal(c.sage.id, 4);
    assert.equal(c.lora, true);
  });

  it("finds a Sage patch upstream of the estimator and a GGUF loader", () => {
    const g = graphFromSpec([
      { id: 10, type: "UnetLoaderGGUF", widgets: { unet_name: GGUF_FILE }, outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 11, type: "WanSageAttentionPatch", widgets: { kernel: "auto" },
        inputs: [{ name: "model", type: "MODEL", from: [10, 0] }], outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 12, type: "ModelSamplingSD3", inputs: [{ name: "model", type: "MODEL", from: [11, 0] }],
        outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 13, type: "WanWorkingMemoryEstimator", widgets: {}, inputs: [{ name: "model", type: "MODEL", from: [12, 0] }],
        outputs: [{ name: "MODEL", type: "MODEL" }] },
    ]);
    const c = modelChain(g, g.node(13));
    assert.equal(c.modelFile, GGUF_FILE);
    assert.deepEqual(ids(c.upstream), [12, 11]);
    assert.equal(c.sage.id, 11);
    assert.equal(c.lora, false);
    assert.deepEqual(c.downstream, []);
  });

  it("looks through Reroute nodes both ways", () => {
    const spec = [
      { id: 1, type: "UNETLoader", widgets: { unet_name: WAN_FILE }, outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 2, type: "Reroute", inputs: [{ name: "", type: "*", from: [1, 0] }], outputs: [{ name: "", type: "MODEL" }] },
      { id: 3, type: "WanWorkingMemoryEstimator", inputs: [{ name: "model", type: "MODEL", from: [2, 0] }],
        outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 4, type: "Reroute", inputs: [{ name: "", type: "*", from: [3, 0] }], outputs: [{ name: "", type: "*" }] },
      { id: 5, type: "WanSageAttentionPatch", inputs: [{ name: "model", type: "MODEL", from: [4, 0] }],
        outputs: [{ name: "MODEL", type: "MODEL" }] },
    ];
    const g = graphFromSpec(spec);
    const c = modelChain(g, g.node(3));
    assert.equal(c.modelFile, WAN_FILE);
    assert.deepEqual(c.upstream, []);
    assert.equal(c.sage.id, 5);
    assert.deepEqual(targetsOf(g, g.node(3), 0).map((t) => t.node.id), [5]);
    assert.equal(originOf(g, g.node(5).inputs[0]).node.id, 3);
  });

  it("ignores a bypassed or muted Sage patch", () => {
    for (const mode of [2, 4]) {
      const g = graphFromSpec(wanGraph({ sageMode: mode }));
      const c = modelChain(g, g.node(3));
      assert.equal(c.sage, null, `mode ${mode}`);
      assert.deepEqual(ids(c.downstream), [4, 6, 7], "the walk still passes through it");
    }
  });

  it("has no loader when the chain is cut, and stops on cycles", () => {
    const cut = graphFromSpec([{ id: 3, type: "WanWorkingMemoryEstimator", inputs: [{ name: "model", type: "MODEL" }] }]);
    assert.equal(modelChain(cut, cut.node(3)).modelFile, null);
    const loop = graphFromSpec([
      { id: 1, type: "ModelSamplingSD3", inputs: [{ name: "model", type: "MODEL", from: [2, 0] }], outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 2, type: "ModelSamplingSD3", inputs: [{ name: "model", type: "MODEL", from: [1, 0] }], outputs: [{ name: "MODEL", type: "MODEL" }] },
      { id: 3, type: "WanWorkingMemoryEstimator", inputs: [{ name: "model", type: "MODEL", from: [1, 0] }], outputs: [{ name: "MODEL", type: "MODEL" }] },
    ]);
    const c = modelChain(loop, loop.node(3));
    assert.equal(c.modelFile, null);
    assert.deepEqual(ids(c.upstream), [1, 2]);
  });

  it("takes a checkpoint loader's ckpt_name, and ignores empty names", () => {
    assert.equal(loaderFile({ widgets: { ckpt_name: "wan2.1_t2v_1.3B.safetensors" } }), "wan2.1_t2v_1.3B.safetensors");
    assert.equal(loaderFile({ widgets: { unet_name: "  " } }), null);
    assert.equal(loaderFile({ widgets: {} }), null);
  });
});

describe("latentSource", () => {
  it("reads width/height/length/batch_size of an empty video latent", () => {
    const g = graphFromSpec(wanGraph());
    const s = latentSource(g, g.node(3));
    assert.deepEqual({ ...s, node: s.node.id }, { node: 5, width: 832, height: 480, frames: 33, batch_size: 2 });
  });

  it("reads the latent output of WanImageToVideo (slot 2) and Wan22ImageToVideoLatent", () => {
    for (const type of ["WanImageToVideo", "Wan22ImageToVideoLatent"]) {
      const slot = type === "WanImageToVideo" ? 2 : 0;
      const g = graphFromSpec([
        { id: 1, type, widgets: { width: 1280, height: 704, length: 121, batch_size: 1 },
          outputs: [{ name: "positive", type: "CONDITIONING" }, { name: "negative", type: "CONDITIONING" }, { name: "latent", type: "LATENT" }] },
        { id: 2, type: "WanWorkingMemoryEstimator", inputs: [{ name: "latent", type: "LATENT", from: [1, slot] }] },
      ]);
      const s = latentSource(g, g.node(2));
      assert.equal(s.node.type, type);
      assert.deepEqual([s.width, s.height, s.frames, s.batch_size], [1280, 704, 121, 1]);
    }
  });

  it("follows LATENT inputs of nodes without a size, and reroutes", () => {
    const g = graphFromSpec([
      { id: 1, type: "EmptyHunyuanLatentVideo", widgets: { width: 640, height: 640, length: 49, batch_size: 1 } },
      { id: 2, type: "RepeatLatentBatch", widgets: { amount: 2 }, inputs: [{ name: "samples", type: "LATENT", from: [1, 0] }] },
      { id: 3, type: "Reroute", inputs: [{ name: "", type: "*", from: [2, 0] }] },
      { id: 4, type: "WanWorkingMemoryEstimator", inputs: [{ name: "latent", type: "LATENT", from: [3, 0] }] },
    ]);
    const s = latentSource(g, g.node(4));
    assert.equal(s.node.id, 1);
    assert.equal(s.frames, 49);
  });

  it("is null for an image latent, an unconnected input or a missing node", () => {
    const g = graphFromSpec([
      { id: 1, type: "EmptyLatentImage", widgets: { width: 512, height: 512, batch_size: 1 } },
      { id: 2, type: "WanWorkingMemoryEstimator", inputs: [{ name: "latent", type: "LATENT", from: [1, 0] }] },
      { id: 3, type: "WanWorkingMemoryEstimator", inputs: [{ name: "latent", type: "LATENT" }] },
      { id: 4, type: "WanWorkingMemoryEstimator", inputs: [{ name: "latent", type: "LATENT", from: [42, 0] }] },
    ]);
    assert.equal(latentSource(g, g.node(2)), null);
    assert.equal(latentSource(g, g.node(3)), null);
    assert.equal(latentSource(g, g.node(4)), null);
  });

  it("uses the frames/num_frames widget names as well as length", () => {
    const g = graphFromSpec([
      { id: 1, type: "SomeWanLatent", widgets: { width: 480, height: 832, num_frames: 17 } },
      { id: 2, type: "WanWorkingMemoryEstimator", inputs: [{ name: "latent", type: "LATENT", from: [1, 0] }] },
    ]);
    const s = latentSource(g, g.node(2));
    assert.equal(s.frames, 17);
    assert.equal(s.batch_size, undefined);
  });
});

describe("widgetValue and findInput", () => {
  it("reads a widget turned into an input from the linked primitive", () => {
    const g = graphFromSpec([
      { id: 1, type: "PrimitiveInt", widgets: { value: 1024 } },
      { id: 2, type: "EmptyHunyuanLatentVideo", widgets: { width: 832, height: 480, length: 33, batch_size: 1 },
        inputs: [{ name: "width", type: "INT", from: [1, 0] }] },
    ]);
    assert.equal(widgetValue(g, g.node(2), "width"), 1024);
    assert.equal(widgetValue(g, g.node(2), "height"), 480);
  });

  it("finds inputs by name, then by type", () => {
    const n = { inputs: [{ name: "a", type: "LATENT" }, { name: "b", type: "MODEL,CLIP" }] };
    assert.equal(findInput(n, "a").name, "a");
    assert.equal(findInput(n, "model", "MODEL").name, "b");
    assert.equal(findInput(n, "model"), null);
    assert.equal(findInput(null, "model", "MODEL"), null);
  });
});
