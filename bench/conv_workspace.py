"""The free memory a cuDNN convolution needs, when PyTorch picks its engine, to get a fast one.

PyTorch's cuDNN bindings pick a convolution's engine the first time they see its shapes in a process and keep
it: they try cuDNN's engines in its order and take the first whose workspace the allocator can give then.  A
later call whose workspace cannot be allocated picks again, among what fits then, and keeps that one.

This tool runs one convolution per fresh process with F GiB free on the device just before its first call,
then times it on the engine that call settled on.  One JSON line per (convolution, F), printed and appended to
``--out``:

    python -m bench.conv_workspace --conv 1x96x6x722x1282:96x96x3x3x3 --free-gib 2,3,4,5,6 --out conv.jsonl
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from . import _host
from .e2e import GiB, _r

SCHEMA = "wan-sage-conv-workspace/1"


def parse_conv(text: str) -> tuple[list[int], list[int]]:
    """``NxCxTxHxW:OxCxKtxKhxKw`` (or the 2-D forms) as (input shape, weight shape); ValueError naming the fix."""
    try:
        a, b = text.strip().split(":")
        x, w = [int(v) for v in a.split("x")], [int(v) for v in b.split("x")]
    except ValueError:
        raise ValueError(f"--conv {text!r}: write INPUT:WEIGHT as x-separated sizes, "
                         f"e.g. 1x96x6x722x1282:96x96x3x3x3") from None
    if len(x) not in (4, 5) or len(w) != len(x) or x[1] != w[1] or min(x + w) < 1:
        raise ValueError(f"--conv {text!r}: input and weight need the same rank (4 or 5), positive sizes and the "
                         f"same channel count (input[1] == weight[1])")
    return x, w


def one(conv: str, free_gib: float, allocator: str, calls: int, then_gib: float | None = None) -> dict:
    """Run the convolution in this process with ``free_gib`` free before its first call, and time it with
    ``then_gib`` free (default: as it was planned)."""
    _host.set_allocator(allocator)
    import torch
    x_shape, w_shape = parse_conv(conv)
    dev = torch.device("cuda")
    conv_fn = torch.nn.functional.conv3d if len(x_shape) == 5 else torch.nn.functional.conv2d
    x = torch.randn(x_shape, device=dev, dtype=torch.bfloat16)
    w = torch.randn(w_shape, device=dev, dtype=torch.bfloat16) * 0.01
    out_el = 1
    for s, k in zip(x_shape[2:], w_shape[2:]):     # stride 1, no padding: what the Wan VAE's convolutions run
        out_el *= s - k + 1
    out_bytes = x_shape[0] * w_shape[0] * out_el * 2
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    want = free - int(free_gib * GiB)
    ballast = torch.empty(want, dtype=torch.uint8, device=dev) if want > 0 else None
    torch.cuda.synchronize()
    seen = torch.cuda.mem_get_info()[0]
    t = time.perf_counter()
    y = conv_fn(x, w)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t) * 1e3
    del y
    later = None
    if then_gib is not None:
        torch.cuda.synchronize()
        more = torch.cuda.mem_get_info()[0] - int(then_gib * GiB)
        later = torch.empty(more, dtype=torch.uint8, device=dev) if more > 0 else None
        torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        y = conv_fn(x, w)
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1))
        del y
    times.sort()
    del ballast, later
    return {"schema": SCHEMA, "input": x_shape, "weight": w_shape, "free_gib": free_gib, "then_free_gib": then_gib,
            "free_seen_gib": _r(seen / GiB), "input_gib": _r(x.numel() * 2 / GiB),
            "output_gib": _r(out_bytes / GiB), "first_ms": _r(first_ms, 1), "ms": _r(times[len(times) // 2], 2),
            "allocator": allocator, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "gpu": torch.cuda.get_device_name(), "commit": _host.git_head()}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.conv_workspace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--conv", required=True, help="comma-separated INPUT:WEIGHT shapes (bf16)")
    ap.add_argument("--free-gib", required=True, help="comma-separated GiB free before the first call")
    ap.add_argument("--then-free-gib", type=float, default=None,
                    help="time the calls after the first with this many GiB free (the engine stays the one picked "
                         "at --free-gib unless its workspace no longer fits)")
    ap.add_argument("--allocator", choices=["async", "native"], default="async")
    ap.add_argument("--calls", type=int, default=5, help="timed calls after the first (median kept)")
    ap.add_argument("--out", help="append the JSON lines here")
    ap.add_argument("--one", nargs=2, metavar=("CONV", "FREE"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    convs = [c for c in a.conv.split(",") if c.strip()]
    for c in convs:
        parse_conv(c)
    try:
        frees = [float(v) for v in a.free_gib.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--free-gib {a.free_gib!r}: write GiB as comma-separated numbers, e.g. 2,3.5,5") from None
    if not frees or min(frees) <= 0:
        raise ValueError("--free-gib: give at least one positive GiB figure")
    if a.calls < 1:
        raise ValueError("--calls: at least 1")
    return a, convs, frees


def main(argv=None) -> int:
    try:
        a, convs, frees = parse_args(argv)
    except ValueError as e:
        print(f"bench.conv_workspace: {e}", file=sys.stderr)
        return 2
    if a.one:
        print(json.dumps(one(a.one[0], float(a.one[1]), a.allocator, a.calls, a.then_free_gib)))
        return 0
    rc, emit = 0, _host.JsonLines(a.out)
    for conv in convs:
        for f in frees:
            cmd = [sys.executable, "-m", "bench.conv_workspace", "--conv", conv, "--free-gib", str(f),
                   "--allocator", a.allocator, "--calls", str(a.calls), "--one", conv, str(f)]
            if a.then_free_gib is not None:
                cmd += ["--then-free-gib", str(a.then_free_gib)]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(_host.ROOT))
            line = p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else None
            row = json.loads(line) if line else {"schema": SCHEMA, "conv": conv, "free_gib": f, "status": "failed",
                                                 "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
            rc = rc or (0 if line else 1)
            emit(row)
    emit.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
