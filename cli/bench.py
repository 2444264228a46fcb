"""``wan-sage bench``: time the installed attention kernels against PyTorch SDPA on Wan's attention shapes
on this GPU, and fill the kernel timing cache that the Sage patch reads (so ComfyUI's first prompt
calibrates nothing it has measured here).  Needs PyTorch and a CUDA GPU."""
from __future__ import annotations

import os
import sys

from ..attention import registry
from ..memory import activation_model, request
from ..memory.errors import RequestError
from .plan import FLAGS, SIZE_DEFAULTS

__all__ = ["add_parser", "run", "TORCH_HINT", "WAN_SHAPES"]

# name: (B, H, Nq, Nk, D) as ComfyUI's Wan model calls attention (q/k/v [B, N, H*D]).
WAN_SHAPES = {
    "a14b_720p81_self": (1, 40, 75600, 75600, 128),
    "a14b_720p81_cross": (1, 40, 75600, 512, 128),
    "a14b_480p81_self": (1, 40, 32760, 32760, 128),
    "a14b_480p81_cross": (1, 40, 32760, 512, 128),
    "a14b_480p81_cfg2_self": (2, 40, 32760, 32760, 128),
    "i2v14b_480p81_img_cross": (1, 40, 32760, 257, 128),
    "ti2v5b_704p121_self": (1, 24, 27280, 27280, 128),
    "ti2v5b_704p121_cross": (1, 24, 27280, 512, 128),
    "t2v1.3b_480p81_self": (1, 12, 32760, 32760, 128),
    "t2v1.3b_480p81_cross": (1, 12, 32760, 512, 128),
}

TORCH_HINT = ("install PyTorch into this environment (its CUDA build for your GPU, as pytorch.org's Get Started "
              "page gives it; from a checkout of wan-sage, pip install \".[bench]\" takes the build your package "
              "index offers), or run wan-sage bench with ComfyUI's own Python, which has it")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time SageAttention kernels against SDPA on Wan shapes on this GPU",
                       description="Calibrate kernels vs PyTorch SDPA on Wan attention shapes and fill the "
                                   "kernel timing cache. The ComfyUI node reads it from ComfyUI/user/wan_sage "
                                   "(write there with --comfyui), or from $WAN_SAGE_CACHE_DIR when that is set. "
                                   "Needs PyTorch and a CUDA GPU.")
    p.add_argument("--shapes", default=None, help="'wan' (all Wan shapes; the default), or a comma list of names")
    size = p.add_argument_group("one model at your size, instead of --shapes")
    size.add_argument("--preset", choices=sorted(activation_model.PRESETS),
                      help="time this Wan model's self- and cross-attention at --width x --height x --frames")
    for flag, default in SIZE_DEFAULTS.items():
        size.add_argument(f"--{flag}", default=None, help=f"with --preset (default {default})")
    p.add_argument("--kernels", default="auto", help="'auto' (this GPU's candidates), 'all', or a comma list")
    p.add_argument("--dtype", choices=["fp16", "bf16", "both"], default="fp16",
                   help="the dtype of the attention inputs: ComfyUI runs Wan in fp16 (its Wan models list fp16 "
                        "first), bf16 only when started with --bf16-unet (default fp16)")
    p.add_argument("--iters", type=int, default=5,
                   help="timed batches per kernel and shape (each batch at least about 20 ms of calls); the table "
                        "gives their median and minimum (default 5)")
    p.add_argument("--no-accuracy", action="store_true", help="skip the fp32 reference comparison")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--comfyui", metavar="PATH", default=None,
                       help="the ComfyUI folder whose node should use the results: writes PATH/user/wan_sage")
    where.add_argument("--cache-dir", default=None,
                       help="timing cache directory (default: $WAN_SAGE_CACHE_DIR, else ~/.cache/wan-sage)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write all results to FILE as JSON lines")


def model_shapes(preset: str, width, height, frames, batch) -> dict:
    """{name: (B, H, Nq, Nk, D)}: the attention calls of ``preset``'s blocks for a latent of that size, as
    ComfyUI's Wan model makes them (self-attention; cross-attention to the text, and to the image where the
    model has image tokens).  The size is checked as the planner checks it."""
    built = request.build({"preset": preset, "width": width, "height": height, "frames": frames, "batch": batch},
                          text=True, labels=FLAGS)
    setup = built.setup
    d = setup.dims
    B, _, T, H, W = setup.latent
    L = activation_model.tokens(d, T, H, W)
    tag = f"{preset}_{width}x{height}x{frames}" + (f"_b{B}" if B > 1 else "")
    shapes = {f"{tag}_self": (B, d.num_heads, L, L, d.head_dim),
              f"{tag}_cross": (B, d.num_heads, L, d.text_len, d.head_dim)}
    if setup.img_tokens:
        shapes[f"{tag}_img_cross"] = (B, d.num_heads, L, setup.img_tokens, d.head_dim)
    return shapes


def _check_names(a) -> None:
    """--shapes and --kernels name what this tool knows: RequestError naming the flag and the known names."""
    if a.model_shapes is None and a.shapes != "wan":
        unknown = [n for n in a.shapes.split(",") if n not in WAN_SHAPES]
        if unknown:
            raise RequestError("shapes", f"--shapes: unknown shape {unknown[0][:40]!r}; known: {', '.join(WAN_SHAPES)}")
    if a.kernels not in ("auto", "all"):
        unknown = [n for n in a.kernels.split(",") if n not in registry.KERNELS]
        if unknown:
            raise RequestError("kernels", f"--kernels: unknown kernel {unknown[0][:40]!r}; give auto, all or a comma "
                                          f"list of {', '.join(registry.KERNELS)}")


def _check_writable(flag: str, path: str) -> None:
    """Stop before the GPU work where ``path`` cannot be written (a folder, a missing or read-only folder)."""
    where = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        why = "is a folder"
    elif not (os.path.isdir(where) and os.access(where, os.W_OK)):
        why = "is in a folder that does not exist or cannot be written"
    elif os.path.exists(path) and not os.access(path, os.W_OK):
        why = "cannot be written"
    else:
        return
    raise RequestError(flag, f"--{flag} {path!r} {why}; give a file path in a folder you can write")


def run(a) -> int:
    sized = {k: getattr(a, k) for k in SIZE_DEFAULTS if getattr(a, k) is not None}
    if a.preset is None and sized:
        flag = next(iter(sized))
        raise RequestError(flag, f"--{flag} sizes the shapes of --preset; add --preset MODEL, or leave --{flag} out "
                                 "for the named Wan shapes (--shapes)")
    if not 1 <= a.iters <= 1000:
        raise RequestError("iters", f"--iters must be between 1 and 1000, got {a.iters}")
    if a.preset is not None and a.shapes is not None:
        raise RequestError("shapes", "--shapes and --preset each choose the shapes; give one of them")
    a.model_shapes = None if a.preset is None else model_shapes(a.preset, **{**SIZE_DEFAULTS, **sized})
    a.shapes = a.shapes or "wan"
    _check_names(a)
    if a.json is not None:
        _check_writable("json", a.json)
    if a.comfyui is not None:
        comfyui = os.path.expanduser(a.comfyui)
        if not os.path.isfile(os.path.join(comfyui, "folder_paths.py")):
            print(f"wan-sage bench: --comfyui {a.comfyui!r} is not a ComfyUI folder (it has no folder_paths.py); "
                  "give the folder that holds ComfyUI's main.py", file=sys.stderr)
            return 2
        a.cache_dir = os.path.join(comfyui, "user", "wan_sage")
        if os.environ.get("WAN_SAGE_CACHE_DIR"):
            print(f"wan-sage bench: note: WAN_SAGE_CACHE_DIR is set; a ComfyUI started with it reads "
                  f"{os.environ['WAN_SAGE_CACHE_DIR']}, not {a.cache_dir}", file=sys.stderr)
    try:
        import torch  # noqa: F401  (the kernels and the timing need it)
    except ImportError as e:
        print(f"wan-sage bench: needs PyTorch, which is not importable here ({e}); {TORCH_HINT}", file=sys.stderr)
        return 2
    from . import bench_kernels
    return bench_kernels.main(a)
