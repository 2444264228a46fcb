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
 * {totalGib, freeGib, name, type} of the first device in GET /system_stats, or null without one.
 * On a CPU device ComfyUI reports system RAM as its "VRAM", and plans model loading against it,
 * so that figure is used too (fmtVram labels it).
 */
export function vramFromSystemStats(stats) {
  const d = stats?.devices?.[0];
  if (!d || !isNum(d.vram_total) || d.vram_total <= 0) return null;
  return {
    totalGib: d.vram_total / GiB,
    freeGib: isNum(d.vram_free) ? d.vram_free / GiB : null,
    name: typeof d.name === "string" ? d.name : "",
    type: d.type ?? "",
  };
}

/**
 * "18.2 free / 24.0 GiB", "24.0 GiB" without a free figure, "... (CPU RAM)" on a CPU device,
 * "no GPU" without a device.
 */
export function fmtVram(vram, summaryVramGib = null) {
  if (vram && isNum(vram.totalGib)) {
    const s = isNum(vram.freeGib) ? `${vram.freeGib.toFixed(1)} free / ${vram.totalGib.toFixed(1)} GiB`
      : `${vram.totalGib.toFixed(1)} GiB`;
    return vram.type === "cpu" ? `${s} (CPU RAM)` : s;
  }
  if (isNum(summaryVramGib) && summaryVramGib > 0) return `${summaryVramGib.toFixed(1)} GiB`;
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
    { field: "activation_gib", label: "Predicted peak", value: fmtGiB(s.activation_gib) },
    { field: "sage_extra_gib", label: "Sage extra", value: fmtSignedGiB(s.sage_extra_gib) },
    { field: "reservation_gib", label: "Reservation", value: fmtGiB(s.reservation_gib) },
    { field: "comfy_gib", label: "ComfyUI estimate", value: fmtGiB(s.comfy_gib) },
    { field: "vram", label: "VRAM", value: fmtVram(vram, s.vram_gib) },
  ];
}

/**
 * What makes the setup wrong, from the route's ``summary.problems`` (one-line strings, e.g. a latent
 * of another channel count than the model takes): the non-empty strings, trimmed; [] without any.
 */
export function problemsOf(summary) {
  const p = summary?.problems;
  return Array.isArray(p) ? p.filter((x) => typeof x === "string" && x.trim()).map((x) => x.trim()) : [];
}

/**
 * How many lines ``text`` takes when it wraps in a box ``widthPx`` wide at about ``charPx`` per
 * character (at least one per line of the text; one for an empty text).  For the panel's height
 * before its content has been laid out and measured.
 */
export function wrappedLines(text, widthPx, charPx = 6.5) {
  const perLine = Math.max(8, Math.floor((isNum(widthPx) && widthPx > 0 ? widthPx : 300) / charPx));
  return String(text ?? "").split("\n").reduce((n, line) => n + Math.max(1, Math.ceil(line.length / perLine)), 0);
}

/** The verdict line: {text, level, colour}; the text is the server's, as it sends it. */
export function verdictOf(summary) {
  const { level, colour } = verdictStyle(summary?.level);
  const text = typeof summary?.verdict === "string" && summary.verdict ? summary.verdict : level;
  return { text, level, colour };
}

const str = (v) => (typeof v === "string" && v.trim() ? v.trim() : null);

/**
 * The model the estimate is for, as the route's ``summary.detected`` describes it:
 * {name, text, guessed}.  ``name``: the model (file or preset name); ``text``: "t2v · dim 5120 ·
 * 40 layers · 40 heads · bf16 weights" (the parts the server sent); ``guessed``: the server
 * guessed it from a name or preset instead of reading a model file's header.  Null without
 * ``detected``.
 */
export function detectedModel(summary) {
  const d = summary?.detected;
  if (!d || typeof d !== "object") return null;
  const parts = [];
  if (str(d.model_type)) parts.push(str(d.model_type));
  if (isNum(d.dim)) parts.push(`dim ${d.dim}`);
  if (isNum(d.num_layers)) parts.push(`${d.num_layers} layers`);
  if (isNum(d.num_heads)) parts.push(`${d.num_heads} heads`);
  if (str(d.weight_dtype)) parts.push(`${str(d.weight_dtype)} weights`);
  return { name: str(d.model) ?? "", text: parts.join(" \u00b7 "), guessed: d.guessed === true };
}

/**
 * What the estimate assumes about the model, for the panel's headline, or null when it read the
 * model file.  No loader upstream: "Assumed model: <name> (no model loader upstream)"; a loader
 * whose file header could not be read: "Model guessed from its name: <name>".
 */
export function assumptionOf(info, summary) {
  const m = detectedModel(summary);
  const name = m?.name || str(summary?.source) || "a preset";
  if (!info?.modelFile) return `Assumed model: ${name} (no model loader upstream)`;
  if (m?.guessed) return `Model guessed from its name: ${name}`;
  return null;
}

const fmtSize = (s) => {
  const frames = isNum(s?.frames) ? `${s.frames} frames` : "? frames";
  const wh = isNum(s?.width) && isNum(s?.height) ? `${s.width}\u00d7${s.height}` : "?\u00d7?";
  return `${isNum(s?.batch) && s.batch > 1 ? `${s.batch} \u00d7 ` : ""}${wh}, ${frames}`;
};

/**
 * The one line that says where the video size comes from: {text, title}.  ``info`` is
 * buildEstimatePayload's.  With the latent connected the widgets are not used (the panel disables
 * them); the title carries the longer explanation.
 */
export function sizeLine(info) {
  if (!info || !info.size) return { text: "", title: "" };
  const size = fmtSize(info.size);
  if (info.sizeFrom === "latent") {
    return {
      text: `Size ${size} \u00b7 from the latent (#${info.latent.id})`,
      title: `The size comes from the connected latent (${info.latent.type} #${info.latent.id}); `
        + "this node's width, height, frames and batch_size widgets are not used while it is connected.",
    };
  }
  if (info.sizeFrom === "latent-unread") {
    return {
      text: `Size from the latent when it runs \u00b7 preview: ${size}`,
      title: "The latent input is connected to a node whose size the panel cannot read. The node uses the "
        + "latent's size when it runs; until then the panel previews the widgets' size.",
    };
  }
  return {
    text: `Size ${size} \u00b7 from the widgets`,
    title: "Nothing is connected to the latent input, so this node's width, height, frames and batch_size "
      + "widgets set the size. Connect the video latent to follow it instead.",
  };
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
  // Under torch.distributed (multi-GPU runs) each rank counts its own calls: the row says whose.
  const rank = isNum(s.rank) ? [{ field: "rank", label: "Rank", value: `${fmtInt(s.rank)} (its own calls)` }] : [];
  return [
    ...rank,
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
 * The Sage panel's compile line from a stats event's ``compile`` object (memory.report.compile_payback_summary):
 * {text, verdict} with verdict "compile" (compiling pays back for the steps this model samples), "eager" (it does
 * not: run eagerly), "unknown" (the steps were not known) or "none" (the model ran eagerly: no line).
 */
export function compileView(payback) {
  const text = payback && typeof payback === "object" && typeof payback.text === "string" ? payback.text : "";
  if (!text) return { text: "", verdict: "none" };
  const verdict = payback.pays_back === true ? "compile" : payback.pays_back === false ? "eager" : "unknown";
  return { text, verdict };
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

/** The panel's source line: the attention counted, a LoRA, and the server's model source. */
export function sourceLine(info, summary) {
  if (!info) return "";
  const parts = [`attention ${info.attention ?? "sdpa"}`];
  if (info.lora) parts.push("LoRA");
  if (info.compiled) parts.push("compiled blocks");
  if (info.compiledWhole) parts.push("whole-model compile, estimated as eager");
  const src = str(summary?.source) ?? (info.modelFile ? `model ${info.modelFile}` : null);
  if (src) parts.push(src.startsWith("model") ? src : `model: ${src}`);
  return parts.join(" \u00b7 ");
}

export const DYNAMIC_VRAM_LINE = "dynamic VRAM: ComfyUI manages residency, the reservation changes nothing here (the estimate is information)";

/** The line of an estimator report to show after a run: its "verdict: ..." line, else its last. */
export function lastRunLine(text) {
  if (typeof text !== "string" || !text.trim()) return "";
  const lines = text.split("\n").map((l) => l.trim()).filter(Boolean);
  const v = lines.find((l) => /^verdict:/i.test(l));
  const line = (v ? v.replace(/^verdict:\s*/i, "") : lines.at(-1)) ?? "";
  // The node's report says so on its "memory path: dynamic VRAM" line; the panel shows it beside the verdict.
  return lines.some((l) => /^memory path: dynamic VRAM/i.test(l)) ? `${line} · ${DYNAMIC_VRAM_LINE}` : line;
}
