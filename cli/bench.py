"""``wan-sage bench``: time the installed attention kernels against PyTorch SDPA on Wan's attention shapes
on this GPU, and fill the kernel timing cache that the Sage patch reads (so ComfyUI's first prompt
calibrates nothing it has measured here).  Needs PyTorch and a CUDA GPU."""
from __future__ import annotations

import os
import sys

__all__ = ["add_parser", "run", "TORCH_HINT"]

TORCH_HINT = ("install PyTorch into this environment (its CUDA build for your GPU, as pytorch.org's Get Started "
              "page gives it; from a checkout of wan-sage, pip install \".[bench]\" takes the build your package "
              "index offers), or run wan-sage bench with ComfyUI's own Python, which has it")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time SageAttention kernels against SDPA on Wan shapes on this GPU",
                       description="Calibrate kernels vs PyTorch SDPA on Wan attention shapes and fill the "
                                   "kernel timing cache. The ComfyUI node reads it from ComfyUI/user/wan_sage "
                                   "(write there with --comfyui), or from $WAN_SAGE_CACHE_DIR when that is set. "
                                   "Needs PyTorch and a CUDA GPU.")
    p.add_argument("--shapes", default="wan", help="'wan' (all Wan shapes), or a comma list of names")
    p.add_argument("--kernels", default="auto", help="'auto' (this GPU's candidates), 'all', or a comma list")
    p.add_argument("--dtype", choices=["fp16", "bf16", "both"], default="fp16",
                   help="the dtype of the attention inputs: ComfyUI runs Wan in fp16 (its Wan models list fp16 "
                        "first), bf16 only when started with --bf16-unet (default fp16)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-accuracy", action="store_true", help="skip the fp32 reference comparison")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--comfyui", metavar="PATH", default=None,
                       help="the ComfyUI folder whose node should use the results: writes PATH/user/wan_sage")
    where.add_argument("--cache-dir", default=None,
                       help="timing cache directory (default: $WAN_SAGE_CACHE_DIR, else ~/.cache/wan-sage)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write all results to FILE as JSON lines")


def run(a) -> int:
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
