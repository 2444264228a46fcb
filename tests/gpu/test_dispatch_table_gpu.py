"""gpu tier, the dispatch table: the "auto" patch on held-out shapes (shapes no other test names)
times each on its first calls on the real kernels, then the settled call is measured against plain SDPA:

* ``ratio``: SDPA's time (ComfyUI's SDPA: :func:`comfy_sdpa`) over the patched call's (interleaved batches,
  medians);
* ``peak`` against ``sdpa_peak``: ``torch.cuda.max_memory_allocated`` above the inputs, same call;
* ``rel_l2`` / ``cos`` against SDPA in the call's dtype, and ``rel_l2_fp32`` (SDPA's own
  ``sdpa_rel_l2_fp32``) against an fp32 reference, on the first 1,024 query rows of every head;
* ``decision_us``: what the patch adds per call over plain SDPA on a shape settled on SDPA (the
  patch's SDPA swapped for one that returns a kept output: the CPU cost of the declined call, free
  of SDPA's time; the least of two passes, one as the row is measured and one after the table), through ``override(func, ...)``; ``decision_containers_us``: the same through
  ``container_function`` (ComfyUI 0.38's entry); ``call_overhead_us``: everything but the kernel on a
  shape served by a kernel.

The table is printed (``pytest -s``) and written as JSON lines to ``$WAN_SAGE_GPU_TABLE`` when set.
Asserted: every served output within the accuracy bound (:mod:`wan_sage.attention.accuracy`); every
declined shape's output SDPA's and its decision at most :func:`decision_bound_us` (:data:`DECISION_MAX_US` on a
host whose plain Python call costs :data:`PLAIN_REF_US`, more in proportion on a slower one); no served shape
slower than SDPA beyond noise (:data:`SERVED_MIN_RATIO`).  Every other number is reported, not
asserted."""
import gc
import json
import os
import statistics
import time

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

from wan_sage.attention import accuracy, kernels  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride  # noqa: E402
from wan_sage.attention.sdpa import attention_sdpa  # noqa: E402
from wan_sage.attention.state import STATE  # noqa: E402
from wan_sage.cli.bench_kernels import _ab, _call_overhead_us, _reference, peak_extra  # noqa: E402
from wan_sage.nodes.handover import Container as Box  # noqa: E402  (the containers ComfyUI 0.38 hands over)

DEV = torch.device("cuda")


def comfy_sdpa(q, k, v, heads, **kwargs):
    """SDPA as a Wan call gets it inside ComfyUI: ComfyUI 0.3.64's attention_pytorch calls PyTorch's SDPA in
    the backend order comfy/ops.py sets around every call (cuDNN, flash, efficient, math; ``set_priority``).
    The table's baseline and the patch's SDPA.  PyTorch's plain call depends on the process: run alone, this
    file's plain SDPA peaked at the output alone (no log-sum-exp: cuDNN) and ran these shapes 1.3-1.7x faster
    than in the whole gpu tier, whose earlier tests run ComfyUI's own SDPA calls (its peak there had the
    log-sum-exp too).  Pinning ComfyUI's order makes the baseline the user's, whatever ran before."""
    with sdpa_kernel(COMFY_SDPA_ORDER, set_priority=True):
        return attention_sdpa(q, k, v, heads, **kwargs)
CC = kernels.device_cc(DEV)
AUTO = kernels.auto_candidates(CC)
COMFY_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
DECISION_MAX_US = 3.0  # a declined shape runs at >= 0.99x SDPA down to calls of 0.3 ms, on a host as fast as:
PLAIN_REF_US = 0.1  # a plain Python call of the kept SDPA; a slower host's bound grows with that call's cost
SERVED_MIN_RATIO = 0.97  # calibration picks a kernel only when it is 2 % faster; below 0.97 is not noise
ROWS = 1024

# name: (B, H, Nq, Nk, D), dtypes.  Wan's tokens: latent frames (frames - 1) / 4 + 1 times (W/16) x (H/16).
SHAPES = {
    "t2v1.3b_480p81_self": ((1, 12, 32760, 32760, 128), ("bf16", "fp16")),
    "t2v1.3b_480p81_cfg2_self": ((2, 12, 32760, 32760, 128), ("bf16",)),
    "a14b_1080p49_self": ((1, 40, 106080, 106080, 128), ("bf16", "fp16")),
    "ti2v5b_704p121_self": ((1, 24, 27280, 27280, 128), ("bf16",)),
    "a14b_short_1750_self": ((1, 40, 1750, 1750, 128), ("bf16", "fp16")),
    "a14b_short_7480_self": ((1, 40, 7480, 7480, 128), ("bf16",)),
    "a14b_1080p49_text_cross": ((1, 40, 106080, 512, 128), ("bf16",)),
    "i2v14b_720p81_image_cross": ((1, 40, 75600, 257, 128), ("bf16",)),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


pytestmark = pytest.mark.usefixtures("fresh_state")


def _decision_us(config, q, k, v, H, n=2000, rounds=15) -> dict:
    """Microseconds the patch adds per call on a shape settled on SDPA, over the patch's SDPA
    itself: a patch of the same options (so the same settled decision) whose SDPA returns a kept
    output, against that SDPA called directly, in interleaved loops of this thread's CPU time (no GPU
    work runs in them).  Both of ComfyUI's entries, called as its ``wrap_attn`` calls them:
    ``override(func, ...)`` (0.3.64) and ``container_function`` with q, k and v in containers (0.38; the
    plain side makes and empties the same containers).  The least round of each loop is taken: the
    cost of the code, without what other work on the machine adds to some rounds."""
    kept = attention_sdpa(q, k, v, H)

    def kept_sdpa(q, k, v, heads, **kwargs):
        return kept
    patch = SageAttentionOverride(config, sdpa=kept_sdpa)
    options = {}
    calls = {"plain": lambda: kept_sdpa(q, k, v, H),
             "patched": lambda: patch(attention_sdpa, q, k, v, heads=H, transformer_options=options,
                                      _inside_attn_wrapper=True),
             "plain_containers": lambda: kept_sdpa(Box(q).take(), Box(k).take(), Box(v).take(), H),
             "patched_containers": lambda: patch.container_function(Box(q), Box(k), Box(v), heads=H,
                                                                    transformer_options=options,
                                                                    _inside_attn_wrapper=True)}
    times = {name: [] for name in calls}
    for fn in calls.values():
        fn()
        fn()  # the second call finds the settled shape and remembers it as declined
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.thread_time()
            for _ in range(n):
                fn()
            times[name].append((time.thread_time() - t0) / n * 1e6)
    low = {name: min(t) for name, t in times.items()}
    med = {name: statistics.median(t) for name, t in times.items()}
    return {"plain_call_us": low["plain"],  # the host's own speed: the same Python call costs more on a slower CPU
            "decision_us": low["patched"] - low["plain"],
            "decision_containers_us": low["patched_containers"] - low["plain_containers"],
            "decision_median_us": med["patched"] - med["plain"],
            "decision_containers_median_us": med["patched_containers"] - med["plain_containers"]}


def decision_bound_us(plain_call_us: float) -> float:
    """The most a declined shape's decision may cost on this host.  The decision is Python run on the
    CPU, so its cost grows with the host's speed, measured by the same loop as a plain call of the kept
    SDPA: a host that takes twice :data:`PLAIN_REF_US` for that call may take twice
    :data:`DECISION_MAX_US`.  A faster host keeps :data:`DECISION_MAX_US`."""
    return DECISION_MAX_US * max(1.0, plain_call_us / PLAIN_REF_US)


def decision_over_bound(row: dict, field: str):
    """None where some pass of ``row``'s decision ``field`` kept within the bound of the host's speed in that pass
    (:func:`decision_bound_us` of the plain call timed in the same interleaved loop); else the least pass's
    (decision us, its bound, its plain call us).  The host's speed is taken per pass, not across the table: one
    H200 host ran the plain call at 0.09 us early in the table and at 0.16-0.20 us later, and the decisions timed
    then cost 17x the plain call, as on hosts at 0.08 us."""
    decisions = row.get(field + "_passes", [row[field]])
    plains = row.get("plain_call_us_passes", [row["plain_call_us"]] * len(decisions))
    passes = [(d, decision_bound_us(p), p) for d, p in zip(decisions, plains)]
    if any(d <= bound for d, bound, _ in passes):
        return None
    return min(passes)


def _sdpa_backends() -> str:
    """The baseline's backend order (ComfyUI's), and the process's own order and enabled backends, which a
    plain SDPA call would use."""
    names = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
    get = getattr(torch._C, "_get_sdp_priority_order", None)
    order = ", ".join(names.get(int(b), str(int(b))) for b in get()) if get else "unknown"
    cuda = torch.backends.cuda
    enabled = {"flash": cuda.flash_sdp_enabled(), "efficient": cuda.mem_efficient_sdp_enabled(),
               "cudnn": getattr(cuda, "cudnn_sdp_enabled", lambda: None)(), "math": cuda.math_sdp_enabled()}
    pinned = ", ".join(names[int(b)] for b in COMFY_SDPA_ORDER)
    return (f"SDPA baseline: ComfyUI's backend order ({pinned}); this process's own order: {order}; enabled: "
            + ", ".join(k for k, v in enabled.items() if v))


def _inputs(B, H, NQ, NK, D, dtype):
    """A row's q, k and v ([B, N, H*D]), the same on every call for the same shape."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    return tuple(torch.randn(B, n, H * D, device=DEV, dtype=dtype, generator=gen) for n in (NQ, NK, NK))


def _second_pass(rows) -> None:
    """Measure every declined row's decision again once the whole table has run, and keep the least of the
    two passes: a decision's cost is the code's, and one pass can fall in a stretch where other work on the
    host slows this thread (a first pass of 3.3 us against 1.7 us for the same shape in fp16, next to it).
    Both passes stay in the row."""
    fields = ("decision_us", "decision_containers_us")
    for r in rows:
        again = r.pop("_again", None)
        if again is None:
            continue
        config, (B, H, NQ, NK, D, dtype) = again
        STATE.reset()
        q, k, v = _inputs(B, H, NQ, NK, D, dtype)
        second = _decision_us(config, q, k, v, H)
        del q, k, v
        r["plain_call_us_passes"] = [r["plain_call_us"], second["plain_call_us"]]
        for f in fields:
            r[f + "_passes"] = [r[f], second[f]]
            r[f] = min(r[f], second[f])
        STATE.reset()
        gc.collect()
        torch.cuda.empty_cache()


def _compare(out, ref):
    o, r = out[:, :ROWS].float(), ref[:, :ROWS].float()
    return ((o - r).norm() / r.norm()).item(), F.cosine_similarity(o.flatten(), r.flatten(), dim=0).item()


def _row(name, B, H, NQ, NK, D, dt, tmp_path) -> dict:
    dtype = DTYPES[dt]
    q, k, v = _inputs(B, H, NQ, NK, D, dtype)
    config = PatchConfig(calibration_budget_s=3600.0, cache_dir=str(tmp_path / f"{name}-{dt}"))
    patch = SageAttentionOverride(config, sdpa=comfy_sdpa)
    sdpa = lambda: comfy_sdpa(q, k, v, H)  # noqa: E731
    call = lambda: patch(comfy_sdpa, q, k, v, heads=H, transformer_options={})  # noqa: E731
    call()  # the shape's first calls time it and settle it
    for _ in range(31):
        if not STATE.trials:
            break
        call()
    assert not STATE.trials
    plan = patch.plan(q, k, v, H)
    sdpa_ms, ms = _ab(sdpa, call)
    ref_out, sdpa_peak = peak_extra(sdpa)
    out, peak = peak_extra(call)
    ref32 = _reference(q, k, v, H, ROWS)
    rel, cos = _compare(out, ref_out)
    row = {"shape": name, "B": B, "H": H, "Nq": NQ, "Nk": NK, "D": D, "dtype": dt,
           "served": plan.kernel, "reason": plan.reason, "groups": plan.groups if plan.kernel else None,
           "ms": ms, "sdpa_ms": sdpa_ms, "ratio": sdpa_ms / ms, "peak": peak, "sdpa_peak": sdpa_peak,
           "peak_ratio": peak / sdpa_peak if sdpa_peak else None, "rel_l2": rel, "cos": cos,
           "rel_l2_fp32": _compare(out, ref32)[0], "sdpa_rel_l2_fp32": _compare(ref_out, ref32)[0]}
    del out, ref_out, ref32
    if plan.kernel is None:
        row.update(_decision_us(config, q, k, v, H))
        row["_again"] = (config, (B, H, NQ, NK, D, dtype))  # for the second pass, after the whole table
    else:
        row["call_overhead_us"] = _call_overhead_us(patch, q, k, v, H)
    return row


def _table(rows) -> str:
    head = (f"{'shape':<28} {'dtype':<5} {'runs on':<26} {'x SDPA':>6} {'peak MiB':>9} {'SDPA MiB':>9} "
            f"{'relL2':>7} {'cos':>8} {'relL2 f32':>9} {'SDPA f32':>9} {'us/call':>8} {'us/box':>8}")
    lines = [head]
    for r in rows:
        runs = r["served"] + (f" x{r['groups']}" if r["groups"] and r["groups"] > 1 else "") if r["served"] \
            else f"sdpa ({r['reason']})"
        us = r.get("decision_us", r.get("call_overhead_us"))
        us_c = r.get("decision_containers_us")
        lines.append(f"{r['shape']:<28} {r['dtype']:<5} {runs:<26} {r['ratio']:6.3f} {r['peak'] / 2**20:9.1f} "
                     f"{r['sdpa_peak'] / 2**20:9.1f} {r['rel_l2']:7.4f} {r['cos']:8.5f} {r['rel_l2_fp32']:9.4f} "
                     f"{r['sdpa_rel_l2_fp32']:9.4f} {'-' if us is None else f'{us:8.2f}'} "
                     f"{'-' if us_c is None else f'{us_c:8.2f}'}")
    lines.append("us/call: the decision of a declined shape over plain SDPA (override(func, ...)); everything but the "
                 "kernel on a served one.  us/box: the same decision through container_function")
    plain = [p for r in rows for p in r.get("plain_call_us_passes", [r["plain_call_us"]] if "plain_call_us" in r
                                            else [])]
    if plain:
        lo, hi = min(plain), max(plain)
        lines.append(f"host speed: a plain Python call of the kept SDPA took {lo:.3f}-{hi:.3f} us; a declined "
                     f"shape's decision may add {decision_bound_us(lo):.2f}-{decision_bound_us(hi):.2f} us, by the "
                     f"speed in its own loop")
    return "\n".join(lines)


def test_the_dispatch_table_of_held_out_shapes(tmp_path):
    rows = []
    for name, ((B, H, NQ, NK, D), dtypes) in SHAPES.items():
        for dt in dtypes:
            rows.append(_row(name, B, H, NQ, NK, D, dt, tmp_path))
            STATE.reset()
            gc.collect()
            torch.cuda.empty_cache()
    _second_pass(rows)
    p = kernels.probe()
    print(f"\n{torch.cuda.get_device_name()} (sm{CC}), torch {torch.__version__}, sageattention "
          f"{p.sage_version or 'not installed'}, comfy-kitchen {p.ck_version or 'not installed'}; auto candidates "
          f"{', '.join(AUTO) or 'none'}\n{_sdpa_backends()}\n" + _table(rows))
    target = os.environ.get("WAN_SAGE_GPU_TABLE")
    if target:
        with open(target, "w") as f:
            for r in rows:
                f.write(json.dumps({"gpu": torch.cuda.get_device_name(), "cc": CC, **r}) + "\n")
    problems = []
    for r in rows:
        where = f"{r['shape']} {r['dtype']}"
        if r["served"]:
            if not (r["rel_l2"] <= accuracy.MAX_REL_L2 and r["cos"] >= accuracy.MIN_COSINE):
                problems.append(f"{where}: {r['served']} served an output beyond the bound "
                                f"(rel L2 {r['rel_l2']:.4f}, cosine {r['cos']:.5f})")
            if r["ratio"] < SERVED_MIN_RATIO:
                problems.append(f"{where}: {r['served']} served at {r['ratio']:.3f}x SDPA")
        else:
            if r["rel_l2"] > 1e-3:  # the same SDPA on the same inputs (0 unless the backend is nondeterministic)
                problems.append(f"{where}: declined, yet its output differs from SDPA's (rel L2 {r['rel_l2']:.4f})")
            for entry, field in (("override(func, ...)", "decision_us"),
                                 ("container_function", "decision_containers_us")):
                over = decision_over_bound(r, field)
                if over:
                    problems.append(f"{where}: declined ({r['reason']}), yet the patch adds {over[0]:.2f} us per "
                                    f"call over SDPA through {entry} (bound {over[1]:.2f} us, the host's plain "
                                    f"call {over[2]:.3f} us in the same loop)")
    assert not problems, "\n".join(problems)
