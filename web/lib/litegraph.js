// wan-sage panel: a GraphView (see graph.js) over a LiteGraph graph, duck-typed so that it
// works with the classic canvas and Nodes 2.0 alike (both keep the LiteGraph model) and can be
// tested with plain objects.  Side-effect free (the frontend imports every .js under web/).

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
    inputs: (n.inputs ?? []).map((i) => {
      const l = linkOf(graph, i?.link);
      return { name: i?.name, type: i?.type, link: l ? { origin: l.origin_id, slot: l.origin_slot } : null };
    }),
    outputs: (n.outputs ?? []).map((o) => ({
      name: o?.name,
      type: o?.type,
      links: (o?.links ?? [])
        .map((id) => linkOf(graph, id))
        .filter(Boolean)
        .map((l) => ({ target: l.target_id, slot: l.target_slot })),
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
