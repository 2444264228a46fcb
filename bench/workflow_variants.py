"""The variants of a saved workflow that the whole-prompt benchmark measures, made on its API prompt (what
``bench.workflow_api.ui_to_api`` makes of the saved file), and the run spec that names one.

Variants:

* ``template``: the workflow as saved;
* ``comfy``: stock ComfyUI: each of the pack's nodes removed and its consumers wired to its input (the pack's
  nodes pass their MODEL or CLIP through, so the graph is what the workflow would be without the pack);
* ``compilenode``: the saved workflow plus the pack's Wan Compile Blocks (``WanCompileBlocks``) after each Wan
  Sage Attention Patch, before whatever read the patch's model (the sampler).

A run spec of a saved workflow is ``VARIANT@{GB|full}[:WxHxF][:Nsteps]`` (``compilenode@24``,
``comfy@full:64x64x5:2steps``): the variant, the VRAM budget, and optionally the video size (the latent nodes'
width, height and length) and the KSampler's steps instead of the saved ones.

Pure functions on plain dicts: importing this module imports neither ComfyUI nor torch.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

VARIANTS = ("template", "comfy", "compilenode")
# The pack's nodes and the input each passes through to its first output (MODEL -> MODEL, CLIP -> CLIP).
PACK_PASS_THROUGH = {"WanTextEncoderHostCopy": "clip", "WanWorkingMemoryEstimator": "model",
                     "WanSageAttentionPatch": "model", "WanCompileBlocks": "model"}
SAGE_NODE = "WanSageAttentionPatch"
COMPILE_NODE = "WanCompileBlocks"
SEED_INPUTS = ("seed", "noise_seed")
SAMPLERS = ("KSampler", "KSamplerAdvanced")
# The nodes that set the video size, and their width / height / frame-count inputs.
SIZE_INPUTS = {"EmptyHunyuanLatentVideo": ("width", "height", "length"),
               "Wan22ImageToVideoLatent": ("width", "height", "length"),
               "WanImageToVideo": ("width", "height", "length"),
               "WanWorkingMemoryEstimator": ("width", "height", "frames")}
SPEC_FORM = "{template|comfy|compilenode}@{GB|full}[:WxHxF][:Nsteps]"
# The model files a workflow loads: the Wan 2.1 I2V 14B with CLIP vision H, the TI2V-5B or the A14B experts.
MODEL_SETS = ("a14b", "ti2v-5b", "i2v-14b")
# The diffusion model file's weights of the sets with one model (bench.e2e_models writes them so whatever
# --weights says); the A14B experts' are --weights.
MODEL_SET_WEIGHTS = {"ti2v-5b": "fp16", "i2v-14b": "fp8"}
IMAGE_LOADER = "LoadImage"


@dataclass(frozen=True)
class WorkflowSpec:
    """One whole-prompt configuration of a saved workflow: the file (its name), the variant, the budget, and
    the size and steps when they replace the saved ones (None: as saved)."""
    workflow: str
    variant: str
    budget_gib: float | None
    res: tuple | None = None
    steps: int | None = None

    @classmethod
    def parse(cls, s: str, workflow: str) -> "WorkflowSpec":
        m = re.fullmatch(r"([a-z]+)@(full|\d+(?:\.\d+)?)((?::[^:]+)*)", s.strip())
        if m is None or m.group(1) not in VARIANTS:
            raise SystemExit(f"bad run spec {s!r} for --workflow: expected {SPEC_FORM} (variants: {', '.join(VARIANTS)})")
        res = steps = None
        for opt in [x for x in m.group(3).split(":") if x]:
            size = re.fullmatch(r"(\d+)x(\d+)x(\d+)", opt)
            n = re.fullmatch(r"(\d+)steps", opt)
            if size and res is None:
                res = tuple(int(x) for x in size.groups())
            elif n and steps is None and int(n.group(1)) >= 1:
                steps = int(n.group(1))
            else:
                raise SystemExit(f"bad run spec {s!r} for --workflow: expected {SPEC_FORM}")
        budget = None if m.group(2) == "full" else float(m.group(2))
        return cls(Path(workflow).name, m.group(1), budget, res, steps)

    @property
    def label(self) -> str:
        """The spec as ``--runs`` takes it."""
        b = "full" if self.budget_gib is None else f"{self.budget_gib:g}"
        return (f"{self.variant}@{b}" + ("" if self.res is None else ":" + "x".join(map(str, self.res)))
                + ("" if self.steps is None else f":{self.steps}steps"))

    @property
    def name(self) -> str:
        """The record's ``run``: the workflow's file name (without .json) and the spec."""
        return f"{Path(self.workflow).stem}/{self.label}"


def consumers(prompt: dict, nid: str, slot: int) -> list[tuple[str, str]]:
    """``(node id, input name)`` of every input linked to output ``slot`` of node ``nid``."""
    return [(k, name) for k, n in prompt.items() for name, v in n["inputs"].items()
            if isinstance(v, list) and len(v) == 2 and str(v[0]) == str(nid) and v[1] == slot]


def bypass_pack_nodes(prompt: dict) -> dict:
    """A copy of the prompt without the pack's nodes: each one's consumers of its first output read what its
    pass-through input reads.  ValueError where a node of the pack has no such input linked, or something reads
    one of its other outputs (a status string), which stock ComfyUI cannot give."""
    out = copy.deepcopy(prompt)
    for nid in [k for k, n in out.items() if n["class_type"] in PACK_PASS_THROUGH]:
        node = out[nid]
        source = node["inputs"].get(PACK_PASS_THROUGH[node["class_type"]])
        if not (isinstance(source, list) and len(source) == 2):
            raise ValueError(f"node {nid} ({node['class_type']}) has no linked "
                             f"{PACK_PASS_THROUGH[node['class_type']]} input to pass through")
        others = [c for slot in range(1, 8) for c in consumers(out, nid, slot)]
        if others:
            raise ValueError(f"node {nid} ({node['class_type']}): {others} read an output other than its "
                             "model/clip, which the graph without the pack cannot give")
        for k, name in consumers(out, nid, 0):
            out[k]["inputs"][name] = list(source)
        del out[nid]
    return out


def next_id(prompt: dict) -> str:
    """A node id not in the prompt: one more than its largest numeric id."""
    return str(max([int(k) for k in prompt if str(k).isdigit()] or [0]) + 1)


def insert_compile_blocks(prompt: dict, backend: str, mode: str = "default") -> dict:
    """A copy of the prompt with a Wan Compile Blocks node after each Wan Sage Attention Patch, read by every
    input that read the patch's model.  ValueError where the prompt has no Sage patch."""
    out = copy.deepcopy(prompt)
    patches = [k for k, n in out.items() if n["class_type"] == SAGE_NODE]
    if not patches:
        raise ValueError(f"the workflow has no {SAGE_NODE} node to put {COMPILE_NODE} after")
    for pid in patches:
        readers = consumers(out, pid, 0)
        cid = next_id(out)
        out[cid] = {"class_type": COMPILE_NODE, "inputs": {"model": [pid, 0], "backend": backend, "mode": mode},
                    "_meta": {"title": "Wan Compile Blocks"}}
        for k, name in readers:
            out[k]["inputs"][name] = [cid, 0]
    return out


def variant_prompt(prompt: dict, variant: str, backend: str = "inductor") -> dict:
    """The prompt of a variant (:data:`VARIANTS`); ``backend``: Wan Compile Blocks' backend for ``compilenode``."""
    if variant == "template":
        return copy.deepcopy(prompt)
    if variant == "comfy":
        return bypass_pack_nodes(prompt)
    if variant == "compilenode":
        return insert_compile_blocks(prompt, backend)
    raise ValueError(f"unknown variant {variant!r}: expected one of {', '.join(VARIANTS)}")


def samplers(prompt: dict) -> list[str]:
    """The ids of the sampler nodes, in id order."""
    return sorted((k for k, n in prompt.items() if n["class_type"] in SAMPLERS), key=_order)


def with_seed(prompt: dict, seed: int) -> dict:
    """A copy of the prompt whose samplers' seeds (``seed`` / ``noise_seed`` given as values) are ``seed``;
    everything else identical, so ComfyUI's node cache serves every node upstream of the samplers."""
    out = copy.deepcopy(prompt)
    for k in samplers(out):
        for name in SEED_INPUTS:
            if name in out[k]["inputs"] and not isinstance(out[k]["inputs"][name], list):
                out[k]["inputs"][name] = int(seed)
    return out


def resized(prompt: dict, res: tuple | None) -> dict:
    """A copy of the prompt with the video size ``(width, height, frames)`` in every node that sets it
    (:data:`SIZE_INPUTS`); None: as saved."""
    out = copy.deepcopy(prompt)
    if res is None:
        return out
    for n in out.values():
        names = SIZE_INPUTS.get(n["class_type"])
        if names:
            n["inputs"].update(dict(zip(names, res)))
    return out


def with_steps(prompt: dict, steps: int | None) -> dict:
    """A copy of the prompt whose KSampler nodes take ``steps`` steps (None: as saved).  ValueError for a
    KSamplerAdvanced, whose start and end steps split the steps between experts."""
    out = copy.deepcopy(prompt)
    if steps is None:
        return out
    for k in samplers(out):
        if out[k]["class_type"] != "KSampler":
            raise ValueError(f"node {k} is {out[k]['class_type']}: a spec's :Nsteps sets KSampler steps only; "
                             "leave it out for this workflow")
        out[k]["inputs"]["steps"] = int(steps)
    return out


def spec_prompt(prompt: dict, spec: WorkflowSpec, backend: str = "inductor") -> dict:
    """The prompt a spec runs: its variant, at its size and steps."""
    return with_steps(resized(variant_prompt(prompt, spec.variant, backend), spec.res), spec.steps)


def pack_nodes(prompt: dict) -> list[str]:
    """The pack's node types in the prompt, sorted."""
    return sorted({n["class_type"] for n in prompt.values() if n["class_type"] in PACK_PASS_THROUGH})


def loader_values(wf: dict, node_type: str) -> list[list]:
    """The saved values of every node of that type in a saved workflow, UI format (its widgets' values) or API
    format (its inputs' values)."""
    if "nodes" in wf and isinstance(wf.get("nodes"), list):
        rows = [n.get("widgets_values") or [] for n in wf["nodes"] if n.get("type") == node_type]
    else:
        rows = [list(n.get("inputs", {}).values()) for n in wf.values()
                if isinstance(n, dict) and n.get("class_type") == node_type]
    return [r if isinstance(r, list) else [] for r in rows]


def model_set(wf: dict) -> str:
    """The model files a saved workflow (UI or API format) loads (:data:`MODEL_SETS`): ``i2v-14b`` where it has a
    CLIPVisionLoader (of the Wan models, Wan 2.1 I2V is the one that reads CLIP vision; Wan 2.2's I2V experts and
    TI2V-5B do not), ``ti2v-5b`` where its UNETLoader names a 5B file, else ``a14b``."""
    if loader_values(wf, "CLIPVisionLoader"):
        return "i2v-14b"
    names = [str(v).lower() for values in loader_values(wf, "UNETLoader") for v in values]
    return "ti2v-5b" if any("5b" in v for v in names) else "a14b"


def start_images(prompt: dict) -> dict:
    """{node id: file name} of the prompt's LoadImage nodes (the start image of an image-to-video workflow).
    ValueError for a name that is not a plain file of ComfyUI's input folder."""
    out = {}
    for k in sorted((k for k, n in prompt.items() if n["class_type"] == IMAGE_LOADER), key=_order):
        name = prompt[k]["inputs"].get("image")
        if not isinstance(name, str) or not name or Path(name).name != name or name.endswith("]"):
            raise ValueError(f"node {k} ({IMAGE_LOADER}): image {name!r} is not a plain file name; the harness "
                             "writes the start image as a file of ComfyUI's input folder, e.g. example.png")
        out[k] = name
    return out


def _order(k):
    return (0, int(k), "") if str(k).isdigit() else (1, 0, str(k))


def prompt_settings(prompt: dict) -> dict:
    """What a record's ``config`` says of a prompt: the video size its latent node sets and its first sampler's
    steps, cfg, sampler and scheduler (None where the prompt has no such node)."""
    latent = next((n["inputs"] for n in prompt.values()
                   if n["class_type"] in SIZE_INPUTS and n["class_type"] != "WanWorkingMemoryEstimator"), {})
    ks = samplers(prompt)
    k = prompt[ks[0]]["inputs"] if ks else {}
    return {"width": latent.get("width"), "height": latent.get("height"), "frames": latent.get("length"),
            "steps": k.get("steps"), "cfg": k.get("cfg"), "sampler": k.get("sampler_name"),
            "scheduler": k.get("scheduler")}
