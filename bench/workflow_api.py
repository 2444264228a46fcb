"""Convert a ComfyUI UI-format workflow (the saved .json) into the API prompt that execution.PromptExecutor runs.

What the frontend does when it queues a graph, for the parts a saved Wan workflow uses:

* one API node per graph node, ``{"class_type", "inputs", "_meta": {"title"}}``, keyed by the node id;
* widget values (``widgets_values``, a list in input order, or a dict by name) go to the inputs
  that are widgets in the node definition (INT, FLOAT, STRING, BOOLEAN, COMBO, or a list of
  options), required inputs first, then optional ones; the extra "control after generate"
  value that follows a seed widget is skipped;
* links (``[id, from_node, from_slot, to_node, to_slot, type]`` lists, or the object form) become
  ``[from_node_id, from_slot]``, also for widgets converted to inputs;
* ``Reroute`` nodes are followed, ``PrimitiveNode`` values are inlined, bypassed nodes (mode 4)
  pass the first input of the same type through, muted nodes (mode 2) and notes are dropped.

Subgraphs are not supported and raise ``ValueError``, as does a node type the host does not know.
"""
from __future__ import annotations

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize", "increment-wrap"}
SKIP_TYPES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
MUTED, BYPASS = 2, 4

__all__ = ["is_api_prompt", "ui_to_api", "widget_inputs"]


def is_api_prompt(wf) -> bool:
    return isinstance(wf, dict) and bool(wf) and all(isinstance(v, dict) and "class_type" in v for v in wf.values())


def _is_widget(spec) -> bool:
    if not isinstance(spec, (list, tuple)) or not spec:
        return False
    t = spec[0]
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if opts.get("forceInput") or opts.get("rawLink"):
        return False
    return isinstance(t, (list, tuple)) or t in WIDGET_TYPES


def _has_control(name: str, spec) -> bool:
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    if "control_after_generate" in opts:
        return bool(opts["control_after_generate"])
    return spec[0] == "INT" and name in ("seed", "noise_seed")


def widget_inputs(input_types: dict) -> list[tuple[str, object]]:
    """(name, spec) of the widget inputs of a node definition, in the frontend's order."""
    out = []
    for section in ("required", "optional"):
        for name, spec in (input_types.get(section) or {}).items():
            if _is_widget(spec):
                out.append((name, spec))
    return out


def _links(wf) -> dict:
    out = {}
    for ln in wf.get("links") or []:
        if isinstance(ln, dict):
            out[ln["id"]] = (ln["origin_id"], ln["origin_slot"], ln.get("type"))
        else:
            out[ln[0]] = (ln[1], ln[2], ln[5] if len(ln) > 5 else None)
    return out


def ui_to_api(wf: dict, node_defs: dict) -> dict:
    """``node_defs``: class_type -> node class (``nodes.NODE_CLASS_MAPPINGS``)."""
    if (wf.get("definitions") or {}).get("subgraphs"):
        raise ValueError("this workflow uses subgraphs, which the converter does not expand")
    nodes = {n["id"]: n for n in wf.get("nodes") or []}
    links = _links(wf)

    def resolve(link_id, depth=0):
        """-> ("link", node_id, slot) | ("value", v) | None"""
        if link_id is None or link_id not in links or depth > 64:
            return None
        src_id, slot, ltype = links[link_id]
        src = nodes.get(src_id)
        if src is None:
            return None
        if src.get("type") == "Reroute":
            ins = src.get("inputs") or []
            return resolve(ins[0].get("link"), depth + 1) if ins else None
        if src.get("type") == "PrimitiveNode":
            wv = src.get("widgets_values") or []
            return ("value", wv[0]) if wv else None
        mode = src.get("mode", 0)
        if mode == MUTED:
            return None
        if mode == BYPASS:
            out_type = ((src.get("outputs") or [{}])[slot] or {}).get("type", ltype)
            for inp in src.get("inputs") or []:
                if inp.get("type") == out_type and inp.get("link") is not None:
                    return resolve(inp["link"], depth + 1)
            return None
        return ("link", str(src_id), slot)

    prompt = {}
    for nid, n in nodes.items():
        ctype = n.get("type")
        if ctype in SKIP_TYPES or n.get("mode", 0) in (MUTED, BYPASS):
            continue
        cls = node_defs.get(ctype)
        if cls is None:
            raise ValueError(f"node {nid} has type {ctype!r}, which this ComfyUI does not know "
                             f"(a custom node pack is missing)")
        defs = cls.INPUT_TYPES()
        inputs = {}
        wv = n.get("widgets_values")
        widgets = widget_inputs(defs)
        if isinstance(wv, dict):
            for name, _spec in widgets:
                if name in wv:
                    inputs[name] = wv[name]
        elif isinstance(wv, list):
            i = 0
            for name, spec in widgets:
                if i >= len(wv):
                    break
                inputs[name] = wv[i]
                i += 1
                if _has_control(name, spec) and i < len(wv) and isinstance(wv[i], str) and wv[i] in CONTROL_VALUES:
                    i += 1
        for inp in n.get("inputs") or []:
            if inp.get("link") is None:
                continue
            r = resolve(inp["link"])
            if r is None:
                inputs.pop(inp["name"], None)
            elif r[0] == "value":
                inputs[inp["name"]] = r[1]
            else:
                inputs[inp["name"]] = [r[1], r[2]]
        prompt[str(nid)] = {"class_type": ctype, "inputs": inputs, "_meta": {"title": n.get("title") or ctype}}
    return prompt
