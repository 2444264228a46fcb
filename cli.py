"""Command line: ``wan-sage plan`` (the working-memory estimate, no GPU needed) and
``wan-sage bench`` (kernel calibration and comparison on this GPU), without ComfyUI."""
from __future__ import annotations

import argparse
import json
import sys

from .attention.registry import KERNELS
from .memory import activation_model
from .memory.api import WEIGHT_BYTES, RequestError, weights_for_file, weights_for_key
from .memory.estimate import EstimateRequest, GiB, estimate
from .memory.headers import NotAWanModel, read_model_file



def _gb(x):
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def _plan_parser(sub):
    p = sub.add_parser("plan", help="estimate the working memory of a Wan denoise (no GPU needed)",
                       description="Estimate a Wan denoise's activation memory and what a card must offload.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(activation_model.PRESETS), help="a known Wan model")
    src.add_argument("--model", metavar="FILE", help="a Wan DiT .safetensors or .gguf file (header only is read)")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cfg", type=float, default=1.0, help="cfg != 1 runs cond and uncond (2 rows if batched)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="compute dtype")
    p.add_argument("--attention", default="sdpa",
                   help="sdpa, sage-auto, or a kernel: " + ", ".join(KERNELS))
    p.add_argument("--arch", default=None, help="GPU arch for sage-auto, e.g. sm90, sm89 (default: this GPU, else sm90)")
    p.add_argument("--vram", type=float, default=None, help="GB the model may use (default: this GPU's total)")
    p.add_argument("--weights", default=None, help="weight dtype for presets: " + ", ".join(WEIGHT_BYTES))
    p.add_argument("--lora", action="store_true", help="a LoRA applied at forward time (GGUF or offloaded layers)")
    p.add_argument("--margin", type=float, default=0.0, help="GB added to the reservation")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _cuda_info():
    try:
        import torch
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            cc = torch.cuda.get_device_capability()
            return total, cc[0] * 10 + cc[1], torch.cuda.get_device_name()
    except Exception:
        pass
    return None, None, None


def cmd_plan(a) -> int:
    notes = []
    if a.model:
        try:
            info = read_model_file(a.model)
        except (NotAWanModel, FileNotFoundError, ValueError, RuntimeError) as e:
            print(f"wan-sage plan: {e}", file=sys.stderr)
            return 2
        dims = info.dims
        ws, weights_bytes = weights_for_file(info, a.lora)
        notes.append(f"{info.format} file: {info.main_dtype} weights, {weights_bytes / GiB:.2f} GiB")
    else:
        dims = activation_model.PRESETS[a.preset]
        try:
            ws, weights_bytes = weights_for_key(dims, (a.weights or "bf16").lower(), a.lora)
        except RequestError:
            print(f"wan-sage plan: --weights must be one of {', '.join(WEIGHT_BYTES)}", file=sys.stderr)
            return 2
    total, cc, gpu = _cuda_info()
    if a.arch:
        try:
            cc = int(a.arch.lower().removeprefix("sm"))
        except ValueError:
            print(f"wan-sage plan: --arch must look like sm90, got {a.arch!r}", file=sys.stderr)
            return 2
    vram = int(a.vram * GiB) if a.vram is not None else total
    if a.vram is None and total is None:
        notes.append("no GPU found and no --vram given: the verdict needs --vram GB")
    try:
        est = estimate(EstimateRequest(
            dims=dims, width=a.width, height=a.height, frames=a.frames, batch=a.batch, cfg=a.cfg,
            dtype=a.dtype, attention=a.attention, cc=cc, vram_bytes=vram, weights_bytes=weights_bytes,
            weights=ws, margin_bytes=int(a.margin * GiB),
            img_tokens=257 if dims.has_img_emb else 0, per_frame_timesteps=False))
    except ValueError as e:
        print(f"wan-sage plan: {e}", file=sys.stderr)
        return 2
    if a.json:
        d = est.as_dict()
        d["notes"] = list(est.notes) + notes
        print(json.dumps(d, indent=1, default=str))
        return 0
    r = est.request
    print(f"wan-sage plan: {r['model']}, {r['width']}x{r['height']}x{r['frames']}, batch {r['batch']}, "
          f"cfg {r['cfg']}, {r['dtype']}, attention {r['attention']}" + (f" (sm{cc})" if cc and r['attention'] != 'sdpa' else ""))
    rows = [
        ("latent [B,C,T,H,W]", str(list(est.latent)), ""),
        ("tokens per row", f"{est.tokens:,}", ""),
        ("rows per forward", f"{est.rows_sequential} (cfg batched: {est.rows_batched})", ""),
        ("", "weights resident", "weights partly offloaded"),
        ("activation phase peak", _gb(est.resident["phase_peak"]) + f" ({est.resident['dominant_phase']})",
         _gb(est.partial["phase_peak"])),
        ("  of which Sage extra", _gb(est.resident["sage_extra"]), _gb(est.partial["sage_extra"])),
        ("persistent (RoPE, context)", _gb(est.resident["persistent"]), _gb(est.partial["persistent"])),
        ("weight transients", _gb(est.resident["weight_transient"]), _gb(est.partial["weight_transient"])),
        ("streaming + fragmentation", _gb(est.resident["fragmentation"]), _gb(est.partial["fragmentation"])),
        ("allocator slack", _gb(est.resident["slack"]), _gb(est.partial["slack"])),
        ("reservation per forward", _gb(est.reservation_resident), _gb(est.reservation_partial)),
        ("ComfyUI's own estimate", _gb(est.comfy_estimate), ""),
        ("weights", _gb(est.weights_bytes), ""),
        ("VRAM for this model", _gb(est.vram_bytes) + (f" ({gpu})" if gpu and a.vram is None else ""), ""),
    ]
    w0 = max(len(x[0]) for x in rows)
    w1 = max(len(x[1]) for x in rows)
    for k, v1, v2 in rows:
        print(f"  {k:<{w0}}  {v1:<{w1}}  {v2}")
    print(f"  verdict: {est.verdict}")
    for n in list(est.notes) + notes:
        print(f"  note: {n}")
    return 0


def _bench_parser(sub):
    p = sub.add_parser("bench", help="time SageAttention kernels against SDPA on Wan shapes on this GPU",
                       description="Calibrate kernels vs PyTorch SDPA on Wan attention shapes and fill the "
                                   "kernel timing cache. The ComfyUI node reads it from ComfyUI/user/wan_sage "
                                   "(write there with --comfyui), or from $WAN_SAGE_CACHE_DIR when that is set. "
                                   "Needs PyTorch: pip install \"wan-sage[bench]\", or run it in ComfyUI's Python.")
    p.add_argument("--shapes", default="wan", help="'wan' (all Wan shapes), or a comma list of names")
    p.add_argument("--kernels", default="auto", help="'auto' (this GPU's candidates), 'all', or a comma list")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-accuracy", action="store_true", help="skip the fp32 reference comparison")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--comfyui", metavar="PATH", default=None,
                       help="the ComfyUI folder whose node should use the results: writes PATH/user/wan_sage")
    where.add_argument("--cache-dir", default=None,
                       help="timing cache directory (default: $WAN_SAGE_CACHE_DIR, else ~/.cache/wan-sage)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write all results to FILE as JSON lines")


def cmd_bench(a) -> int:
    import os
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
        print(f"wan-sage bench: needs PyTorch, which is not importable here ({e}); install it with "
              "`pip install \"wan-sage[bench]\"`, or run wan-sage bench in ComfyUI's Python environment",
              file=sys.stderr)
        return 2
    from .attention import kernel_compare
    return kernel_compare.main(a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="wan-sage", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _plan_parser(sub)
    _bench_parser(sub)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        return cmd_plan(a)
    return cmd_bench(a)


if __name__ == "__main__":
    sys.exit(main())
