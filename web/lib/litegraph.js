// wan-sage panel: a GraphView (see graph.js) over a LiteGraph graph, duck-typed so that it
// works with the classic canvas and Nodes 2.0 alike (both keep the LiteGraph model) and can be
// tested with plain objects.  Side-effect free (the frontend imports every .js under web/).
//
// Links are read through the node methods the frontend recommends (LGraphNode.getInputLink and
// getOutputNodes, present in 1.27 and current; frontend 1.58 warns that reading input.link and
// output.links is deprecated).  Objects without those methods (older frontends, plain test
// objects) are read through input.link / output.links.

/** The LLink of ``id``: graph.getLink, the links Map (or the older id-keyed object), _links. */
export function linkOf(graph, id) {
  if (id === null || id === undefined || !graph) return null;
  if (typeof graph.getLink === "function") return graph.getLink(id) ?? null;
  const links = graph.links ?? graph._links;
  if (links && typeof links.get === "function") return links.get(id) ?? null;
  return links?.[id] ?? null;
}

/** The ComfyUI class of a LiteGraph node ("UNETLoader", ...). */
export const nodeClass = (n) => n?.comfyClass ?? n?.type ?? "";

// A subgraph node overrides getInputLink with a meaning of its own (the link inside the subgraph
// that feeds one of its outputs), so its inputs are found in the graph's links instead.
const isSubgraphNode = (n) => {
  try {
    return typeof n?.isSubgraphNode === "function" && n.isSubgraphNode() === true;
  } catch {
    return false;
  }
};

function allLinks(graph) {
  const links = graph?.links ?? graph?._links;
  if (!links) return [];
  return typeof links.values === "function" ? [...links.values()] : Object.values(links);
}

/** The LLink that feeds input ``slot`` of LiteGraph node ``n``, or null. */
export function inputLinkOf(graph, n, slot) {
  if (!n) return null;
  if (isSubgraphNode(n)) {
    return allLinks(graph).find((l) => l && l.target_id === n.id && l.target_slot === slot) ?? null;
  }
  if (typeof n.getInputLink === "function") {
    try {
      return n.getInputLink(slot) ?? null;
    } catch {
      return null; // a node outside any graph
    }
  }
  return linkOf(graph, n.inputs?.[slot]?.link);
}

/** [{target, slot}]: the inputs that output ``slot`` of LiteGraph node ``n`` feeds. */
export function outputTargetsOf(graph, n, slot) {
  if (!n) return [];
  if (typeof n.getOutputNodes === "function") {
    let targets;
    try {
      targets = n.getOutputNodes(slot) ?? [];
    } catch {
      targets = [];
    }
    const out = [];
    const seen = new Set();
    for (const t of targets) {
      if (!t || seen.has(t.id)) continue;
      seen.add(t.id);
      (t.inputs ?? []).forEach((_input, j) => {
        const l = inputLinkOf(graph, t, j);
        if (l && l.origin_id === n.id && l.origin_slot === slot) out.push({ target: t.id, slot: j });
      });
    }
    return out;
  }
  return (n.outputs?.[slot]?.links ?? [])
    .map((id) => linkOf(graph, id))
    .filter(Boolean)
    .map((l) => ({ target: l.target_id, slot: l.target_slot }));
}

/** A NodeView of one LiteGraph node; ``skipWidget`` names a widget to leave out (our panel). */
export function nodeView(graph, n, skipWidget = null) {
  const widgets = {};
  for (const w of n.widgets ?? []) {
    if (!w || !w.name || w.name === skipWidget || w.name in widgets) continue;
    widgets[w.name] = w.value;
  }
  return {
    id: n.id,
    type: nodeClass(n),
    mode: n.mode ?? 0,
    widgets,
    inputs: (n.inputs ?? []).map((i, slot) => {
      const l = inputLinkOf(graph, n, slot);
      return { name: i?.name, type: i?.type, link: l ? { origin: l.origin_id, slot: l.origin_slot } : null };
    }),
    outputs: (n.outputs ?? []).map((o, slot) => ({
      name: o?.name,
      type: o?.type,
      links: outputTargetsOf(graph, n, slot),
    })),
  };
}

/** GraphView of a LiteGraph graph (LGraph or a subgraph); node views are cached per view. */
export function liteGraphView(graph, skipWidget = null) {
  const cache = new Map();
  return {
    node(id) {
      if (cache.has(id)) return cache.get(id);
      const n = graph?.getNodeById?.(id) ?? null;
      const v = n ? nodeView(graph, n, skipWidget) : null;
      cache.set(id, v);
      return v;
    },
  };
}
