"""What the Sage patch's override adds per call over plain SDPA on a settled shape: on a shape settled on SDPA
(the declined call's decision) and on one settled on a kernel (everything but the kernel: views, free-memory check,
sampled output check, stats), in microseconds.

    python -m bench.dispatch_overhead [--device cpu|cuda] [--shape B,H,Nq,Nk,D] [--calls N]

On the CPU the CPU tensors are treated as eligible for the measurement and no kernel runs (the kernel's entry point
replays one SDPA output), so the figures are the dispatch's own, on any machine.  ``wan-sage bench`` measures the
decision and the call overhead of each Wan shape it times on the GPU (``cli/bench_kernels.py``)."""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import uuid

from . import _host

_host.load_pack()
import torch  # noqa: E402

from wan_sage.attention import execution, kernels, planning, policy  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride  # noqa: E402
from wan_sage.attention.sdpa import attention_sdpa  # noqa: E402
from wan_sage.attention.state import STATE, Decision  # noqa: E402
from wan_sage.cli import bench_kernels  # noqa: E402


@contextlib.contextmanager
def _eligible(device_type: str):
    """CPU tensors pass the static checks while the overhead is measured on the CPU."""
    saved = policy.ACCEL_DEVICE_TYPES
    if device_type not in saved:
        policy.ACCEL_DEVICE_TYPES = saved + (device_type,)
    try:
        yield
    finally:
        policy.ACCEL_DEVICE_TYPES = saved


def _loops_us(fns: dict, n: int, rounds: int, sync, clock=time.perf_counter) -> dict:
    """Median microseconds per call of each function, in interleaved loops of ``n`` calls timed by
    ``clock`` (wall time, with ``sync`` after each loop; or :func:`time.thread_time`, this thread's
    CPU time, for calls that do no GPU work: not moved by other processes on the machine)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    sync()
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(n):
                fn()
            sync()
            times[name].append((clock() - t0) / n * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def dispatch_overhead(device: str = "cuda", shape=(1, 2, 1024, 1024, 64), dtype=torch.bfloat16, n: int = 2000,
                      rounds: int = 9, kernel: str = "sage2_sm90") -> dict:
    """Microseconds per call that the override adds over plain SDPA (the override's ``sdpa`` called
    directly) on a settled shape ``(B, H, Nq, Nk, D)``, measured in interleaved loops (medians):

    * ``sdpa_us`` / ``settled_sdpa_us``: plain SDPA, and the override on the shape settled on SDPA
      (``settled_sdpa_overhead_us`` their difference; on a GPU, with the calls issued back to back,
      the loops are bound by the CPU for a small shape);
    * ``decision_us``: the override on the SDPA-settled shape with an SDPA that returns a kept
      output, less that SDPA's own cost: the per-call cost of a declined shape, free of SDPA's
      time and noise (this thread's CPU time);
    * ``settled_kernel_us``: everything but the kernel on the shape settled on ``kernel`` (whose
      entry point replays one SDPA output: the views, free-memory check, sampled output check and
      stats), less the bare replaying entry point (CPU time too).

    On ``device="cpu"`` the CPU tensors are treated as eligible and free memory is taken as ample;
    the patches made here have their own options, so no other patch's decisions change."""
    dev = torch.device(device)
    B, H, NQ, NK, D = shape
    gen = torch.Generator(device=dev).manual_seed(1)
    q, k, v = (torch.randn(B, n_, H * D, device=dev, dtype=dtype, generator=gen) for n_ in (NQ, NK, NK))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    free = None if dev.type == "cuda" else (lambda device: 1 << 50)
    cc = kernels.device_cc(dev) if dev.type == "cuda" else 90
    kept = attention_sdpa(q, k, v, H)

    def kept_sdpa(q, k, v, heads, **kwargs):
        return kept
    tag = uuid.uuid4().hex[:8]
    make = lambda label, sdpa=None: SageAttentionOverride(  # noqa: E731
        PatchConfig(calibrate=False, min_tokens=0, label=f"dispatch overhead {label} {tag}"), sdpa=sdpa,
        free_memory=free, patch_id=f"overhead-{label}-{tag}")
    on_sdpa, on_sdpa_kept, on_kernel = make("sdpa"), make("sdpa-kept", kept_sdpa), make("kernel")
    call_shape = policy.call_shape(q, k, H, False, False)
    for o in (on_sdpa, on_sdpa_kept):
        STATE.settle(execution.call_key(o, q, call_shape), Decision(None, "slower", cc=cc))
    aspec = planning.attn_shape(call_shape, dtype)
    copy = planning.output_copy(kernel, "NHD", "NHD")
    need = planning.need_bytes(kernel, cc, aspec, 1, copy, on_kernel.config.memory_margin_mb << 20)
    STATE.settle(execution.call_key(on_kernel, q, call_shape), Decision(kernel, None, 1, need, 0.0, cc, copy))
    q4, k4, v4 = (t.view(B, -1, H, D) for t in (q, k, v))
    replay = bench_kernels._replaying(lambda q, k, v, **options: kept.view(B, NQ, H, D))
    real = kernels.entry_point(kernel)
    kernels.install_test_kernel(kernel, replay)
    options = {}
    try:
        with _eligible(dev.type):
            us = _loops_us({
                "sdpa_us": lambda: attention_sdpa(q, k, v, H),
                # the override called as ComfyUI's wrap_attn calls it
                "settled_sdpa_us": lambda: on_sdpa(attention_sdpa, q, k, v, heads=H, transformer_options=options,
                                                   _inside_attn_wrapper=True),
            }, n, rounds, sync)
            us.update(_loops_us({
                "kept_sdpa_us": lambda: kept_sdpa(q, k, v, H),
                "settled_kept_sdpa_us": lambda: on_sdpa_kept(attention_sdpa, q, k, v, heads=H,
                                                             transformer_options=options,
                                                             _inside_attn_wrapper=True),
                "replay_us": lambda: kernels.run(kernel, q4, k4, v4, "NHD", None, cc),
                "settled_kernel_call_us": lambda: on_kernel(attention_sdpa, q, k, v, heads=H,
                                                            transformer_options=options,
                                                            _inside_attn_wrapper=True),
            }, n, rounds, sync, time.thread_time))
    finally:
        kernels.install_test_kernel(kernel, real)
    return {"device": str(dev), "shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
            "sdpa_us": us["sdpa_us"], "settled_sdpa_us": us["settled_sdpa_us"],
            "settled_sdpa_overhead_us": us["settled_sdpa_us"] - us["sdpa_us"],
            "decision_us": us["settled_kept_sdpa_us"] - us["kept_sdpa_us"],
            "settled_kernel_us": us["settled_kernel_call_us"] - us["replay_us"]}



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dispatch_overhead",
                                 description="Per-call overhead of the Sage patch on a settled shape, against plain "
                                             "SDPA (microseconds).")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--shape", default="1,2,1024,1024,64", help="B,H,Nq,Nk,D")
    ap.add_argument("--calls", type=int, default=2000)
    a = ap.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    r = dispatch_overhead(device, tuple(int(x) for x in a.shape.split(",")), n=a.calls)
    print(json.dumps(r))
    print(f"{r['device']} {r['shape']}: plain SDPA {r['sdpa_us']:.1f} us, settled on SDPA "
          f"{r['settled_sdpa_us']:.1f} us ({r['settled_sdpa_overhead_us']:+.2f} us); decision of a settled SDPA "
          f"shape {r['decision_us']:.2f} us; "
          f"everything but the kernel on a settled kernel shape {r['settled_kernel_us']:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
