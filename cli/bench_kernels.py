"""What ``wan-sage bench`` measures (:mod:`.bench` parses its flags): time every available kernel against SDPA on Wan attention shapes, ungrouped
and split into the memory mode's head groups (the cost of running Sage at SDPA's memory); check
accuracy against an fp32 reference and measured extra bytes against the formulas; run the "auto"
override end to end in both memory modes, with and without the sampled output check, and measure
its per-call decision cost; write the timings into the timing cache the node reads.

:func:`dispatch_overhead` measures what the override adds per call over plain SDPA on a settled
shape (on SDPA, and on a kernel); ``python -m wan_sage.cli.bench_kernels [--device cpu]`` prints
it, on the CPU too (the CPU tensors are then treated as eligible; no kernel runs)."""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import uuid

import torch
import torch.nn.functional as F

from ..attention import execution, head_groups, kernel_bytes, kernels, planning, policy, registry, timing
from ..attention.config import PatchConfig
from ..attention.override import SageAttentionOverride
from ..attention.sdpa import attention_sdpa
from ..attention.state import STATE, Decision

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


def _reference(q, k, v, H, nq=1024):
    B, _, C = q.shape
    D = C // H
    qs = q[:, :nq].reshape(B, -1, H, D).transpose(1, 2).float()
    ks = k.reshape(B, -1, H, D).transpose(1, 2).float()
    vs = v.reshape(B, -1, H, D).transpose(1, 2).float()
    out = torch.empty(B, H, qs.shape[2], D, device=q.device)
    for h in range(H):
        out[:, h] = F.scaled_dot_product_attention(qs[:, h:h + 1], ks[:, h:h + 1], vs[:, h:h + 1])[:, 0]
    return out.transpose(1, 2).reshape(B, -1, C)


def _batch(fn) -> int:
    """How many back-to-back calls make a ~20 ms batch (after two warm-up calls)."""
    fn()
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return max(1, min(200, int(20.0 / max(s.elapsed_time(e), 1e-3))))


def _batch_ms(fn, n) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


def _time(fn, iters):
    """Median and min milliseconds per call.  Calls are issued back to back in batches of at
    least ~20 ms (as inside a model forward, where the CPU runs ahead of the GPU), so the launch
    latency of sub-millisecond shapes is not counted as kernel time."""
    n = _batch(fn)
    ts = [_batch_ms(fn, n) for _ in range(iters)]
    return statistics.median(ts), min(ts)


def _ab(fa, fb, rounds=7):
    """Interleaved A/B timing (ms per call, medians): clocks and heat drift affect both alike."""
    fb()
    n = _batch(fa)
    ta, tb = [], []
    for _ in range(rounds):
        ta.append(_batch_ms(fa, n))
        tb.append(_batch_ms(fb, n))
    return statistics.median(ta), statistics.median(tb)


def peak_extra(fn):
    """(fn's output, the most bytes allocated above what was allocated before it, while it ran).  Garbage in
    reference cycles is collected first, so that none of it is freed during ``fn`` below the base."""
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = fn()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return o, extra


def _acc(o, ref):
    o = o[:, :ref.shape[1]].float()
    rel = ((o - ref).norm() / ref.norm()).item()
    cos = F.cosine_similarity(o.flatten(), ref.flatten(), dim=0).item()
    return rel, cos


def _decision_us(override, q, k, v, H, n=400, repeats=7) -> float:
    """CPU microseconds per call of a settled shape: the override's static checks and the
    run-time decision with its free-memory check (everything a call does besides the kernel).
    The median of ``repeats`` loops of ``n`` calls, so one descheduled loop does not decide it."""
    override.plan(q, k, v, H)
    loops = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            override.plan(q, k, v, H)
        loops.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(loops)


def _replaying(real):
    """An entry point that runs ``real`` once per input (each head group of a split call is one)
    and returns that output on every later call with it: a kernel of no cost whose output is right
    (the sampled output check passes it)."""
    kept = {}

    def entry(q, k, v, **options):
        key = (q.data_ptr(), tuple(q.shape), tuple(q.stride()))
        if key not in kept:
            kept[key] = real(q, k, v, **options)
        return kept[key]
    return entry


def _call_overhead_us(override, q, k, v, H, n=2000) -> float | None:
    """CPU microseconds per call of a settled shape for everything but the kernel: the call as
    ComfyUI makes it, with the chosen kernel's entry point swapped for one that replays its first
    output for each input (:func:`_replaying`; the views, head split and copies, output-check
    sample and stats included).  None when the shape runs on SDPA."""
    plan = override.plan(q, k, v, H)
    if plan.kernel is None:
        return None
    real = kernels.entry_point(plan.kernel)
    kernels.install_test_kernel(plan.kernel, _replaying(real))
    try:
        call = lambda: override(attention_sdpa, q, k, v, heads=H, transformer_options={})  # noqa: E731
        call()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        elapsed = time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        kernels.install_test_kernel(plan.kernel, real)
    return elapsed / n * 1e6


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
    replay = _replaying(lambda q, k, v, **options: kept.view(B, NQ, H, D))
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


def run_bench(shapes, kernel_names, dtype=torch.bfloat16, iters=5, accuracy=True, cache_dir=None, emit=print):
    dev = torch.device("cuda", torch.cuda.current_device())
    cc = kernels.device_cc(dev)
    gpu = torch.cuda.get_device_name(dev)
    cache = planning.timing_cache(cache_dir)  # the timing cache the overrides below read
    dt = "bf16" if dtype == torch.bfloat16 else "fp16"
    rows = []
    budget = {"calibration_budget_s": 600.0, "cache_dir": cache_dir}
    overrides = {
        "auto": SageAttentionOverride(PatchConfig(**budget), patch_id="bench"),
        "fastest": SageAttentionOverride(PatchConfig(memory_mode="fastest", **budget), patch_id="bench-fastest"),
        "no_finite_check": SageAttentionOverride(PatchConfig(check_finite=False, **budget), patch_id="bench-nofinite"),
    }
    for sname, (B, H, NQ, NK, D) in shapes.items():
        gen = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(B, NQ, H * D, device=dev, dtype=dtype, generator=gen)
        k = torch.randn(B, NK, H * D, device=dev, dtype=dtype, generator=gen)
        v = torch.randn(B, NK, H * D, device=dev, dtype=dtype, generator=gen)
        ref = _reference(q, k, v, H) if accuracy else None
        shape = kernel_bytes.AttnShape(B, H, NQ, NK, D, 2, None, dtype == torch.bfloat16)
        sdpa = lambda: attention_sdpa(q, k, v, H)  # noqa: E731
        sdpa_ms, sdpa_min = _time(sdpa, iters)
        o, sdpa_extra = peak_extra(sdpa)
        row0 = {"shape": sname, "B": B, "H": H, "Nq": NQ, "Nk": NK, "D": D, "dtype": dt, "backend": "sdpa",
                "ms": sdpa_ms, "ms_min": sdpa_min, "ratio": 1.0, "extra_bytes": sdpa_extra,
                "formula_bytes": kernel_bytes.extra_bytes("sdpa", shape)}
        if ref is not None:
            row0["rel_l2"], row0["cos"] = _acc(o, ref)
        del o
        rows.append(row0)
        emit(json.dumps(row0))
        q4, k4, v4 = (t.view(B, -1, H, D) for t in (q, k, v))
        for name in kernel_names:
            why = kernels.unavailable_reason(name, cc)
            if why:
                r = {"shape": sname, "dtype": dt, "backend": name, "skipped": why}
                rows.append(r)
                emit(json.dumps(r))
                continue
            path = registry.KERNELS[name].memory_path(cc)
            split = head_groups.head_groups(path, shape, "sdpa")
            measured = {}
            for groups in sorted({1, split.groups}):
                fn = lambda g=groups: execution.run_kernel(name, q4, k4, v4, "NHD", "NHD", g, None, cc)  # noqa: E731
                try:
                    ms, ms_min = _time(fn, iters)
                    o, extra = peak_extra(fn)
                except Exception as e:
                    r = {"shape": sname, "dtype": dt, "backend": name, "groups": groups,
                         "error": f"{type(e).__name__}: {e}"[:300]}
                    rows.append(r)
                    emit(json.dumps(r))
                    continue
                formula = head_groups.split_bytes(path, shape, groups)
                r = {"shape": sname, "B": B, "H": H, "Nq": NQ, "Nk": NK, "D": D, "dtype": dt, "backend": name,
                     "groups": groups, "ms": ms, "ms_min": ms_min, "ratio": sdpa_ms / ms, "extra_bytes": extra,
                     "formula_bytes": formula, "formula_err": (extra - formula) / formula}
                if groups > 1 and 1 in measured:
                    r["grouping_cost"] = ms / measured[1] - 1
                if ref is not None:
                    r["rel_l2"], r["cos"] = _acc(o, ref)
                del o
                measured[groups] = ms
                rows.append(r)
                emit(json.dumps(r))
            if measured:
                grouped = measured.get(split.groups) if split.groups > 1 else None
                cache.put(planning.timing_key(gpu, cc, name, dt, H, D, NQ, NK),
                          measured.get(1), sdpa_ms, NQ, NK, save=False, grouped_ms=grouped, groups=split.groups,
                          repeats=iters)
        cache.save()
        # The override end to end, as ComfyUI calls it, after the cache holds this shape,
        # interleaved with plain SDPA so that clock drift cancels.
        calls = {}
        for label, override in overrides.items():
            call = lambda o=override: o(attention_sdpa, q, k, v, heads=H, transformer_options={})  # noqa: E731
            call()
            calls[label] = call
        sdpa_ab, ms = _ab(sdpa, calls["auto"])
        _, ms_fastest = _ab(sdpa, calls["fastest"], rounds=3)
        _, ms_nf = _ab(sdpa, calls["no_finite_check"], rounds=3)
        plan = overrides["auto"].plan(q, k, v, H)
        plan_fastest = overrides["fastest"].plan(q, k, v, H)
        _, auto_extra = peak_extra(calls["auto"])
        _, fastest_extra = peak_extra(calls["fastest"])
        r = {"shape": sname, "B": B, "H": H, "Nq": NQ, "Nk": NK, "D": D, "dtype": dt, "backend": "auto",
             "chosen": plan.kernel or f"sdpa ({plan.reason})", "groups": plan.groups, "ms": ms,
             "sdpa_ms_interleaved": sdpa_ab, "ratio": sdpa_ab / ms, "extra_bytes": auto_extra,
             "fastest_groups": plan_fastest.groups, "ms_fastest": ms_fastest, "ratio_fastest": sdpa_ab / ms_fastest,
             "extra_bytes_fastest": fastest_extra,
             "ms_no_finite_check": ms_nf, "ratio_no_finite_check": sdpa_ab / ms_nf,
             "decision_us": _decision_us(overrides["auto"], q, k, v, H),
             "call_overhead_us": _call_overhead_us(overrides["auto"], q, k, v, H)}
        rows.append(r)
        emit(json.dumps(r))
        del q, k, v, q4, k4, v4, ref
        torch.cuda.empty_cache()
    return rows


def table(rows) -> str:
    lines = [f"{'shape':<26} {'dtype':<5} {'backend':<18} {'groups':>6} {'ms':>9} {'x SDPA':>7} {'extra MB':>9} "
             f"{'formula MB':>10} {'err %':>6} {'rel-L2':>7}  note"]
    for r in rows:
        if "skipped" in r or "error" in r:
            lines.append(f"{r['shape']:<26} {r.get('dtype', '-'):<5} {r['backend']:<18} {r.get('groups', '-'):>6} "
                         f"{'-':>9} {'-':>7} {'-':>9} "
                         f"{'-':>10} {'-':>6} {'-':>7}  " + (r.get("skipped") or r.get("error"))[:70])
            continue
        ex = f"{r['extra_bytes'] / 1e6:9.1f}" if "extra_bytes" in r else f"{'':>9}"
        fo = f"{r['formula_bytes'] / 1e6:10.1f}" if "formula_bytes" in r else f"{'':>10}"
        er = f"{100 * r['formula_err']:6.2f}" if "formula_err" in r else f"{'':>6}"
        rl = f"{r['rel_l2']:7.4f}" if "rel_l2" in r else f"{'':>7}"
        if r["backend"] == "auto":
            note = (f"chose {r['chosen']}; memory mode fastest: {r['fastest_groups']} group(s) "
                    f"x{r['ratio_fastest']:.3f} {r['extra_bytes_fastest'] / 1e6:.0f} MB; "
                    f"without the output check x{r['ratio_no_finite_check']:.3f}; "
                    f"decision {r['decision_us']:.1f} us"
                    + (f", call without the kernel {r['call_overhead_us']:.1f} us" if r["call_overhead_us"] else ""))
        elif "grouping_cost" in r:
            note = f"grouping costs {100 * r['grouping_cost']:+.1f} % against ungrouped"
        else:
            note = ""
        groups = r.get("groups", "")
        lines.append(f"{r['shape']:<26} {r['dtype']:<5} {r['backend']:<18} {groups:>6} {r['ms']:9.2f} {r['ratio']:7.3f} "
                     f"{ex} {fo} {er} {rl}  {note}")
    return "\n".join(lines)


def main(a) -> int:
    if not torch.cuda.is_available():
        print("wan-sage bench needs a CUDA GPU; on this machine use `wan-sage plan` for the memory estimate.",
              file=sys.stderr)
        return 2
    shapes = getattr(a, "model_shapes", None) or (WAN_SHAPES if a.shapes == "wan" else {})
    if not shapes:
        for n in a.shapes.split(","):
            if n not in WAN_SHAPES:
                print(f"unknown shape {n!r}; known: {', '.join(WAN_SHAPES)}", file=sys.stderr)
                return 2
            shapes[n] = WAN_SHAPES[n]
    cc = kernels.device_cc(torch.device("cuda"))
    if a.kernels == "auto":
        names = list(registry.auto_order(cc))
    elif a.kernels == "all":
        names = list(registry.KERNELS)
    else:
        names = a.kernels.split(",")
    p = kernels.probe()
    print(f"wan-sage bench: {torch.cuda.get_device_name()} (sm{cc}), torch {torch.__version__}, "
          f"sageattention {p.sage_version or 'not installed'}, comfy-kitchen {p.ck_version or 'not installed'}; "
          f"cache {timing.TimingCache(a.cache_dir).path}", flush=True)
    out = open(a.json, "w") if a.json else None

    def emit(line):
        if out:
            out.write(line + "\n")
            out.flush()
    rows = []
    for dtype in (("fp16", "bf16") if a.dtype == "both" else (a.dtype,)):
        rows += run_bench(shapes, names, torch.bfloat16 if dtype == "bf16" else torch.float16, a.iters,
                          not a.no_accuracy, a.cache_dir, emit)
    if out:
        out.close()
    print(table(rows))
    return 0


def _overhead_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wan_sage.cli.bench_kernels",
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
    sys.exit(_overhead_main())
