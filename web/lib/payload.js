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
 * The channel count of the latent each of ComfyUI's video latent nodes makes, where its type alone
 * tells it (comfy_extras/nodes_hunyuan.py and nodes_wan.py): 16 for the Wan 2.1 / A14B VAE's
 * latents, 48 for the Wan 2.2 VAE's (TI2V-5B).  Nodes whose count follows the VAE wired to them
 * (WanFirstLastFrameToVideo, WanFunInpaintToVideo, Wan22FunControlToVideo) are not listed.
 */
export const LATENT_CHANNELS = Object.freeze({
  EmptyHunyuanLatentVideo: 16,
  HunyuanImageToVideo: 16,
  WanImageToVideo: 16,
  WanFunControlToVideo: 16,
  WanVaceToVideo: 16,
  WanCameraImageToVideo: 16,
  WanPhantomSubjectToVideo: 16,
  WanTrackToVideo: 16,
  WanSoundImageToVideo: 16,
  WanSoundImageToVideoExtend: 16,
  WanHuMoImageToVideo: 16,
  WanAnimateToVideo: 16,
  Wan22ImageToVideoLatent: 48,
});

/**
 * The first of ``names`` that the node has as a widget (or as a linked widget input), else the
 * first name: the current widget names come first, the names an older frontend state may still
 * carry after them.
 */
const widgetName = (node, names) =>
  names.find((n) => n in (node.widgets ?? {}) || (node.inputs ?? []).some((i) => i.name === n)) ?? names[0];

/**
 * Build the estimate request for the estimator node ``estimatorId``.
 *
 * Returns { payload, info } where ``payload`` is the JSON body (or null when a size is missing)
 * and ``info`` says where things came from: { modelFile, loaderType, sage (node id | null),
 * attention, lora, latent: {id, type} | null, latentLinked, latentChannels, sizeFrom, size, missing }.
 * ``latentLinked``: the estimator's latent input is connected.  ``sizeFrom``: "latent" (read from
 * the video latent node), "latent-unread" (connected, but to nothing whose size the panel can
 * read: the panel uses the widgets, the node the latent when it runs) or "widgets" (nothing
 * connected, or an image latent, for which the node uses its widgets too).
 * ``size``: {width, height, frames, batch} as sent.  ``missing``: size fields without a value.
 * ``latentChannels``: the channel count of the connected latent when its node's type tells it
 * (LATENT_CHANNELS), else null; sent as ``latent_channels``, so the server can say when the model
 * takes another count (``summary.problems``).
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
  const latentNode = origin ? (origin.kind === "video" ? origin.source.node : origin.node) : null;
  const channels = latentNode ? LATENT_CHANNELS[latentNode.type] ?? null : null;
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
    latentChannels: channels,
    sizeFrom: latent ? "latent" : origin?.kind === "unknown" ? "latent-unread" : "widgets",
    size,
    missing: Object.entries(size).filter(([, v]) => v === null).map(([k]) => k),
  };
  if (info.missing.length) return { payload: null, info };
  const payload = { ...size, cfg: cfg ?? 1.0, attention };
  // The widgets are margin_gib / fixed_gib; margin_gb / fixed_gb are their names before the rename
  // (both hold GiB), read should a node still carry them.
  const margin = toNum(own(widgetName(node, ["margin_gib", "margin_gb"])));
  if (margin !== null) payload.margin_gib = margin;
  const policy = own("policy");
  if (typeof policy === "string" && policy !== "wan-sage estimate") {
    payload.policy = policy;
    const fixed = toNum(own(widgetName(node, ["fixed_gib", "fixed_gb"])));
    if (fixed !== null) payload.fixed_gib = fixed;
  }
  if (channels !== null) payload.latent_channels = channels;
  if (chain.modelFile) payload.model_file = chain.modelFile;
  const wd = chain.loader?.widgets?.weight_dtype;
  // UNETLoader's fp8_e4m3fn_fast multiplies in fp8 (the route's fp8_fast); its other fp8 choices cast per call
  if (typeof wd === "string" && wd.startsWith("fp8")) payload.weights = wd === "fp8_e4m3fn_fast" ? "fp8_fast" : "fp8";
  if (chain.lora) payload.lora = true;
  if (chain.compiled) payload.compiled = true;
  const vram = toNum(opts.vramGib);
  if (vram !== null && vram > 0) payload.vram_gib = Math.round(vram * 1000) / 1000;
  return { payload, info };
}
