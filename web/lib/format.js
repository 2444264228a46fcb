// wan-sage panel: number formatting, verdict colours and the rows the panels show.
// Side-effect free (the frontend imports every .js under web/ as an extension).

export const GiB = 1024 ** 3;
export const DASH = "\u2014";

/** Colours of the verdict levels the estimate route returns (summary.level), plus "error". */
export const LEVEL_COLOURS = Object.freeze({
  fits: "#3fb950", // green
  offloads: "#d29922", // amber
  cannot: "#f85149", // red
  unknown: "#8b949e", // grey
  error: "#f85149",
});

export const isNum = (x) => typeof x === "number" && Number.isFinite(x);

export function bytesToGiB(b) {
  return isNum(b) ? b / GiB : null;
}

/** "12.34 GiB"; a dash for a missing value. */
export function fmtGiB(x, digits = 2) {
  return isNum(x) ? `${x.toFixed(digits)} GiB` : DASH;
}

/** "+0.42 GiB" / "-0.10 GiB" (zero is "+0.00 GiB"). */
export function fmtSignedGiB(x, digits = 2) {
  if (!isNum(x)) return DASH;
  const s = Math.abs(x).toFixed(digits);
  return `${x < 0 && Number(s) !== 0 ? "-" : "+"}${s} GiB`;
}

/** 75600 -> "75,600" (no locale dependence). */
export function fmtInt(n) {
  if (!isNum(n)) return DASH;
  const s = String(Math.round(Math.abs(n)));
  return (n < 0 ? "-" : "") + s.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

/** Milliseconds as seconds: 12345 -> "12.3 s"; under 10 s two decimals. */
export function fmtSeconds(ms) {
  if (!isNum(ms)) return DASH;
  const s = ms / 1000;
  return `${Math.abs(s) < 10 ? s.toFixed(2) : s.toFixed(1)} s`;
}

/** {level, colour} for a summary.level; anything unknown maps to "unknown". */
export function verdictStyle(level) {
  const l = Object.prototype.hasOwnProperty.call(LEVEL_COLOURS, level) ? level : "unknown";
  return { level: l, colour: LEVEL_COLOURS[l] };
}

/**
 * {totalGb, freeGb, name, type} of the first device in GET /system_stats, or null without one.
 * On a CPU device ComfyUI reports system RAM as its "VRAM", and plans model loading against it,
 * so that figure is used too (fmtVram labels it).
 */
export function vramFromSystemStats(stats) {
  const d = stats?.devices?.[0];
  if (!d || !isNum(d.vram_total) || d.vram_total <= 0) return null;
  return {
    totalGb: d.vram_total / GiB,
    freeGb: isNum(d.vram_free) ? d.vram_free / GiB : null,
    name: typeof d.name === "string" ? d.name : "",
    type: d.type ?? "",
  };
}

/**
 * "18.2 free / 24.0 GiB", "24.0 GiB" without a free figure, "... (CPU RAM)" on a CPU device,
 * "no GPU" without a device.
 */
export function fmtVram(vram, summaryVramGb = null) {
  if (vram && isNum(vram.totalGb)) {
    const s = isNum(vram.freeGb) ? `${vram.freeGb.toFixed(1)} free / ${vram.totalGb.toFixed(1)} GiB`
      : `${vram.totalGb.toFixed(1)} GiB`;
    return vram.type === "cpu" ? `${s} (CPU RAM)` : s;
  }
  if (isNum(summaryVramGb) && summaryVramGb > 0) return `${summaryVramGb.toFixed(1)} GiB`;
  return "no GPU";
}

/**
 * The estimator panel's rows: [{field, label, value}] in display order, from the route's
 * ``summary`` and the device's VRAM (vramFromSystemStats).  ``field`` is the data-field name.
 */
export function estimateRows(summary, vram) {
  const s = summary ?? {};
  return [
    { field: "tokens", label: "Tokens", value: fmtInt(s.tokens) },
    { field: "activation_gb", label: "Predicted peak", value: fmtGiB(s.activation_gb) },
    { field: "sage_extra_gb", label: "Sage extra", value: fmtSignedGiB(s.sage_extra_gb) },
    { field: "reservation_gb", label: "Reservation", value: fmtGiB(s.reservation_gb) },
    { field: "comfy_gb", label: "ComfyUI estimate", value: fmtGiB(s.comfy_gb) },
    { field: "vram", label: "VRAM", value: fmtVram(vram, s.vram_gb) },
  ];
}

/** The verdict line: {text, level, colour}. */
export function verdictOf(summary) {
  const { level, colour } = verdictStyle(summary?.level);
  const text = typeof summary?.verdict === "string" && summary.verdict ? summary.verdict : level;
  return { text, level, colour };
}

/** The message of a failed estimate: the route's 400 body, or the status. */
export function errorMessage(status, body) {
  if (body && typeof body.error === "string" && body.error) {
    return body.field && !body.error.startsWith(body.field) ? `${body.field}: ${body.error}` : body.error;
  }
  return `estimate failed (HTTP ${status})`;
}

/** {"short": 3, "cross_slower": 40} -> "cross_slower 40, short 3" (largest first); "none". */
export function fmtCounts(obj) {
  const e = Object.entries(obj ?? {}).filter(([, n]) => isNum(n) && n > 0);
  if (!e.length) return "none";
  e.sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : a[0] > b[0] ? 1 : 0));
  return e.map(([k, n]) => `${k} ${fmtInt(n)}`).join(", ");
}

/** The Sage patch panel's rows from a wan_sage.stats summary: [{field, label, value}]. */
export function statsRows(summary) {
  const s = summary ?? {};
  const sage = isNum(s.sage_calls) ? s.sage_calls : 0;
  const sdpa = isNum(s.sdpa_calls) ? s.sdpa_calls : 0;
  const total = sage + sdpa;
  const pct = total ? ` (${Math.round((100 * sage) / total)} %)` : "";
  const fallbacks = Object.values(s.fallbacks ?? {}).reduce((a, n) => a + (isNum(n) ? n : 0), 0);
  return [
    { field: "sage_calls", label: "Sage calls", value: `${fmtInt(sage)} of ${fmtInt(total)}${pct}` },
    { field: "sdpa_calls", label: "SDPA calls", value: fmtInt(sdpa) },
    { field: "by_kernel", label: "By kernel", value: fmtCounts(s.by_kernel) },
    { field: "reasons", label: "SDPA reasons", value: fmtCounts(s.reasons) },
    { field: "fallbacks", label: "Fallbacks", value: fallbacks ? `${fmtInt(fallbacks)} (${fmtCounts(s.fallbacks)})` : "none" },
    { field: "head_split_calls", label: "Head-split calls", value: fmtInt(isNum(s.head_split_calls) ? s.head_split_calls : 0) },
    { field: "saved", label: "Time saved (est.)", value: fmtSeconds(isNum(s.saved_ms) ? s.saved_ms : 0) },
    { field: "calibration", label: "Calibration", value: fmtSeconds(isNum(s.calibration_ms) ? s.calibration_ms : 0) },
  ];
}

/**
 * Whether an execution id from the server ("12", or "7:12" for a node inside a subgraph) is the
 * node ``nodeId``.  ``nested``: the node lives in a subgraph (then only the last part is compared).
 */
export function execIdMatches(execId, nodeId, nested = false) {
  if (execId === null || execId === undefined || nodeId === null || nodeId === undefined) return false;
  const e = String(execId);
  const n = String(nodeId);
  if (e === n) return true;
  return nested && e.endsWith(`:${n}`);
}

/** The first text of an ``executed`` message's output ({"text": [report]}), or null. */
export function executedText(detail) {
  const t = detail?.output?.text;
  const v = Array.isArray(t) ? t[0] : typeof t === "string" ? t : null;
  return typeof v === "string" ? v : null;
}

/** What the panel says about where its inputs came from (model, attention, size source). */
export function sourceLine(info, summary) {
  if (!info) return "";
  const parts = [];
  if (!info.modelFile) parts.push("no model loader found");
  parts.push(summary?.source ? `model: ${summary.source}` : info.modelFile ? `model ${info.modelFile}` : "");
  parts.push(`attention ${info.attention ?? "sdpa"}`);
  if (info.lora) parts.push("LoRA");
  if (info.latent) parts.push(`size from ${info.latent.type} #${info.latent.id}`);
  return parts.filter(Boolean).join(" \u00b7 ");
}
