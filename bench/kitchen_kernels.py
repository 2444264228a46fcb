"""comfy-kitchen's fused Wan kernels on the GPU: the bytes each call allocates, against its output.

The activation model plans ComfyUI 0.38's Wan phases (``KERNEL_SETS`` ``comfy-kitchen`` in
memory/activation_model.py) on two claims about comfy-kitchen's kernels:

* ``ck.apply_rope1`` makes no fp32 temporaries: a call allocates its output and nothing else, where
  the eager RoPE of 0.3.64 also holds an fp32 copy of its input and an fp32 result (``8 d T`` bytes);
* ``ck.adaln`` writes ``layernorm(x) * (1 + scale) + shift`` without the normalised temporary;
* with int8 tensorwise weights, the FFN's down-projection ``ck.int8_linear(h, w, scale, input_act="gelu_tanh")``
  holds one int8 copy of the activated ``h`` (``f T`` bytes) beside its output, not a second ``ffn_dim``-wide
  bf16 buffer (``--ffn``: the modelled ``f T`` is printed beside the measured bytes; with and without ConvRot).

This tool measures both at Wan's real dims: each call's peak allocation above its inputs
(``torch.cuda.max_memory_allocated``), against its output's bytes, on comfy-kitchen's CUDA backend and,
as the reference, on its eager backend (the same arithmetic as 0.3.64's eager code).  The FFN phase's
``linear_input_act`` with other weights is ComfyUI 0.38 code, not comfy-kitchen's, and is not measured here.

    PYTHONPATH=<comfy-kitchen site> python -m bench.kitchen_kernels --out kitchen.jsonl

The sizes are none the model's constants were set from (it has none for these phases: the figures are
structural).  Needs CUDA and comfy-kitchen; says so and exits 2 without them.
"""
from __future__ import annotations

import argparse
import json
import sys

from . import _host

# name, model dim, heads, ffn dim, tokens per row (latent frames x (H/16) x (W/16))
SIZES = (
    ("a14b_1280x720x81", 5120, 40, 13824, 21 * 45 * 80),
    ("a14b_960x544x81", 5120, 40, 13824, 21 * 34 * 60),
    ("ti2v5b_1280x704x121", 3072, 24, 14336, 31 * 22 * 40),  # the 5B VAE packs 32x32 pixels per token
    ("t2v1.3b_832x480x81", 1536, 12, 8960, 21 * 30 * 52),
)


def _extra(torch, fn):
    """(peak bytes allocated above what was allocated before the call, output bytes), as ``wan-sage bench``
    measures them; on the CPU (the tool's own test) the peak reads 0."""
    if torch.cuda.is_available():
        _host.load_pack()
        from wan_sage.cli.bench_kernels import peak_extra
        out, peak = peak_extra(fn)
    else:
        out, peak = fn(), 0
    return peak, out.numel() * out.element_size()


def measure(torch, ck, sizes=SIZES, dtype_name="bf16", ffn=False, device="cuda",
            backends=("cuda", "eager")) -> list[dict]:
    """One row per size and kernel: the peak beyond the output on each of ``backends`` (the last one the
    reference of ``rel_l2_vs_eager``)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    dev = torch.device(device)
    rows = []
    for name, dim, heads, ffn_dim, T in sizes:
        D = dim // heads
        gen = torch.Generator(device=dev).manual_seed(3)
        x4 = torch.randn(1, T, heads, D, device=dev, dtype=dtype, generator=gen)
        # Wan's RoPE table as ComfyUI builds it: [1, T, 1, D/2, 2, 2] fp32 rotation matrices
        angle = torch.rand(1, T, 1, D // 2, device=dev, generator=gen) * 6.283
        c, s = torch.cos(angle), torch.sin(angle)
        freqs = torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)
        x3 = torch.randn(1, T, dim, device=dev, dtype=dtype, generator=gen)
        mod = {"per_sample": (torch.randn(1, 1, dim, device=dev, dtype=dtype, generator=gen),) * 2,
               "per_token": (torch.randn(1, T, dim, device=dev, dtype=dtype, generator=gen),) * 2}
        calls = {"apply_rope1": lambda: ck.apply_rope1(x4, freqs)}
        for kind, (scale, shift) in mod.items():
            calls[f"adaln_{kind}"] = (lambda scale=scale, shift=shift: ck.adaln(x3, scale, shift))
        if ffn:  # the up-projection's output and the int8 down-projection weight
            h = torch.randn(1, T, ffn_dim, device=dev, dtype=dtype, generator=gen)
            w8 = torch.randint(-127, 128, (dim, ffn_dim), device=dev, dtype=torch.int8, generator=gen)
            w_scale = torch.tensor(0.01, device=dev)
            for convrot in (False, True):
                calls["int8_linear_gelu" + ("_convrot" if convrot else "")] = (
                    lambda convrot=convrot: ck.int8_linear(h, w8, w_scale, out_dtype=dtype, convrot=convrot,
                                                           input_act="gelu_tanh"))
        for kernel, fn in calls.items():
            row = {"size": name, "dim": dim, "heads": heads, "ffn_dim": ffn_dim, "tokens": T, "dtype": dtype_name,
                   "kernel": kernel}
            for backend in backends:
                with ck.use_backend(backend):
                    peak, nbytes = _extra(torch, fn)
                row[f"{backend}_peak_bytes"] = peak
                row["output_bytes"] = nbytes
            with ck.use_backend(backends[0]):
                fused = fn()
            with ck.use_backend(backends[-1]):
                ref = fn()
            row["rel_l2_vs_eager"] = ((fused.float() - ref.float()).norm() / ref.float().norm()).item()
            del fused, ref
            for backend in backends:
                row[f"{backend}_beyond_output_mib"] = (row[f"{backend}_peak_bytes"] - nbytes) / 2**20
            row["eager_fp32_temporaries_model_mib"] = 8 * dim * T / 2**20 if kernel == "apply_rope1" else None
            row["int8_copy_model_mib"] = ffn_dim * T / 2**20 if kernel.startswith("int8_linear") else None
            rows.append(row)
        del x4, x3, freqs, mod, calls
        h = w8 = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kitchen_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write the rows as JSON lines to this file")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--ffn", action="store_true",
                    help="also the int8 FFN down-projection with the GELU folded in (ck.int8_linear), with and "
                         "without ConvRot")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("kitchen_kernels: torch is not installed", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kitchen_kernels: no CUDA device (run on the GPU machine)", file=sys.stderr)
        return 2
    try:
        import comfy_kitchen as ck
    except Exception as e:  # a wheel that does not load on this torch is a finding, reported as such
        print(f"kitchen_kernels: comfy-kitchen does not import here: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    backends = ck.list_backends()
    cuda = backends.get("cuda", {})
    if not cuda.get("available"):
        print(f"kitchen_kernels: comfy-kitchen's CUDA backend is unavailable: {cuda.get('unavailable_reason')}",
              file=sys.stderr)
        return 2
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "comfy_kitchen": getattr(ck, "__version__", "unknown")}
    rows = [{**r, **env} for r in measure(torch, ck, dtype_name=args.dtype, ffn=args.ffn)]
    for r in rows:
        print(f"{r['size']:<22} {r['kernel']:<18} output {r['output_bytes'] / 2**20:8.1f} MiB  "
              f"beyond it: cuda {r['cuda_beyond_output_mib']:7.1f} MiB, eager {r['eager_beyond_output_mib']:7.1f} MiB"
              + (f" (model of the eager fp32 temporaries {r['eager_fp32_temporaries_model_mib']:.1f})"
                 if r["eager_fp32_temporaries_model_mib"] is not None else "")
              + (f" (modelled int8 copy {r['int8_copy_model_mib']:.1f})" if r["int8_copy_model_mib"] is not None else "")
              + f"  rel L2 {r['rel_l2_vs_eager']:.1e}")
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
