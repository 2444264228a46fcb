// wan-sage panel: the body of POST /wan_sage/estimate, built from a GraphView (see graph.js).
// Side-effect free (the frontend imports every .js under web/ as an extension).

import { latentOrigin, modelChain, widgetValue } from "./graph.js";

const toInt = (v) => {
  const n = typeof v === "string" && v.trim() !== "" ? Number(v) : v;
  return typeof n === "number" && Number.isFinite(n) ? Math.round(n) : null;
};
const toNum = (v) => {
  const n = typeof v === "string" && v.trim() !== "" ? Number(v) : v;
  return typeof n === "number" && Number.isFinite(n) ? n : null;
};

/** The attention choice: the Sage patch's kernel ("auto" -> "sage-auto"), or "sdpa". */
export function attentionFor(sage, countSageExtra) {
  if (countSageExtra === "never") return "sdpa";
  if (sage) {
    const k = sage.widgets?.kernel;
    return typeof k === "string" && k && k !== "auto" ? k : "sage-auto";
  }
  return countSageExtra === "always" ? "sage-auto" : "sdpa";
}

/** The estimator widgets that set the video size; the latent input replaces all four. */
export const SIZE_WIDGETS = Object.freeze(["width", "height", "frames", "batch_size"]);

/**
 * Build the estimate request for the estimator node ``estimatorId``.
 *
 * Returns { payload, info } where ``payload`` is the JSON body (or null when a size is missing)
 * and ``info`` says where things came from: { modelFile, loaderType, sage (node id | null),
 * attention, lora, latent: {id, type} | null, latentLinked, sizeFrom, size, missing }.
 * ``latentLinked``: the estimator's latent input is connected.  ``sizeFrom``: "latent" (read from
 * the video latent node), "latent-unread" (connected, but to nothing whose size the panel can
 * read: the panel uses the widgets, the node the latent when it runs) or "widgets" (nothing
 * connected, or an image latent, for which the node uses its widgets too).
 * ``size``: {width, height, frames, batch} as sent.  ``missing``: size fields without a value.
 *
 * ``opts.vramGib``: total VRAM in GiB from /system_stats, or null (then no vram_gib is sent and the
 * server uses its own device, if any).
 */
export function buildEstimatePayload(view, estimatorId, opts = {}) {
  const node = view.node(estimatorId);
  if (!node) return { payload: null, info: { missing: ["node"] } };
  const chain = modelChain(view, node);
  const origin = latentOrigin(view, node);
  const latent = origin?.kind === "video" ? origin.source : null;
  const own = (name) => widgetValue(view, node, name);
  const pick = (fromLatent, name) => {
    const v = latent ? toInt(fromLatent) : null;
    return v ?? toInt(own(name));
  };
  const size = {
    width: pick(latent?.width, "width"),
    height: pick(latent?.height, "height"),
    frames: pick(latent?.frames, "frames"),
    batch: pick(latent?.batch_size, "batch_size"),
  };
  const cfg = toNum(own("cfg"));
  const countSage = node.widgets?.count_sage_extra;
  const attention = attentionFor(chain.sage, countSage);
  const latentLinked = origin !== null;
  const info = {
    modelFile: chain.modelFile,
    loaderType: chain.loader?.type ?? null,
    sage: chain.sage ? chain.sage.id : null,
    attention,
    lora: chain.lora,
    compiled: chain.compiled,
    compiledWhole: chain.compiledWhole,
    latent: latent ? { id: latent.node.id, type: latent.node.type } : null,
    latentLinked,
    sizeFrom: latent ? "latent" : origin?.kind === "unknown" ? "latent-unread" : "widgets",
    size,
    missing: Object.entries(size).filter(([, v]) => v === null).map(([k]) => k),
  };
  if (info.missing.length) return { payload: null, info };
  const payload = { ...size, cfg: cfg ?? 1.0, attention };
  // The node's widget ids stay margin_gb / fixed_gb (saved workflows keep loading); both hold GiB.
  const margin = toNum(own("margin_gb"));
  if (margin !== null) payload.margin_gib = margin;
  const policy = own("policy");
  if (typeof policy === "string" && policy !== "wan-sage estimate") {
    payload.policy = policy;
    const fixed = toNum(own("fixed_gb"));
    if (fixed !== null) payload.fixed_gib = fixed;
  }
  if (chain.modelFile) payload.model_file = chain.modelFile;
  const wd = chain.loader?.widgets?.weight_dtype;
  if (typeof wd === "string" && wd.startsWith("fp8")) payload.weights = "fp8";
  if (chain.lora) payload.lora = true;
  if (chain.compiled) payload.compiled = true;
  const vram = toNum(opts.vramGib);
  if (vram !== null && vram > 0) payload.vram_gib = Math.round(vram * 1000) / 1000;
  return { payload, info };
}
