// wan-sage web extension: a live memory panel on every "Wan Working-Memory Estimator" node and a
// status and run-stats panel on every "Wan 2.1/2.2 Sage Attention Patch" node.
//
// One DOM widget per node (node.addDOMWidget), so the same element shows in the classic
// LiteGraph canvas and in Nodes 2.0.  No node prototype is patched: results arrive through
// api.addEventListener("executed" | "wan_sage.stats") filtered by node id, and the estimate
// follows widget and link changes by comparing the request it would send (polled, and checked
// at once on "graphChanged"), debounced.  Each panel is as tall as its content: the widget asks
// for the content's height, and on the classic canvas the node is resized to fit whenever that
// height changes.  Every line wraps at the node's width (none is cut off), so a narrow node is
// as tall as its wrapped lines.  The pure logic lives in ./lib (tested under node).
//
// DOM contract (read by the browser test): the estimator panel is [data-testid="wan-sage-panel"]
// with [data-field] problems (one [data-problem] line per problem the server found, e.g. a latent
// of another channel count than the model's; first and red), assumption, verdict (with data-level
// fits|offloads|cannot|unknown|error),
// size (with data-from latent|latent-unread|widgets), model (with data-guessed), tokens,
// activation_gib, sage_extra_gib, reservation_gib, comfy_gib, vram, error, source, report; its
// data-state is idle|pending|ok|error.  The Sage panel is [data-testid="wan-sage-stats"] with
// [data-field] sage (with data-state missing|rejected|ok|unknown), hint, link, status,
// rank (multi-GPU runs only), sage_calls, sdpa_calls, by_kernel, reasons, fallbacks, head_split_calls, saved, calibration,
// compile (runs of a compiled model only; with data-verdict compile|eager|unknown|none); its data-state is empty|ok.
// Both carry data-node-id and data-content-height (px).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { changeWatcher, sequencer } from "./lib/debounce.js";
import {
  assumptionOf, compileView, detectedModel, errorMessage, estimateRows, execIdMatches, executedText, lastRunLine,
  LEVEL_COLOURS, problemsOf, sizeLine, sourceLine, statsRows, verdictOf, vramFromSystemStats, wrappedLines,
} from "./lib/format.js";
import { ESTIMATOR_TYPE, SAGE_TYPE } from "./lib/graph.js";
import { liteGraphView, nodeClass } from "./lib/litegraph.js";
import { buildEstimatePayload, SIZE_WIDGETS } from "./lib/payload.js";
import { sageStatusView } from "./lib/sage_status.js";

const EXTENSION = "wan_sage.panel";
const WIDGET = "wan_sage_panel";
const DEBOUNCE_MS = 300;
const POLL_MS = 400;
const VRAM_TTL_MS = 10000;
const LINE_PX = 16; // every line of the panels is one 16 px line box
const PAD_PX = 4; // the panel's vertical padding, each side
const MARGIN_PX = 4; // the DOM widget's margin inside the node, each side
const ESTIMATOR_EMPTY = "Memory estimate: waiting for the graph";
const STATS_PLACEHOLDER = "Call counts and time saved appear after a run.";
const WARN_COLOUR = LEVEL_COLOURS.offloads;

const panels = new Set();
const vram = { settled: false, value: null, at: 0, loading: null };
const sage = { status: null, loading: null };
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
  boxSizing: "border-box", width: "100%", height: "100%", overflow: "hidden",
  font: `12px/${LINE_PX}px system-ui, sans-serif`, color: "var(--input-text, #ddd)",
  background: "var(--comfy-input-bg, #222)", borderRadius: "6px",
};
const INNER_STYLE = { padding: `${PAD_PX}px 6px` };
const MUTED = { color: "var(--descrip-text, #999)", fontSize: "11px" };
// A line longer than the node is wide wraps (at spaces, else anywhere), and the panel grows by it.
const WRAP = { whiteSpace: "normal", overflowWrap: "anywhere" };
const TEXT_PX = 2 * MARGIN_PX + 12; // the DOM widget's margins and the panel's side padding

function rowsTable(rows) {
  const table = h("table", { style: { width: "100%", borderCollapse: "collapse" } });
  const cells = {};
  for (const r of rows) {
    const tr = h("tr");
    tr.appendChild(h("td", { style: { ...MUTED, padding: "0 8px 0 0", whiteSpace: "nowrap" } }, r.label));
    const td = h("td", { "data-field": r.field, style: { padding: "0", textAlign: "right",
      fontVariantNumeric: "tabular-nums", ...WRAP } }, r.value);
    tr.appendChild(td);
    table.appendChild(tr);
    cells[r.field] = td;
  }
  return { table, cells, rows: rows.length };
}

function show(el, on) {
  el.hidden = !on;
  el.style.display = on ? "" : "none";
}

// ---------------------------------------------------------------- panel base: size to content

class Panel {
  constructor(node, testid, state) {
    this.node = node;
    this.height = 0;
    this.vue = null;
    this.measured = false;
    this.root = h("div", { "data-testid": testid, "data-state": state, style: ROOT_STYLE });
    this.inner = h("div", { style: INNER_STYLE });
    this.root.appendChild(this.inner);
  }

  /** The width the panel's text wraps at, in px (the node's width less margins and padding). */
  textWidth() {
    const w = Array.isArray(this.node.size) || ArrayBuffer.isView(this.node.size) ? this.node.size[0] : NaN;
    return Number.isFinite(w) ? w - TEXT_PX : NaN;
  }

  /** The lines ``el``'s text takes at the panel's width, 0 while it is hidden. */
  linesOf(el) {
    return el.hidden ? 0 : wrappedLines(el.textContent, this.textWidth());
  }

  /** Add the DOM widget once the content exists. */
  mount() {
    this.height = this.contentHeight();
    const widget = this.node.addDOMWidget(WIDGET, WIDGET, this.root, {
      serialize: false, // not part of the prompt
      hideOnZoom: true,
      margin: MARGIN_PX,
      getValue: () => "",
      setValue: () => {},
      getMinHeight: () => this.height + 2 * MARGIN_PX,
      getMaxHeight: () => this.height + 2 * MARGIN_PX,
    });
    if (widget) widget.serialize = false; // not part of widgets_values in the saved workflow
    this.widget = widget;
    this.root.setAttribute("data-content-height", String(this.height));
  }

  /**
   * The content's height: measured while it is laid out; while it is not (hidden when zoomed out,
   * or not attached yet) the last measurement, or before any, its lines counted.
   */
  contentHeight() {
    const measured = this.inner.offsetHeight;
    if (typeof measured === "number" && measured > 0) {
      this.measured = true;
      return Math.ceil(measured);
    }
    return this.measured ? this.height : this.lineCount() * LINE_PX + 2 * PAD_PX;
  }

  /**
   * Ask for the content's height again and resize the node to it.  In Nodes 2.0 the panel is a
   * grid row that would stretch to the node's height, so it gets the content's height itself.
   */
  fit() {
    const vue = isVueMode();
    if (vue !== this.vue) {
      this.vue = vue;
      Object.assign(this.root.style, vue ? { flex: "0 0 auto" } : { flex: "", height: "100%" });
    }
    const hgt = this.contentHeight();
    if (vue) this.root.style.height = `${hgt}px`;
    if (hgt === this.height) return;
    this.height = hgt;
    this.root.setAttribute("data-content-height", String(hgt));
    fitNode(this.node);
  }
}

/** The frontend's LiteGraph object: window.LiteGraph, else the one under window.comfyAPI. */
const liteGraph = () => globalThis.LiteGraph ?? globalThis.comfyAPI?.litegraph?.LiteGraph ?? null;

const isVueMode = () => liteGraph()?.vueNodesMode === true;

/**
 * Resize the node to what its widgets ask for; the canvas redraws.  (Nodes 2.0 never draws a node
 * smaller than its content, so the same call shrinks it to the content there.)
 */
function fitNode(node) {
  try {
    if (typeof node.computeSize === "function" && typeof node.setSize === "function" && node.size) {
      const [, hgt] = node.computeSize();
      if (Number.isFinite(hgt) && hgt > 0 && Math.abs(hgt - node.size[1]) > 0.5) node.setSize([node.size[0], hgt]);
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

// ---------------------------------------------------------------- server state

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

/** GET /wan_sage/stats for the installed SageAttention (its sage_status). */
function refreshSageStatus() {
  if (sage.loading) return sage.loading;
  sage.loading = (async () => {
    try {
      const r = await api.fetchApi("/wan_sage/stats");
      const body = r.ok ? await r.json() : null;
      if (body && typeof body.sage_status === "object") sage.status = body.sage_status;
    } catch {
      // keep the last status
    } finally {
      sage.loading = null;
    }
    for (const p of panels) p.showSageStatus?.();
    return sage.status;
  })();
  return sage.loading;
}

// ---------------------------------------------------------------- estimator panel

class EstimatorPanel extends Panel {
  constructor(node) {
    super(node, "wan-sage-panel", "idle");
    this.summary = null;
    this.info = null;
    this.disabledSize = false;
    this.seq = sequencer();
    this.headline = h("div", { style: { fontWeight: "600" } });
    this.problems = h("div", { "data-field": "problems", style: { color: LEVEL_COLOURS.error, ...WRAP } });
    this.assumption = h("div", { "data-field": "assumption", style: { color: WARN_COLOUR, ...WRAP } }, "");
    this.verdict = h("div", { "data-field": "verdict", "data-level": "unknown",
      style: { color: LEVEL_COLOURS.unknown, ...WRAP } }, ESTIMATOR_EMPTY);
    this.headline.append(this.problems, this.assumption, this.verdict);
    this.size = h("div", { "data-field": "size", "data-from": "", style: { ...MUTED, ...WRAP } }, "");
    this.model = h("div", { "data-field": "model", "data-guessed": "false", style: { ...MUTED, ...WRAP } }, "");
    const { table, cells, rows } = rowsTable(estimateRows(null, null));
    this.table = table;
    this.tableRows = rows;
    this.cells = cells;
    this.error = h("div", { "data-field": "error", style: { color: LEVEL_COLOURS.error, whiteSpace: "pre-wrap", overflowWrap: "anywhere" } }, "");
    this.source = h("div", { "data-field": "source", style: { ...MUTED, ...WRAP } }, "");
    this.report = h("div", { "data-field": "report", style: { ...MUTED, ...WRAP,
      borderTop: "1px solid var(--border-color, #444)", marginTop: "2px" } }, "");
    for (const el of [this.problems, this.assumption, this.size, this.model, this.table, this.error, this.source,
      this.report]) {
      show(el, false);
    }
    this.inner.append(this.headline, this.size, this.model, this.table, this.error, this.source, this.report);
    this.mount();
    this.current = { waiting: true };
    this.watcher = changeWatcher({ read: () => this.current, onChange: (r) => this.estimate(r), wait: DEBOUNCE_MS });
  }

  lineCount() {
    let n = 0;
    for (const el of [this.verdict, this.assumption, this.size, this.model, this.source, this.report]) n += this.linesOf(el);
    for (const el of this.problems.hidden ? [] : this.problems.children) n += this.linesOf(el);
    if (!this.table.hidden) n += this.tableRows;
    if (!this.error.hidden) n += this.linesOf(this.error);
    return n;
  }

  read() {
    const node = this.node;
    if (!vram.settled || !node.graph || node.id === null || node.id === undefined || node.id === -1) {
      return { waiting: true };
    }
    return buildEstimatePayload(liteGraphView(node.graph, WIDGET), node.id, { vramGib: vram.value?.totalGib });
  }

  check() {
    this.root.setAttribute("data-node-id", String(this.node.id));
    this.current = this.read();
    this.watcher.check();
    if (!this.current.waiting) this.showSize(this.current.info);
    this.fit();
  }

  /** The size line, and the size widgets disabled while the latent sets the size. */
  showSize(info) {
    this.info = info;
    const line = sizeLine(info);
    if (this.size.textContent !== line.text) this.size.textContent = line.text;
    this.size.title = line.title;
    this.size.setAttribute("data-from", info?.sizeFrom ?? "");
    show(this.size, !!line.text);
    this.setSizeWidgetsDisabled(info?.sizeFrom === "latent");
  }

  setSizeWidgetsDisabled(off) {
    if (off !== this.disabledSize) {
      this.disabledSize = off;
      for (const w of this.node.widgets ?? []) {
        if (w && SIZE_WIDGETS.includes(w.name)) w.disabled = off;
      }
      this.node.setDirtyCanvas?.(true, true);
    }
    this.dimVueRows(off);
  }

  /**
   * Nodes 2.0 marks a disabled number widget only by greying its +/- buttons, so its rows (in the
   * node's own element, which holds this panel there) are dimmed as a whole as well.
   */
  dimVueRows(off) {
    const nodeEl = typeof this.root.closest === "function" ? this.root.closest(".lg-node") : null;
    if (!nodeEl) return;
    for (const name of SIZE_WIDGETS) {
      const row = nodeEl.querySelector(`[data-widget-name="${name}"]`);
      if (!row) continue;
      const opacity = off ? "0.4" : "";
      if (row.style.opacity !== opacity) row.style.opacity = opacity;
      row.title = off ? "set by the connected latent" : "";
    }
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
    this.fit();
  }

  showEstimate(body, info) {
    const s = body.summary;
    this.summary = s;
    this.showProblems(problemsOf(s));
    for (const row of estimateRows(s, vram.value)) {
      if (this.cells[row.field]) this.cells[row.field].textContent = row.value;
    }
    show(this.table, true);
    const assumed = assumptionOf(info, s);
    this.assumption.textContent = assumed ?? "";
    show(this.assumption, !!assumed);
    const v = verdictOf(s);
    this.verdict.textContent = v.text;
    this.verdict.setAttribute("data-level", v.level);
    this.verdict.style.color = v.colour;
    this.verdict.title = (s.notes ?? []).join("\n");
    const m = detectedModel(s);
    this.model.textContent = m ? `Model ${m.text || m.name}${m.guessed ? " (guessed)" : ""}` : "";
    this.model.title = m ? `${m.name}${m.guessed ? ": guessed from the file name or preset, not read from a model file" : ""}` : "";
    this.model.setAttribute("data-guessed", String(!!m?.guessed));
    show(this.model, !!m);
    this.error.textContent = "";
    show(this.error, false);
    this.source.textContent = sourceLine(info, s);
    this.source.title = [this.source.textContent, body.text ?? ""].join("\n");
    show(this.source, true);
    this.setState("ok");
  }

  /** One red line per problem, first in the panel; none: the block is hidden. */
  showProblems(problems) {
    const now = [...this.problems.children].map((el) => el.textContent);
    if (now.length !== problems.length || now.some((t, i) => t !== problems[i])) {
      this.problems.textContent = "";
      problems.forEach((p, i) => this.problems.appendChild(h("div", { "data-problem": String(i) }, p)));
    }
    this.problems.title = problems.join("\n");
    show(this.problems, problems.length > 0);
  }

  showError(message, info) {
    this.summary = null;
    this.showProblems([]);
    for (const row of estimateRows(null, vram.value)) this.cells[row.field].textContent = row.value;
    show(this.table, false);
    show(this.assumption, false);
    show(this.model, false);
    this.verdict.textContent = "no estimate";
    this.verdict.setAttribute("data-level", "error");
    this.verdict.style.color = LEVEL_COLOURS.error;
    this.error.textContent = message;
    show(this.error, true);
    this.source.textContent = sourceLine(info, null);
    show(this.source, !!this.source.textContent);
    this.setState("error");
  }

  onExecuted(text) {
    if (text === null) return;
    this.report.textContent = `Last run: ${lastRunLine(text)}`;
    this.report.title = `last run:\n${text}`;
    show(this.report, true);
    this.fit();
  }
}

// ---------------------------------------------------------------- Sage patch panel

class SagePanel extends Panel {
  constructor(node) {
    super(node, "wan-sage-stats", "empty");
    this.sage = h("div", { "data-field": "sage", "data-state": "unknown", style: { ...MUTED, ...WRAP } }, "");
    this.hint = h("div", { "data-field": "hint", style: { ...MUTED, ...WRAP } }, "");
    this.hintText = h("span", {}, "");
    this.link = h("a", { "data-field": "link", target: "_blank", rel: "noopener noreferrer",
      style: { color: "var(--p-primary-color, #58a6ff)", marginLeft: "4px" } }, "Getting SageAttention (README)");
    this.hint.append(this.hintText, this.link);
    this.status = h("div", { "data-field": "status", style: { ...MUTED, ...WRAP } }, STATS_PLACEHOLDER);
    const { table, cells, rows } = rowsTable(statsRows(null));
    this.cells = cells;
    this.table = table;
    this.tableRows = rows;
    this.compile = h("div", { "data-field": "compile", "data-verdict": "none", style: { ...MUTED, ...WRAP } }, "");
    show(this.sage, false);
    show(this.hint, false);
    show(this.table, false);
    show(this.compile, false);
    this.inner.append(this.sage, this.hint, this.status, table, this.compile);
    this.mount();
    this.showSageStatus();
  }

  lineCount() {
    let n = this.linesOf(this.status) + this.linesOf(this.sage) + this.linesOf(this.hint) + this.linesOf(this.compile);
    if (!this.table.hidden) n += this.tableRows;
    return n;
  }

  check() {
    this.root.setAttribute("data-node-id", String(this.node.id));
    this.fit();
  }

  showSageStatus() {
    const v = sageStatusView(sage.status);
    this.sage.setAttribute("data-state", v.state);
    this.sage.textContent = v.headline;
    this.sage.title = [v.headline, v.detail].filter(Boolean).join("\n");
    const warn = v.state === "missing" || v.state === "rejected";
    Object.assign(this.sage.style, warn
      ? { color: WARN_COLOUR, fontWeight: "600", fontSize: "12px", ...WRAP }
      : { ...MUTED, fontWeight: "", ...WRAP });
    show(this.sage, !!v.headline);
    this.hintText.textContent = v.hint;
    this.hint.title = v.detail;
    if (v.link) this.link.setAttribute("href", v.link);
    show(this.hint, warn);
    // Without a usable kernel no call counts will come: the placeholder would promise them.
    if (this.status.textContent === STATS_PLACEHOLDER) show(this.status, !warn);
  }

  onExecuted(text) {
    if (text === null) return;
    this.status.textContent = text;
    this.status.title = text;
    show(this.status, true);
    this.fit();
  }

  onStats(detail) {
    if (this.status.textContent === STATS_PLACEHOLDER) this.status.textContent = "Last sampling run:";
    for (const row of statsRows(detail.summary)) {
      if (this.cells[row.field]) this.cells[row.field].textContent = row.value;
    }
    this.table.title = typeof detail.text === "string" ? detail.text : "";
    show(this.table, true);
    const c = compileView(detail.compile);
    this.compile.textContent = c.text;
    this.compile.title = c.text;
    this.compile.setAttribute("data-verdict", c.verdict);
    this.compile.style.color = c.verdict === "eager" ? WARN_COLOUR : MUTED.color;
    show(this.compile, !!c.text);
    this.root.setAttribute("data-state", "ok");
    this.fit();
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
  const Kind = cls === ESTIMATOR_TYPE ? EstimatorPanel : cls === SAGE_TYPE ? SagePanel : null;
  if (!Kind || typeof node.addDOMWidget !== "function") return;
  if (node.widgets?.some((w) => w?.name === WIDGET)) return; // one panel per node
  const panel = new Kind(node);
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
  const sagePanels = [...panels].filter((p) => p instanceof SagePanel);
  const hit = d.node_id === null || d.node_id === undefined
    ? (sagePanels.length === 1 ? sagePanels : [])
    : sagePanels.filter((p) => matches(p.node, d.node_id));
  for (const p of hit) p.onStats(d);
  void refreshSageStatus(); // a run may have self-tested a kernel
}

function start() {
  if (ticker !== null) return;
  api.addEventListener("executed", onExecuted);
  api.addEventListener("wan_sage.stats", onStats);
  api.addEventListener("graphChanged", tick);
  ticker = setInterval(tick, POLL_MS);
  void refreshVram(true);
  void refreshSageStatus();
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
