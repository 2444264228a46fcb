"""Write ``example_workflows/*.json`` (and ``.jpg`` thumbnails) from the live node definitions.

From the repository root::

    COMFYUI_PATH=/path/to/ComfyUI [COMFYUI_GGUF_PATH=/path/to/ComfyUI-GGUF] \\
        python -m bench.make_workflows [--no-thumbnails] [--check]

ComfyUI boots in-process on the CPU (``tests/host/comfy_env``) with its comfy_extras nodes,
ComfyUI-GGUF (``$COMFYUI_GGUF_PATH``, default ``<COMFYUI_PATH>/../ComfyUI-GGUF``) and this pack, and
every workflow is checked against their definitions (``tests/host/workflow_check``) before it is
written.

Each workflow is described below by its nodes (type + widget values by name), its links (by output
and input *name*) and a column layout. The inputs/outputs arrays and the order of
``widgets_values`` (including ``control_after_generate``) come from the node definitions, the way the
frontend builds them (see ``bench.workflow_api``), so a saved file is what ComfyUI's frontend would save.
``--check`` writes nothing and exits 1 if a committed file differs from what would be written.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from pathlib import Path

from . import workflow_api as wa

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "example_workflows"

FRONTEND_VERSION = "1.27.10"
NOTE_COLOR, NOTE_BGCOLOR = "#432", "#653"          # the frontend's "yellow" node colour
PACK_COLOR, PACK_BGCOLOR = "#223", "#335"          # "blue": the wan-sage nodes stand out
PACK_TYPES = ("WanWorkingMemoryEstimator", "WanSageAttentionPatch", "WanTextEncoderHostCopy")
PACK_ID = "wan-sage"                               # the pack's id in the Comfy Registry
GGUF_ID = "comfyui-gguf"                           # ComfyUI-GGUF's id in the Comfy Registry
CORE_ID = "comfy-core"
# Room each wan-sage node keeps below it in the layout: its height after a run in Nodes 2.0 (whose
# widgets are taller than the classic canvas's), where the panel has grown by its run lines.
AFTER_RUN_HEIGHT = {"WanWorkingMemoryEstimator": 700, "WanSageAttentionPatch": 540}

WAN_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，"
                "JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，"
                "手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")
UMT5 = "umt5_xxl_fp8_e4m3fn_scaled.safetensors"
SAGE = {"kernel": "auto", "min_tokens": 1024, "calibrate": True, "memory_margin_mb": 256, "check_finite": True,
        "memory_mode": "within SDPA's memory"}
SAGE_TITLE = "Wan 2.1/2.2 Sage Attention Patch"  # the node's display name
ESTIMATOR = {"batch_size": 1, "policy": "wan-sage estimate", "margin_gib": 0.0, "fixed_gib": 10.0,
             "count_sage_extra": "auto-detect"}


def estimator_widgets(width: int, height: int, frames: int, cfg: float) -> dict:
    """The estimator's widgets: this workflow's size and cfg, the node's defaults for the rest."""
    return {"width": width, "height": height, "frames": frames, "cfg": cfg, **ESTIMATOR}


# --------------------------------------------------------------------------- graph builder

def version_of_pyproject(path: Path) -> str:
    return tomllib.loads(path.read_text(encoding="utf-8"))["project"]["version"]


def comfy_version(comfy_path: str) -> str:
    text = Path(comfy_path, "comfyui_version.py").read_text(encoding="utf-8")
    return re.search(r"__version__\s*=\s*[\"']([^\"']+)", text).group(1)


def pack_ids(info_by_type: dict, comfy_path: str, gguf_path: str) -> dict:
    """{node type: {"cnr_id", "ver"}}, as the current frontend saves them in each node's properties:
    this pack's nodes carry its id and version, ComfyUI-GGUF's nodes its own, ComfyUI's nodes
    "comfy-core" and the ComfyUI version."""
    core = {"cnr_id": CORE_ID, "ver": comfy_version(comfy_path)}
    gguf = {"cnr_id": GGUF_ID, "ver": version_of_pyproject(Path(gguf_path, "pyproject.toml"))}
    ours = {"cnr_id": PACK_ID, "ver": version_of_pyproject(ROOT / "pyproject.toml")}
    ids = {}
    for t, info in info_by_type.items():
        module = str(info.get("python_module", "nodes"))
        ids[t] = ours if t in PACK_TYPES else gguf if module.startswith("custom_nodes.") else core
    return ids


class Graph:
    def __init__(self, info_by_type: dict, ids: dict):
        self.info = info_by_type
        self.ids = ids
        self.nodes: dict[str, dict] = {}
        self.links: list[list] = []

    def add(self, key: str, node_type: str, widgets: dict | None = None, title: str | None = None,
            size: tuple | None = None) -> dict:
        info = self.info[node_type]
        widgets = dict(widgets or {})
        values = []
        for spec, role in wa.widget_layout(info):
            if role == "value":
                if spec.name in widgets:
                    v = widgets.pop(spec.name)
                elif spec.type == "IMAGEUPLOAD":
                    v = "image"
                elif "default" in spec.extra:
                    v = spec.extra["default"]
                elif spec.type == "COMBO":
                    v = spec.options[0]
                else:
                    raise KeyError(f"{key}: no value for widget {spec.name!r} of {node_type}")
            elif role == "control":
                v = widgets.pop(spec.name + ":control", "randomize")
            else:
                v = widgets.pop(spec.name + ":filter", "")
            values.append(v)
        if widgets:
            raise KeyError(f"{key}: {node_type} has no widgets {sorted(widgets)}")
        inputs = []
        for e in wa.expected_inputs(info):
            d = {"localized_name": e["name"], "name": e["name"], "type": e["type"]}
            if e["optional"]:
                d["shape"] = 7  # RenderShape.HollowCircle
            if "widget" in e:
                d["widget"] = dict(e["widget"])
            d["link"] = None
            inputs.append(d)
        outputs = [{"localized_name": n, "name": n, "type": t, "links": [], "slot_index": i}
                   for i, (n, t) in enumerate(wa.outputs_of(info))]
        node = {"id": len(self.nodes) + 1, "type": node_type, "pos": [0, 0],
                "size": list(size or self._size(info, node_type)), "flags": {}, "order": 0, "mode": 0,
                "inputs": inputs, "outputs": outputs,
                "properties": {"Node name for S&R": node_type, **self.ids[node_type]},
                "widgets_values": values}
        if title:
            node["title"] = title
        if node_type in PACK_TYPES:
            node["color"], node["bgcolor"] = PACK_COLOR, PACK_BGCOLOR
        self.nodes[key] = node
        return node

    def note(self, key: str, text: str, size=(460, 600)) -> dict:
        node = {"id": len(self.nodes) + 1, "type": "MarkdownNote", "pos": [0, 0], "size": list(size),
                "flags": {}, "order": 0, "mode": 0, "inputs": [], "outputs": [], "properties": {},
                "widgets_values": [text.strip() + "\n"], "color": NOTE_COLOR, "bgcolor": NOTE_BGCOLOR}
        self.nodes[key] = node
        return node

    @staticmethod
    def _size(info, node_type):
        specs = wa.input_specs(info)
        sockets = sum(1 for s in specs if not s.is_widget)
        widgets = len(wa.widget_layout(info))
        rows = max(sockets, len(wa.outputs_of(info)))
        width = 330
        height = rows * 20 + widgets * 24 + 16
        if node_type == "CLIPTextEncode":
            width, height = 420, 190
        elif node_type in ("SaveVideo", "SaveAnimatedWEBP"):
            width, height = 480, 420
        elif node_type == "LoadImage":
            width, height = 330, 360
        elif node_type == "WanWorkingMemoryEstimator":
            width, height = 360, height + 220  # the live memory panel (web/wan_sage.js) before a run
        elif node_type == "WanSageAttentionPatch":
            width, height = 360, height + 80  # the status panel before a run
        return width, max(height, 46)

    def link(self, src: str, out: str | int, dst: str, inp: str) -> None:
        o, t = self.nodes[src], self.nodes[dst]
        oslot = out if isinstance(out, int) else next(i for i, x in enumerate(o["outputs"]) if x["name"] == out)
        tslot = next(i for i, x in enumerate(t["inputs"]) if x["name"] == inp)
        if t["inputs"][tslot]["link"] is not None:
            raise ValueError(f"{dst}.{inp} is already connected")
        lid = len(self.links) + 1
        typ = o["outputs"][oslot]["type"]
        self.links.append([lid, o["id"], oslot, t["id"], tslot, typ])
        o["outputs"][oslot]["links"].append(lid)
        t["inputs"][tslot]["link"] = lid

    def text_encoder(self) -> None:
        """CLIPLoader (umt5-xxl fp8) -> Wan Text Encoder Host Copy (keys clip, te_copy); the encodes take
        ``te_copy``'s CLIP."""
        self.add("clip", "CLIPLoader", {"clip_name": UMT5, "type": "wan", "device": "default"})
        self.add("te_copy", "WanTextEncoderHostCopy")
        self.link("clip", "CLIP", "te_copy", "clip")

    def video_output(self, samples: str, vae: str, fps: float, prefix: str) -> None:
        """VAEDecode -> CreateVideo -> SaveVideo (keys decode, video, save) from ``samples``' LATENT."""
        self.add("decode", "VAEDecode")
        self.add("video", "CreateVideo", {"fps": fps})
        self.add("save", "SaveVideo", {"filename_prefix": f"video/{prefix}", "format": "auto", "codec": "auto"})
        self.link(samples, "LATENT", "decode", "samples")
        self.link(vae, "VAE", "decode", "vae")
        self.link("decode", "IMAGE", "video", "images")
        self.link("video", "VIDEO", "save", "video")

    def layout(self, columns: list[list[str]], x0: int = 0, y0: int = 0, gap_x: int = 60, gap_y: int = 50):
        """Columns left to right; nodes stacked top to bottom (title bar: 30 px above pos).  Below a
        wan-sage node the column keeps its height after a run (``AFTER_RUN_HEIGHT``), so a panel
        that grows never covers the node under it."""
        x = x0
        for col in columns:
            y = y0
            width = 0
            for key in col:
                if key is None:          # a spacer
                    y += 60
                    continue
                n = self.nodes[key]
                n["pos"] = [x, y + 30]
                y += max(30 + n["size"][1], AFTER_RUN_HEIGHT.get(n["type"], 0)) + gap_y
                width = max(width, n["size"][0])
            x += width + gap_x

    def _order(self):
        ids = [n["id"] for n in self.nodes.values()]
        deps = {i: set() for i in ids}
        for _lid, oid, _os, tid, _ts, _t in self.links:
            deps[tid].add(oid)
        order, done = [], set()
        while len(order) < len(ids):
            ready = [i for i in ids if i not in done and deps[i] <= done]
            if not ready:
                raise ValueError("cycle in the workflow")
            for i in ready:
                order.append(i)
                done.add(i)
        rank = {i: k for k, i in enumerate(order)}
        for n in self.nodes.values():
            n["order"] = rank[n["id"]]

    def to_json(self) -> dict:
        self._order()
        xs = [n["pos"][0] for n in self.nodes.values()]
        ys = [n["pos"][1] for n in self.nodes.values()]
        return {
            "last_node_id": len(self.nodes),
            "last_link_id": len(self.links),
            "nodes": list(self.nodes.values()),
            "links": self.links,
            "groups": [],
            "config": {},
            "extra": {"ds": {"scale": 0.6, "offset": [60 - min(xs), 80 - min(ys)]},
                      "frontendVersion": FRONTEND_VERSION},
            "version": 0.4,
        }


# --------------------------------------------------------------------------- the workflows

# Where ComfyUI's own repackaged files are (Hugging Face, each under split_files/<models folder>/).
REPACK_21 = "Comfy-Org/Wan_2.1_ComfyUI_repackaged"
REPACK_22 = "Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
GGUF_PACK = "[ComfyUI-GGUF](https://github.com/city96/ComfyUI-GGUF)"
GGUF_INSTALL = ("install it with ComfyUI-Manager (search *ComfyUI-GGUF*), or `git clone "
                "https://github.com/city96/ComfyUI-GGUF` into `ComfyUI/custom_nodes` and "
                "`pip install --upgrade gguf` in ComfyUI's Python, then restart ComfyUI")
SAGE_LINE = ("**SageAttention** is optional: without it the Sage patch passes the model through and the "
             "speed is ComfyUI's (see the wan-sage README, *Getting SageAttention*).")
TE_COPY_LINE = ("The text encoder goes through **Wan Text Encoder Host Copy**, which keeps its weights' host copy "
                "while it is loaded: the unload that makes room for the Wan model then copies nothing back.")
ESTIMATOR_LATENT = ("Its `latent` input is connected to the latent node, which sets the video size: change "
                    "the size there (the estimator's width/height/frames/batch_size are greyed out meanwhile).")
LIGHTNING = "wan2.2_t2v_lightx2v_4steps_lora_v1.1_{ex}_noise.safetensors"
A14B_LOADERS = {
    # loader type, title, file name pattern, extra widgets
    "gguf": ("UnetLoaderGGUF", "Unet Loader (GGUF): {ex} noise", "wan2.2_t2v_{ex}_noise_14B_Q4_K_M.gguf", {}),
    "fp8": ("UNETLoader", "Load Diffusion Model: {ex} noise", "wan2.2_t2v_{ex}_noise_14B_fp8_scaled.safetensors",
            {"weight_dtype": "default"}),
}


def compile_line(preset: str, width: int, height: int, frames: int, rows: int, steps: int, experts: int = 1) -> str:
    """The note's line on Wan Compile Blocks for this template's size and steps, from the payback model the Sage
    patch's panel gives after a run (``memory.compile_payback``, every weight on the GPU; ``rows``: 2 where cfg adds
    the uncond pass; ``experts``: the models of the schedule sharing the block graph, each sampling ``steps``).
    A template leaves the node out only where it would lengthen the first prompt of a first start; one where it
    would not is an error here, to be built with the node."""
    from ._host import load_pack
    load_pack()
    from wan_sage.memory import activation_model as am
    from wan_sage.memory import compile_payback as cp
    dims = am.PRESETS[preset]
    tokens = am.tokens(dims, *am.latent_shape(dims, width, height, frames)[2:])
    fresh, kept = (cp.compile_payback(dims, tokens, rows=rows, steps=steps, shared_by=experts, kept=k)
                   for k in (False, True))
    if fresh.payback_prompt == 1:
        raise ValueError(f"{preset} {width}x{height}x{frames}, {steps} steps: compiling pays back within the "
                         "first prompt, so the template should run Wan Compile Blocks")

    def by(p) -> str:
        return "the first prompt" if p.payback_prompt == 1 else f"prompt {p.payback_prompt}"

    return (f"**Wan Compile Blocks** (torch.compile per block, after the Sage patch) is left out, as it would "
            f"lengthen the first prompt: with every weight on the GPU a compiled step saves about "
            f"{fresh.step_gain_s:.2f} s here, against about {cp.FIRST_GRAPH_S:.0f} s of compiling in a fresh "
            f"ComfyUI ({cp.KEPT_GRAPH_S:.0f} s once the pack keeps its compile file), so it pays back by "
            f"{by(fresh)} of a first start and by {by(kept)} after a restart. After a run, the Sage patch's panel "
            "says when it pays back for your own size and steps.")


def _note_a14b(width: int, height: int, weights: str) -> str:
    gguf = weights == "gguf"
    high, low = (A14B_LOADERS[weights][2].format(ex=ex) for ex in ("high", "low"))
    tokens = (width // 16) * (height // 16) * 21
    if gguf:
        heading = f"Wan 2.2 T2V A14B · GGUF Q4_K_M · needs ComfyUI-GGUF · {width}×{height}, 81 frames"
        packs = (f"**Needs the {GGUF_PACK} pack** for its *Unet Loader (GGUF)* nodes, which load the .gguf "
                 f"experts: {GGUF_INSTALL}. Without it, use the *A14B fp8* templates, which need no other pack.")
        models = (f"- diffusion_models: `{high}`, `{low}`: any Wan 2.2 T2V A14B Q4_K_M pair, e.g. "
                  "QuantStack/Wan2.2-T2V-A14B-GGUF on Hugging Face (HighNoise/, LowNoise/); pick yours in the "
                  "two loaders")
        speed = ("with SageAttention 2.x about 1.25× PyTorch SDPA per step at 720p (measured on an H200 held to a "
                 "24 GB budget: 1.26× stock ComfyUI)" if height >= 720 else
                 "smaller than at 720p: Sage's self-attention is 1.23× SDPA at this size on an H200, and "
                 "attention is a smaller share of the step")
        memory = ("the estimator reserves the real activation peak (ComfyUI's own Wan figure is about 2× it) and "
                  "counts GGUF dequantisation and the LoRA patches, so ComfyUI keeps more of each expert on the GPU "
                  "(at a 16 GB budget 49 % against 22 %) and offloads only the rest")
    else:
        heading = f"Wan 2.2 T2V A14B · fp8 · ComfyUI's own loaders · {width}×{height}, 81 frames"
        packs = ("**Packs:** wan-sage only: the experts load through ComfyUI's own *Load Diffusion Model* "
                 "(UNETLoader), from ComfyUI's repackaged fp8 files.")
        models = (f"- diffusion_models: `{high}`, `{low}` ({REPACK_22})")
        speed = ("with SageAttention 2.x 1.27× PyTorch SDPA per step with both experts resident (H200), and "
                 "1.26× stock ComfyUI at a 16 GB budget" if height >= 720 else
                 "smaller than at 720p: Sage's self-attention is 1.23× SDPA at this size on an H200, and "
                 "attention is a smaller share of the step")
        memory = ("the estimator reserves the real activation peak (ComfyUI's own Wan figure is about 2× it) plus "
                  "room for the fp8 weight casts, so ComfyUI keeps more of each expert on the GPU (at a 16 GB "
                  "budget 28 % against 15 %) and offloads only the rest")
    plan_weights = "q4_k_m --lora" if gguf else "fp8 --lora"
    return f"""
# {heading}

Text to video with both Wan 2.2 A14B experts ({"GGUF Q4_K_M" if gguf else "fp8"}), 4 steps with the
Lightning LoRAs, at {width}×{height} and 81 frames ({tokens:,} tokens per forward), through the wan-sage
nodes.

{packs} {SAGE_LINE}

- **Speed-up:** {speed}.
- **Memory:** {memory}.

**Files**, each in `ComfyUI/models/<folder>/` (ComfyUI's repackaged files are on Hugging Face, in
`split_files/<folder>/` of the repository named)
{models}
- loras: `{LIGHTNING.format(ex="high")}`, `{LIGHTNING.format(ex="low")}` ({REPACK_22})
- text_encoders: `{UMT5}` ({REPACK_21})
- vae: `wan_2.1_vae.safetensors` ({REPACK_21})

**How it runs.** Each expert (high noise, low noise) runs loader → Lightning LoRA → ModelSamplingSD3 →
**Wan Working-Memory Estimator** → **Wan 2.1/2.2 Sage Attention Patch** → KSamplerAdvanced. The
high-noise expert samples steps 0–2 and hands its leftover noise to the low-noise expert, which
finishes steps 2–4; cfg is 1, so the negative prompt is not used.

- The estimator reserves the activation memory this denoise needs before sampling. {ESTIMATOR_LATENT}
- The Sage patch runs the long self-attention on SageAttention where it was measured faster on your
  GPU and fits in free VRAM; every other call stays on PyTorch SDPA.
- {TE_COPY_LINE}
- {compile_line("wan2.2-a14b", width, height, 81, rows=1, steps=2, experts=2)}

The same estimate without ComfyUI or a GPU:
`wan-sage plan --preset wan2.2-a14b --width {width} --height {height} --frames 81 --vram 24 --attention sage-auto --weights {plan_weights}`
"""


def a14b(info, ids, width: int, height: int, weights: str, prefix: str) -> dict:
    """Wan 2.2 T2V A14B, both experts with the Lightning 4-step LoRAs; ``weights`` "gguf"
    (ComfyUI-GGUF's loader) or "fp8" (ComfyUI's UNETLoader)."""
    loader, title, pattern, extra = A14B_LOADERS[weights]
    g = Graph(info, ids)
    g.note("note", _note_a14b(width, height, weights), size=(480, 900))
    for ex in ("high", "low"):
        g.add(f"unet_{ex}", loader, {"unet_name": pattern.format(ex=ex), **extra}, title=title.format(ex=ex))
        g.add(f"lora_{ex}", "LoraLoaderModelOnly", {"lora_name": LIGHTNING.format(ex=ex), "strength_model": 1.0},
              title=f"Lightning 4-step LoRA: {ex} noise")
        g.add(f"shift_{ex}", "ModelSamplingSD3", {"shift": 5.0})
        g.add(f"est_{ex}", "WanWorkingMemoryEstimator", estimator_widgets(width, height, 81, 1.0),
              title=f"Wan Working-Memory Estimator: {ex} noise")
        g.add(f"sage_{ex}", "WanSageAttentionPatch", dict(SAGE), title=f"{SAGE_TITLE}: {ex} noise")
    g.text_encoder()
    g.add("pos", "CLIPTextEncode", {"text": (
        "A red fox trots through fresh snow in a pine forest at sunrise, its breath visible in the cold air. "
        "Golden light falls between the trees; the camera tracks alongside at ground level. "
        "Shallow depth of field, cinematic, highly detailed.")}, title="CLIP Text Encode (Positive Prompt)")
    g.add("neg", "CLIPTextEncode", {"text": WAN_NEGATIVE}, title="CLIP Text Encode (Negative Prompt)")
    g.add("latent", "EmptyHunyuanLatentVideo", {"width": width, "height": height, "length": 81, "batch_size": 1})
    g.add("ks_high", "KSamplerAdvanced",
          {"add_noise": "enable", "noise_seed": 42, "noise_seed:control": "randomize", "steps": 4, "cfg": 1.0,
           "sampler_name": "euler", "scheduler": "simple", "start_at_step": 0, "end_at_step": 2,
           "return_with_leftover_noise": "enable"}, title="KSampler (Advanced): high noise, steps 0-2")
    g.add("ks_low", "KSamplerAdvanced",
          {"add_noise": "disable", "noise_seed": 0, "noise_seed:control": "fixed", "steps": 4, "cfg": 1.0,
           "sampler_name": "euler", "scheduler": "simple", "start_at_step": 2, "end_at_step": 4,
           "return_with_leftover_noise": "disable"}, title="KSampler (Advanced): low noise, steps 2-4")
    g.add("vae", "VAELoader", {"vae_name": "wan_2.1_vae.safetensors"})

    for ex in ("high", "low"):
        g.link(f"unet_{ex}", "MODEL", f"lora_{ex}", "model")
        g.link(f"lora_{ex}", "MODEL", f"shift_{ex}", "model")
        g.link(f"shift_{ex}", "MODEL", f"est_{ex}", "model")
        g.link("latent", "LATENT", f"est_{ex}", "latent")
        g.link(f"est_{ex}", "MODEL", f"sage_{ex}", "model")
        g.link(f"sage_{ex}", "MODEL", f"ks_{ex}", "model")
        g.link("pos", "CONDITIONING", f"ks_{ex}", "positive")
        g.link("neg", "CONDITIONING", f"ks_{ex}", "negative")
    g.link("te_copy", "CLIP", "pos", "clip")
    g.link("te_copy", "CLIP", "neg", "clip")
    g.link("latent", "LATENT", "ks_high", "latent_image")
    g.link("ks_high", "LATENT", "ks_low", "latent_image")
    g.video_output("ks_low", "vae", 16.0, prefix)

    g.layout([
        ["note"],
        ["unet_high", "unet_low", "clip", "te_copy", "vae"],
        ["lora_high", "lora_low", "pos", "neg"],
        ["shift_high", "shift_low", None, "latent"],
        ["est_high", "est_low"],
        ["sage_high", "sage_low"],
        ["ks_high", "ks_low"],
        ["decode", "video", "save"],
    ])
    return g.to_json()


def note_5b() -> str:
    return f"""
# Wan 2.2 TI2V-5B · ComfyUI's own loaders · 1280×704, 121 frames (24 fps)

Text to video with the Wan 2.2 TI2V-5B model at 1280×704 and 121 frames (27,280 tokens per forward;
its VAE compresses 16× in space and has 48 latent channels), 20 steps at cfg 5, through the wan-sage
nodes. For image to video, connect a *Load Image* to the latent node's `start_image`.

**Packs:** wan-sage only (ComfyUI's own loaders). {SAGE_LINE}

- **Speed-up:** with SageAttention 2.x Sage's self-attention is 1.21× PyTorch SDPA at this size on an
  H200; the whole step gains less.
- **Memory:** ComfyUI's own figure for the 5B is about 1.5× its real peak; the estimator reserves the real
  one (cfg 5 counts cond and uncond), so more of the model stays on the GPU when VRAM is short.

**Files**, each in `ComfyUI/models/<folder>/` (ComfyUI's repackaged files are on Hugging Face, in
`split_files/<folder>/` of the repository named)
- diffusion_models: `wan2.2_ti2v_5B_fp16.safetensors` ({REPACK_22})
- text_encoders: `{UMT5}` ({REPACK_21})
- vae: `wan2.2_vae.safetensors` ({REPACK_22}): the Wan 2.2 VAE; the 2.1 VAE does not
  fit the 5B model

**How it runs.** UNETLoader → ModelSamplingSD3 → **Wan Working-Memory Estimator** →
**Wan 2.1/2.2 Sage Attention Patch** → KSampler.

- The estimator reserves the activation memory this denoise needs before sampling. {ESTIMATOR_LATENT}
  Its `cfg` matches the sampler's.
- The Sage patch runs the long self-attention on SageAttention where it was measured faster and fits
  in free VRAM; every other call stays on PyTorch SDPA.
- {TE_COPY_LINE}
- {compile_line("wan2.2-ti2v-5b", 1280, 704, 121, rows=2, steps=20)}

The same estimate without ComfyUI or a GPU:
`wan-sage plan --preset wan2.2-ti2v-5b --width 1280 --height 704 --frames 121 --cfg 5 --vram 24 --attention sage-auto --weights fp16`
"""


def ti2v_5b(info, ids) -> dict:
    g = Graph(info, ids)
    g.note("note", note_5b(), size=(480, 760))
    g.add("unet", "UNETLoader", {"unet_name": "wan2.2_ti2v_5B_fp16.safetensors", "weight_dtype": "default"})
    g.text_encoder()
    g.add("vae", "VAELoader", {"vae_name": "wan2.2_vae.safetensors"})
    g.add("shift", "ModelSamplingSD3", {"shift": 8.0})
    g.add("pos", "CLIPTextEncode", {"text": (
        "A paper boat drifts down a rain-soaked city gutter at dusk, neon signs reflecting in the ripples. "
        "Raindrops splash around it; the camera follows low and close. Cinematic, detailed.")},
        title="CLIP Text Encode (Positive Prompt)")
    g.add("neg", "CLIPTextEncode", {"text": WAN_NEGATIVE}, title="CLIP Text Encode (Negative Prompt)")
    g.add("latent", "Wan22ImageToVideoLatent", {"width": 1280, "height": 704, "length": 121, "batch_size": 1})
    g.add("est", "WanWorkingMemoryEstimator", estimator_widgets(1280, 704, 121, 5.0))
    g.add("sage", "WanSageAttentionPatch", dict(SAGE))
    g.add("ks", "KSampler", {"seed": 42, "seed:control": "randomize", "steps": 20, "cfg": 5.0,
                             "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0})

    g.link("unet", "MODEL", "shift", "model")
    g.link("shift", "MODEL", "est", "model")
    g.link("latent", "LATENT", "est", "latent")
    g.link("est", "MODEL", "sage", "model")
    g.link("sage", "MODEL", "ks", "model")
    g.link("te_copy", "CLIP", "pos", "clip")
    g.link("te_copy", "CLIP", "neg", "clip")
    g.link("vae", "VAE", "latent", "vae")
    g.link("pos", "CONDITIONING", "ks", "positive")
    g.link("neg", "CONDITIONING", "ks", "negative")
    g.link("latent", "LATENT", "ks", "latent_image")
    g.video_output("ks", "vae", 24.0, "wan22_ti2v_5b_704p121")

    g.layout([
        ["note"],
        ["unet", "clip", "te_copy", "vae"],
        ["shift", "pos", "neg"],
        ["latent", "est"],
        ["sage", "ks"],
        ["decode", "video", "save"],
    ])
    return g.to_json()


def note_i2v() -> str:
    return f"""
# Wan 2.1 I2V 14B 480p · fp8 · ComfyUI's own loaders · 832×480, 81 frames

Image to video with the Wan 2.1 I2V 14B 480p model at 832×480 and 81 frames, 20 steps at cfg 6,
through the wan-sage nodes: the start image goes to CLIP Vision and to `WanImageToVideo`. Load your
own start image in *Load Image* (`example.png` is a placeholder).

**Packs:** wan-sage only (ComfyUI's own loaders). {SAGE_LINE}

- **Speed-up:** with SageAttention 2.x Sage's self-attention is 1.23× PyTorch SDPA at this size on an
  H200; the text and image cross-attention stay on SDPA, where Sage is slower.
- **Memory:** ComfyUI's own figure for the 14B is about 2× its real peak; the estimator reads the I2V
  model's real config (36 input channels, 257 CLIP-vision tokens) and reserves the real one, so more of
  the model stays on the GPU.

**Files**, each in `ComfyUI/models/<folder>/` (ComfyUI's repackaged files are on Hugging Face, in
`split_files/<folder>/` of the repository named)
- diffusion_models: `wan2.1_i2v_480p_14B_fp8_e4m3fn.safetensors` ({REPACK_21})
- text_encoders: `{UMT5}` ({REPACK_21})
- clip_vision: `clip_vision_h.safetensors` ({REPACK_21})
- vae: `wan_2.1_vae.safetensors` ({REPACK_21})

**How it runs.** UNETLoader → ModelSamplingSD3 → **Wan Working-Memory Estimator** →
**Wan 2.1/2.2 Sage Attention Patch** → KSampler.

- The estimator reserves the activation memory this denoise needs before sampling. {ESTIMATOR_LATENT}
  Its `cfg` matches the sampler's.
- The Sage patch works on Wan 2.1 too: the long self-attention runs on SageAttention where it was
  measured faster and fits in free VRAM; every other call stays on PyTorch SDPA.
- {TE_COPY_LINE}
- {compile_line("wan2.1-i2v-14b", 832, 480, 81, rows=2, steps=20)}

The same estimate without ComfyUI or a GPU:
`wan-sage plan --preset wan2.1-i2v-14b --width 832 --height 480 --frames 81 --cfg 6 --vram 24 --attention sage-auto --weights fp8`
"""


def i2v_21(info, ids) -> dict:
    g = Graph(info, ids)
    g.note("note", note_i2v(), size=(480, 760))
    g.add("unet", "UNETLoader", {"unet_name": "wan2.1_i2v_480p_14B_fp8_e4m3fn.safetensors", "weight_dtype": "default"})
    g.text_encoder()
    g.add("clipvision", "CLIPVisionLoader", {"clip_name": "clip_vision_h.safetensors"})
    g.add("vae", "VAELoader", {"vae_name": "wan_2.1_vae.safetensors"})
    g.add("image", "LoadImage", {"image": "example.png", "upload": "image"})
    g.add("shift", "ModelSamplingSD3", {"shift": 8.0})
    g.add("pos", "CLIPTextEncode", {"text": (
        "The woman in the picture turns her head towards the camera and smiles, a light breeze moving her "
        "hair; soft afternoon light, natural motion, detailed.")}, title="CLIP Text Encode (Positive Prompt)")
    g.add("neg", "CLIPTextEncode", {"text": WAN_NEGATIVE}, title="CLIP Text Encode (Negative Prompt)")
    g.add("cve", "CLIPVisionEncode", {"crop": "none"})
    g.add("i2v", "WanImageToVideo", {"width": 832, "height": 480, "length": 81, "batch_size": 1})
    g.add("est", "WanWorkingMemoryEstimator", estimator_widgets(832, 480, 81, 6.0))
    g.add("sage", "WanSageAttentionPatch", dict(SAGE))
    g.add("ks", "KSampler", {"seed": 42, "seed:control": "randomize", "steps": 20, "cfg": 6.0,
                             "sampler_name": "uni_pc", "scheduler": "simple", "denoise": 1.0})

    g.link("unet", "MODEL", "shift", "model")
    g.link("shift", "MODEL", "est", "model")
    g.link("est", "MODEL", "sage", "model")
    g.link("sage", "MODEL", "ks", "model")
    g.link("te_copy", "CLIP", "pos", "clip")
    g.link("te_copy", "CLIP", "neg", "clip")
    g.link("clipvision", "CLIP_VISION", "cve", "clip_vision")
    g.link("image", "IMAGE", "cve", "image")
    g.link("pos", "CONDITIONING", "i2v", "positive")
    g.link("neg", "CONDITIONING", "i2v", "negative")
    g.link("vae", "VAE", "i2v", "vae")
    g.link("cve", "CLIP_VISION_OUTPUT", "i2v", "clip_vision_output")
    g.link("image", "IMAGE", "i2v", "start_image")
    g.link("i2v", "latent", "est", "latent")
    g.link("i2v", "positive", "ks", "positive")
    g.link("i2v", "negative", "ks", "negative")
    g.link("i2v", "latent", "ks", "latent_image")
    g.video_output("ks", "vae", 16.0, "wan21_i2v_480p")

    g.layout([
        ["note"],
        ["unet", "clip", "te_copy", "clipvision", "vae"],
        ["shift", "pos", "neg", "image"],
        ["cve", "i2v", "est"],
        ["sage", "ks"],
        ["decode", "video", "save"],
    ])
    return g.to_json()


# The file names are the templates' titles: ComfyUI's GET /workflow_templates lists only the file
# names of example_workflows/, and the Templates dialog (frontend 1.27 and 1.58) shows a custom
# pack's template under its file name, and that name again as its description; its thumbnail
# (the .jpg of the same name) carries the note's heading, which names the packs it needs.
A14B_720P = "Wan 2.2 A14B GGUF T2V 720p"
A14B_480P = "Wan 2.2 A14B GGUF T2V 480p"
A14B_FP8_720P = "Wan 2.2 A14B fp8 T2V 720p"
A14B_FP8_480P = "Wan 2.2 A14B fp8 T2V 480p"
TI2V_5B = "Wan 2.2 5B text to video 704p"
I2V_21 = "Wan 2.1 image to video 480p"


def build_all(info, ids) -> dict:
    """{template name: UI workflow} for every template."""
    return {
        A14B_720P: a14b(info, ids, 1280, 720, "gguf", "wan22_a14b_720p81"),
        A14B_480P: a14b(info, ids, 832, 480, "gguf", "wan22_a14b_480p81"),
        A14B_FP8_720P: a14b(info, ids, 1280, 720, "fp8", "wan22_a14b_fp8_720p81"),
        A14B_FP8_480P: a14b(info, ids, 832, 480, "fp8", "wan22_a14b_fp8_480p81"),
        TI2V_5B: ti2v_5b(info, ids),
        I2V_21: i2v_21(info, ids),
    }


# --------------------------------------------------------------------------- thumbnails

SLOT_COLORS = {"CLIP": "#FFD500", "CLIP_VISION": "#A8DADC", "CLIP_VISION_OUTPUT": "#ad7452",
               "CONDITIONING": "#FFA931", "IMAGE": "#64B5F6", "LATENT": "#FF9CF9", "MASK": "#81C784",
               "MODEL": "#B39DDB", "VAE": "#FF6E6E", "VIDEO": "#64B5F6"}


def _caption_lines(note_text: str, font, room: float) -> list[str]:
    """The note's heading as the thumbnail's caption: its " · " parts on one line, else on two (the
    second cut with an ellipsis if it still does not fit)."""
    heading = note_text.lstrip("# ").splitlines()[0] if note_text.strip() else ""
    parts = heading.replace("×", "x").split(" · ")  # glyphs the default font may lack

    def fits(text):
        return font.getlength(text) <= room
    if fits(" | ".join(parts)):
        return [" | ".join(parts)] if heading else []
    k = max((i for i in range(1, len(parts)) if fits(" | ".join(parts[:i]))), default=1)
    first, second = " | ".join(parts[:k]), " | ".join(parts[k:])
    while second and not fits(second):
        second = second[:-2] + "…"
    return [first, second]


def thumbnail(wf: dict, path: Path, info: dict | None = None, width: int = 768) -> None:
    """A schematic of the graph (boxes, titles and links in the frontend's colours) as a JPEG."""
    from PIL import Image, ImageDraw, ImageFont
    info = info or {}
    nodes = {n["id"]: n for n in wf["nodes"]}
    x0 = min(n["pos"][0] for n in nodes.values())
    y0 = min(n["pos"][1] - 30 for n in nodes.values())
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes.values())
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes.values())
    pad = 16
    try:
        big = ImageFont.load_default(size=20)
    except TypeError:  # Pillow < 10.1
        big = ImageFont.load_default()
    note = next((n for n in nodes.values() if n["type"] in wa.NOTE_TYPES), None)
    caption = _caption_lines(note["widgets_values"][0] if note else "", big, width - 2 * pad)
    cap = 20 + 24 * max(1, len(caption))  # caption band: the note's heading, on one or two lines
    graph_h = int(min(max(width * (y1 - y0) / (x1 - x0), width * 0.4), width)) + 2 * pad
    height = graph_h + cap
    s = min((width - 2 * pad) / (x1 - x0), (graph_h - 2 * pad) / (y1 - y0))
    ox = (width - (x1 - x0) * s) / 2 - x0 * s
    oy = cap + (graph_h - (y1 - y0) * s) / 2 - y0 * s

    def P(x, y):
        return ox + x * s, oy + y * s
    img = Image.new("RGB", (width, height), "#202020")
    d = ImageDraw.Draw(img)
    try:
        font = ImageFont.load_default(size=max(8, int(15 * s * 2.2)))
    except TypeError:  # Pillow < 10.1
        font = ImageFont.load_default()
    for _lid, oid, oslot, tid, tslot, typ in wf["links"]:
        o, t = nodes[oid], nodes[tid]
        a = P(o["pos"][0] + o["size"][0], o["pos"][1] + 14 + 20 * oslot)
        t_socks = [i for i in t["inputs"] if "widget" not in i]
        k = next((j for j, i in enumerate(t_socks) if i is t["inputs"][tslot]), 0)
        b = P(t["pos"][0], t["pos"][1] + 14 + 20 * k)
        dx = max(20.0, (b[0] - a[0]) * 0.5)
        pts = []
        for j in range(25):
            u = j / 24
            c = [(1 - u) ** 3 * a[i] + 3 * (1 - u) ** 2 * u * (a[i] + (dx if i == 0 else 0))
                 + 3 * (1 - u) * u ** 2 * (b[i] - (dx if i == 0 else 0)) + u ** 3 * b[i] for i in (0, 1)]
            pts.append(tuple(c))
        d.line(pts, fill=SLOT_COLORS.get(typ, "#AAAAAA"), width=2)
    for n in nodes.values():
        bx0, by0 = P(n["pos"][0], n["pos"][1] - 30)
        bx1, by1 = P(n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
        title_h = 30 * s
        color = n.get("color", "#353535")
        bg = n.get("bgcolor", "#353535" if n["type"] not in wa.NOTE_TYPES else NOTE_BGCOLOR)
        d.rounded_rectangle([bx0, by0, bx1, by1], radius=max(2, int(8 * s)), fill=bg, outline="#111111")
        d.rounded_rectangle([bx0, by0, bx1, by0 + title_h], radius=max(2, int(8 * s)),
                            fill=color if n.get("color") else "#2b2b2b")
        title = n.get("title") or info.get(n["type"], {}).get("display_name") or n["type"]
        if n["type"] in wa.NOTE_TYPES:
            title = n["widgets_values"][0].lstrip("# ").splitlines()[0]
        title = title.replace("×", "x").replace("·", "-")  # glyphs the default font may lack
        while title and d.textlength(title, font=font) > (bx1 - bx0) - 6:
            title = title[:-2] + "…" if len(title) > 2 else ""
        d.text((bx0 + 4, by0 + (title_h - font.size if hasattr(font, "size") else 0) / 2), title,
               fill="#DDDDDD", font=font)
    for i, line in enumerate(caption):
        d.text((pad, 16 + 24 * i), line, fill="#EEEEEE", font=big)
    img.save(path, "JPEG", quality=85, optimize=True)


# --------------------------------------------------------------------------- main

def _host_info():
    """(node definitions, pack ids, file combos) of ComfyUI with ComfyUI-GGUF and this pack loaded."""
    from tests.host import comfy_env, workflow_check
    reason = comfy_env.skip_reason() or workflow_check.gguf_skip_reason()
    if reason:
        raise SystemExit(f"cannot build the workflows: {reason}")
    comfy_env.boot(cpu=True)
    comfy_env.init_extra_nodes()
    comfy_env.load_custom_node(workflow_check.gguf_path())
    comfy_env.load_custom_node(ROOT)
    ns = comfy_env.boot()
    with workflow_check.probe_file_lists(ns.folder_paths) as probes:
        info = wa.object_info(ns.nodes)
        ids = pack_ids(info, comfy_env.comfy_path(), workflow_check.gguf_path())
        return info, ids, workflow_check.file_combos(info, probes)


def dumps(wf: dict) -> str:
    return json.dumps(wf, indent=2, ensure_ascii=False) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-thumbnails", action="store_true")
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed file would change")
    a = ap.parse_args(argv)
    info, ids, files = _host_info()
    from tests.host import workflow_check
    stale = []
    OUT_DIR.mkdir(exist_ok=True)
    built = build_all(info, ids)
    if a.check:
        stale += [f"{p.relative_to(ROOT)} (not written by this script)"
                  for p in sorted(OUT_DIR.glob("*.json")) if p.stem not in built]
    for name, wf in built.items():
        problems = workflow_check.check_workflow(wf, info, files)
        if problems:
            raise SystemExit(f"{name}: " + "; ".join(problems))
        path = OUT_DIR / f"{name}.json"
        text = dumps(wf)
        if a.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(str(path.relative_to(ROOT)))
            continue
        path.write_text(text, encoding="utf-8")
        if not a.no_thumbnails:
            thumbnail(wf, path.with_suffix(".jpg"), info)
        print("wrote", path.relative_to(ROOT))
    if stale:
        print("out of date:", *stale)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    sys.exit(main())
