"""Check ComfyUI UI-format workflows (what the frontend saves) against the live node definitions.

Importing this module imports nothing from ComfyUI. Every function that needs ComfyUI takes the
module it needs (``folder_paths``, ``execution``) as an argument, so it works with the in-process
host of :mod:`comfy_env`. The frontend's rules for a node's inputs and ``widgets_values``, and the
conversion to the API prompt, are those of :mod:`bench.workflow_api` (imported from the repository
root, which ``python -m pytest`` puts on ``sys.path``).

Public API
----------
``probe_file_lists(folder_paths)``       context manager: one probe file per model folder + input dir
``file_combos(info_by_type, probes)``    which combos list model/input files, and their extensions
``check_workflow(wf, info_by_type, files)``  list of problems (empty: valid)
``with_probe_files(prompt, files)``      model-file combo values replaced by probe files
``validate_prompt(execution, prompt)``   ComfyUI's own ``execution.validate_prompt``
``gguf_path()`` / ``gguf_skip_reason()``  where ComfyUI-GGUF is (``$COMFYUI_GGUF_PATH``, default
                                         ``<COMFYUI_PATH>/../ComfyUI-GGUF``), or why it cannot be used

The API prompt of a workflow is ``bench.workflow_api.ui_to_api(wf, info_by_type)``.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import os
import shutil
import tempfile
from dataclasses import dataclass

from bench.workflow_api import (COMBO_CONTROL_VALUES, CONTROL_VALUES, FRONTEND_ONLY, NOTE_TYPES, Spec, expected_inputs,
                                input_specs, outputs_of, types_match, widget_layout)

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff"})
PROBE_PREFIX = "wan_sage_probe__"
INPUT_PROBE = PROBE_PREFIX + "input.png"


# --------------------------------------------------------------------------- ComfyUI-GGUF

def gguf_path() -> str | None:
    p = os.environ.get("COMFYUI_GGUF_PATH")
    if not p and os.environ.get("COMFYUI_PATH"):
        p = os.path.join(os.environ["COMFYUI_PATH"], os.pardir, "ComfyUI-GGUF")
    return os.path.realpath(os.path.expanduser(p)) if p else None


def gguf_skip_reason() -> str | None:
    p = gguf_path()
    if p is None:
        return "neither COMFYUI_GGUF_PATH nor COMFYUI_PATH is set"
    if not os.path.isfile(os.path.join(p, "__init__.py")):
        return (f"ComfyUI-GGUF not found at {p} (set COMFYUI_GGUF_PATH to a ComfyUI-GGUF checkout; "
                "the A14B example workflows use its UnetLoaderGGUF)")
    return None


# --------------------------------------------------------------------------- model-file combos

@contextlib.contextmanager
def probe_file_lists(folder_paths):
    """Put one probe file into an extra folder of every model folder key, and one image into the
    input directory, so each combo whose options come from a file list shows a probe name.

    Yields ``{probe file name: (folder key, extensions)}``. Everything is undone on exit.
    """
    root = tempfile.mkdtemp(prefix="wan-sage-probe-")
    added = []
    probes = {}
    input_probe = os.path.join(folder_paths.get_input_directory(), INPUT_PROBE)
    try:
        for key, (paths, exts) in list(folder_paths.folder_names_and_paths.items()):
            if key == "custom_nodes":
                continue
            exts = {e.lower() for e in exts}
            ext = ".safetensors" if (not exts or ".safetensors" in exts) else sorted(exts)[0]
            d = os.path.join(root, key)
            os.makedirs(d, exist_ok=True)
            fname = f"{PROBE_PREFIX}{key}{ext}"
            with open(os.path.join(d, fname), "wb"):
                pass
            paths.append(d)
            added.append((paths, d))
            probes[fname] = (key, frozenset(exts or folder_paths.supported_pt_extensions))
        _write_png(input_probe)
        probes[INPUT_PROBE] = ("input", IMAGE_EXTENSIONS)
        folder_paths.filename_list_cache.clear()
        yield probes
    finally:
        for paths, d in added:
            while d in paths:
                paths.remove(d)
        folder_paths.filename_list_cache.clear()
        with contextlib.suppress(OSError):
            os.remove(input_probe)
        shutil.rmtree(root, ignore_errors=True)


def _write_png(path: str) -> None:
    import struct
    import zlib

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
    raw = b"\x00\x00\x00\x00"  # one filter byte + one RGB pixel
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


@dataclass(frozen=True)
class FileCombo:
    folders: tuple        # folder keys (or "input") whose files the options list
    extensions: frozenset
    probe: str            # a listed probe file name (exists while the probes do)


def file_combos(info_by_type: dict, probes: dict) -> dict:
    """``{(node type, input name): FileCombo}`` for every combo whose options list probe files."""
    out = {}
    for node_type, info in info_by_type.items():
        for s in input_specs(info):
            if s.type != "COMBO" or not s.options:
                continue
            hits = [o for o in s.options if isinstance(o, str) and o in probes]
            if not hits:
                continue
            exts = frozenset().union(*(probes[h][1] for h in hits))
            out[(node_type, s.name)] = FileCombo(tuple(probes[h][0] for h in hits), exts, hits[0])
    return out


def is_file_name(value, combo: FileCombo) -> bool:
    if not isinstance(value, str) or not value.strip():
        return False
    v = value
    if "input" in combo.folders and v.endswith("]") and " [" in v:  # annotated "name.png [input]"
        v = v[: v.rindex(" [")]
    return os.path.splitext(v)[1].lower() in combo.extensions


# --------------------------------------------------------------------------- the validator

def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_value(spec: Spec, role: str, value, file_combo: FileCombo | None) -> str | None:
    """None if *value* is valid for this widget, else the reason."""
    if role == "control":
        allowed = COMBO_CONTROL_VALUES if spec.type == "COMBO" else CONTROL_VALUES
        return None if value in allowed else f"control_after_generate value {value!r} not in {list(allowed)}"
    if role == "filter":
        return None if isinstance(value, str) else f"combo filter must be a string, not {value!r}"
    t, x = spec.type, spec.extra
    if t == "COMBO":
        if file_combo is not None:
            if is_file_name(value, file_combo) or value in (spec.options or []):  # e.g. pixel_space
                return None
            return (f"{value!r} is not a file name ending in one of {sorted(file_combo.extensions)} "
                    f"(files of {', '.join(file_combo.folders)})")
        if value in (spec.options or []):
            return None
        opts = spec.options or []
        return f"{value!r} not in {opts if len(opts) <= 20 else f'the {len(opts)} options'}"
    if t == "INT":
        if not (_is_number(value) and float(value).is_integer()):
            return f"{value!r} is not an integer"
        return _range(value, x, integer=True)
    if t == "FLOAT":
        if not _is_number(value):
            return f"{value!r} is not a number"
        return _range(value, x, integer=False)
    if t == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a boolean"
    if t in ("STRING", "MARKDOWN", "TEXTAREA"):
        return None if isinstance(value, str) else f"{value!r} is not a string"
    if t == "IMAGEUPLOAD":
        return None if isinstance(value, str) else f"upload widget value {value!r} is not a string"
    return None


def _range(value, x: dict, integer: bool) -> str | None:
    lo, hi = x.get("min"), x.get("max")
    if lo is not None and value < lo:
        return f"{value} < min {lo}"
    if hi is not None and value > hi:
        return f"{value} > max {hi}"
    step = x.get("step")
    if integer and step and step > 1:
        # The frontend snaps INT widgets to min + k*step (offset = min % step).
        offset = (lo or 0) % step
        if (int(value) - offset) % step:
            return f"{value} is not on the widget's grid (step {step}, offset {offset})"
    return None


def _ref(node: dict) -> str:
    return f"node {node.get('id')} ({node.get('type')})"


def check_workflow(wf: dict, info_by_type: dict, files: dict | None = None) -> list[str]:
    """Every problem found in UI-format workflow *wf*, as readable strings (empty: valid)."""
    files = files or {}
    problems: list[str] = []
    p = problems.append
    if not isinstance(wf, dict):
        return ["workflow is not a JSON object"]
    for key in ("last_node_id", "last_link_id", "nodes", "links", "version"):
        if key not in wf:
            p(f"workflow has no {key!r}")
    nodes = wf.get("nodes") or []
    links = wf.get("links") or []
    if not isinstance(nodes, list) or not isinstance(links, list):
        return problems + ["'nodes' and 'links' must be lists"]

    by_id: dict = {}
    for n in nodes:
        if not isinstance(n, dict) or "id" not in n or "type" not in n:
            p(f"malformed node {n!r:.80}")
            continue
        if n["id"] in by_id:
            p(f"duplicate node id {n['id']}")
        by_id[n["id"]] = n
        for k, ln in (("pos", 2), ("size", 2)):
            v = n.get(k)
            if not (isinstance(v, (list, tuple)) and len(v) == ln and all(_is_number(c) for c in v)):
                p(f"{_ref(n)}: {k} must be [x, y] numbers, not {v!r}")
        for k, typ in (("flags", dict), ("order", int), ("mode", int)):
            if not isinstance(n.get(k), typ):
                p(f"{_ref(n)}: {k} missing or not {typ.__name__}")
    ids = [i for i in by_id if isinstance(i, int)]
    if ids and isinstance(wf.get("last_node_id"), int) and wf["last_node_id"] < max(ids):
        p(f"last_node_id {wf['last_node_id']} < largest node id {max(ids)}")

    # ---- node types, inputs/outputs against the definitions, widgets
    for n in by_id.values():
        t = n["type"]
        info = info_by_type.get(t)
        if info is None:
            if t not in FRONTEND_ONLY:
                p(f"{_ref(n)}: unknown node type {t!r}")
            elif t in NOTE_TYPES:
                wv = n.get("widgets_values")
                if not (isinstance(wv, list) and len(wv) == 1 and isinstance(wv[0], str)):
                    p(f"{_ref(n)}: a note's widgets_values must be [text]")
            continue
        if (n.get("properties") or {}).get("Node name for S&R") != t:
            p(f"{_ref(n)}: properties['Node name for S&R'] should be {t!r}")
        _check_pack_id(n, info, p)
        _check_slots(n, info, p)
        _check_widgets(n, info, files, p)

    # ---- links
    link_ids = set()
    for raw in links:
        if not (isinstance(raw, list) and len(raw) == 6):
            p(f"malformed link {raw!r:.80} (want [id, origin_id, origin_slot, target_id, target_slot, type])")
            continue
        lid, oid, oslot, tid, tslot, ltype = raw
        where = f"link {lid}"
        if lid in link_ids:
            p(f"duplicate link id {lid}")
        link_ids.add(lid)
        o, t = by_id.get(oid), by_id.get(tid)
        if o is None or t is None:
            p(f"{where}: {'origin' if o is None else 'target'} node "
              f"{oid if o is None else tid} does not exist")
            continue
        outs, ins = o.get("outputs") or [], t.get("inputs") or []
        if not (isinstance(oslot, int) and 0 <= oslot < len(outs)):
            p(f"{where}: origin slot {oslot} out of range for {_ref(o)}")
            continue
        if not (isinstance(tslot, int) and 0 <= tslot < len(ins)):
            p(f"{where}: target slot {tslot} out of range for {_ref(t)}")
            continue
        out, inp = outs[oslot], ins[tslot]
        if lid not in (out.get("links") or []):
            p(f"{where}: not listed in {_ref(o)} output {oslot} ({out.get('name')}) links")
        if inp.get("link") != lid:
            p(f"{where}: {_ref(t)} input {tslot} ({inp.get('name')}) has link {inp.get('link')}, not {lid}")
        otype = out.get("type")
        oinfo = info_by_type.get(o["type"])
        if oinfo is not None and oslot < len(outputs_of(oinfo)):
            otype = outputs_of(oinfo)[oslot][1]
        if ltype != otype:
            p(f"{where}: type {ltype!r} differs from the type {otype!r} of {_ref(o)} output {oslot}")
        itype = inp.get("type")
        tinfo = info_by_type.get(t["type"])
        if tinfo is not None:
            d = next((e for e in expected_inputs(tinfo) if e["name"] == inp.get("name")), None)
            if d is not None:
                itype = d["type"]
        if not types_match(otype, itype):
            p(f"{where}: {_ref(o)} output {oslot} is {otype!r} but {_ref(t)} input "
              f"{inp.get('name')!r} takes {itype!r}")
    ids = [i for i in link_ids if isinstance(i, int)]
    if ids and isinstance(wf.get("last_link_id"), int) and wf["last_link_id"] < max(ids):
        p(f"last_link_id {wf['last_link_id']} < largest link id {max(ids)}")

    # ---- every link id named on a node exists, and points back at that slot
    by_link = {raw[0]: raw for raw in links if isinstance(raw, list) and len(raw) == 6}
    for n in by_id.values():
        for i, inp in enumerate(n.get("inputs") or []):
            lid = inp.get("link")
            if lid is None:
                continue
            raw = by_link.get(lid)
            if raw is None:
                p(f"{_ref(n)} input {i} ({inp.get('name')}): link {lid} is not in 'links'")
            elif (raw[3], raw[4]) != (n["id"], i):
                p(f"{_ref(n)} input {i} ({inp.get('name')}): link {lid} targets node {raw[3]} slot {raw[4]}")
        for i, out in enumerate(n.get("outputs") or []):
            for lid in out.get("links") or []:
                raw = by_link.get(lid)
                if raw is None:
                    p(f"{_ref(n)} output {i} ({out.get('name')}): link {lid} is not in 'links'")
                elif (raw[1], raw[2]) != (n["id"], i):
                    p(f"{_ref(n)} output {i} ({out.get('name')}): link {lid} starts at node {raw[1]} "
                      f"slot {raw[2]}")
            if "slot_index" in out and out["slot_index"] != i:
                p(f"{_ref(n)} output {i}: slot_index {out['slot_index']}")
    return problems


def _check_pack_id(n: dict, info: dict, p) -> None:
    """``properties.cnr_id`` / ``ver`` as the current frontend saves them: the node's pack in the
    Comfy Registry ("comfy-core" for ComfyUI's own nodes) and its version; the frontend names the
    pack of a missing node from them."""
    props = n.get("properties") or {}
    cnr, ver = props.get("cnr_id"), props.get("ver")
    core = not str(info.get("python_module", "nodes")).startswith("custom_nodes.")
    if not (isinstance(cnr, str) and cnr):
        p(f"{_ref(n)}: properties['cnr_id'] missing (the pack that defines the node)")
    elif core and cnr != "comfy-core":
        p(f"{_ref(n)}: properties['cnr_id'] is {cnr!r}; a ComfyUI node's is 'comfy-core'")
    elif not core and cnr == "comfy-core":
        p(f"{_ref(n)}: properties['cnr_id'] is 'comfy-core' for a custom node ({info.get('python_module')})")
    if not (isinstance(ver, str) and ver):
        p(f"{_ref(n)}: properties['ver'] missing (the pack's version)")


def _check_slots(n: dict, info: dict, p) -> None:
    want_in = {e["name"]: e for e in expected_inputs(info)}
    for i, inp in enumerate(n.get("inputs") or []):
        name = inp.get("name")
        d = want_in.get(name)
        if d is None:
            p(f"{_ref(n)}: input {i} {name!r} is not an input of {n['type']}")
            continue
        if not types_match(inp.get("type"), d["type"]):
            p(f"{_ref(n)}: input {name!r} has type {inp.get('type')!r}, the definition says {d['type']!r}")
        if ("widget" in d) != ("widget" in inp):
            p(f"{_ref(n)}: input {name!r} should {'' if 'widget' in d else 'not '}carry a widget")
    have = {inp.get("name"): inp for inp in n.get("inputs") or []}
    for name, d in want_in.items():
        if "widget" in d or d["optional"]:
            continue
        if have.get(name, {}).get("link") is None:
            p(f"{_ref(n)}: required input {name!r} ({d['type']}) is not connected")
    want_out = outputs_of(info)
    outs = n.get("outputs") or []
    if len(outs) != len(want_out):
        p(f"{_ref(n)}: {len(outs)} outputs, the definition has {len(want_out)}")
    for i, (out, (oname, otype)) in enumerate(zip(outs, want_out)):
        if out.get("type") != otype:
            p(f"{_ref(n)}: output {i} has type {out.get('type')!r}, the definition says {otype!r}")


def _check_widgets(n: dict, info: dict, files: dict, p) -> None:
    layout = widget_layout(info)
    wv = n.get("widgets_values")
    if wv is None:
        wv = []
    if isinstance(wv, dict):  # some custom nodes save a dict; core nodes never do
        p(f"{_ref(n)}: widgets_values is a dict; expected a list of {len(layout)}")
        return
    if len(wv) != len(layout):
        names = [s.name if r == "value" else f"{s.name}:{r}" for s, r in layout]
        p(f"{_ref(n)}: {len(wv)} widgets_values, {n['type']} expects {len(layout)}: {names}")
        return
    for (spec, role), value in zip(layout, wv):
        why = _check_value(spec, role, value, files.get((n["type"], spec.name)))
        if why:
            label = spec.name if role == "value" else f"{spec.name} ({role})"
            p(f"{_ref(n)}: widget {label}: {why}")


# --------------------------------------------------------------------------- ComfyUI's validation of the API prompt

def with_probe_files(prompt: dict, files: dict) -> dict:
    """A copy of *prompt* whose file-combo values (model files, input images) name the probe files."""
    out = copy.deepcopy(prompt)
    for node in out.values():
        for name, value in list(node["inputs"].items()):
            fc = files.get((node["class_type"], name))
            if fc is not None and not isinstance(value, list):
                node["inputs"][name] = fc.probe
    return out


def validate_prompt(execution, prompt: dict, prompt_id: str = "wan-sage-workflow-check"):
    """ComfyUI's own validation: ``(ok, error, outputs, node_errors)``."""
    res = asyncio.run(execution.validate_prompt(prompt_id, copy.deepcopy(prompt), None))
    return res[0], res[1], res[2], res[3]
