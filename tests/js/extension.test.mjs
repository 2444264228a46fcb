// web/wan_sage.js end to end against a fake frontend: registration, one DOM widget per node,
// the DOM contract the browser test reads, the debounced POST, the size line and the disabled
// size widgets, the assumed model, the SageAttention status, events filtered by node id, panels
// as tall as their content, and links read without the deprecated input.link / output.links.
import assert from "node:assert/strict";
import { register } from "node:module";
import { after, before, describe, it, mock } from "node:test";

import { LEVEL_COLOURS } from "../../web/lib/format.js";
import { MISSING_TEXT, SAGE_README_URL } from "../../web/lib/sage_status.js";
import { fakeDocument } from "./fixtures/fakedom.mjs";
import { GGUF_FILE, wanGraph } from "./fixtures/graphs.mjs";
import { fakeLiteGraph, widget } from "./fixtures/litegraph.mjs";

const GiB = 1024 ** 3;
const ESTIMATE_FIELDS = ["problems", "assumption", "verdict", "size", "model", "tokens", "activation_gib", "sage_extra_gib",
  "reservation_gib", "comfy_gib", "vram", "error", "source", "report"];
const STATS_FIELDS = ["sage", "hint", "link", "status", "sage_calls", "sdpa_calls", "by_kernel", "reasons", "fallbacks",
  "head_split_calls", "saved", "calibration"];
const SIZE_WIDGETS = ["width", "height", "frames", "batch_size"];

const summary = (p) => ({
  tokens: (p.width / 16) * (p.height / 16) * ((p.frames - 1) / 4 + 1) * p.batch, activation_gib: 12.3456,
  sage_extra_gib: p.attention === "sdpa" ? 0 : 0.4, reservation_gib: 13.1, comfy_gib: 26.02, weights_gib: 13.3,
  vram_gib: p.vram_gib ?? null, verdict: p.width > 1500 ? "cannot run: ..." : "fits with all weights resident",
  level: p.width > 1500 ? "cannot" : "fits", offload_gib: 0, dominant_phase: "ffn", notes: ["n1"],
  source: p.model_file ? `header of ${p.model_file}` : "preset wan2.2-a14b", policy: "wan-sage estimate",
  detected: { model: p.model_file ?? "wan2.2-a14b", model_type: "t2v", dim: 5120, num_layers: 40, num_heads: 40,
    weight_dtype: p.model_file ? "q4_k_m" : "bf16", guessed: !p.model_file },
  problems: p.latent_channels && p.latent_channels !== 16 ? [CHANNEL_PROBLEM] : [],
});
const CHANNEL_PROBLEM = "the latent has 48 channels but Wan 2.2 T2V A14B (one expert) takes 16: use a 16-channel "
  + "latent node (EmptyHunyuanLatentVideo) or a 48-channel model (TI2V-5B)";

function fakeApi() {
  const api = new EventTarget();
  api.posts = [];
  api.routes = [];
  api.sageStatus = { sage_version: null, sage_error: "ModuleNotFoundError: No module named 'sageattention'",
    sm90_binding_broken: false, ck_available: false, self_test_failures: {} };
  api.fetchApi = async (route, opts = {}) => {
    api.routes.push(route);
    const reply = (status, body) => ({ ok: status === 200, status, json: async () => body });
    if (route === "/system_stats") {
      return reply(200, { devices: [{ name: "cuda:0", type: "cuda", vram_total: 24 * GiB, vram_free: 20 * GiB }] });
    }
    if (route === "/wan_sage/stats") return reply(200, { runs: [], sage_status: api.sageStatus });
    if (route === "/wan_sage/estimate" && opts.method === "POST") {
      const p = JSON.parse(opts.body);
      api.posts.push(p);
      if (p.width === 4000) return reply(400, { error: "width must be at most 3840", field: "width" });
      return reply(200, { estimate: {}, summary: summary(p), text: "one line" });
    }
    return reply(404, null);
  };
  api.emit = (type, detail) => api.dispatchEvent(new CustomEvent(type, { detail }));
  return api;
}

/** Advance the mocked clock in small steps, so timers set by timers also run (Node 20's tick does
 * not run a timer scheduled during the same tick). */
const advance = (ms) => {
  for (let t = 0; t < ms; t += 50) mock.timers.tick(Math.min(50, ms - t));
};

const settle = async () => {
  for (let i = 0; i < 5; i++) await new Promise((r) => setImmediate(r));
};

/** Cut or restore the link into input ``slot`` of ``node`` in a "current" fake graph. */
function relink(graph, node, slot, linkId) {
  const old = node.inputs[slot]._link;
  if (old !== null && old !== undefined) {
    const l = graph.links.get(old);
    const src = graph.getNodeById(l.origin_id).outputs[l.origin_slot];
    src._links = src._links.filter((id) => id !== old);
  }
  node.inputs[slot]._link = linkId;
  if (linkId !== null) {
    const l = graph.links.get(linkId);
    graph.getNodeById(l.origin_id).outputs[l.origin_slot]._links.push(linkId);
  }
  return old;
}

describe("web/wan_sage.js in a fake frontend", () => {
  let app, api, ext, graph, est, sage, estRoot, sageRoot;
  const field = (root, f) => root.querySelector(`[data-field="${f}"]`);
  const sizeDisabled = () => SIZE_WIDGETS.map((n) => widget(est, n).disabled === true);

  before(async () => {
    mock.timers.enable({ apis: ["setTimeout", "setInterval"] });
    globalThis.document = fakeDocument;
    api = fakeApi();
    app = { extensions: [], registerExtension(e) { this.extensions.push(e); } };
    globalThis.__wanSageHost = { app, api };
    register(new URL("./fixtures/frontend_hooks.mjs", import.meta.url));
    await import("../../web/wan_sage.js");
    ext = app.extensions[0];
    graph = fakeLiteGraph(wanGraph({ loader: "UnetLoaderGGUF", file: GGUF_FILE, widgets: { cfg: 3.5 } }), "current");
    app.graph = graph;
    await ext.setup();
    for (const n of graph.nodes.values()) await ext.nodeCreated(n);
    est = graph.getNodeById(3);
    sage = graph.getNodeById(4);
    estRoot = est.widgets.at(-1).element;
    sageRoot = sage.widgets.at(-1).element;
    await settle(); // /system_stats and /wan_sage/stats answered
  });

  after(() => {
    mock.timers.reset();
    delete globalThis.document;
  });

  it("registers one extension named wan_sage.panel", async () => {
    assert.equal(app.extensions.length, 1);
    assert.equal(ext.name, "wan_sage.panel");
    assert.equal(typeof ext.nodeCreated, "function");
    await import("../../web/wan_sage.js"); // a second import is the same module
    assert.equal(app.extensions.length, 1);
  });

  it("adds exactly one unserialised DOM widget to each estimator and Sage node, none elsewhere", async () => {
    for (const n of graph.nodes.values()) {
      const panels = n.widgets.filter((w) => w.name === "wan_sage_panel");
      assert.equal(panels.length, n === est || n === sage ? 1 : 0, n.type);
    }
    const w = est.widgets.at(-1);
    assert.equal(w.serialize, false);
    assert.equal(w.options.serialize, false);
    assert.equal(typeof w.options.getMinHeight(), "number");
    assert.equal(w.options.getMaxHeight(), w.options.getMinHeight(), "the panel takes no more room than it needs");
    await ext.nodeCreated(est); // created twice: still one panel
    assert.equal(est.widgets.filter((x) => x.name === "wan_sage_panel").length, 1);
  });

  it("exposes the DOM contract", () => {
    assert.equal(estRoot.getAttribute("data-testid"), "wan-sage-panel");
    assert.equal(sageRoot.getAttribute("data-testid"), "wan-sage-stats");
    for (const f of ESTIMATE_FIELDS) assert.ok(field(estRoot, f), `estimator field ${f}`);
    for (const f of STATS_FIELDS) assert.ok(field(sageRoot, f), `stats field ${f}`);
    assert.ok(field(estRoot, "verdict").getAttribute("data-level"));
  });

  it("starts compact: a one-line empty state that says what will appear", () => {
    assert.equal(field(estRoot, "verdict").textContent, "Memory estimate: waiting for the graph");
    for (const f of ["assumption", "model", "source", "report", "error"]) assert.equal(field(estRoot, f).hidden, true, f);
    assert.equal(field(estRoot, "tokens").parentNode.parentNode.hidden, true, "no table of dashes");
    assert.match(field(sageRoot, "status").textContent, /appear after a run/);
    assert.equal(field(sageRoot, "status").hidden, true, "no call counts will come without SageAttention");
  });

  it("says SageAttention is not installed before any run, with the install hint and the README link", () => {
    assert.ok(api.routes.includes("/wan_sage/stats"));
    const s = field(sageRoot, "sage");
    assert.equal(s.getAttribute("data-state"), "missing");
    assert.equal(s.textContent, MISSING_TEXT);
    assert.equal(s.hidden, false);
    assert.equal(field(sageRoot, "hint").hidden, false);
    assert.match(field(sageRoot, "hint").textContent, /sageattention==1\.0\.6/);
    assert.equal(field(sageRoot, "link").getAttribute("href"), SAGE_README_URL);
  });

  it("posts the estimate once, 300 ms after it sees the graph, and fills the panel", async () => {
    advance(400); // poll: the request differs from the last one (none)
    assert.equal(api.posts.length, 0, "debounced");
    advance(300);
    await settle();
    assert.equal(api.posts.length, 1);
    assert.deepEqual(api.posts[0], {
      width: 832, height: 480, frames: 33, batch: 2, cfg: 3.5, attention: "sage-auto", margin_gib: 0,
      latent_channels: 16, model_file: GGUF_FILE, lora: true, vram_gib: 24,
    });
    assert.equal(field(estRoot, "problems").hidden, true, "no problem: no problem line");
    assert.equal(estRoot.getAttribute("data-state"), "ok");
    assert.equal(estRoot.getAttribute("data-node-id"), "3");
    assert.equal(field(estRoot, "tokens").textContent, "28,080");
    assert.equal(field(estRoot, "activation_gib").textContent, "12.35 GiB");
    assert.equal(field(estRoot, "sage_extra_gib").textContent, "+0.40 GiB");
    assert.equal(field(estRoot, "vram").textContent, "20.0 free / 24.0 GiB");
    const v = field(estRoot, "verdict");
    assert.equal(v.textContent, "fits with all weights resident", "the server's verdict, as sent");
    assert.equal(v.getAttribute("data-level"), "fits");
    assert.equal(v.style.color, LEVEL_COLOURS.fits);
    assert.equal(field(estRoot, "assumption").hidden, true, "the model file's header was read");
    assert.equal(field(estRoot, "model").textContent,
      "Model t2v \u00b7 dim 5120 \u00b7 40 layers \u00b7 40 heads \u00b7 q4_k_m weights");
    assert.equal(field(estRoot, "model").getAttribute("data-guessed"), "false");
    assert.match(field(estRoot, "source").textContent, /attention sage-auto/);
    advance(2000);
    await settle();
    assert.equal(api.posts.length, 1, "nothing changed: no new request");
    assert.deepEqual(graph.deprecations, [], "no deprecated link property was read");
  });

  it("with the latent connected: one line says so and the size widgets are disabled", () => {
    const size = field(estRoot, "size");
    assert.equal(size.textContent, "Size 2 \u00d7 832\u00d7480, 33 frames \u00b7 from the latent (#5)");
    assert.equal(size.getAttribute("data-from"), "latent");
    assert.equal(size.hidden, false);
    assert.deepEqual(sizeDisabled(), [true, true, true, true]);
    assert.equal(widget(est, "cfg").disabled, undefined, "only the size widgets");
  });

  it("without it, the widgets are enabled again and drive the size", async () => {
    const cut = relink(graph, est, 1, null);
    advance(700);
    await settle();
    assert.deepEqual(sizeDisabled(), [false, false, false, false]);
    assert.equal(field(estRoot, "size").getAttribute("data-from"), "widgets");
    assert.equal(field(estRoot, "size").textContent, "Size 1280\u00d7720, 81 frames \u00b7 from the widgets");
    assert.deepEqual([api.posts.at(-1).width, api.posts.at(-1).frames], [1280, 81]);
    widget(est, "width").value = 960;
    advance(700);
    await settle();
    assert.equal(api.posts.at(-1).width, 960);
    assert.equal(field(estRoot, "tokens").textContent, "56,700");
    relink(graph, est, 1, cut);
    advance(700);
    await settle();
    assert.deepEqual(sizeDisabled(), [true, true, true, true]);
    assert.equal(api.posts.at(-1).width, 832);
  });

  it("follows upstream widget edits, debounced across graphChanged events", async () => {
    const n = api.posts.length;
    const width = widget(graph.getNodeById(5), "width");
    for (const w of [1600, 1664, 1728]) {
      width.value = w;
      api.emit("graphChanged", {});
      advance(100);
    }
    await settle();
    assert.equal(api.posts.length, n, "still within the wait");
    advance(200);
    await settle();
    assert.equal(api.posts.length, n + 1);
    assert.equal(api.posts.at(-1).width, 1728);
    const v = field(estRoot, "verdict");
    assert.equal(v.getAttribute("data-level"), "cannot");
    assert.equal(v.style.color, LEVEL_COLOURS.cannot);
  });

  it("shows each problem the server finds first in the panel, in red, until it is gone", async () => {
    const latent = graph.getNodeById(5);
    latent.comfyClass = "Wan22ImageToVideoLatent"; // a 48-channel latent on the 16-channel A14B
    advance(700);
    await settle();
    assert.equal(api.posts.at(-1).latent_channels, 48);
    const p = field(estRoot, "problems");
    assert.equal(p.hidden, false);
    assert.equal(p.style.color, LEVEL_COLOURS.error);
    assert.equal(p.parentNode.children[0], p, "the first line of the headline");
    assert.equal(estRoot.children[0].children[0], p.parentNode, "the headline is the panel's first block");
    assert.deepEqual(p.children.map((c) => c.textContent), [CHANNEL_PROBLEM]);
    assert.equal(p.children[0].getAttribute("data-problem"), "0");
    assert.equal(p.style.whiteSpace, "normal", "a long problem wraps");
    assert.equal(field(estRoot, "verdict").hidden, false, "the verdict still follows");
    const grown = est.widgets.at(-1).options.getMinHeight();
    latent.comfyClass = "EmptyHunyuanLatentVideo";
    advance(700);
    await settle();
    assert.equal(api.posts.at(-1).latent_channels, 16);
    assert.equal(field(estRoot, "problems").hidden, true);
    assert.ok(est.widgets.at(-1).options.getMinHeight() < grown, "the panel shrinks back");
  });

  it("wraps its lines at the node's width instead of cutting them off", () => {
    for (const f of ["size", "source", "report", "model", "assumption", "verdict"]) {
      assert.equal(field(estRoot, f).style.whiteSpace, "normal", f);
      assert.equal(field(estRoot, f).style.overflowWrap, "anywhere", f);
    }
    for (const f of ["sage", "status", "hint"]) assert.equal(field(sageRoot, f).style.whiteSpace, "normal", f);
    assert.equal(field(estRoot, "size").style.textOverflow, undefined, "no ellipsis");
    const min = () => est.widgets.at(-1).options.getMinHeight();
    est.size = [700, est.size[1]];
    api.emit("graphChanged", {});
    const wide = min();
    est.size = [220, est.size[1]];
    api.emit("graphChanged", {});
    assert.ok(min() > wide, `a narrow node is taller: ${min()} > ${wide}`);
    assert.equal(est.size[0], 220, "the node keeps the width it was given");
    est.size = [300, est.size[1]];
    api.emit("graphChanged", {});
  });

  it("shows a 400 message", async () => {
    widget(graph.getNodeById(5), "width").value = 4000;
    advance(700);
    await settle();
    assert.equal(estRoot.getAttribute("data-state"), "error");
    assert.equal(field(estRoot, "error").textContent, "width must be at most 3840");
    assert.equal(field(estRoot, "error").hidden, false);
    assert.equal(field(estRoot, "verdict").getAttribute("data-level"), "error");
    assert.equal(field(estRoot, "tokens").textContent, "\u2014");
    assert.equal(field(estRoot, "problems").hidden, true, "no stale problem beside an error");
    widget(graph.getNodeById(5), "width").value = 832;
    advance(700);
    await settle();
    assert.equal(estRoot.getAttribute("data-state"), "ok");
    assert.equal(field(estRoot, "error").hidden, true);
  });

  it("puts the assumed model in the headline when no loader is upstream", async () => {
    const cut = relink(graph, est, 0, null);
    advance(700);
    await settle();
    assert.equal(api.posts.at(-1).model_file, undefined);
    const a = field(estRoot, "assumption");
    assert.equal(a.hidden, false);
    assert.equal(a.textContent, "Assumed model: wan2.2-a14b (no model loader upstream)");
    assert.equal(a.parentNode, field(estRoot, "verdict").parentNode, "in the headline, with the verdict");
    assert.equal(field(estRoot, "model").getAttribute("data-guessed"), "true");
    assert.match(field(estRoot, "model").textContent, /\(guessed\)$/);
    relink(graph, est, 0, cut);
    advance(700);
    await settle();
    assert.equal(field(estRoot, "assumption").hidden, true);
  });

  it("switches to sdpa when the Sage patch is bypassed", async () => {
    sage.mode = 4;
    advance(700);
    await settle();
    assert.equal(api.posts.at(-1).attention, "sdpa");
    sage.mode = 0;
    advance(700);
    await settle();
    assert.equal(api.posts.at(-1).attention, "sage-auto");
  });

  it("adds the last run's verdict to its own panel only, the report in its tooltip, and grows to fit it", () => {
    const before = est.size[1];
    api.emit("executed", { node: "33", display_node: "33", output: { text: ["not ours"] } });
    assert.equal(field(estRoot, "report").hidden, true);
    api.emit("executed", { node: "3", display_node: "3", prompt_id: "p",
      output: { text: ["tokens: 28,080\nverdict: fits: all weights resident"] } });
    const r = field(estRoot, "report");
    assert.equal(r.hidden, false);
    assert.equal(r.textContent, "Last run: fits: all weights resident");
    assert.match(r.title, /tokens: 28,080/);
    assert.ok(est.size[1] > before, "the node grew by the new line");
    api.emit("executed", { node: "4", output: { text: ["patched (id ab12); kernel: auto"] } });
    assert.equal(field(sageRoot, "status").textContent, "patched (id ab12); kernel: auto");
    assert.equal(field(sageRoot, "status").hidden, false);
  });

  it("fills the Sage panel from wan_sage.stats for its node id, and the node fits its content", () => {
    assert.equal(sageRoot.getAttribute("data-state"), "empty");
    const s = { sage_calls: 30, sdpa_calls: 10, by_kernel: { sage2_sm90: 30 }, reasons: { cross_slower: 10 },
      fallbacks: {}, head_split_calls: 2, saved_ms: 1500, calibration_ms: 200 };
    api.emit("wan_sage.stats", { patch_id: "x", node_id: "99", summary: { ...s, sage_calls: 1 }, text: "other" });
    assert.equal(sageRoot.getAttribute("data-state"), "empty");
    const panelWidget = sage.widgets.at(-1);
    const small = panelWidget.options.getMinHeight();
    sage.size = [300, 1000]; // taller than its content: it shrinks as well as grows
    api.emit("wan_sage.stats", { patch_id: "ab12", node_id: "4", summary: s, text: "30/40 attention calls on Sage" });
    assert.ok(panelWidget.options.getMinHeight() > small, "the panel asks for room for its table");
    assert.deepEqual(sage.size, sage.computeSize().map((v, i) => (i === 0 ? 300 : v)), "the node fits, as wide as it was");
    assert.equal(sageRoot.getAttribute("data-state"), "ok");
    assert.equal(field(sageRoot, "sage_calls").textContent, "30 of 40 (75 %)");
    assert.equal(field(sageRoot, "reasons").textContent, "cross_slower 10");
    assert.equal(field(sageRoot, "head_split_calls").textContent, "2");
    assert.equal(field(sageRoot, "saved").textContent, "1.50 s");
    assert.equal(field(sageRoot, "sage_calls").parentNode.parentNode.title, "30/40 attention calls on Sage");
    assert.equal(sageRoot.getAttribute("data-node-id"), "4");
    assert.equal(sageRoot.getAttribute("data-content-height"), String(panelWidget.options.getMinHeight() - 8));
  });

  it("shows a build the self-test rejected after the next stats refresh", async () => {
    api.sageStatus = { sage_version: "2.2.0", sage_error: null, sm90_binding_broken: false, ck_available: false,
      self_test_failures: { sage2_sm90: "returned non-finite values (uninitialised output?)" } };
    api.emit("wan_sage.stats", { patch_id: "ab12", node_id: "4", summary: {}, text: "" });
    await settle();
    const s = field(sageRoot, "sage");
    assert.equal(s.getAttribute("data-state"), "rejected");
    assert.match(s.textContent, /^SageAttention 2\.2\.0 rejected by the self-test: sage2_sm90 off/);
    assert.equal(field(sageRoot, "hint").hidden, false);
    assert.match(field(sageRoot, "hint").title, /non-finite/);
  });

  it("stops estimating once the node is removed, having read no deprecated link property", async () => {
    const n = api.posts.length;
    est.onRemoved();
    widget(graph.getNodeById(5), "width").value = 640;
    advance(2000);
    await settle();
    assert.equal(api.posts.length, n);
    assert.deepEqual(graph.deprecations, []);
  });
});
