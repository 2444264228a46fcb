// wan-sage web extension: a live memory panel on every "Wan Working-Memory Estimator" node and a
// run-stats panel on every "Wan 2.2 Sage Attention Patch" node.
//
// One DOM widget per node (node.addDOMWidget), so the same element shows in the classic
// LiteGraph canvas and in Nodes 2.0.  No node prototype is patched: results arrive through
// api.addEventListener("executed" | "wan_sage.stats") filtered by node id, and the estimate
// follows widget and link changes by comparing the request it would send (polled, and checked
// at once on "graphChanged"), debounced.  The pure logic lives in ./lib (tested under node).
//
// DOM contract (read by the browser test): the estimator panel is [data-testid="wan-sage-panel"]
// with [data-field] tokens, activation_gb, sage_extra_gb, reservation_gb, comfy_gb, vram,
// verdict (with data-level fits|offloads|cannot|unknown|error), source, error, report; its
// data-state is idle|pending|ok|error.  The Sage panel is [data-testid="wan-sage-stats"] with
// [data-field] status, sage_calls, sdpa_calls, by_kernel, reasons, fallbacks,
// head_split_calls, saved, calibration, text; its data-state is empty|ok.  Both carry
// data-node-id.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { changeWatcher, sequencer } from "./lib/debounce.js";
import {
  errorMessage, estimateRows, execIdMatches, executedText, LEVEL_COLOURS, sourceLine, statsRows,
  verdictOf, vramFromSystemStats,
} from "./lib/format.js";
import { ESTIMATOR_TYPE, SAGE_TYPE } from "./lib/graph.js";
import { liteGraphView, nodeClass } from "./lib/litegraph.js";
import { buildEstimatePayload } from "./lib/payload.js";

const EXTENSION = "wan_sage.panel";
const WIDGET = "wan_sage_panel";
const DEBOUNCE_MS = 300;
const POLL_MS = 400;
const VRAM_TTL_MS = 10000;
const STATS_PLACEHOLDER = "attention stats appear after a sampling run";

const panels = new Set();
const vram = { settled: false, value: null, at: 0, loading: null };
let ticker = null;

// ---------------------------------------------------------------- DOM helpers

function h(tag, attrs = {}, text = null) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "style") Object.assign(e.style, v);
    else e.setAttribute(k, v);
  }
  if (text !== null) e.textContent = text;
  return e;
}

const ROOT_STYLE = {
  boxSizing: "border-box", width: "100%", height: "100%", overflow: "auto", padding: "4px 6px",
  font: "12px/1.35 system-ui, sans-serif", color: "var(--input-text, #ddd)",
  background: "var(--comfy-input-bg, #222)", borderRadius: "6px",
};
const MUTED = { color: "var(--descrip-text, #999)", fontSize: "11px" };

function rowsTable(rows) {
  const table = h("table", { style: { width: "100%", borderCollapse: "collapse" } });
  const cells = {};
  for (const r of rows) {
    const tr = h("tr");
    tr.appendChild(h("td", { style: { ...MUTED, paddingRight: "8px", whiteSpace: "nowrap" } }, r.label));
    const td = h("td", { "data-field": r.field, style: { textAlign: "right", fontVariantNumeric: "tabular-nums" } },
      r.value);
    tr.appendChild(td);
    table.appendChild(tr);
    cells[r.field] = td;
  }
  return { table, cells };
}

function addPanelWidget(node, element, minHeight) {
  const widget = node.addDOMWidget(WIDGET, WIDGET, element, {
    serialize: false, // not part of the prompt
    hideOnZoom: true,
    getValue: () => "",
    setValue: () => {},
    getMinHeight: minHeight,
  });
  if (widget) widget.serialize = false; // not part of widgets_values in the saved workflow
  return widget;
}

/** Grow the node (never shrink it) when its panel needs more room; the canvas redraws. */
function fitNode(node) {
  try {
    if (typeof node.computeSize === "function" && typeof node.setSize === "function" && node.size) {
      const [w, hgt] = node.computeSize();
      if (hgt > node.size[1]) node.setSize([Math.max(node.size[0], w), hgt]);
    }
    node.setDirtyCanvas?.(true, true);
  } catch {
    // sizing is cosmetic
  }
}

function isNested(node) {
  const root = app.rootGraph ?? app.graph;
  return !!(node.graph && root && node.graph !== root);
}

function matches(node, ...ids) {
  return ids.some((id) => execIdMatches(id, node.id, isNested(node)));
}

// ---------------------------------------------------------------- VRAM (GET /system_stats)

function refreshVram(force = false) {
  if (vram.loading) return vram.loading;
  if (!force && vram.settled && Date.now() - vram.at < VRAM_TTL_MS) return Promise.resolve(vram.value);
  vram.loading = (async () => {
    try {
      const r = await api.fetchApi("/system_stats");
      vram.value = r.ok ? vramFromSystemStats(await r.json()) : vram.value;
    } catch {
      // keep the last value: no VRAM figure is sent, the server uses its own device
    } finally {
      vram.settled = true;
      vram.at = Date.now();
      vram.loading = null;
    }
    for (const p of panels) p.showVram?.();
    return vram.value;
  })();
  return vram.loading;
}

// ---------------------------------------------------------------- estimator panel

class EstimatorPanel {
  constructor(node) {
    this.node = node;
    this.summary = null;
    this.seq = sequencer();
    this.root = h("div", { "data-testid": "wan-sage-panel", "data-state": "idle", style: ROOT_STYLE });
    this.verdict = h("div", { "data-field": "verdict", "data-level": "unknown",
      style: { fontWeight: "600", color: LEVEL_COLOURS.unknown, marginBottom: "2px" } }, "waiting for the graph");
    const { table, cells } = rowsTable(estimateRows(null, null));
    this.cells = cells;
    this.source = h("div", { "data-field": "source", style: { ...MUTED, marginTop: "3px", overflow: "hidden",
      display: "-webkit-box", WebkitBoxOrient: "vertical", WebkitLineClamp: "2", wordBreak: "break-word" } }, "");
    this.error = h("div", { "data-field": "error", style: { color: LEVEL_COLOURS.error, whiteSpace: "pre-wrap" } }, "");
    this.error.hidden = true;
    this.report = h("pre", { "data-field": "report", style: {
      ...MUTED, whiteSpace: "pre-wrap", margin: "4px 0 0", borderTop: "1px solid var(--border-color, #444)",
      paddingTop: "3px", font: "11px/1.3 ui-monospace, monospace" } }, "");
    this.report.hidden = true;
    this.root.append(this.verdict, table, this.error, this.source, this.report);
    this.widget = addPanelWidget(node, this.root, () => (this.report.hidden ? 200 : 320));
    this.watcher = changeWatcher({ read: () => this.read(), onChange: (r) => this.estimate(r), wait: DEBOUNCE_MS });
  }

  read() {
    const node = this.node;
    if (!vram.settled || !node.graph || node.id === null || node.id === undefined || node.id === -1) {
      return { waiting: true };
    }
    return buildEstimatePayload(liteGraphView(node.graph, WIDGET), node.id, { vramGb: vram.value?.totalGb });
  }

  check() {
    this.root.setAttribute("data-node-id", String(this.node.id));
    this.watcher.check();
  }

  showVram() {
    this.cells.vram.textContent = estimateRows(this.summary, vram.value).find((r) => r.field === "vram").value;
  }

  setState(state) {
    this.root.setAttribute("data-state", state);
  }

  async estimate(r) {
    if (!r || r.waiting) return;
    const token = this.seq.next();
    if (!r.payload) {
      this.setState("idle");
      this.showError(`set ${r.info.missing.join(", ")} (or connect a video latent)`, r.info);
      return;
    }
    this.setState("pending");
    void refreshVram();
    let status = 0;
    let body = null;
    try {
      const res = await api.fetchApi("/wan_sage/estimate", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(r.payload),
      });
      status = res.status;
      body = await res.json().catch(() => null);
    } catch (e) {
      body = { error: `request failed: ${e?.message ?? e}` };
    }
    if (!this.seq.isCurrent(token)) return; // a newer request was sent meanwhile
    if (status === 200 && body?.summary) this.showEstimate(body, r.info);
    else this.showError(errorMessage(status, body), r.info);
  }

  showEstimate(body, info) {
    this.summary = body.summary;
    for (const row of estimateRows(body.summary, vram.value)) {
      if (this.cells[row.field]) this.cells[row.field].textContent = row.value;
    }
    const v = verdictOf(body.summary);
    this.verdict.textContent = v.text;
    this.verdict.setAttribute("data-level", v.level);
    this.verdict.style.color = v.colour;
    this.verdict.title = (body.summary.notes ?? []).join("\n");
    this.error.hidden = true;
    this.error.textContent = "";
    this.source.textContent = sourceLine(info, body.summary);
    this.source.title = [this.source.textContent, body.text ?? ""].join("\n");
    this.setState("ok");
  }

  showError(message, info) {
    this.summary = null;
    for (const row of estimateRows(null, vram.value)) this.cells[row.field].textContent = row.value;
    this.verdict.textContent = "no estimate";
    this.verdict.setAttribute("data-level", "error");
    this.verdict.style.color = LEVEL_COLOURS.error;
    this.error.textContent = message;
    this.error.hidden = false;
    this.source.textContent = sourceLine(info, null);
    this.setState("error");
  }

  onExecuted(text) {
    if (text === null) return;
    const first = this.report.hidden;
    this.report.textContent = `last run:\n${text}`;
    this.report.hidden = false;
    if (first) fitNode(this.node);
  }
}

// ---------------------------------------------------------------- Sage patch panel

class SagePanel {
  constructor(node) {
    this.node = node;
    this.root = h("div", { "data-testid": "wan-sage-stats", "data-state": "empty", style: ROOT_STYLE });
    this.status = h("div", { "data-field": "status", style: { ...MUTED, whiteSpace: "pre-wrap" } }, STATS_PLACEHOLDER);
    const { table, cells } = rowsTable(statsRows(null));
    this.cells = cells;
    this.table = table;
    this.table.hidden = true;
    this.text = h("div", { "data-field": "text", style: { ...MUTED, marginTop: "3px" } }, "");
    this.root.append(this.status, table, this.text);
    this.widget = addPanelWidget(node, this.root, () => (this.table.hidden ? 56 : 190));
  }

  check() {
    this.root.setAttribute("data-node-id", String(this.node.id));
  }

  onExecuted(text) {
    if (text !== null) this.status.textContent = text;
  }

  onStats(detail) {
    if (this.status.textContent === STATS_PLACEHOLDER) this.status.textContent = "last sampling run:";
    for (const row of statsRows(detail.summary)) {
      if (this.cells[row.field]) this.cells[row.field].textContent = row.value;
    }
    const first = this.table.hidden;
    this.table.hidden = false;
    if (first) fitNode(this.node);
    this.text.textContent = typeof detail.text === "string" ? detail.text : "";
    this.root.setAttribute("data-state", "ok");
  }
}

// ---------------------------------------------------------------- wiring

function tick() {
  for (const p of panels) {
    const node = p.node;
    if (!node.graph && !p.root.isConnected) {
      panels.delete(p);
      continue;
    }
    try {
      p.check();
    } catch (e) {
      console.warn("wan-sage panel:", e);
    }
  }
}

function attach(node) {
  const cls = nodeClass(node);
  const Panel = cls === ESTIMATOR_TYPE ? EstimatorPanel : cls === SAGE_TYPE ? SagePanel : null;
  if (!Panel || typeof node.addDOMWidget !== "function") return;
  if (node.widgets?.some((w) => w?.name === WIDGET)) return; // one panel per node
  const panel = new Panel(node);
  panels.add(panel);
  const prev = node.onRemoved; // instance callback, chained (addDOMWidget chains its own too)
  node.onRemoved = function (...args) {
    panels.delete(panel);
    return prev?.apply(this, args);
  };
}

function onExecuted(event) {
  const d = event?.detail;
  const text = executedText(d);
  for (const p of panels) {
    if (matches(p.node, d?.node, d?.display_node)) p.onExecuted(text);
  }
  void refreshVram(true);
}

function onStats(event) {
  const d = event?.detail;
  if (!d || typeof d !== "object") return;
  const sage = [...panels].filter((p) => p instanceof SagePanel);
  const hit = d.node_id === null || d.node_id === undefined
    ? (sage.length === 1 ? sage : [])
    : sage.filter((p) => matches(p.node, d.node_id));
  for (const p of hit) p.onStats(d);
}

function start() {
  if (ticker !== null) return;
  api.addEventListener("executed", onExecuted);
  api.addEventListener("wan_sage.stats", onStats);
  api.addEventListener("graphChanged", tick);
  ticker = setInterval(tick, POLL_MS);
  void refreshVram(true);
}

const extension = {
  name: EXTENSION,
  async setup() {
    start();
  },
  async nodeCreated(node) {
    start(); // in case a node is created before setup
    attach(node);
  },
};

if (!(app.extensions ?? []).some((e) => e?.name === EXTENSION)) {
  app.registerExtension(extension);
}
