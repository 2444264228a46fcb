// wan-sage panel: the body of POST /wan_sage/estimate, built from a GraphView (see graph.js).
// Side-effect free (the frontend imports every .js under web/ as an extension).

import { latentSource, modelChain, widgetValue } from "./graph.js";

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

/**
 * Build the estimate request for the estimator node ``estimatorId``.
 *
 * Returns { payload, info } where ``payload`` is the JSON body (or null when a size is missing)
 * and ``info`` says where things came from: { modelFile, loaderType, sage (node id | null),
 * attention, lora, latent: {id, type} | null, missing: [field names] }.
 *
 * ``opts.vramGb``: total VRAM in GiB from /system_stats, or null (then no vram_gb is sent and the
 * server uses its own device, if any).
 */
export function buildEstimatePayload(view, estimatorId, opts = {}) {
  const node = view.node(estimatorId);
  if (!node) return { payload: null, info: { missing: ["node"] } };
  const chain = modelChain(view, node);
  const latent = latentSource(view, node);
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
  const info = {
    modelFile: chain.modelFile,
    loaderType: chain.loader?.type ?? null,
    sage: chain.sage ? chain.sage.id : null,
    attention,
    lora: chain.lora,
    latent: latent ? { id: latent.node.id, type: latent.node.type } : null,
    missing: Object.entries(size).filter(([, v]) => v === null).map(([k]) => k),
  };
  if (info.missing.length) return { payload: null, info };
  const payload = { ...size, cfg: cfg ?? 1.0, attention };
  const margin = toNum(own("margin_gb"));
  if (margin !== null) payload.margin_gb = margin;
  const policy = own("policy");
  if (typeof policy === "string" && policy !== "wan-sage estimate") {
    payload.policy = policy;
    const fixed = toNum(own("fixed_gb"));
    if (fixed !== null) payload.fixed_gb = fixed;
  }
  if (chain.modelFile) payload.model_file = chain.modelFile;
  const wd = chain.loader?.widgets?.weight_dtype;
  if (typeof wd === "string" && wd.startsWith("fp8")) payload.weights = "fp8";
  if (chain.lora) payload.lora = true;
  const vram = toNum(opts.vramGb);
  if (vram !== null && vram > 0) payload.vram_gb = Math.round(vram * 1000) / 1000;
  return { payload, info };
}
