import assert from "node:assert/strict";
import { describe, it } from "node:test";

import { graphFromSpec } from "../../web/lib/graph.js";
import { attentionFor, buildEstimatePayload, LATENT_CHANNELS } from "../../web/lib/payload.js";
import { GGUF_FILE, WAN_FILE, wanGraph } from "./fixtures/graphs.mjs";

const build = (opts, vramGib) => buildEstimatePayload(graphFromSpec(wanGraph(opts)), 3, { vramGib });

describe("buildEstimatePayload", () => {
  it("takes the size from the upstream latent node over the estimator's widgets", () => {
    const { payload, info } = build({ widgets: { cfg: 3.5, margin_gib: 0.5 } }, 24);
    assert.deepEqual(payload, {
      width: 832, height: 480, frames: 33, batch: 2, cfg: 3.5, attention: "sage-auto", margin_gib: 0.5,
      latent_channels: 16, model_file: WAN_FILE, lora: true, vram_gib: 24,
    });
    assert.deepEqual(info.latent, { id: 5, type: "EmptyHunyuanLatentVideo" });
    assert.equal(info.latentLinked, true);
    assert.equal(info.sizeFrom, "latent");
    assert.deepEqual(info.size, { width: 832, height: 480, frames: 33, batch: 2 });
    assert.equal(info.sage, 4);
    assert.equal(info.loaderType, "UNETLoader");
    assert.deepEqual(info.missing, []);
  });

  it("uses the estimator's widgets without a latent", () => {
    const { payload, info } = build({ latent: false, widgets: { width: 1280, height: 720, frames: 81, batch_size: 1 } });
    assert.equal(info.latent, null);
    assert.equal(info.latentLinked, false);
    assert.equal(info.sizeFrom, "widgets");
    assert.deepEqual([payload.width, payload.height, payload.frames, payload.batch], [1280, 720, 81, 1]);
    assert.equal("vram_gib" in payload, false, "no VRAM: the server decides");
  });

  it("says whether a connected latent sets the size, is an image latent, or cannot be read", () => {
    const viaImage = wanGraph();
    viaImage.find((n) => n.id === 5).widgets = { width: 512, height: 512, batch_size: 1 }; // EmptyLatentImage-like
    const image = buildEstimatePayload(graphFromSpec(viaImage), 3, {});
    assert.deepEqual([image.info.latentLinked, image.info.sizeFrom, image.payload.width], [true, "widgets", 1280]);
    const viaEncode = wanGraph();
    viaEncode.find((n) => n.id === 5).widgets = {}; // e.g. a VAE encode of a video
    const unread = buildEstimatePayload(graphFromSpec(viaEncode), 3, {});
    assert.deepEqual([unread.info.latentLinked, unread.info.sizeFrom, unread.info.latent], [true, "latent-unread", null]);
    assert.equal(unread.payload.width, 1280, "the panel previews the widgets");
  });

  it("falls back to a widget when the latent node's value is not a number", () => {
    const spec = wanGraph();
    spec.find((n) => n.id === 5).widgets.width = "";
    const { payload } = buildEstimatePayload(graphFromSpec(spec), 3, {});
    assert.equal(payload.width, 1280);
    assert.equal(payload.height, 480);
  });

  it("finds the model file through LoRA / Sage / ModelSampling, GGUF included", () => {
    const { payload, info } = build({ loader: "UnetLoaderGGUF", file: GGUF_FILE });
    assert.equal(payload.model_file, GGUF_FILE);
    assert.equal(info.loaderType, "UnetLoaderGGUF");
    assert.equal("weights" in payload, false);
  });

  it("sends weights fp8 when UNETLoader casts to fp8, fp8_fast when it multiplies in fp8", () => {
    assert.equal(build({ weightDtype: "fp8_e4m3fn" }).payload.weights, "fp8");
    assert.equal(build({ weightDtype: "fp8_e5m2" }).payload.weights, "fp8");
    assert.equal(build({ weightDtype: "fp8_e4m3fn_fast" }).payload.weights, "fp8_fast");
    assert.equal("weights" in build({ weightDtype: "default" }).payload, false);
  });

  it("detects the Sage patch: sage-auto, a fixed kernel, bypassed, or count_sage_extra", () => {
    assert.equal(build({}).payload.attention, "sage-auto");
    assert.equal(build({ sageKernel: "sage2_sm90" }).payload.attention, "sage2_sm90");
    assert.equal(build({ sageMode: 4 }).payload.attention, "sdpa");
    assert.equal(build({ widgets: { count_sage_extra: "never" } }).payload.attention, "sdpa");
    assert.equal(build({ sageMode: 4, widgets: { count_sage_extra: "always" } }).payload.attention, "sage-auto");
  });

  it("omits model_file without a loader and rounds VRAM", () => {
    const spec = wanGraph().filter((n) => n.id !== 1 && n.id !== 2);
    const { payload, info } = buildEstimatePayload(graphFromSpec(spec), 3, { vramGib: 23.99999 });
    assert.equal("model_file" in payload, false);
    assert.equal(info.modelFile, null);
    assert.equal(payload.lora, undefined);
    assert.equal(payload.vram_gib, 24);
    assert.equal(buildEstimatePayload(graphFromSpec(spec), 3, { vramGib: 0 }).payload.vram_gib, undefined);
  });

  it("coerces numeric strings, defaults cfg to 1, and reports missing sizes", () => {
    const ok = build({ latent: false, widgets: { width: "960", cfg: undefined } });
    assert.equal(ok.payload.width, 960);
    assert.equal(ok.payload.cfg, 1.0);
    const bad = build({ latent: false, widgets: { frames: null, batch_size: "x" } });
    assert.equal(bad.payload, null);
    assert.deepEqual(bad.info.missing, ["frames", "batch"]);
    assert.deepEqual(buildEstimatePayload(graphFromSpec([]), 3).info.missing, ["node"]);
  });

  it("rounds sizes to integers", () => {
    const { payload } = build({ latent: false, widgets: { width: 1279.6, frames: 80.9 } });
    assert.equal(payload.width, 1280);
    assert.equal(payload.frames, 81);
  });
});

describe("attentionFor", () => {
  it("maps patch presence and the count_sage_extra choice", () => {
    assert.equal(attentionFor(null, "auto-detect"), "sdpa");
    assert.equal(attentionFor(null, undefined), "sdpa");
    assert.equal(attentionFor({ widgets: { kernel: "auto" } }, "auto-detect"), "sage-auto");
    assert.equal(attentionFor({ widgets: {} }, "auto-detect"), "sage-auto");
    assert.equal(attentionFor({ widgets: { kernel: "sage1" } }, "always"), "sage1");
    assert.equal(attentionFor({ widgets: { kernel: "sage1" } }, "never"), "sdpa");
  });
});

it("sends a non-default policy with the request, the GiB widgets as *_gib fields", () => {
  const { payload } = build({ widgets: { cfg: 1.0, policy: "fixed GiB per row", fixed_gib: 9.5 } }, 24);
  assert.equal(payload.policy, "fixed GiB per row");
  assert.equal(payload.fixed_gib, 9.5);
  assert.deepEqual(Object.keys(payload).filter((k) => /_gb$/.test(k)), [], "no *_gb field is sent");
  const d = build({ widgets: { cfg: 1.0, policy: "wan-sage estimate", fixed_gib: 9.5 } }, 24).payload;
  assert.equal(d.policy, undefined);
  assert.equal(d.fixed_gib, undefined);
});

it("still reads margin_gb / fixed_gb from a node that carries the names before the rename", () => {
  const spec = wanGraph();
  const est = spec.find((n) => n.id === 3);
  const { margin_gib: _m, fixed_gib: _f, ...rest } = est.widgets;
  est.widgets = { ...rest, margin_gb: 0.75, fixed_gb: 8.0, policy: "fixed GB per row" };
  const { payload } = buildEstimatePayload(graphFromSpec(spec), 3, {});
  assert.deepEqual([payload.margin_gib, payload.fixed_gib, payload.policy], [0.75, 8.0, "fixed GB per row"]);
  assert.deepEqual(Object.keys(payload).filter((k) => /_gb$/.test(k)), []);
  const both = build({ widgets: { margin_gib: 0.25, margin_gb: 0.75 } }).payload;
  assert.equal(both.margin_gib, 0.25, "the current name wins");
});

describe("buildEstimatePayload and the latent's channels", () => {
  const channels = (opts) => {
    const { payload, info } = build(opts);
    assert.equal(payload.latent_channels ?? null, info.latentChannels, "sent as the info says");
    return info.latentChannels;
  };

  it("sends the channel count that the latent node's type tells", () => {
    assert.equal(channels({}), 16, "EmptyHunyuanLatentVideo");
    assert.equal(channels({ latentType: "WanImageToVideo" }), 16);
    assert.equal(channels({ latentType: "HunyuanImageToVideo" }), 16);
    assert.equal(channels({ latentType: "Wan22ImageToVideoLatent" }), 48, "the Wan 2.2 VAE (TI2V-5B)");
    assert.equal(LATENT_CHANNELS.Wan22ImageToVideoLatent, 48);
    assert.ok(Object.isFrozen(LATENT_CHANNELS));
  });

  it("sends none when the type does not tell, or nothing is connected", () => {
    assert.equal(channels({ latentType: "WanFirstLastFrameToVideo" }), null, "its count follows the VAE");
    assert.equal(channels({ latentType: "SomePackLatent" }), null);
    assert.equal(channels({ latent: false }), null);
    const unread = wanGraph({ latentType: "VAEEncode" });
    unread.find((n) => n.id === 5).widgets = {};
    assert.equal(buildEstimatePayload(graphFromSpec(unread), 3, {}).payload.latent_channels, undefined);
  });

  it("looks through a node without a size of its own to the latent node behind it", () => {
    const spec = wanGraph({ latentType: "Wan22ImageToVideoLatent" });
    const est = spec.find((n) => n.id === 3);
    spec.push({ id: 30, type: "RepeatLatentBatch", widgets: { amount: 1 },
      inputs: [{ name: "samples", type: "LATENT", from: [5, 0] }], outputs: [{ name: "LATENT", type: "LATENT" }] });
    est.inputs[1].from = [30, 0];
    const { payload, info } = buildEstimatePayload(graphFromSpec(spec), 3, {});
    assert.deepEqual([payload.latent_channels, info.latent.type], [48, "Wan22ImageToVideoLatent"]);
  });
});

describe("buildEstimatePayload and torch.compile", () => {
  const withCompile = (at, type, widgets) => {
    const spec = wanGraph();
    const est = spec.find((n) => n.id === 3);
    const compile = { id: 40, type, widgets, outputs: [{ name: "MODEL", type: "MODEL" }] };
    if (at === "before") {
      compile.inputs = [{ name: "model", type: "MODEL", from: est.inputs[0].from }];
      est.inputs[0].from = [40, 0];
    } else {
      compile.inputs = [{ name: "model", type: "MODEL", from: [3, 0] }];
    }
    spec.push(compile);
    return buildEstimatePayload(graphFromSpec(spec), 3, {});
  };

  it("leaves compiled out for a whole-model compile, which the node estimates as eager", () => {
    for (const at of ["before", "after"]) {
      const { payload, info } = withCompile(at, "TorchCompileModel", { backend: "inductor" });
      assert.equal("compiled" in payload, false, at);
      assert.equal(info.compiled, false, at);
      assert.equal(info.compiledWhole, true, at);
    }
    const told = withCompile("after", "TorchCompileModelWanVideoV2", { backend: "inductor", compile_transformer_blocks_only: false });
    assert.equal("compiled" in told.payload, false);
  });

  it("takes the compile node nearest the sampler, as ComfyUI keeps only its wrapper", () => {
    const spec = wanGraph();
    const est = spec.find((n) => n.id === 3);
    const whole = { id: 40, type: "TorchCompileModel", widgets: { backend: "inductor" },
      inputs: [{ name: "model", type: "MODEL", from: est.inputs[0].from }], outputs: [{ name: "MODEL", type: "MODEL" }] };
    est.inputs[0].from = [40, 0];
    const blocks = { id: 41, type: "TorchCompileModelWanVideoV2", widgets: { backend: "inductor" },
      inputs: [{ name: "model", type: "MODEL", from: [3, 0] }], outputs: [{ name: "MODEL", type: "MODEL" }] };
    spec.push(whole, blocks);
    const { payload, info } = buildEstimatePayload(graphFromSpec(spec), 3, {});
    assert.equal(payload.compiled, true);
    assert.equal(info.compiledWhole, false);
  });

  it("sends compiled when a per-block compile node is on the model chain, upstream or downstream", () => {
    for (const at of ["before", "after"]) {
      const { payload, info } = withCompile(at, "TorchCompileModelWanVideoV2",
        { backend: "inductor", compile_transformer_blocks_only: true });
      assert.equal(payload.compiled, true, at);
      assert.equal(info.compiled, true, at);
    }
    assert.equal("compiled" in build({}).payload, false, "no compile node: the field is left out");
  });
});
