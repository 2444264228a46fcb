import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  DASH, GiB, LEVEL_COLOURS, assumptionOf, bytesToGiB, detectedModel, errorMessage, estimateRows, execIdMatches,
  executedText, fmtCounts, fmtGiB, fmtInt, fmtSeconds, fmtSignedGiB, fmtVram, lastRunLine, DYNAMIC_VRAM_LINE, sizeLine, sourceLine,
  compileView, statsRows, verdictOf, verdictStyle, vramFromSystemStats,
} from "../../web/lib/format.js";

const DETECTED = { model: "x.gguf", model_type: "t2v", dim: 5120, num_layers: 40, num_heads: 40, weight_dtype: "q4_k_m",
  guessed: false };
const SUMMARY = {
  tokens: 75600, activation_gib: 12.3456, sage_extra_gib: 0.4, reservation_gib: 13.1, comfy_gib: 26.02, weights_gib: 13.3,
  vram_gib: 24, verdict: "offloads 2.4 GiB of weights", level: "offloads", offload_gib: 2.4, dominant_phase: "ffn",
  notes: [], source: "header of x.gguf", policy: "wan-sage estimate", detected: DETECTED,
};

describe("numbers", () => {
  it("formats GiB, signed GiB, integers and seconds", () => {
    assert.equal(fmtGiB(12.3456), "12.35 GiB");
    assert.equal(fmtGiB(1, 1), "1.0 GiB");
    assert.equal(fmtGiB(null), DASH);
    assert.equal(fmtGiB(NaN), DASH);
    assert.equal(fmtSignedGiB(0.4), "+0.40 GiB");
    assert.equal(fmtSignedGiB(-0.1), "-0.10 GiB");
    assert.equal(fmtSignedGiB(-0.0001), "+0.00 GiB");
    assert.equal(fmtSignedGiB(undefined), DASH);
    assert.equal(fmtInt(75600), "75,600");
    assert.equal(fmtInt(1234567), "1,234,567");
    assert.equal(fmtInt(999), "999");
    assert.equal(fmtInt(-4096), "-4,096");
    assert.equal(fmtInt("12"), DASH);
    assert.equal(fmtSeconds(12345), "12.3 s");
    assert.equal(fmtSeconds(2500), "2.50 s");
    assert.equal(fmtSeconds(null), DASH);
    assert.equal(bytesToGiB(2 * GiB), 2);
    assert.equal(bytesToGiB("1"), null);
  });
});

describe("verdict", () => {
  it("colours fits green, offloads amber, cannot red, anything else grey", () => {
    assert.deepEqual(verdictStyle("fits"), { level: "fits", colour: LEVEL_COLOURS.fits });
    assert.deepEqual(verdictStyle("offloads"), { level: "offloads", colour: LEVEL_COLOURS.offloads });
    assert.deepEqual(verdictStyle("cannot"), { level: "cannot", colour: LEVEL_COLOURS.cannot });
    assert.deepEqual(verdictStyle("unknown"), { level: "unknown", colour: LEVEL_COLOURS.unknown });
    assert.equal(verdictStyle("toString").level, "unknown");
    assert.equal(verdictStyle(undefined).level, "unknown");
    const hue = (hex) => {
      const [r, g, b] = [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
      return { r, g, b };
    };
    const fits = hue(LEVEL_COLOURS.fits), amber = hue(LEVEL_COLOURS.offloads), red = hue(LEVEL_COLOURS.cannot);
    assert.ok(fits.g > fits.r && fits.g > fits.b, "fits is green");
    assert.ok(amber.r > amber.b && amber.g > amber.b && amber.r >= amber.g, "offloads is amber");
    assert.ok(red.r > red.g && red.r > red.b, "cannot is red");
  });

  it("uses the route's verdict text, or the level", () => {
    assert.deepEqual(verdictOf(SUMMARY), { text: "offloads 2.4 GiB of weights", level: "offloads", colour: LEVEL_COLOURS.offloads });
    assert.equal(verdictOf({ level: "fits" }).text, "fits");
    assert.equal(verdictOf(null).level, "unknown");
  });
});

describe("estimate rows", () => {
  it("lists the contract fields in order with formatted values", () => {
    const vram = { totalGib: 24, freeGib: 18.2 };
    const rows = estimateRows(SUMMARY, vram);
    assert.deepEqual(rows.map((r) => r.field), ["tokens", "activation_gib", "sage_extra_gib", "reservation_gib", "comfy_gib", "vram"]);
    assert.deepEqual(rows.map((r) => r.value), ["75,600", "12.35 GiB", "+0.40 GiB", "13.10 GiB", "26.02 GiB", "18.2 free / 24.0 GiB"]);
    assert.ok(estimateRows(null, null).every((r) => r.value === DASH || r.value === "no GPU"));
  });

  it("formats VRAM from system_stats, without a free figure, from the summary, or none", () => {
    assert.equal(fmtVram({ totalGib: 80, freeGib: null }), "80.0 GiB");
    assert.equal(fmtVram(null, 24), "24.0 GiB");
    assert.equal(fmtVram(null, null), "no GPU");
  });

  it("reads the first device of /system_stats, a CPU device's RAM included", () => {
    const cuda = { devices: [{ name: "cuda:0 NVIDIA H200", type: "cuda", vram_total: 140 * GiB, vram_free: 100 * GiB },
      { type: "cuda", vram_total: 1 }] };
    assert.deepEqual(vramFromSystemStats(cuda), { totalGib: 140, freeGib: 100, name: "cuda:0 NVIDIA H200", type: "cuda" });
    const cpu = vramFromSystemStats({ devices: [{ name: "cpu", type: "cpu", vram_total: 64 * GiB, vram_free: 40 * GiB }] });
    assert.deepEqual(cpu, { totalGib: 64, freeGib: 40, name: "cpu", type: "cpu" });
    assert.equal(fmtVram(cpu), "40.0 free / 64.0 GiB (CPU RAM)");
    assert.equal(vramFromSystemStats({ devices: [] }), null);
    assert.equal(vramFromSystemStats(null), null);
    assert.equal(vramFromSystemStats({ devices: [{ type: "cuda", vram_total: 0 }] }), null);
  });

  it("shows the 400 message with its field", () => {
    assert.equal(errorMessage(400, { error: "width must be a multiple of 16", field: "width" }), "width must be a multiple of 16");
    assert.equal(errorMessage(400, { error: "unknown preset", field: "preset" }), "preset: unknown preset");
    assert.equal(errorMessage(400, { error: "bad", field: null }), "bad");
    assert.equal(errorMessage(502, null), "estimate failed (HTTP 502)");
  });

  it("says which attention, LoRA and model source the estimate used", () => {
    const info = { modelFile: "a.gguf", attention: "sage-auto", lora: true };
    assert.equal(sourceLine(info, SUMMARY), "attention sage-auto \u00b7 LoRA \u00b7 model: header of x.gguf");
    assert.equal(sourceLine({ modelFile: null, attention: "sdpa" }, { source: "preset wan2.2-a14b" }),
      "attention sdpa \u00b7 model: preset wan2.2-a14b");
    assert.equal(sourceLine({ modelFile: "a.gguf" }, null), "attention sdpa \u00b7 model a.gguf");
    assert.equal(sourceLine({ modelFile: null, compiled: true }, null), "attention sdpa \u00b7 compiled blocks");
    assert.equal(sourceLine({ modelFile: null, compiledWhole: true }, null),
      "attention sdpa \u00b7 whole-model compile, estimated as eager");
    assert.equal(sourceLine(null, null), "");
  });
});

describe("the model and its assumptions", () => {
  it("describes the detected model, and marks a guess", () => {
    assert.deepEqual(detectedModel(SUMMARY),
      { name: "x.gguf", text: "t2v \u00b7 dim 5120 \u00b7 40 layers \u00b7 40 heads \u00b7 q4_k_m weights", guessed: false });
    const guessed = detectedModel({ detected: { ...DETECTED, model: "wan2.2-a14b", weight_dtype: "bf16", guessed: true } });
    assert.equal(guessed.guessed, true);
    assert.equal(guessed.name, "wan2.2-a14b");
    assert.equal(detectedModel({ detected: { model: "m", dim: "5120" } }).text, "", "only numbers count as numbers");
    assert.equal(detectedModel({}), null);
    assert.equal(detectedModel(null), null);
  });

  it("puts the assumed model in the headline without a loader, or a guessed one", () => {
    const preset = { ...SUMMARY, source: "preset wan2.2-a14b", detected: { ...DETECTED, model: "wan2.2-a14b", guessed: true } };
    assert.equal(assumptionOf({ modelFile: null }, preset), "Assumed model: wan2.2-a14b (no model loader upstream)");
    assert.equal(assumptionOf({ modelFile: "a.gguf" }, preset), "Model guessed from its name: wan2.2-a14b");
    assert.equal(assumptionOf({ modelFile: "a.gguf" }, SUMMARY), null, "a header read is no assumption");
    assert.equal(assumptionOf({ modelFile: null }, { source: "preset wan2.1-1.3b" }),
      "Assumed model: preset wan2.1-1.3b (no model loader upstream)");
    assert.equal(assumptionOf(null, null), "Assumed model: a preset (no model loader upstream)");
  });
});

describe("the size line", () => {
  const size = { width: 1280, height: 720, frames: 81, batch: 1 };

  it("says the latent sets the size and the widgets are not used", () => {
    const l = sizeLine({ sizeFrom: "latent", size, latent: { id: 15, type: "EmptyHunyuanLatentVideo" } });
    assert.equal(l.text, "Size 1280\u00d7720, 81 frames \u00b7 from the latent (#15)");
    assert.match(l.title, /EmptyHunyuanLatentVideo #15/);
    assert.match(l.title, /widgets are not used/);
  });

  it("says the widgets set it when nothing is connected, with the batch when it is more than one", () => {
    const l = sizeLine({ sizeFrom: "widgets", size: { ...size, batch: 2 } });
    assert.equal(l.text, "Size 2 \u00d7 1280\u00d7720, 81 frames \u00b7 from the widgets");
    assert.match(l.title, /Connect the video latent/);
  });

  it("says a latent it cannot read sets the size at run time", () => {
    const l = sizeLine({ sizeFrom: "latent-unread", size });
    assert.equal(l.text, "Size from the latent when it runs \u00b7 preview: 1280\u00d7720, 81 frames");
    assert.deepEqual(sizeLine(null), { text: "", title: "" });
    assert.equal(sizeLine({ sizeFrom: "widgets", size: { width: null, height: 720, frames: null } }).text,
      "Size ?\u00d7?, ? frames \u00b7 from the widgets");
  });
});

describe("the last run", () => {
  it("shows the report's verdict line, else its last line", () => {
    assert.equal(lastRunLine("tokens: 75,600\nreservation: 7.8 GiB\nverdict: fits: all weights resident\nnote: x"),
      "fits: all weights resident");
    assert.equal(lastRunLine("not a Wan model: passed through unchanged"), "not a Wan model: passed through unchanged");
    assert.equal(lastRunLine("a\n\nb\n"), "b");
    const dynamic = "verdict: fits: all weights resident\nmemory path: dynamic VRAM. ComfyUI keeps or evicts this model's weights";
    assert.equal(lastRunLine(dynamic), `fits: all weights resident · ${DYNAMIC_VRAM_LINE}`);
    assert.equal(lastRunLine(""), "");
    assert.equal(lastRunLine(null), "");
  });
});

describe("stats rows", () => {
  it("summarises a wan_sage.stats run", () => {
    const rows = statsRows({
      sage_calls: 480, sdpa_calls: 160, by_kernel: { sage2_sm90: 480 }, reasons: { cross_slower: 120, short: 40 },
      fallbacks: { oom: 2, nonfinite: 1 }, head_split_calls: 12, saved_ms: 41234.5, calibration_ms: 812.3,
    });
    const v = Object.fromEntries(rows.map((r) => [r.field, r.value]));
    assert.deepEqual(v, {
      sage_calls: "480 of 640 (75 %)", sdpa_calls: "160", by_kernel: "sage2_sm90 480", reasons: "cross_slower 120, short 40",
      fallbacks: "3 (oom 2, nonfinite 1)", head_split_calls: "12", saved: "41.2 s", calibration: "0.81 s",
    });
  });

  it("leads with the rank when the run was one rank of a multi-GPU run", () => {
    const rows = statsRows({ rank: 1, sage_calls: 3, sdpa_calls: 1 });
    assert.deepEqual(rows[0], { field: "rank", label: "Rank", value: "1 (its own calls)" });
    assert.equal(statsRows({ sage_calls: 3 })[0].field, "sage_calls");
  });

  it("copes with an empty or partial summary", () => {
    const v = Object.fromEntries(statsRows(null).map((r) => [r.field, r.value]));
    assert.equal(v.sage_calls, "0 of 0");
    assert.equal(v.reasons, "none");
    assert.equal(v.fallbacks, "none");
    assert.equal(v.saved, "0.00 s");
  });

  it("sorts counts largest first, then by name, and drops zeros", () => {
    assert.equal(fmtCounts({ b: 2, a: 2, c: 5, z: 0 }), "c 5, a 2, b 2");
    assert.equal(fmtCounts({}), "none");
    assert.equal(fmtCounts(undefined), "none");
  });
});

describe("compile line", () => {
  const TEXT = "compile: about 20 s to compile in a fresh process (1 graph for the blocks); saves about 0.80 s per step; "
    + "pays back after 25 steps per model; this model samples 2: run eager";

  it("gives the line of a compiled run and its verdict", () => {
    assert.deepEqual(compileView({ text: TEXT, pays_back: false }), { text: TEXT, verdict: "eager" });
    assert.deepEqual(compileView({ text: TEXT, pays_back: true }), { text: TEXT, verdict: "compile" });
    assert.deepEqual(compileView({ text: TEXT, pays_back: null }), { text: TEXT, verdict: "unknown" });
  });

  it("gives no line for an eager run or a malformed object", () => {
    for (const c of [null, undefined, {}, { text: "" }, { text: 3, pays_back: true }, "compile"]) {
      assert.deepEqual(compileView(c), { text: "", verdict: "none" });
    }
  });
});

describe("events", () => {
  it("matches execution ids, subgraph paths only for nested nodes", () => {
    assert.equal(execIdMatches("12", 12), true);
    assert.equal(execIdMatches(12, "12"), true);
    assert.equal(execIdMatches("7:12", 12), false);
    assert.equal(execIdMatches("7:12", 12, true), true);
    assert.equal(execIdMatches("112", 12, true), false);
    assert.equal(execIdMatches(null, 12), false);
    assert.equal(execIdMatches("12", undefined), false);
  });

  it("reads output.text[0] of an executed message", () => {
    assert.equal(executedText({ node: "3", output: { text: ["report"] } }), "report");
    assert.equal(executedText({ output: { text: "plain" } }), "plain");
    assert.equal(executedText({ output: { images: [] } }), null);
    assert.equal(executedText(null), null);
  });
});
