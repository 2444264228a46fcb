// wan-sage panel: walks over a small, frontend-independent graph interface.
//
// ComfyUI's server lists every .js file under web/ as an extension and the frontend imports
// each one, so this module must stay side-effect free: it only declares constants and
// functions, and imports nothing.
//
// The interface (web/lib/litegraph.js adapts a LiteGraph graph to it; tests build one from
// plain objects with graphFromSpec):
//
//   GraphView = { node(id) -> NodeView | null }
//   NodeView  = {
//     id, type,                         // type: the ComfyUI class name ("UNETLoader", ...)
//     mode,                             // 0 always, 2 muted ("never"), 4 bypassed
//     widgets: { [name]: value },
//     inputs:  [{ name, type, link: { origin: id, slot: n } | null }],
//     outputs: [{ name, type, links: [{ target: id, slot: n }] }],
//   }

export const ESTIMATOR_TYPE = "WanWorkingMemoryEstimator";
export const SAGE_TYPE = "WanSageAttentionPatch";
export const MODE_MUTED = 2;
export const MODE_BYPASS = 4;
/** Widgets that name the model file of a loader (UNETLoader, UnetLoaderGGUF, checkpoint loaders). */
export const LOADER_WIDGETS = Object.freeze(["unet_name", "ckpt_name"]);
/** Frontend-only pass-through nodes: one input, one output, no effect on the value. */
export const PASS_THROUGH_TYPES = Object.freeze(["Reroute"]);
const MAX_STEPS = 64;

const isActive = (n) => n.mode !== MODE_BYPASS && n.mode !== MODE_MUTED;
const isPassThrough = (n) => PASS_THROUGH_TYPES.includes(n.type);
const typeIs = (slotType, want) => String(slotType ?? "").split(",").includes(want);

/** The input called ``name``, else the first input of slot type ``type`` (when given). */
export function findInput(node, name, type) {
  const inputs = node?.inputs ?? [];
  return inputs.find((i) => i.name === name) ?? (type ? inputs.find((i) => typeIs(i.type, type)) : undefined) ?? null;
}

/** The node (and its output slot) that feeds ``input``, looking through Reroute nodes. */
export function originOf(view, input) {
  let link = input?.link ?? null;
  for (let step = 0; link && step < MAX_STEPS; step++) {
    const node = view.node(link.origin);
    if (!node) return null;
    if (!isPassThrough(node)) return { node, slot: link.slot };
    link = node.inputs?.[0]?.link ?? null;
  }
  return null;
}

/** The nodes fed by output ``slot`` of ``node``, looking through Reroute nodes. */
export function targetsOf(view, node, slot) {
  const out = [];
  const queue = [...(node?.outputs?.[slot]?.links ?? [])];
  const seen = new Set();
  while (queue.length && seen.size < MAX_STEPS * 4) {
    const l = queue.shift();
    const key = `${l.target}:${l.slot}`;
    if (seen.has(key)) continue;
    seen.add(key);
    const t = view.node(l.target);
    if (!t) continue;
    if (isPassThrough(t)) queue.push(...(t.outputs?.[0]?.links ?? []));
    else out.push({ node: t, slot: l.slot });
  }
  return out;
}

/** A loader's model file name, or null when ``node`` is not a loader. */
export function loaderFile(node) {
  for (const w of LOADER_WIDGETS) {
    const v = node?.widgets?.[w];
    if (typeof v === "string" && v.trim()) return v;
  }
  return null;
}

/**
 * Walk back from ``startNode``'s MODEL input to the loader, and forward from its MODEL output.
 * Returns { loader, modelFile, upstream: [NodeView], downstream: [NodeView], sage: NodeView | null,
 * lora: bool, compiled: bool, compiledWhole: bool }.  ``upstream`` lists the nodes between the loader
 * and startNode (nearest first); ``sage`` is the first active Sage patch found on either side (upstream
 * first); ``compiled`` / ``compiledWhole``: the compile node in force compiles the blocks one by one /
 * the whole model.
 */
export function modelChain(view, startNode) {
  const upstream = [];
  let loader = null;
  const seen = new Set([startNode.id]);
  let input = findInput(startNode, "model", "MODEL");
  for (let step = 0; input && step < MAX_STEPS; step++) {
    const o = originOf(view, input);
    if (!o || seen.has(o.node.id)) break;
    seen.add(o.node.id);
    if (loaderFile(o.node)) {
      loader = o.node;
      break;
    }
    upstream.push(o.node);
    input = findInput(o.node, "model", "MODEL");
  }
  const downstream = [];
  const queue = [startNode];
  const down = new Set([startNode.id]);
  while (queue.length && downstream.length < MAX_STEPS) {
    const n = queue.shift();
    (n.outputs ?? []).forEach((o, slot) => {
      if (!typeIs(o.type, "MODEL")) return;
      for (const t of targetsOf(view, n, slot)) {
        if (down.has(t.node.id)) continue;
        down.add(t.node.id);
        downstream.push(t.node);
        queue.push(t.node);
      }
    });
  }
  const sage = [...upstream, ...downstream].find((n) => n.type === SAGE_TYPE && isActive(n)) ?? null;
  const lora = upstream.some((n) => isActive(n) && /lora/i.test(n.type));
  // Compile nodes: ComfyUI's TorchCompileModel and the nodes of other packs, named alike.  The
  // compiled figure is for blocks compiled one by one (per-block nodes such as KJNodes'); a graph over
  // the whole model (TorchCompileModel, or a per-block node told otherwise) is estimated as eager, as
  // the node does when sampling starts.
  // ComfyUI keeps one compile wrapper (a compile node removes the ones before it), so the compile node
  // nearest the sampler decides: the last one downstream, else the nearest upstream.
  const isCompile = (n) => isActive(n) && /torchcompile/i.test(n.type);
  const last = [...upstream.slice().reverse(), ...downstream].filter(isCompile).at(-1) ?? null;
  const wholeModel = (n) => n.type === "TorchCompileModel" || n.widgets?.compile_transformer_blocks_only === false;
  const compiled = last !== null && !wholeModel(last);
  const compiledWhole = last !== null && wholeModel(last);
  return { loader, modelFile: loader ? loaderFile(loader) : null, upstream, downstream, sage, lora, compiled,
    compiledWhole };
}

/**
 * A widget's value, or, when the widget was turned into an input and linked, the value of the
 * upstream node's "value" widget (PrimitiveInt, PrimitiveFloat, the frontend's PrimitiveNode ...).
 */
export function widgetValue(view, node, name) {
  const input = (node?.inputs ?? []).find((i) => i.name === name);
  if (input?.link) {
    const o = originOf(view, input);
    const v = o?.node?.widgets?.value ?? o?.node?.widgets?.[name];
    if (v !== undefined && v !== null && v !== "") return v;
  }
  return node?.widgets?.[name];
}

/** Widget names a latent node uses for its frame count. */
export const FRAME_WIDGETS = Object.freeze(["length", "frames", "num_frames", "video_frames"]);

/**
 * What feeds ``startNode``'s LATENT input: null when nothing is connected, else
 * {kind: "video", source} (``source`` as latentSource returns it), {kind: "image", node} (a node
 * with width and height but no frame count: a 4-D image latent, for which the estimator uses its
 * own widgets) or {kind: "unknown", node} (no size the panel can read, e.g. an encoded video).
 * Follows LATENT inputs of nodes that carry no size of their own (e.g. a latent batch repeat) up
 * to a few steps.
 */
export function latentOrigin(view, startNode) {
  let input = findInput(startNode, "latent", "LATENT");
  if (!input?.link) return null;
  const seen = new Set([startNode.id]);
  let last = null;
  for (let step = 0; input && step < 8; step++) {
    const o = originOf(view, input);
    if (!o || seen.has(o.node.id)) break;
    seen.add(o.node.id);
    const n = o.node;
    last = n;
    const w = n.widgets ?? {};
    if ("width" in w && "height" in w) {
      const fw = FRAME_WIDGETS.find((f) => f in w);
      if (!fw) return { kind: "image", node: n };
      return {
        kind: "video",
        source: {
          node: n,
          width: widgetValue(view, n, "width"),
          height: widgetValue(view, n, "height"),
          frames: widgetValue(view, n, fw),
          batch_size: "batch_size" in w ? widgetValue(view, n, "batch_size") : undefined,
        },
      };
    }
    input = (n.inputs ?? []).find((i) => typeIs(i.type, "LATENT") && i.link) ?? null;
  }
  return { kind: "unknown", node: last };
}

/**
 * The video size set by the node behind ``startNode``'s LATENT input: {node, width, height,
 * frames, batch_size} or null.  Only nodes with a frame-count widget count: an image latent (4-D)
 * makes the estimator use its own widgets, so the panel does too.
 */
export function latentSource(view, startNode) {
  const o = latentOrigin(view, startNode);
  return o?.kind === "video" ? o.source : null;
}

/**
 * A GraphView from plain objects, for tests and tools:
 * graphFromSpec([{id, type, mode?, widgets?, inputs?: [{name, type, from?: [originId, slot]}],
 * outputs?: [{name, type}]}]).  Output links are derived from the inputs' ``from``.
 */
export function graphFromSpec(spec) {
  const nodes = new Map();
  for (const s of spec) {
    nodes.set(s.id, {
      id: s.id,
      type: s.type,
      mode: s.mode ?? 0,
      widgets: { ...(s.widgets ?? {}) },
      inputs: (s.inputs ?? []).map((i) => ({
        name: i.name,
        type: i.type,
        link: i.from ? { origin: i.from[0], slot: i.from[1] ?? 0 } : null,
      })),
      outputs: (s.outputs ?? []).map((o) => ({ name: o.name, type: o.type, links: [] })),
    });
  }
  for (const n of nodes.values()) {
    n.inputs.forEach((i, slot) => {
      if (!i.link) return;
      const src = nodes.get(i.link.origin);
      if (!src) return;
      while (src.outputs.length <= i.link.slot) src.outputs.push({ name: "", type: i.type, links: [] });
      src.outputs[i.link.slot].links.push({ target: n.id, slot });
    });
  }
  return { node: (id) => nodes.get(id) ?? null };
}
