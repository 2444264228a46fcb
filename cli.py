"""Command line: ``wan-sage plan`` (the working-memory estimate, no GPU needed) and
``wan-sage bench`` (kernel calibration and comparison on this GPU), without ComfyUI."""
from __future__ import annotations

import argparse
import json
import math
import sys

from .attention import registry
from .memory import activation_model
from .memory.api import ATTENTION_CHOICES, MARGIN_GIB_MAX, VRAM_GIB_MAX
from .memory.estimate import CFG_LIMITS, SIZE_LIMITS, EstimateRequest, GiB, estimate
from .memory.headers import ModelFileError, NotAWanModel, read_model_file
from .memory.weights import WEIGHT_BYTES, weights_for_file, weights_for_key

MESSAGE_CAP = 300


class UsageError(Exception):
    """A bad command line or input file: one line for stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def _gib(x):
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def _plan_parser(sub):
    p = sub.add_parser("plan", help="estimate the working memory of a Wan denoise (no GPU needed)",
                       description="Estimate a Wan denoise's activation memory and what a card must offload. "
                                   "Sizes are in GiB (2**30 bytes).")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", choices=sorted(activation_model.PRESETS), help="a known Wan model")
    src.add_argument("--model", metavar="FILE", help="a Wan DiT .safetensors or .gguf file (header only is read)")
    p.add_argument("--width", default="1280", help="pixels, %d to %d" % SIZE_LIMITS["width"])
    p.add_argument("--height", default="720", help="pixels, %d to %d" % SIZE_LIMITS["height"])
    p.add_argument("--frames", default="81", help="frames, %d to %d" % SIZE_LIMITS["frames"])
    p.add_argument("--batch", default="1", help="latent batch, %d to %d" % SIZE_LIMITS["batch"])
    p.add_argument("--cfg", default="1.0", help="cfg scale; not 1 adds the uncond pass: one row per forward when "
                                                "cond and uncond run one after the other, 2 when ComfyUI batches them")
    p.add_argument("--dtype", choices=["auto", *activation_model.DTYPE_BYTES], default="auto",
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
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _number(text: str, flag: str, lo: float, hi: float, integer: bool = False, unit: str = ""):
    """The value of a numeric flag, or UsageError naming the flag and its range."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} must be {'an integer' if integer else 'a number'}{unit}, got {text[:40]!r}") from None
    if not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number{unit}, got {text[:40]!r}")
    if not lo <= value <= hi:
        raise UsageError(f"{flag} must be between {lo:g} and {hi:g}{unit}, got {text[:40]}")
    if integer:
        if value != int(value):
            raise UsageError(f"{flag} must be an integer, got {text[:40]}")
        return int(value)
    return value


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
        return None, None, None, f"the GPU could not be read ({type(e).__name__}: {str(e)[:80]}); assuming none"


def _read_model(path: str):
    try:
        return read_model_file(path)
    except NotAWanModel as e:
        raise UsageError(f"{e} (or use --preset for a known Wan model)") from None
    except ModelFileError as e:
        raise UsageError(str(e)) from None


def _described(info) -> str:
    d = info.dims
    return (f"{info.format}, Wan {d.model_type}, dim {d.dim}, {d.num_layers} layers, {d.num_heads} heads, "
            f"FFN {d.ffn_dim}, weights {info.main_dtype}, {info.weights_bytes / GiB:.2f} GiB in the file")


def cmd_plan(a) -> int:
    size = {k: _number(getattr(a, k), f"--{k}", *SIZE_LIMITS[k], integer=True) for k in SIZE_LIMITS}
    cfg = _number(a.cfg, "--cfg", *CFG_LIMITS)
    vram_gib = None if a.vram is None else _number(a.vram, "--vram", 0.0, VRAM_GIB_MAX, unit=" of GiB")
    if vram_gib is not None and vram_gib <= 0:
        raise UsageError(f"--vram must be more than 0 GiB, got {a.vram[:40]}")
    margin_gib = _number(a.margin, "--margin", 0.0, MARGIN_GIB_MAX, unit=" of GiB")
    if a.attention not in ATTENTION_CHOICES:
        raise UsageError(f"--attention must be sdpa, sage-auto or one of {', '.join(registry.KERNELS)}; "
                         f"got {a.attention[:40]!r}")
    if a.weights is not None and a.model:
        raise UsageError("--weights cannot be used with --model: the file's header gives its weight type")
    if a.weights is not None and a.weights.lower() not in WEIGHT_BYTES:
        raise UsageError(f"--weights must be one of {', '.join(WEIGHT_BYTES)}; got {a.weights[:40]!r}")
    cc = None
    if a.arch is not None:
        try:
            cc = registry.parse_arch(a.arch)
        except ValueError as e:
            raise UsageError(f"--arch: {e}") from None
    info = _read_model(a.model) if a.model else None
    notes = []
    total, gpu_cc, gpu, gpu_note = (None, None, None, None)
    if vram_gib is None or cc is None:
        total, gpu_cc, gpu, gpu_note = _cuda_info()
    if gpu_note:
        notes.append(gpu_note)
    cc = cc if cc is not None else gpu_cc
    vram = int(vram_gib * GiB) if vram_gib is not None else total
    if vram is None:
        notes.append("no GPU found and no --vram given: the verdict needs --vram GiB")
    compute = None if a.dtype == "auto" else a.dtype
    if info is not None:
        dims = info.dims
        try:
            weights = weights_for_file(info, a.lora, compute, cc, vram)
        except ValueError as e:
            raise UsageError(f"{a.model}: {e}") from None
    else:
        dims = activation_model.PRESETS[a.preset]
        weights = weights_for_key(dims, (a.weights or "bf16").lower(), a.lora, compute, cc, vram)
    notes.extend(weights.notes)
    est = estimate(EstimateRequest(
        dims=dims, **size, cfg=cfg, dtype=weights.compute, attention=a.attention, cc=cc, vram_bytes=vram,
        weights_bytes=weights.nbytes, weights=weights.setup, margin_bytes=int(margin_gib * GiB),
        img_tokens=257 if dims.has_img_emb else 0, per_frame_timesteps=False, compiled=a.compiled,
        sage_grouped=a.sage_grouped))
    if a.json:
        d = est.as_dict()
        d["notes"] = list(est.notes) + notes
        d["compute_dtype"] = weights.compute
        d["weights_held"] = weights.held
        if info is not None:
            d["model_file"] = {"format": info.format, "model_type": dims.model_type, "dim": dims.dim,
                               "num_layers": dims.num_layers, "num_heads": dims.num_heads, "ffn_dim": dims.ffn_dim,
                               "weight_dtype": info.main_dtype, "weights_bytes": info.weights_bytes}
        print(json.dumps(d, indent=1, default=str))
        return 0
    _print_table(a, est, info, weights, gpu, notes)
    return 0


def _rows_text(est) -> str:
    cfg = est.request["cfg"]
    if est.rows_batched == est.rows_sequential:
        return f"{est.rows_sequential} (cfg {cfg:g}: no uncond pass)"
    return (f"{est.rows_sequential} assumed (cfg {cfg:g}: cond and uncond one after the other; "
            f"{est.rows_batched} when ComfyUI batches them)")


def _attention_text(est) -> str:
    r = est.request
    if r["attention"] == "sdpa":
        return "SDPA"
    if r["kernel"] is None:
        return f"{r['attention']} on sm{r['cc']}: SDPA"
    groups = r.get("sage_head_groups", 1)
    split = f" in {groups} head groups" if groups > 1 else ""
    return f"{r['attention']} on sm{r['cc']}: {r['kernel']}{split} for self-attention, SDPA for cross-attention"


def _print_table(a, est, info, weights, gpu, notes) -> None:
    r = est.request
    print(f"wan-sage plan: {r['model']}, {r['width']}x{r['height']}x{r['frames']}, batch {r['batch']}, cfg {r['cfg']:g}")
    if info is not None:
        print(f"  model file: {a.model}: {_described(info)}")
    print(f"  compute: {weights.compute}; weights held as {weights.held}; attention: {_attention_text(est)}"
          + ("; blocks compiled (torch.compile)" if r.get("compiled") else ""))
    res, par = est.resident, est.partial
    rows = [
        ("latent [B,C,T,H,W]", str(list(est.latent)), ""),
        ("tokens per row", f"{est.tokens:,}", ""),
        ("rows per forward", _rows_text(est), ""),
        ("", "weights resident", "weights partly offloaded"),
        ("activation phase peak", _gib(res["phase_peak"]) + f" ({res['dominant_phase']})", _gib(par["phase_peak"])),
        ("  of which Sage extra", _gib(res["sage_extra"]), _gib(par["sage_extra"])),
        ("persistent (RoPE, context)", _gib(res["persistent"]), _gib(par["persistent"])),
        ("weight transients", _gib(res["weight_transient"]), _gib(par["weight_transient"])),
        ("streaming + fragmentation", _gib(res["fragmentation"]), _gib(par["fragmentation"])),
        ("allocator slack", _gib(res["slack"]), _gib(par["slack"])),
        (f"reservation per forward ({est.rows_sequential} row{'s' if est.rows_sequential > 1 else ''})",
         _gib(est.reservation_resident), _gib(est.reservation_partial)),
    ]
    if est.reservation_batched_resident is not None:
        rows.append((f"  cfg batched ({est.rows_batched} rows)", _gib(est.reservation_batched_resident),
                     _gib(est.reservation_batched_partial)))
    rows += [
        ("ComfyUI's own estimate", _gib(est.comfy_estimate), ""),
        ("weights", _gib(est.weights_bytes), ""),
        ("VRAM for this model", _gib(est.vram_bytes) + (f" ({gpu})" if gpu and a.vram is None else ""), ""),
    ]
    w0 = max(len(x[0]) for x in rows)
    w1 = max(len(x[1]) for x in rows if x[2])
    for k, v1, v2 in rows:
        print(f"  {k:<{w0}}  {v1:<{w1}}  {v2}".rstrip())
    print(f"  verdict: {est.verdict}")
    for n in list(est.notes) + notes:
        print(f"  note: {n}")


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


def _one_line(message: str) -> str:
    line = " ".join(str(message).split())
    return line if len(line) <= MESSAGE_CAP else line[:MESSAGE_CAP - 3] + "..."


def main(argv=None) -> int:
    ap = _Parser(prog="wan-sage", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    _plan_parser(sub)
    _bench_parser(sub)
    try:
        a = ap.parse_args(argv)
        if a.cmd == "plan":
            return cmd_plan(a)
    except UsageError as e:
        message = str(e) if str(e).startswith("wan-sage") else f"wan-sage plan: {e}"
        print(_one_line(message), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()
    return cmd_bench(a)


def _closed_pipe() -> int:
    """The reader of our output went away (``wan-sage plan | head``): stop quietly, as Unix tools do.
    stdout is pointed at devnull so that the interpreter's final flush raises nothing either."""
    import os
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
