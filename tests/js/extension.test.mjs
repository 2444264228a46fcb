// web/wan_sage.js end to end against a fake frontend: registration, one DOM widget per node,
// the DOM contract the browser test reads, the debounced POST, events filtered by node id.
import assert from "node:assert/strict";
import { register } from "node:module";
import { after, before, describe, it, mock } from "node:test";

import { LEVEL_COLOURS } from "../../web/lib/format.js";
import { fakeDocument } from "./fixtures/fakedom.mjs";
import { GGUF_FILE, wanGraph } from "./fixtures/graphs.mjs";
import { fakeLiteGraph, widget } from "./fixtures/litegraph.mjs";

const GiB = 1024 ** 3;
const ESTIMATE_FIELDS = ["tokens", "activation_gb", "sage_extra_gb", "reservation_gb", "comfy_gb", "vram", "verdict"];
const STATS_FIELDS = ["status", "sage_calls", "sdpa_calls", "by_kernel", "reasons", "fallbacks", "head_split_calls", "saved"];

const summary = (p) => ({
  tokens: (p.width / 16) * (p.height / 16) * ((p.frames - 1) / 4 + 1) * p.batch, activation_gb: 12.3456,
  sage_extra_gb: p.attention === "sdpa" ? 0 : 0.4, reservation_gb: 13.1, comfy_gb: 26.02, weights_gb: 13.3,
  vram_gb: p.vram_gb ?? null, verdict: p.width > 1500 ? "cannot run: ..." : "fits with all weights resident",
  level: p.width > 1500 ? "cannot" : "fits", offload_gb: 0, dominant_phase: "ffn", notes: ["n1"],
  source: `header of ${p.model_file}`,
});

function fakeApi() {
  const api = new EventTarget();
  api.posts = [];
  api.routes = [];
  api.fetchApi = async (route, opts = {}) => {
    api.routes.push(route);
    const reply = (status, body) => ({ ok: status === 200, status, json: async () => body });
    if (route === "/system_stats") {
      return reply(200, { devices: [{ name: "cuda:0", type: "cuda", vram_total: 24 * GiB, vram_free: 20 * GiB }] });
    }
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

describe("web/wan_sage.js in a fake frontend", () => {
  let app, api, ext, graph, est, sage, estRoot, sageRoot;
  const field = (root, f) => root.querySelector(`[data-field="${f}"]`);

  before(async () => {
    mock.timers.enable({ apis: ["setTimeout", "setInterval"] });
    globalThis.document = fakeDocument;
    api = fakeApi();
    app = { extensions: [], registerExtension(e) { this.extensions.push(e); } };
    globalThis.__wanSageHost = { app, api };
    register(new URL("./fixtures/frontend_hooks.mjs", import.meta.url));
    await import("../../web/wan_sage.js");
    ext = app.extensions[0];
    graph = fakeLiteGraph(wanGraph({ loader: "UnetLoaderGGUF", file: GGUF_FILE, widgets: { cfg: 3.5 } }));
    app.graph = graph;
    await ext.setup();
    for (const n of graph.nodes.values()) await ext.nodeCreated(n);
    est = graph.getNodeById(3);
    sage = graph.getNodeById(4);
    estRoot = est.widgets.at(-1).element;
    sageRoot = sage.widgets.at(-1).element;
    await settle(); // /system_stats answered
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

  it("posts the estimate once, 300 ms after it sees the graph, and fills the panel", async () => {
    assert.deepEqual(api.routes, ["/system_stats"]);
    advance(400); // poll: the request differs from the last one (none)
    assert.equal(api.posts.length, 0, "debounced");
    advance(300);
    await settle();
    assert.equal(api.posts.length, 1);
    assert.deepEqual(api.posts[0], {
      width: 832, height: 480, frames: 33, batch: 2, cfg: 3.5, attention: "sage-auto", margin_gb: 0,
      model_file: GGUF_FILE, lora: true, vram_gb: 24,
    });
    assert.equal(estRoot.getAttribute("data-state"), "ok");
    assert.equal(estRoot.getAttribute("data-node-id"), "3");
    assert.equal(field(estRoot, "tokens").textContent, "28,080");
    assert.equal(field(estRoot, "activation_gb").textContent, "12.35 GiB");
    assert.equal(field(estRoot, "sage_extra_gb").textContent, "+0.40 GiB");
    assert.equal(field(estRoot, "vram").textContent, "20.0 free / 24.0 GiB");
    const v = field(estRoot, "verdict");
    assert.equal(v.getAttribute("data-level"), "fits");
    assert.equal(v.style.color, LEVEL_COLOURS.fits);
    assert.match(field(estRoot, "source").textContent, /attention sage-auto/);
    advance(2000);
    await settle();
    assert.equal(api.posts.length, 1, "nothing changed: no new request");
  });

  it("follows upstream widget edits, debounced across graphChanged events", async () => {
    const width = widget(graph.getNodeById(5), "width");
    for (const w of [1600, 1664, 1728]) {
      width.value = w;
      api.emit("graphChanged", {});
      advance(100);
    }
    await settle();
    assert.equal(api.posts.length, 1, "still within the wait");
    advance(200);
    await settle();
    assert.equal(api.posts.length, 2);
    assert.equal(api.posts[1].width, 1728);
    const v = field(estRoot, "verdict");
    assert.equal(v.getAttribute("data-level"), "cannot");
    assert.equal(v.style.color, LEVEL_COLOURS.cannot);
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
    widget(graph.getNodeById(5), "width").value = 832;
    advance(700);
    await settle();
    assert.equal(estRoot.getAttribute("data-state"), "ok");
    assert.equal(field(estRoot, "error").hidden, true);
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

  it("adds the executed report to its own panel only", () => {
    api.emit("executed", { node: "33", display_node: "33", output: { text: ["not ours"] } });
    assert.equal(field(estRoot, "report").hidden, true);
    api.emit("executed", { node: "3", display_node: "3", output: { text: ["the report"] }, prompt_id: "p" });
    assert.equal(field(estRoot, "report").hidden, false);
    assert.match(field(estRoot, "report").textContent, /the report/);
    api.emit("executed", { node: "4", output: { text: ["patched (id ab12); kernel: auto"] } });
    assert.equal(field(sageRoot, "status").textContent, "patched (id ab12); kernel: auto");
  });

  it("fills the Sage panel from wan_sage.stats for its node id", () => {
    assert.equal(sageRoot.getAttribute("data-state"), "empty");
    const s = { sage_calls: 30, sdpa_calls: 10, by_kernel: { sage2_sm90: 30 }, reasons: { cross_slower: 10 },
      fallbacks: {}, head_split_calls: 2, saved_ms: 1500, calibration_ms: 200 };
    api.emit("wan_sage.stats", { patch_id: "x", node_id: "99", summary: { ...s, sage_calls: 1 }, text: "other" });
    assert.equal(sageRoot.getAttribute("data-state"), "empty");
    const panelWidget = sage.widgets.at(-1);
    const small = panelWidget.options.getMinHeight();
    sage.size = [300, 100];
    sage.computeSize = () => [280, 60 + panelWidget.options.getMinHeight()];
    sage.setSize = (sz) => { sage.size = sz; };
    api.emit("wan_sage.stats", { patch_id: "ab12", node_id: "4", summary: s, text: "30/40 attention calls on Sage" });
    assert.ok(panelWidget.options.getMinHeight() > small, "the panel asks for room for its table");
    assert.deepEqual(sage.size, [300, 60 + panelWidget.options.getMinHeight()], "the node grew, never narrower");
    assert.equal(sageRoot.getAttribute("data-state"), "ok");
    assert.equal(field(sageRoot, "sage_calls").textContent, "30 of 40 (75 %)");
    assert.equal(field(sageRoot, "reasons").textContent, "cross_slower 10");
    assert.equal(field(sageRoot, "head_split_calls").textContent, "2");
    assert.equal(field(sageRoot, "saved").textContent, "1.50 s");
    assert.equal(field(sageRoot, "text").textContent, "30/40 attention calls on Sage");
    assert.equal(sageRoot.getAttribute("data-node-id"), "4");
  });

  it("stops estimating once the node is removed", async () => {
    const n = api.posts.length;
    est.onRemoved();
    widget(graph.getNodeById(5), "width").value = 640;
    advance(2000);
    await settle();
    assert.equal(api.posts.length, n);
  });
});
