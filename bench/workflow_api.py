"""ComfyUI UI-format workflows (the saved .json) and the API prompt the frontend queues from them.

The one converter of the project: the end-to-end harness runs saved workflows through it, the host
tests validate the example workflows with it, and the workflow generator lays nodes out with the same
rules. Importing this module imports nothing (neither ComfyUI nor another bench module), so it
loads as ``bench.workflow_api`` and as a top-level ``workflow_api`` alike.

The frontend rules mirrored here are those of ComfyUI frontend 1.27 (the one ComfyUI 0.3.64 ships):

* A node's ``inputs`` are its sockets first (inputs whose type has no widget, or ``forceInput``), then
  one input per widget (``"widget": {"name": ...}``); each group in ``input_order`` order (required,
  then optional, then inputs that are not in ``input_order``).
* ``widgets_values`` has one value per widget in that order, by position: a saved node keeps
  loading after a widget is renamed. An INT whose spec has ``control_after_generate`` (or, when the
  key is absent, one named ``seed``/``noise_seed``) is followed by its control value
  (``fixed``/``increment``/``decrement``/``randomize``). A COMBO with ``control_after_generate`` is
  followed by the control value and a filter string.
* A COMBO with ``image_upload``/``video_upload``/``animated_image_upload`` gets an extra ``upload``
  widget (type IMAGEUPLOAD, saved as ``"image"``) after all other inputs; it is not sent to the server.
* Links are ``[id, origin_id, origin_slot, target_id, target_slot, type]`` (or the object form
  ``{"id", "origin_id", "origin_slot", ...}``); ``type`` is the origin output's type.

What :func:`ui_to_api` does when it queues a graph:

* one API node per graph node, ``{"class_type", "inputs", "_meta": {"title"}}``, keyed by the node id;
* the widget values go to the inputs of the same position in the node definition (a list value is
  sent as ``{"__value__": [...]}``, as the frontend does); ``widgets_values`` saved as a dict by
  some custom nodes are read by name;
* links become ``[origin_id, origin_slot]``, also for widgets converted to inputs;
* ``Reroute`` nodes are followed, ``PrimitiveNode`` values are inlined, bypassed nodes (mode 4)
  pass an input of the output's type through (the same slot first), muted nodes (mode 2) and notes
  are dropped, and so is a link from a muted node.

Subgraphs are not supported and raise ``ValueError``, as does a node type the host does not know.

Public API
----------
``node_info(cls, name, display_name=None)``  one node's definition as ``GET /object_info/<name>`` returns it
``object_info(nodes)``                   every node of ComfyUI's ``nodes`` module
``input_specs(info)``                    the inputs as the frontend orders them (:class:`Spec`)
``widget_layout(info)``                  ``[(spec, role)]``, one per ``widgets_values`` entry
``expected_inputs(info)``                the node's ``inputs`` list as the frontend builds it
``outputs_of(info)``                     ``[(name, type)]`` of the outputs
``types_match(a, b)``                    LiteGraph's rule for connecting slot types
``is_api_prompt(wf)``                    the file is already an API prompt
``ui_to_api(wf, node_defs)``             the API prompt the frontend would queue
"""
from __future__ import annotations

from dataclasses import dataclass, field

FRONTEND_ONLY = frozenset({"Note", "MarkdownNote", "Reroute", "PrimitiveNode"})
NOTE_TYPES = frozenset({"Note", "MarkdownNote"})
# Widget constructors of frontend 1.27 (ComfyWidgets); a type not in here is a socket.
WIDGET_TYPES = frozenset({"INT", "FLOAT", "BOOLEAN", "STRING", "MARKDOWN", "COMBO", "IMAGEUPLOAD",
                          "FILEUPLOAD", "COLOR", "IMAGECOMPARE", "TREESELECT", "MULTISELECT", "CHART",
                          "GALLERIA", "SELECTBUTTON", "TEXTAREA"})
UPLOAD_FLAGS = ("image_upload", "video_upload", "animated_image_upload")
CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")
COMBO_CONTROL_VALUES = CONTROL_VALUES + ("increment-wrap",)
SEED_NAMES = ("seed", "noise_seed")
MODE_ALWAYS, MODE_NEVER, MODE_BYPASS = 0, 2, 4

__all__ = ["FRONTEND_ONLY", "NOTE_TYPES", "Spec", "expected_inputs", "input_specs", "is_api_prompt", "node_info",
           "object_info", "outputs_of", "types_match", "ui_to_api", "widget_layout"]


# --------------------------------------------------------------------------- node definitions

def node_info(cls, name: str, display_name: str | None = None) -> dict:
    """``GET /object_info/<name>`` (server.py ``node_info``) for one node class, V1 or V3."""
    if hasattr(cls, "GET_NODE_INFO_V1"):  # V3 (comfy_api ... io.ComfyNode)
        return cls.GET_NODE_INFO_V1()
    inputs = cls.INPUT_TYPES()
    out = tuple(getattr(cls, "RETURN_TYPES", ()))
    return {
        "input": inputs,
        "input_order": {k: list(v.keys()) for k, v in inputs.items()},
        "output": out,
        "output_is_list": list(getattr(cls, "OUTPUT_IS_LIST", [False] * len(out))),
        "output_name": tuple(getattr(cls, "RETURN_NAMES", out)),
        "name": name,
        "display_name": display_name or name,
        "description": getattr(cls, "DESCRIPTION", ""),
        "python_module": getattr(cls, "RELATIVE_PYTHON_MODULE", "nodes"),
        "category": getattr(cls, "CATEGORY", "sd"),
        "output_node": getattr(cls, "OUTPUT_NODE", False) is True,
    }


def object_info(nodes) -> dict:
    """``GET /object_info``: the definition of every node registered in ComfyUI's ``nodes`` module."""
    names = nodes.NODE_DISPLAY_NAME_MAPPINGS
    return {name: node_info(cls, name, names.get(name)) for name, cls in list(nodes.NODE_CLASS_MAPPINGS.items())}


@dataclass
class Spec:
    name: str
    type: str                      # "COMBO" for option lists
    extra: dict = field(default_factory=dict)
    options: list | None = None    # COMBO options
    optional: bool = False

    @property
    def is_widget(self) -> bool:
        return self.type in WIDGET_TYPES and not self.extra.get("forceInput", False)


def _spec(name: str, raw, optional: bool) -> Spec:
    raw = list(raw) if isinstance(raw, (list, tuple)) else [raw]
    typ = raw[0]
    extra = raw[1] if len(raw) > 1 and isinstance(raw[1], dict) else {}
    if isinstance(typ, (list, tuple)):
        return Spec(name, "COMBO", extra, list(typ), optional)
    if typ == "COMBO":
        return Spec(name, "COMBO", extra, list(extra.get("options", [])), optional)
    return Spec(name, str(typ), extra, None, optional)


def input_specs(info: dict) -> list[Spec]:
    """Inputs (not hidden) in the frontend's order, with the upload widget it adds."""
    inp = info.get("input") or {}
    required = dict(inp.get("required") or {})
    optional = dict(inp.get("optional") or {})
    specs = {n: _spec(n, r, False) for n, r in required.items()}
    specs.update({n: _spec(n, r, True) for n, r in optional.items() if n not in specs})
    # Comfy.UploadImage extension: an "upload" input after the first media combo.
    for n, s in list(specs.items()):
        if not s.optional and s.type == "COMBO" and any(s.extra.get(f) is True for f in UPLOAD_FLAGS):
            specs["upload"] = Spec("upload", "IMAGEUPLOAD", {**s.extra, "imageInputName": n})
            break
    order = info.get("input_order")
    if not order:
        return list(specs.values())
    out, seen = [], set()
    for group, want_optional in (("required", False), ("optional", True)):
        for n in order.get(group) or []:
            s = specs.get(n)
            if s is not None and s.optional == want_optional and n not in seen:
                out.append(s)
                seen.add(n)
    out += [s for n, s in specs.items() if n not in seen]
    return out


def _int_has_control(spec: Spec) -> bool:
    if "control_after_generate" in spec.extra and spec.extra["control_after_generate"] is not None:
        return bool(spec.extra["control_after_generate"])
    return spec.name in SEED_NAMES


def widget_layout(info: dict) -> list[tuple[Spec, str]]:
    """One ``(spec, role)`` per ``widgets_values`` entry; role is "value", "control" or "filter"."""
    out = []
    for s in input_specs(info):
        if not s.is_widget:
            continue
        out.append((s, "value"))
        if s.type == "INT" and _int_has_control(s):
            out.append((s, "control"))
        elif s.type == "COMBO" and s.extra.get("control_after_generate"):
            out += [(s, "control"), (s, "filter")]
    return out


def expected_inputs(info: dict) -> list[dict]:
    """The node's ``inputs`` as frontend 1.27 creates them: sockets, then one per widget."""
    specs = input_specs(info)
    socks = [{"name": s.name, "type": s.type, "optional": s.optional} for s in specs if not s.is_widget]
    wids = [{"name": s.name, "type": s.type, "optional": s.optional, "widget": {"name": s.name}}
            for s in specs if s.is_widget]
    return socks + wids


def outputs_of(info: dict) -> list[tuple[str, str]]:
    types = list(info.get("output") or [])
    names = list(info.get("output_name") or types)
    return [(n, "COMBO" if isinstance(t, (list, tuple)) else str(t)) for n, t in zip(names, types)]


def types_match(a: str, b: str) -> bool:
    """LiteGraph's rule: equal, a wildcard, or overlapping comma-separated unions."""
    if a in ("*", "", None) or b in ("*", "", None):
        return True
    a, b = str(a).upper(), str(b).upper()
    return a == b or bool(set(a.split(",")) & set(b.split(",")))


# --------------------------------------------------------------------------- API format

def is_api_prompt(wf) -> bool:
    """The file is already an API prompt (``{id: {"class_type", "inputs"}}``), not a UI workflow."""
    return isinstance(wf, dict) and bool(wf) and all(isinstance(v, dict) and "class_type" in v for v in wf.values())


def _links(wf: dict) -> dict:
    """``{link id: (origin id, origin slot)}`` from either link form."""
    out = {}
    for ln in wf.get("links") or []:
        if isinstance(ln, dict):
            out[ln["id"]] = (ln["origin_id"], ln["origin_slot"])
        elif isinstance(ln, (list, tuple)) and len(ln) >= 3:
            out[ln[0]] = (ln[1], ln[2])
    return out


def _resolve(by_id: dict, links: dict, lid, depth: int = 0):
    """Follow a link back through Reroute and bypassed nodes: ("link", origin id, slot),
    ("value", v) for a PrimitiveNode, or None (nothing there, or a muted node)."""
    if lid is None or lid not in links or depth > 64:
        return None
    oid, slot = links[lid]
    o = by_id.get(oid)
    if o is None:
        return None
    if o.get("type") == "Reroute":
        up = (o.get("inputs") or [{}])[0].get("link")
        return _resolve(by_id, links, up, depth + 1)
    if o.get("type") == "PrimitiveNode":
        wv = o.get("widgets_values") or []
        return ("value", wv[0]) if wv else None
    mode = o.get("mode", MODE_ALWAYS)
    if mode == MODE_NEVER:
        return None
    if mode == MODE_BYPASS:
        outs = o.get("outputs") or []
        otype = (outs[slot] or {}).get("type") if 0 <= slot < len(outs) else None
        ins = o.get("inputs") or []
        same = [ins[slot]] if 0 <= slot < len(ins) else []
        for inp in same + ins:
            if inp.get("link") is not None and types_match(inp.get("type"), otype):
                return _resolve(by_id, links, inp["link"], depth + 1)
        return None
    return ("link", str(oid), slot)


def _definition(node_defs: dict, node_type: str) -> dict | None:
    d = node_defs.get(node_type)
    if d is None or isinstance(d, dict):
        return d
    return node_info(d, node_type)


def ui_to_api(wf: dict, node_defs: dict) -> dict:
    """The API prompt (``{id: {class_type, inputs, _meta}}``) the frontend would queue for *wf*.

    ``node_defs``: class_type -> the node's definition as ``GET /object_info`` gives it
    (:func:`object_info`), or the node class itself (``nodes.NODE_CLASS_MAPPINGS``)."""
    if (wf.get("definitions") or {}).get("subgraphs"):
        raise ValueError("this workflow uses subgraphs, which the converter does not expand")
    nodes = list(wf.get("nodes") or [])
    by_id = {n["id"]: n for n in nodes}
    links = _links(wf)
    prompt = {}
    for n in nodes:
        t = n.get("type")
        if t in FRONTEND_ONLY or n.get("mode", MODE_ALWAYS) in (MODE_NEVER, MODE_BYPASS):
            continue
        info = _definition(node_defs, t)
        if info is None:
            raise ValueError(f"node {n['id']} has type {t!r}, which this ComfyUI does not know "
                             f"(a custom node pack is missing)")
        inputs = {}
        wv = n.get("widgets_values")
        layout = [s for s, role in widget_layout(info) if role == "value" and s.type != "IMAGEUPLOAD"]
        if isinstance(wv, dict):
            inputs.update({s.name: wv[s.name] for s in layout if s.name in wv})
        else:
            for (spec, role), value in zip(widget_layout(info), wv or []):
                if role == "value" and spec.type != "IMAGEUPLOAD":
                    inputs[spec.name] = {"__value__": value} if isinstance(value, list) else value
        for inp in n.get("inputs") or []:
            r = _resolve(by_id, links, inp.get("link"))
            if r is None:
                continue
            inputs[inp["name"]] = r[1] if r[0] == "value" else [r[1], r[2]]
        title = n.get("title") or info.get("display_name") or t
        prompt[str(n["id"])] = {"class_type": t, "inputs": inputs, "_meta": {"title": title}}
    return prompt
