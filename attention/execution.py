"""Run one attention call that passed the static checks, at run time: settle its decision, check
free memory, split it into head groups, run the kernel, fall back to SDPA, check a sample of the
outputs against SDPA (NaN/Inf and accuracy), and count it.

The custom op (:mod:`.op`) calls :func:`run_attention` under ``torch.compile``; in eager mode the
override calls it directly.  Every call that does not run on a kernel runs SDPA here (the
override's ``sdpa``, ComfyUI's own ``attention_pytorch`` inside ComfyUI), with its reason counted.

Decisions (:class:`.state.Decision`) are kept per call key (:class:`.state.CallKey`: patch
options, device, dtype and the :class:`.policy.CallShape`) and settled on the first call, so a
shape does the same thing step after step; per call only free memory is checked.  A call whose
key is settled on SDPA does no run-time work at all: one dict lookup, its count, SDPA
(:func:`settled_sdpa`; the eager override makes the same lookup before it calls in here).
Calibration rejects a kernel whose output on the call is beyond the accuracy bound of
:mod:`.accuracy`.  The rules that change a settled shape:

* **free memory short**: the call splits into more head groups (the fewest that fit), and keeps
  that count from then on; when not even one head per group fits, that call runs on SDPA.
* **out of memory**: the call is redone on SDPA and the shape remembers the memory available
  after the error and what the kernel needed; later calls run on SDPA (reason ``memory``) until
  the available memory has grown by more than that need, then the kernel is tried again.
* **error**: the kernel is not used again on that (device, dtype, head dim); the shape plans
  again without it.
* **wrong output**: the first :data:`CHECK_FIRST_CALLS` calls of each (kernel, shape) and every
  :data:`CHECK_EVERY`-th after that are checked (:func:`.accuracy.check`: NaN/Inf in the whole
  output, and a slice of its query rows against SDPA on the same rows; one host sync each, the
  rest never sync); an output with NaN/Inf (reason ``nonfinite``) or beyond the bound (reason
  ``inaccurate``) is redone on SDPA, and the shape stays on SDPA.
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from . import accuracy, kernels, planning, policy, stats, timing
from .planning import Plan
from .policy import DTYPE_NAMES
from .policy import CallShape
from .state import STATE, CallKey, Decision, FailureKey, OomMemory

__all__ = ["run_attention", "decide", "run_kernel", "call_key", "settled_sdpa", "run_sdpa", "CHECK_FIRST_CALLS",
           "CHECK_EVERY", "fits", "available_bytes"]

log = logging.getLogger("wan_sage")

# The output check's sample: the first calls of each (kernel, call key), then one call in
# CHECK_EVERY, so a kernel that goes wrong is caught within CHECK_EVERY calls of a shape.
CHECK_FIRST_CALLS = 4
CHECK_EVERY = 64

_new = tuple.__new__  # builds a CallKey from its fields in order, without its Python-level __new__


# ------------------------------------------------------------------ free memory
def fits(device, need: int, free_memory) -> bool:
    """Does ``need`` fit?  The driver's free memory first (cheap); torch's cached-but-unused
    memory only when that is not enough."""
    if free_memory is not None:
        return free_memory(device) >= need
    free, _total = torch.cuda.mem_get_info(device)
    if free >= need:
        return True
    return available_bytes(device, None) >= need


def available_bytes(device, free_memory) -> int:
    """Memory a kernel's buffers can get: the driver's free memory plus what torch's allocator holds
    unused and can hand back.  Cached blocks split off a segment that is partly in use
    (``inactive_split_bytes``) are left out: the allocator can release only whole segments, so such a
    block serves only a request that fits in it, and counting it would let a call plan on memory that
    a large buffer cannot get."""
    if free_memory is not None:
        return int(free_memory(device))
    free, _total = torch.cuda.mem_get_info(device)
    allocator = torch.cuda.memory_stats(device)
    unused = allocator.get("reserved_bytes.all.current", 0) - allocator.get("allocated_bytes.all.current", 0)
    return free + max(0, unused - allocator.get("inactive_split_bytes.all.current", 0))


# ------------------------------------------------------------------ decisions
def _plan(decision: Decision, key: CallKey) -> Plan:
    s = key.shape
    return Plan(kernel=decision.kernel, reason=decision.reason, layout=s.layout, out_layout=s.out_layout, B=s.B,
                H=s.H, Nq=s.Nq, Nk=s.Nk, D=s.D, groups=decision.groups, saved_ms=decision.saved_ms, cc=decision.cc,
                need=decision.need, output_copy=decision.output_copy, into_q=decision.into_q, call_key=key)


def _decision_of(choice: planning.Choice, cc: int, shape: CallShape, dtype, margin: int) -> Decision:
    if choice.kernel is None:
        return Decision(None, choice.reason, cc=cc)
    aspec = planning.attn_shape(shape, dtype)
    if shape.into_q:
        # q is handed over: the write-into-q path in the fewest groups within SDPA's bytes, where it exists
        found = planning.into_q_groups(choice.kernel, cc, aspec)
        if found is not None:
            need = planning.need_bytes(choice.kernel, cc, aspec, found.groups, False, margin, True)
            return Decision(choice.kernel, None, found.groups, need, choice.saved_ms, cc, False, True)
    copy = choice.groups == 1 and planning.output_copy(choice.kernel, shape.layout, shape.out_layout)
    need = planning.need_bytes(choice.kernel, cc, aspec, choice.groups, copy, margin)
    return Decision(choice.kernel, None, choice.groups, need, choice.saved_ms, cc, copy)


def _timing_context(ov, info, names, dtype, shape: CallShape):
    """(timing cache, {kernel: cache key}, {kernel: memory-mode groups}) for the candidates of a shape."""
    cfg = ov.config
    cache = planning.timing_cache(cfg.cache_dir)
    dtype_name = DTYPE_NAMES.get(dtype, str(dtype))
    keys = {n: planning.timing_key(info.gpu, info.cc, n, dtype_name, shape.H, shape.D, shape.Nq, shape.Nk)
            for n in names}
    aspec = planning.attn_shape(shape, dtype)
    groups = {n: planning.mode_groups(n, info.cc, aspec, cfg.memory_mode,
                                      planning.output_copy(n, shape.layout, shape.out_layout)).groups for n in names}
    return cache, keys, groups


def _settle(ov, device, key: CallKey, claim: bool):
    """First call of a shape: a settled Decision, or a calibration Plan when the shape is to be
    measured now (within the budget; with ``claim``, the calibration is claimed: once per shape
    and process, whether it then succeeds or not)."""
    cfg = ov.config
    margin = cfg.memory_margin_mb << 20
    shape, dtype = key.shape, key.dtype
    info = planning.device_info(device, key.device_index, cfg.kernel)
    if info.reason:
        decision = Decision(None, "no_kernel", cc=info.cc)
        STATE.settle(key, decision)
        return decision
    names, why = planning.candidates(info, device, key, cfg.self_test)
    if not names:
        decision = Decision(None, why, cc=info.cc)
        STATE.settle(key, decision)
        return decision
    cross = policy.is_cross(shape.Nq, shape.Nk)
    cache, keys, groups = _timing_context(ov, info, names, dtype, shape)
    entries = {n: cache.get(keys[n]) for n in names}
    to_time = tuple(n for n in names if entries[n] is None
                    or (not timing.trusted(entries[n]) and keys[n] not in STATE.timed_here))
    if to_time and cfg.calibrate and _budget_left(ov, shape, to_time, groups) and (
            not claim or STATE.claim_calibration(key)):
        return Plan(kernel=to_time[0], layout=shape.layout, out_layout=shape.out_layout, B=shape.B, H=shape.H,
                    Nq=shape.Nq, Nk=shape.Nk, D=shape.D, calibrate=to_time, cc=info.cc, call_key=key)
    choice = planning.choose(names, {n: e for n, e in entries.items() if e is not None}, groups, cross) \
        or planning.default_choice(names, cross, groups)
    # A calibration finishing in another thread wins over this unmeasured choice.
    return STATE.settle_if_absent(key, _decision_of(choice, info.cc, shape, dtype, margin))


def _budget_left(ov, shape: CallShape, names: tuple, groups: dict) -> bool:
    cfg = ov.config
    runs = 2 * (1 + sum(1 + (cfg.memory_mode == "sdpa" and groups[n] > 1) for n in names))
    estimate = planning.calibration_estimate_s(shape, runs)
    if estimate <= cfg.calibration_budget_s - STATE.calibration_spent_s:
        return True
    if STATE.log_once(("budget", cfg.calibration_budget_s)):
        log.info("wan-sage: calibration budget (%.0f s) used up; unmeasured shapes use the default rule (Sage "
                 "for self-attention, SDPA for cross-attention). `wan-sage bench` measures the Wan shapes ahead "
                 "of time.", cfg.calibration_budget_s)
    return False


def call_key(ov, q, shape: CallShape) -> CallKey:
    """The :class:`.state.CallKey` of a call of ``ov`` on q: q's device index (0 for a CPU
    tensor, as :func:`.kernels.device_index` normalises it), dtype and ``shape``."""
    index = q.get_device()
    return _new(CallKey, (ov.config_key, index if index >= 0 else 0, q.dtype, shape))


def settled_sdpa(key: CallKey) -> str | None:
    """The reason when ``key`` is settled on SDPA (a settled SDPA decision stays until the state
    is reset), else None.  One dict lookup, without the lock."""
    decision = STATE.decisions.get(key)
    if decision is not None and decision.kernel is None:
        return decision.reason
    return None


def decide(ov, q, shape: CallShape, claim: bool = True) -> Plan:
    """The plan for one call (no kernel runs here, except a kernel's one-time self-test).
    ``claim=False`` reports a pending calibration without claiming it (a dry run)."""
    return _decide(ov, q.device, call_key(ov, q, shape), claim)


def _decide(ov, device, key: CallKey, claim: bool) -> Plan:
    decision = STATE.decisions.get(key)
    if decision is None:
        decision = _settle(ov, device, key, claim)
        if isinstance(decision, Plan):
            return decision
    if decision.kernel is None:
        return _plan(decision, key)
    return _fit_memory(ov, device, key, decision)


def _fit_memory(ov, device, key: CallKey, decision: Decision) -> Plan:
    oom = STATE.ooms.get(key)
    if oom is not None:
        if available_bytes(device, ov.free_memory) < oom.available + oom.need:
            return _plan(Decision(None, "memory", cc=decision.cc), key)
        STATE.forget_oom(key)
    if fits(device, decision.need, ov.free_memory):
        return _plan(decision, key)
    margin = ov.config.memory_margin_mb << 20
    found = planning.more_groups(decision.kernel, decision.cc, planning.attn_shape(key.shape, key.dtype),
                                 decision.groups, available_bytes(device, ov.free_memory), margin, decision.into_q)
    if found is None:
        return _plan(Decision(None, "memory", cc=decision.cc), key)
    groups, need = found
    decision = dataclasses.replace(decision, groups=groups, need=need, output_copy=False)
    STATE.settle(key, decision)
    return _plan(decision, key)


# ------------------------------------------------------------------ running
def _views(q, k, v, plan: Plan):
    if plan.layout == "NHD":
        return (q.reshape(plan.B, plan.Nq, plan.H, plan.D), k.reshape(plan.B, plan.Nk, plan.H, plan.D),
                v.reshape(plan.B, plan.Nk, plan.H, plan.D))
    return q, k, v


def _to_caller_layout(out, layout: str, out_layout: str):
    B, H, Nq, D = (out.shape[0], out.shape[2], out.shape[1], out.shape[3]) if layout == "NHD" else out.shape
    if layout != out_layout:
        out = out.transpose(1, 2)
    out = out.contiguous()
    if out_layout == "NHD":
        return out.reshape(B, Nq, H * D)
    return out


def _head_spans(heads: int, groups: int) -> list:
    """[(h0, h1), ...]: the heads of each of ``groups`` head groups, ``ceil(heads / groups)`` to a group."""
    per_group = -(-heads // groups)
    return [(h0, min(heads, h0 + per_group)) for h0 in range(0, heads, per_group)]


def _run_split(name: str, q4, k4, v4, layout: str, out_layout: str, groups: int, scale, cc: int):
    """The call in ``groups`` head groups.  The full output is allocated once, in the caller's
    layout, and each group's output is copied into it and freed: peak = full output + one
    group's kernel bytes (:func:`.head_groups.split_bytes`)."""
    if layout == "NHD":
        B, Nq, H, D = q4.shape
    else:
        B, H, Nq, D = q4.shape
    full = (B, Nq, H, D) if out_layout == "NHD" else (B, H, Nq, D)
    out = torch.empty(full, dtype=q4.dtype, device=q4.device)
    target = out if layout == out_layout else out.transpose(1, 2)
    head_dim = 2 if layout == "NHD" else 1
    for h0, h1 in _head_spans(H, groups):
        index = [slice(None)] * 4
        index[head_dim] = slice(h0, h1)
        index = tuple(index)
        part = kernels.run(name, q4[index], k4[index], v4[index], layout, scale, cc)
        target[index].copy_(part)
        del part
    if out_layout == "NHD":
        return out.reshape(B, Nq, H * D)
    return out


def run_kernel(name: str, q4, k4, v4, layout: str, out_layout: str, groups: int, scale, cc: int):
    """Kernel ``name`` on q4/k4/v4 (``layout`` "NHD" [B, N, H, D] or "HND" [B, H, N, D]) in
    ``groups`` head groups (1: one direct call); the output in the caller's ``out_layout``
    ("NHD": [B, N, H*D]; "HND": [B, H, N, D]), contiguous."""
    if groups <= 1:
        return _to_caller_layout(kernels.run(name, q4, k4, v4, layout, scale, cc), layout, out_layout)
    return _run_split(name, q4, k4, v4, layout, out_layout, groups, scale, cc)


def run_sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale):
    """The call on the override's SDPA, in the caller's layout (contiguous); not counted."""
    if scale is None:
        out = ov.sdpa(q, k, v, heads, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    else:
        out = ov.sdpa(q, k, v, heads, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                      scale=scale)
    return out.contiguous()


def _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, reason, fallback=None, calibration_ms=0.0):
    stats.record(ov.patch_id, reason=reason, fallback=fallback, calibration_ms=calibration_ms)
    return run_sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale)


def _check_output(out, ref: accuracy.Reference) -> accuracy.Verdict:
    """The output check of one call (:func:`.accuracy.check`): one host sync."""
    return accuracy.check(out, ref)


def _check_due(name: str, key: CallKey) -> bool:
    n = STATE.count_call((name, key))
    return n <= CHECK_FIRST_CALLS or n % CHECK_EVERY == 0


def _measured(verdict: accuracy.Verdict) -> str:
    if verdict.failure == "nonfinite":
        return "NaN/Inf in its output"
    return (f"relative L2 {verdict.rel_l2:.3g} and cosine {verdict.cosine:.4f} on {accuracy.CHECK_ROWS} query rows "
            f"(the bound: {accuracy.bound_text()})")


def _log_rejected(name: str, key: CallKey, failure: str, measured: str, what: str) -> None:
    if STATE.log_once(("rejected", name, key)):
        s = key.shape
        log.warning("wan-sage: %s's output differed from SDPA's on attention [B=%d, H=%d, Nq=%d, Nk=%d, D=%d] (%s: "
                    "%s); %s", name, s.B, s.H, s.Nq, s.Nk, s.D, failure, measured, what)


def _reject(plan: Plan, name: str, verdict: accuracy.Verdict) -> None:
    """A checked output of ``name`` failed: the shape settles on SDPA for the failure's reason."""
    STATE.reject(name, plan.call_key, verdict.failure)
    STATE.settle(plan.call_key, Decision(None, verdict.failure, cc=plan.cc))
    _log_rejected(name, plan.call_key, verdict.failure, _measured(verdict),
                  "that call was redone on SDPA and this shape stays on SDPA.")


def _remember_failure(plan: Plan, name: str, text: str) -> None:
    key = FailureKey(plan.call_key.device_index, name, plan.call_key.dtype, plan.D)
    STATE.mark_failed(key, text)
    if STATE.log_once(("error", key)):
        log.warning("wan-sage: %s raised %s; SDPA serves its shapes with this dtype and head dim from now on.",
                    name, text)


def run_attention(ov, q, k, v, heads: int, skip_reshape: bool, skip_output_reshape: bool, scale, shape=None,
                  key=None):
    """The output of one statically eligible call, in the caller's layout (contiguous).
    ``shape``: the call's :func:`.policy.call_shape`, when the caller has it already; ``key``: its
    :func:`call_key`, when the caller has it and has found it not settled on SDPA."""
    if key is None:
        if shape is None:
            shape = policy.call_shape(q, k, heads, skip_reshape, skip_output_reshape)
        key = call_key(ov, q, shape)
        reason = settled_sdpa(key)
        if reason is not None:
            stats.count_sdpa(ov.patch_id, reason)
            return run_sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale)
    plan = _decide(ov, q.device, key, True)
    if plan.calibrate:
        return _calibrate(ov, plan, q, k, v, heads, skip_reshape, skip_output_reshape, scale)
    if plan.kernel is None:
        return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, plan.reason)
    name = plan.kernel
    q4, k4, v4 = _views(q, k, v, plan)
    if plan.into_q:
        return _run_into_q(ov, plan, q, k, v, q4, k4, v4, heads, skip_reshape, skip_output_reshape, scale)
    oom_error = kernels.out_of_memory_error()
    failure = None
    try:
        out = run_kernel(name, q4, k4, v4, plan.layout, plan.out_layout, plan.groups, scale, plan.cc)
    except oom_error:
        failure = "oom"
    except Exception as e:  # charged to this kernel on this (device, dtype, head dim)
        failure = "error"
        _remember_failure(plan, name, f"{type(e).__name__}: {e}")
    if failure == "oom":
        out = None
        STATE.remember_oom(plan.call_key, OomMemory(available_bytes(q.device, ov.free_memory), plan.need))
        if STATE.log_once(("oom", plan.call_key)):
            log.warning("wan-sage: %s ran out of memory on attention [B=%d, H=%d, Nq=%d, Nk=%d, D=%d]; the call was "
                        "redone on SDPA, and SDPA serves this shape until free memory grows by what the kernel "
                        "needs (%.2f GiB).", name, plan.B, plan.H, plan.Nq, plan.Nk, plan.D, plan.need / 2**30)
    if failure:
        return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, failure, fallback=failure)
    if ov.config.check_finite and _check_due(name, plan.call_key):
        verdict = _check_output(out, accuracy.reference(q4, k4, v4, plan.layout, plan.out_layout, scale))
        if verdict.failure is not None:
            out = None
            _reject(plan, name, verdict)
            return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, verdict.failure,
                         fallback=verdict.failure)
    stats.record(ov.patch_id, kernel=name, split=plan.groups > 1, saved_ms=plan.saved_ms)
    return out


def _sdpa_into_q(q4, k4, v4, h0: int, scale) -> None:
    """SDPA on heads ``h0:`` of q4/k4/v4 ([B, N, H, D]), written into those heads of q4."""
    q_h, k_h, v_h = (t[:, :, h0:].transpose(1, 2) for t in (q4, k4, v4))
    out = torch.nn.functional.scaled_dot_product_attention(q_h, k_h, v_h, scale=scale)
    q4[:, :, h0:].copy_(out.transpose(1, 2))


def _run_into_q(ov, plan: Plan, q, k, v, q4, k4, v4, heads, skip_reshape, skip_output_reshape, scale):
    """A call whose q was handed over, on the kernel's write-into-q path: head group by head group, each
    group's output written into its heads of q, so the call allocates no output and peaks at one group's
    quantised q, k and V (:func:`.head_groups.into_q_groups`: at or below SDPA's bytes).  Returns q.

    The output check cannot redo the call on SDPA once q is overwritten, so a call that is due a check
    runs the same path first on a copy of :data:`.accuracy.CHECK_ROWS` query rows with all of k and v,
    and compares those rows with SDPA's; a failure settles the shape on SDPA, and this call runs there
    with q intact.  A kernel that raises (or runs out of memory) in a group leaves that group's heads
    of q unwritten: SDPA finishes them and the heads after them, so the output is whole."""
    name = plan.kernel
    try:
        shared = kernels.into_q_shared(name, k4)
    except Exception as e:  # nothing of q was written
        failure = "oom" if isinstance(e, kernels.out_of_memory_error()) else "error"
        if failure == "error":
            _remember_failure(plan, name, f"{type(e).__name__}: {e}")
        return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, failure, fallback=failure)
    if ov.config.check_finite and _check_due(name, plan.call_key):
        ref = accuracy.reference(q4, k4, v4, "NHD", "NHD", scale)
        probe = q4.index_select(1, ref.rows)
        try:
            for h0, h1 in _head_spans(plan.H, plan.groups):
                kernels.run_into_q(name, probe, k4, v4, scale, h0, h1, shared)
            B, R, H, D = probe.shape
            verdict = _check_output(probe.reshape(B, R, H * D),
                                    accuracy.Reference(torch.arange(R, device=probe.device), ref.output, "NHD"))
        except Exception as e:  # raised on the probe: nothing of q was written
            del probe
            failure = "oom" if isinstance(e, kernels.out_of_memory_error()) else "error"
            if failure == "error":
                _remember_failure(plan, name, f"{type(e).__name__}: {e}")
            return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, failure, fallback=failure)
        del probe
        if verdict.failure is not None:
            _reject(plan, name, verdict)
            return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, verdict.failure,
                         fallback=verdict.failure)
    for h0, h1 in _head_spans(plan.H, plan.groups):
        try:
            kernels.run_into_q(name, q4, k4, v4, scale, h0, h1, shared)
        except Exception as e:
            failure = "oom" if isinstance(e, kernels.out_of_memory_error()) else "error"
            if failure == "oom":
                STATE.remember_oom(plan.call_key, OomMemory(available_bytes(q.device, ov.free_memory), plan.need))
            else:
                _remember_failure(plan, name, f"{type(e).__name__}: {e}")
            _sdpa_into_q(q4, k4, v4, h0, scale)
            stats.record(ov.patch_id, reason=failure, fallback=failure)
            return q
    stats.record(ov.patch_id, kernel=name, split=plan.groups > 1, saved_ms=plan.saved_ms)
    return q


# ------------------------------------------------------------------ calibration
def _variants(ov, plan: Plan, groups: dict, q4, k4, v4, scale) -> list:
    """What calibration times per kernel: the ungrouped call, and the memory mode's split."""
    cfg = ov.config
    aspec = planning.attn_shape(plan.call_key.shape, q4.dtype)
    variants = []
    for name in plan.calibrate:
        counts = [1] + ([groups[name]] if cfg.memory_mode == "sdpa" and groups[name] > 1 else [])
        for count in counts:
            copy = count == 1 and planning.output_copy(name, plan.layout, plan.out_layout)
            need = planning.need_bytes(name, plan.cc, aspec, count, copy, cfg.memory_margin_mb << 20)
            variants.append(timing.Variant(name, count, need, lambda n=name, c=count: run_kernel(
                n, q4, k4, v4, plan.layout, plan.out_layout, c, scale, plan.cc)))
    return variants


def _record(ov, plan: Plan, result: timing.Calibration, variants: list, cache, keys: dict, groups: dict, device,
            dtype) -> None:
    """Charge errors to the kernels that raised, reject on this call key the kernels whose output
    failed the check, cache the timings, and remember an out-of-memory error when no variant could
    be timed."""
    measured = {}
    for trial in result.trials:
        if trial.failure == "error":
            _remember_failure(plan, trial.kernel, trial.error)
        elif trial.failure in ("inaccurate", "nonfinite"):
            STATE.reject(trial.kernel, plan.call_key, trial.failure)
            _log_rejected(trial.kernel, plan.call_key, trial.failure, trial.error,
                          "calibration rejected it: another candidate or SDPA serves this shape.")
        elif trial.ms is not None:
            measured.setdefault(trial.kernel, {})[trial.groups] = trial.ms
    for name, times in measured.items():
        count, grouped_ms = next(((c, ms) for c, ms in times.items() if c > 1), (groups[name], None))
        cache.put(keys[name], times.get(1), result.sdpa_ms, plan.Nq, plan.Nk, save=False, grouped_ms=grouped_ms,
                  groups=count)
    cache.save()
    STATE.add_timed(keys[n] for n in measured)
    ran_out = {(t.kernel, t.groups) for t in result.trials if t.failure == "oom"}
    if ran_out and not measured:
        need = min(v.need for v in variants if (v.kernel, v.groups) in ran_out)
        STATE.remember_oom(plan.call_key, OomMemory(available_bytes(device, ov.free_memory), need))


def _settle_measured(ov, plan: Plan, info, device, dtype) -> planning.Choice:
    """Settle the shape from every candidate that may still run and its cache entry, old or new."""
    cfg = ov.config
    shape = plan.call_key.shape
    names, why = planning.candidates(info, device, plan.call_key, cfg.self_test)
    if names:
        cache, keys, groups = _timing_context(ov, info, names, dtype, shape)
        entries = {n: e for n in names if (e := cache.get(keys[n])) is not None}
        cross = policy.is_cross(plan.Nq, plan.Nk)
        choice = planning.choose(names, entries, groups, cross) or planning.default_choice(names, cross, groups)
    else:
        choice = planning.Choice(None, reason=why)
    STATE.settle(plan.call_key, _decision_of(choice, plan.cc, shape, dtype, cfg.memory_margin_mb << 20))
    return choice


def _calibrate(ov, plan: Plan, q, k, v, heads, skip_reshape, skip_output_reshape, scale):
    """Time the unmeasured kernels (ungrouped, and in the memory mode's head groups) and SDPA on
    this call, cache the timings, settle the shape, and return the output that the settling rule
    favours (SDPA's unless a kernel beat it).  Each kernel's output is checked against SDPA on a
    slice of the call's query rows before it is timed (:mod:`.accuracy`): one beyond the bound is
    rejected on this shape.  The time spent is charged to the budget whatever happens; a kernel
    that raises is charged to itself; a variant that would not fit in free memory is not timed."""
    cfg = ov.config
    info = planning.device_info(q.device, plan.call_key.device_index, cfg.kernel)
    cache, keys, groups = _timing_context(ov, info, plan.calibrate, q.dtype, plan.call_key.shape)
    views = _views(q, k, v, plan)
    variants = _variants(ov, plan, groups, *views, scale)
    sdpa_kwargs = {"skip_reshape": skip_reshape, "skip_output_reshape": skip_output_reshape}
    if scale is not None:
        sdpa_kwargs["scale"] = scale

    def check(out):
        verdict = accuracy.check(out, ref)
        return verdict.failure, _measured(verdict)
    t0 = time.perf_counter()
    try:
        ref = accuracy.reference(*views, plan.layout, plan.out_layout, scale)
        result = timing.calibrate(variants, lambda: ov.sdpa(q, k, v, heads, **sdpa_kwargs),
                                  lambda need: fits(q.device, need, ov.free_memory), kernels.out_of_memory_error(),
                                  timing.time_cuda, check)
    finally:
        spent = time.perf_counter() - t0
        STATE.charge_calibration(spent)
    _record(ov, plan, result, variants, cache, keys, groups, q.device, q.dtype)
    log.info("wan-sage: calibrated %s on %s for [B=%d, H=%d, Nq=%d, Nk=%d, D=%d] in %.2f s: SDPA %.2f ms, %s",
             DTYPE_NAMES.get(q.dtype), info.gpu, plan.B, plan.H, plan.Nq, plan.Nk, plan.D, spent, result.sdpa_ms,
             ", ".join(f"{t.kernel}/{t.groups} " + (f"{t.ms:.2f} ms" if t.ms is not None else t.failure)
                       for t in result.trials) or "no kernel timed")
    choice = _settle_measured(ov, plan, info, q.device, q.dtype)
    calibration_ms = spent * 1000
    source = result.output_from
    if source is None:
        failures = [t.failure for t in result.trials if t.failure in ("oom", "error", "inaccurate", "nonfinite")]
        reason = failures[0] if failures else (choice.reason if choice.kernel is None else "memory")
        stats.record(ov.patch_id, reason=reason, fallback=failures[0] if failures else None,
                     calibration_ms=calibration_ms)
        return result.output.contiguous()
    out = result.output
    if cfg.check_finite and _check_due(source.kernel, plan.call_key):
        verdict = _check_output(out, ref)
        if verdict.failure is not None:
            out = None
            _reject(plan, source.kernel, verdict)
            return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, verdict.failure,
                         fallback=verdict.failure, calibration_ms=calibration_ms)
    stats.record(ov.patch_id, kernel=source.kernel, split=source.groups > 1,
                 saved_ms=max(0.0, result.sdpa_ms - source.ms), calibration_ms=calibration_ms)
    return out
