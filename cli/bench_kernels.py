"""What ``wan-sage bench`` measures (:mod:`.bench` parses its flags): time every available kernel against SDPA on
Wan attention shapes, ungrouped and split into the memory mode's head groups (the cost of running Sage at SDPA's
memory); check accuracy against an fp32 reference and measured extra bytes against the formulas; run the "auto"
override end to end in both memory modes, with and without the sampled output check, and measure its per-call
decision cost; write the timings into the timing cache the node reads."""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ..attention import execution, head_groups, kernel_bytes, kernels, planning, registry, timing
from ..attention.config import PatchConfig
from ..attention.override import SageAttentionOverride
from ..attention.sdpa import attention_sdpa
from .bench import WAN_SHAPES



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
    shapes = getattr(a, "model_shapes", None) or (WAN_SHAPES if a.shapes == "wan" else
                                                  {n: WAN_SHAPES[n] for n in a.shapes.split(",")})
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
    out = open(a.json, "w") if a.json else None  # cli.bench checked that it can be written

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
