import assert from "node:assert/strict";
import { describe, it } from "node:test";

import {
  DASH, GiB, LEVEL_COLOURS, bytesToGiB, errorMessage, estimateRows, execIdMatches, executedText, fmtCounts,
  fmtGiB, fmtInt, fmtSeconds, fmtSignedGiB, fmtVram, sourceLine, statsRows, verdictOf, verdictStyle,
  vramFromSystemStats,
} from "../../web/lib/format.js";

const SUMMARY = {
  tokens: 75600, activation_gb: 12.3456, sage_extra_gb: 0.4, reservation_gb: 13.1, comfy_gb: 26.02, weights_gb: 13.3,
  vram_gb: 24, verdict: "offloads 2.4 GB of weights", level: "offloads", offload_gb: 2.4, dominant_phase: "ffn",
  notes: [], source: "header of x.gguf",
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
    assert.deepEqual(verdictOf(SUMMARY), { text: "offloads 2.4 GB of weights", level: "offloads", colour: LEVEL_COLOURS.offloads });
    assert.equal(verdictOf({ level: "fits" }).text, "fits");
    assert.equal(verdictOf(null).level, "unknown");
  });
});

describe("estimate rows", () => {
  it("lists the contract fields in order with formatted values", () => {
    const vram = { totalGb: 24, freeGb: 18.2 };
    const rows = estimateRows(SUMMARY, vram);
    assert.deepEqual(rows.map((r) => r.field), ["tokens", "activation_gb", "sage_extra_gb", "reservation_gb", "comfy_gb", "vram"]);
    assert.deepEqual(rows.map((r) => r.value), ["75,600", "12.35 GiB", "+0.40 GiB", "13.10 GiB", "26.02 GiB", "18.2 free / 24.0 GiB"]);
    assert.ok(estimateRows(null, null).every((r) => r.value === DASH || r.value === "no GPU"));
  });

  it("formats VRAM from system_stats, without a free figure, from the summary, or none", () => {
    assert.equal(fmtVram({ totalGb: 80, freeGb: null }), "80.0 GiB");
    assert.equal(fmtVram(null, 24), "24.0 GiB");
    assert.equal(fmtVram(null, null), "no GPU");
  });

  it("reads the first device of /system_stats, a CPU device's RAM included", () => {
    const cuda = { devices: [{ name: "cuda:0 NVIDIA H200", type: "cuda", vram_total: 140 * GiB, vram_free: 100 * GiB },
      { type: "cuda", vram_total: 1 }] };
    assert.deepEqual(vramFromSystemStats(cuda), { totalGb: 140, freeGb: 100, name: "cuda:0 NVIDIA H200", type: "cuda" });
    const cpu = vramFromSystemStats({ devices: [{ name: "cpu", type: "cpu", vram_total: 64 * GiB, vram_free: 40 * GiB }] });
    assert.deepEqual(cpu, { totalGb: 64, freeGb: 40, name: "cpu", type: "cpu" });
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

  it("says where the inputs came from", () => {
    const info = { modelFile: "a.gguf", attention: "sage-auto", lora: true, latent: { id: 5, type: "EmptyHunyuanLatentVideo" } };
    assert.equal(sourceLine(info, SUMMARY),
      "model: header of x.gguf \u00b7 attention sage-auto \u00b7 LoRA \u00b7 size from EmptyHunyuanLatentVideo #5");
    assert.equal(sourceLine({ modelFile: null, attention: "sdpa" }, { source: "preset wan2.2-a14b" }),
      "no model loader found \u00b7 model: preset wan2.2-a14b \u00b7 attention sdpa");
    assert.equal(sourceLine({ modelFile: "a.gguf" }, null), "model a.gguf \u00b7 attention sdpa");
    assert.equal(sourceLine(null, null), "");
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
