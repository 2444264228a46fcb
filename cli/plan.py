"""``wan-sage plan``: the flags become an estimate request, answered by :func:`memory.answer.estimate_answer`, the
path the server route answers with (the validator of :mod:`memory.request`, the words of :mod:`memory.report`):
the same figures and words as the node's report and the route's answer."""
from __future__ import annotations

import json

from ..attention import registry
from ..memory import activation_model, request
from ..memory.answer import estimate_answer
from ..memory.errors import ModelFileError, NotAWanModel, brief
from ..memory.estimate import DEFAULT_CC
from ..memory.headers import read_model_file
from ..memory.request import SIZE_LIMITS
from ..memory.weights import WEIGHT_BYTES

__all__ = ["add_parser", "run", "PlanError", "FLAGS"]


class PlanError(Exception):
    """A bad input file or flag combination: one line for stderr, exit status 2."""


# The size planned (and timed by wan-sage bench --preset) where a flag is left out.
SIZE_DEFAULTS = {"width": "1280", "height": "720", "frames": "81", "batch": "1"}

# The request field each flag sets, and the flag a message names for it.
FLAGS = {"preset": "--preset", "width": "--width", "height": "--height", "frames": "--frames", "batch": "--batch",
         "cfg": "--cfg", "dtype": "--dtype", "attention": "--attention", "arch": "--arch", "vram_gib": "--vram",
         "weights": "--weights", "lora": "--lora", "compiled": "--compiled", "sage_grouped": "--sage-grouped",
         "margin_gib": "--margin", "kernel_set": "--kernel-set", "ulysses": "--ulysses", "ring": "--ring",
         "fsdp": "--fsdp", "cfg_parallel": "--cfg-parallel", "no_decode": "--no-decode"}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="estimate the working memory of a Wan denoise (no GPU needed)",
                       description="Estimate a Wan denoise's activation memory and what a card must offload. "
                                   "Sizes are in GiB (2**30 bytes).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(activation_model.PRESETS), help="a known Wan model")
    src.add_argument("--model", metavar="FILE", help="a Wan DiT .safetensors or .gguf file (header only is read)")
    p.add_argument("--width", default=SIZE_DEFAULTS["width"], help="pixels, %d to %d" % SIZE_LIMITS["width"])
    p.add_argument("--height", default=SIZE_DEFAULTS["height"], help="pixels, %d to %d" % SIZE_LIMITS["height"])
    p.add_argument("--frames", default=SIZE_DEFAULTS["frames"], help="frames, %d to %d" % SIZE_LIMITS["frames"])
    p.add_argument("--batch", default=SIZE_DEFAULTS["batch"], help="latent batch, %d to %d" % SIZE_LIMITS["batch"])
    p.add_argument("--cfg", default="1.0", help="cfg scale; not 1 adds the uncond pass: one row per forward when "
                                                "cond and uncond run one after the other, 2 when ComfyUI batches them")
    p.add_argument("--dtype", choices=list(request.COMPUTE_DTYPES), default="auto",
                   help="compute dtype (default auto: as ComfyUI picks it for the weights, fp16 for Wan on NVIDIA)")
    p.add_argument("--attention", default="sdpa",
                   help="sdpa, sage-auto, or a kernel: " + ", ".join(registry.KERNELS))
    p.add_argument("--arch", default=None, help="GPU arch for the kernels, e.g. sm90, sm89 (default: this GPU, else sm90)")
    p.add_argument("--vram", default=None, help="GiB the model may use (default: this GPU's total)")
    p.add_argument("--weights", default=None, help="weight type of a preset (default bf16): " + ", ".join(WEIGHT_BYTES))
    p.add_argument("--lora", action="store_true", help="a LoRA applied at forward time (GGUF or offloaded layers)")
    p.add_argument("--compiled", action="store_true",
                   help="the transformer blocks run under torch.compile, each its own graph (per-block compile "
                        "nodes): fused RoPE and FFN lower the peak. ComfyUI's TorchCompileModel compiles the whole "
                        "model as one graph; plan that without --compiled (it is reserved for as eager)")
    p.add_argument("--sage-grouped", action="store_true",
                   help="the Sage patch splits self-attention into head groups (its memory mode, where the split "
                        "costs <= 2 %%); without it the estimate assumes the ungrouped call, which needs more")
    p.add_argument("--margin", default="0", help="GiB added to the reservation")
    p.add_argument("--no-decode", action="store_true",
                   help="no Wan VAE decode follows the sampling (by default the plan makes room for the one ComfyUI "
                        "runs after it, unloading the model when its sampling ends where the weights leave too little)")
    p.add_argument("--kernel-set", choices=list(activation_model.KERNEL_SETS), default=activation_model.KERNEL_SETS[0],
                   help="Wan's elementwise kernels to plan for: comfy-0.3.64 (eager, as measured; the default) or "
                        "comfy-kitchen (ComfyUI 0.38's fused RoPE and adaln, measured; its FFN measured only with "
                        "int8 weights)")
    multi = p.add_argument_group("multi-GPU (Raylight: xDiT USP, FSDP, CFG parallel); the figures are per rank")
    multi.add_argument("--ulysses", default=None, help="Ulysses degree U: heads split over U ranks (must divide the heads)")
    multi.add_argument("--ring", default=None, help="ring degree R: the sequence split over R ranks")
    multi.add_argument("--fsdp", action="store_true", help="weights sharded over every rank (FSDP2)")
    multi.add_argument("--cfg-parallel", action="store_true", help="cond and uncond rows on different ranks")
    p.add_argument("--json", action="store_true", help="print the route's JSON answer instead of the table")


def _cuda_info():
    """(total bytes, compute capability, name, note) of this machine's GPU; Nones without one."""
    try:
        import torch
    except ImportError:
        return None, None, None, None
    try:
        if not torch.cuda.is_available():
            return None, None, None, None
        _free, total = torch.cuda.mem_get_info()
        cc = torch.cuda.get_device_capability()
        return total, cc[0] * 10 + cc[1], torch.cuda.get_device_name(), None
    except (RuntimeError, AssertionError) as e:  # a broken CUDA setup: plan works without the GPU
        return None, None, None, f"the GPU could not be read ({type(e).__name__}: {brief(e)}); assuming none"


def _read_model(path: str):
    try:
        return read_model_file(path)
    except NotAWanModel as e:
        raise PlanError(f"{e} (or use --preset for a known Wan model)") from None
    except ModelFileError as e:
        raise PlanError(str(e)) from None


def _described(info) -> str:
    d = info.dims
    return (f"{info.format}, Wan {d.model_type}, dim {d.dim}, {d.num_layers} layers, {d.num_heads} heads, "
            f"FFN {d.ffn_dim}, weights {info.main_dtype}, {info.weights_bytes / 2**30:.2f} GiB in the file")


def run(a) -> int:
    if a.model is not None and not a.model.strip():
        raise PlanError("--model is empty: give the path of a Wan .safetensors or .gguf file, or leave --model out "
                        "(a --preset is planned then)")
    if a.weights is not None and a.model:
        raise PlanError("--weights cannot be used with --model: the file's header gives its weight type")
    fields = {"preset": a.preset, "width": a.width, "height": a.height, "frames": a.frames, "batch": a.batch,
              "cfg": a.cfg, "dtype": None if a.dtype == "auto" else a.dtype, "attention": a.attention, "arch": a.arch,
              "vram_gib": a.vram, "weights": a.weights, "lora": a.lora or None, "compiled": a.compiled or None,
              "sage_grouped": a.sage_grouped or None, "margin_gib": a.margin, "kernel_set": a.kernel_set,
              "ulysses": a.ulysses, "ring": a.ring, "fsdp": a.fsdp or None, "cfg_parallel": a.cfg_parallel or None,
              "no_decode": a.no_decode or None}
    fields = {k: v for k, v in fields.items() if v is not None}
    info = _read_model(a.model) if a.model else None
    total = cc = gpu = note = None
    if a.vram is None or a.arch is None:
        total, cc, gpu, note = _cuda_info()
    notes = ([note] if note else []) + ([] if a.vram is not None or total is not None else
                                        ["no GPU found and no --vram given: the verdict needs --vram GiB"])
    if a.arch is None and cc is None and a.attention != "sdpa":
        notes.append(f"no GPU found and no --arch given: the Sage kernels are planned for "
                     f"{registry.arch_name(DEFAULT_CC)}; give --arch (e.g. sm89, sm120) for another GPU")
    answer = estimate_answer(fields, request.Env(vram_bytes=total, cc=cc), text=True, labels=FLAGS, model_info=info,
                             notes=notes, gpu=gpu if a.vram is None else None)
    if a.json:
        print(json.dumps(answer, indent=1, default=str))
        return 0
    if info is not None:
        print(f"model file: {a.model}: {_described(info)}")
    print(answer["text"])
    return 0
