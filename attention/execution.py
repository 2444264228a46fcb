"""Run one attention call that passed the static checks, at run time: settle its decision, check
free memory, split it into head groups, run the kernel, fall back to SDPA, check a sample of the
outputs against SDPA (NaN/Inf and accuracy), and count it.

The custom op (:mod:`.op`) calls :func:`run_attention` under ``torch.compile``; in eager mode the
override calls it directly.  Every call that does not run on a kernel runs SDPA here (the
override's ``sdpa``, ComfyUI's own ``attention_pytorch`` inside ComfyUI), with its reason counted.

Decisions (:class:`.state.Decision`) are kept per call key (:class:`.state.CallKey`: patch
options, device, dtype and the :class:`.policy.CallShape`) and settled by its first calls, so a
shape does the same thing step after step; per call only free memory is checked.  A call whose
key is settled on SDPA does no run-time work at all: one dict lookup, its count, SDPA
(:func:`settled_sdpa`; the eager override makes the same lookup before it calls in here).
A new shape is timed on its own first calls (:func:`_trial_call`): each runs one kernel variant or
SDPA for its output, so the timing runs nothing extra; a kernel whose first output there is beyond
the accuracy bound of :mod:`.accuracy` is rejected on the shape.  The rules that change a settled shape:

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


def _to_time(names, entries: dict, keys: dict) -> tuple:
    """The candidates a shape's first calls measure: no timing cached, or one measured fewer times than
    it is trusted at and not by this process."""
    return tuple(n for n in names if entries[n] is None
                 or (not timing.trusted(entries[n]) and keys[n] not in STATE.timed_here))


def _choice(names, entries: dict, groups: dict, shape: CallShape) -> planning.Choice:
    """The choice among ``names`` from their cache ``entries`` (None: not measured), or, where none is
    measured, the registry's unmeasured one."""
    cross = policy.is_cross(shape.Nq, shape.Nk)
    measured = {n: e for n, e in entries.items() if e is not None}
    return planning.choose(names, measured, groups, cross) or planning.default_choice(names, cross, groups)


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
    names, why = planning.candidates(info, device, key, cfg.self_test, cache_dir=cfg.cache_dir)
    if not names:
        decision = Decision(None, why, cc=info.cc)
        STATE.settle(key, decision)
        return decision
    trial = STATE.trials.get(key)
    if trial is not None:  # the shape is being timed on its calls: this call takes the next step
        return _trial_plan(shape, trial.kernels, info.cc, key)
    cache, keys, groups = _timing_context(ov, info, names, dtype, shape)
    entries = {n: cache.get(keys[n]) for n in names}
    to_time = _to_time(names, entries, keys)
    if to_time and cfg.calibrate and _budget_left(ov, shape, to_time, groups):
        if not claim:
            return _trial_plan(shape, to_time, info.cc, key)
        trial = timing.ShapeTrial(timing.schedule(_variants(cfg, to_time, groups)))
        if STATE.claim_calibration(key, trial):
            return _trial_plan(shape, to_time, info.cc, key)
    choice = _choice(names, entries, groups, shape)
    # A calibration finishing in another thread wins over this unmeasured choice.
    return STATE.settle_if_absent(key, _decision_of(choice, info.cc, shape, dtype, margin))


def first_decision(ov, device, dtype, shape: CallShape) -> Decision | None:
    """The decision the calls of ``shape`` on ``device`` run with, worked out without running a kernel: the
    settled one, or, before the first call, the one that call will settle from the timing cache.  A
    candidate's self-test counts as passed where this process passed it or, while its own runs (the patch's
    warm-up starts it when the patch is applied), where the timing cache keeps a pass of the same GPU, build
    and software.  None where the first call will measure first (a candidate without a trusted timing while
    calibration is on; its timed calls run ungrouped) or where a candidate's verdict is unknown.  Free
    memory short at the call can still split it further (:func:`_fit_memory`), never less."""
    device = torch.device(device)
    index = kernels.device_index(device)
    key = _new(CallKey, (ov.config_key, index, dtype, shape))
    decision = STATE.decisions.get(key)
    if decision is not None:
        return decision
    if key in STATE.trials:
        return None
    cfg = ov.config
    info = STATE.devices.get((index, cfg.kernel)) or planning.device_info(device, index, cfg.kernel)
    if info.reason:
        return Decision(None, "no_kernel", cc=info.cc)
    names, why = planning.candidates(info, device, key, cfg.self_test, run_self_test=False,
                                     cache_dir=cfg.cache_dir)
    if names is None:
        return None
    if not names:
        return Decision(None, why, cc=info.cc)
    cache, keys, groups = _timing_context(ov, info, names, dtype, shape)
    entries = {n: cache.get(keys[n]) for n in names}
    if cfg.calibrate and _to_time(names, entries, keys):
        return None
    return _decision_of(_choice(names, entries, groups, shape), info.cc, shape, dtype, cfg.memory_margin_mb << 20)


def _trial_plan(shape: CallShape, names: tuple, cc: int, key: CallKey) -> Plan:
    return Plan(kernel=names[0], layout=shape.layout, out_layout=shape.out_layout, B=shape.B, H=shape.H,
                Nq=shape.Nq, Nk=shape.Nk, D=shape.D, calibrate=tuple(names), cc=cc, call_key=key)


def _variants(cfg, names: tuple, groups: dict) -> list:
    """What a shape's timing measures per kernel: the ungrouped call, and the memory mode's split."""
    return [(n, count) for n in names
            for count in [1] + ([groups[n]] if cfg.memory_mode == "sdpa" and groups[n] > 1 else [])]


def _budget_left(ov, shape: CallShape, names: tuple, groups: dict) -> bool:
    """Whether the process's timing budget has room for this shape's checks and host syncs (estimated
    from its steps; the calls themselves run either way)."""
    cfg = ov.config
    runs = len(timing.schedule(_variants(cfg, names, groups)))
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
        return _trial_call(ov, plan, q, k, v, heads, skip_reshape, skip_output_reshape, scale)
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


# ------------------------------------------------------------------ timing a shape on its calls
def _trial_call(ov, plan: Plan, q, k, v, heads, skip_reshape, skip_output_reshape, scale):
    """One of a shape's first calls, while the shape is timed (:class:`.timing.ShapeTrial`): it runs
    the trial's next step, a kernel variant or SDPA, for its own output, timed with CUDA events
    (nothing waits for them until the trial ends).  A variant's first run is checked against SDPA on
    a slice of the call's query rows (:mod:`.accuracy`), and its later runs as the output check
    samples any kernel call; a variant that does not fit in free memory, runs out of memory, raises
    or fails the check gives the call to SDPA and loses its remaining steps.  The call that ends the
    trial caches the timings and settles the shape (:func:`_end_trial`)."""
    key = plan.call_key
    trial = STATE.trials.get(key)
    step = trial.take() if trial is not None else None
    if step is None:  # another thread ended the trial a moment ago
        return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, "timing")
    try:
        if step.kernel is None:
            timer = timing.timer() if step.timed else None
            out = run_sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale)
            if timer is not None:
                timer.stop()
        else:
            out, timer, failure, error, spent = _trial_kernel(ov, plan, step, q, k, v, scale)
    except BaseException:  # an interrupt: the step is over, untimed, so the trial can still end
        if trial.done(step):
            _end_trial(ov, plan, trial, q)
        raise
    if step.kernel is None:
        stats.record(ov.patch_id, reason="timing")
        if trial.done(step, timer):
            _end_trial(ov, plan, trial, q)
        return out
    if failure is None:
        stats.record(ov.patch_id, kernel=step.kernel, split=step.groups > 1, calibration_ms=spent * 1000)
    if trial.done(step, timer, failure, error, whole_kernel=failure not in (None, "memory", "oom"),
                  need=_need(ov, plan, step, q.dtype) if failure == "oom" else 0):
        _end_trial(ov, plan, trial, q)
    if failure is None:
        return out
    return _sdpa(ov, q, k, v, heads, skip_reshape, skip_output_reshape, scale, failure,
                 fallback=None if failure == "memory" else failure, calibration_ms=spent * 1000)


def _need(ov, plan: Plan, step, dtype) -> int:
    copy = step.groups == 1 and planning.output_copy(step.kernel, plan.layout, plan.out_layout)
    return planning.need_bytes(step.kernel, plan.cc, planning.attn_shape(plan.call_key.shape, dtype), step.groups,
                               copy, ov.config.memory_margin_mb << 20)


def _trial_kernel(ov, plan: Plan, step, q, k, v, scale) -> tuple:
    """(output or None, timer, failure, what failed, seconds the check took) of a kernel step."""
    name, key = step.kernel, plan.call_key
    if not fits(q.device, _need(ov, plan, step, q.dtype), ov.free_memory):
        return None, None, "memory", None, 0.0
    q4, k4, v4 = _views(q, k, v, plan)
    timer = timing.timer() if step.timed else None
    try:
        out = run_kernel(name, q4, k4, v4, plan.layout, plan.out_layout, step.groups, scale, plan.cc)
    except kernels.out_of_memory_error():
        return None, None, "oom", None, 0.0
    except Exception as e:  # charged to this kernel on this (device, dtype, head dim)
        text = f"{type(e).__name__}: {e}"
        _remember_failure(plan, name, text)
        return None, None, "error", text, 0.0
    if timer is not None:
        timer.stop()
    due = _check_due(name, key)
    if step.timed and not (ov.config.check_finite and due):
        return out, timer, None, None, 0.0
    t0 = time.perf_counter()
    verdict = _check_output(out, accuracy.reference(q4, k4, v4, plan.layout, plan.out_layout, scale))
    spent = time.perf_counter() - t0
    STATE.charge_calibration(spent)
    if verdict.failure is None:
        return out, timer, None, None, spent
    del out
    STATE.reject(name, key, verdict.failure)
    _log_rejected(name, key, verdict.failure, _measured(verdict),
                  "that call was redone on SDPA, and another candidate or SDPA serves this shape.")
    return None, None, verdict.failure, _measured(verdict), spent


def _end_trial(ov, plan: Plan, trial, q) -> None:
    """Cache the trial's timings, settle the shape from them, and log what was measured; an
    out-of-memory error is remembered when no variant could be timed."""
    t0 = time.perf_counter()
    key = plan.call_key
    info = planning.device_info(q.device, key.device_index, ov.config.kernel)
    try:
        sdpa_ms, trials = trial.result()
        names = tuple(dict.fromkeys(t.kernel for t in trials))
        cache, keys, groups = _timing_context(ov, info, names, q.dtype, key.shape)
        measured = {}
        for t in trials:
            if t.ms is not None:
                measured.setdefault(t.kernel, {})[t.groups] = t.ms
        if sdpa_ms is not None:
            for name, times in measured.items():
                count, grouped_ms = next(((c, ms) for c, ms in times.items() if c > 1), (groups[name], None))
                cache.put(keys[name], times.get(1), sdpa_ms, plan.Nq, plan.Nk, save=False, grouped_ms=grouped_ms,
                          groups=count)
            cache.save()
            STATE.add_timed(keys[n] for n in measured)
        ran_out = [t for t in trials if t.failure == "oom"]
        if ran_out and not measured:
            STATE.remember_oom(key, OomMemory(available_bytes(q.device, ov.free_memory), min(t.need for t in ran_out)))
        choice = _settle_measured(ov, plan, info, q.device, q.dtype)
    finally:
        STATE.end_trial(key)
        spent = time.perf_counter() - t0
        STATE.charge_calibration(spent)
        stats.add_calibration(ov.patch_id, spent * 1000)
    log.info("wan-sage: timed %s on %s for [B=%d, H=%d, Nq=%d, Nk=%d, D=%d] on its first calls: SDPA %s, %s; "
             "%s", DTYPE_NAMES.get(q.dtype), info.gpu, plan.B, plan.H, plan.Nq, plan.Nk, plan.D,
             "not timed" if sdpa_ms is None else f"{sdpa_ms:.2f} ms",
             ", ".join(f"{t.kernel}/{t.groups} " + (f"{t.ms:.2f} ms" if t.ms is not None else t.failure)
                       for t in trials) or "no kernel timed",
             f"serves {choice.kernel} in {_groups_text(key, choice)}" if choice.kernel else f"SDPA ({choice.reason})")


def _groups_text(key: CallKey, choice) -> str:
    decision = STATE.decisions.get(key)
    groups = decision.groups if decision is not None and decision.kernel else choice.groups
    return f"{groups} head group(s)"


def _settle_measured(ov, plan: Plan, info, device, dtype) -> planning.Choice:
    """Settle the shape from every candidate that may still run and its cache entry, old or new."""
    cfg = ov.config
    shape = plan.call_key.shape
    names, why = planning.candidates(info, device, plan.call_key, cfg.self_test, cache_dir=cfg.cache_dir)
    if names:
        cache, keys, groups = _timing_context(ov, info, names, dtype, shape)
        choice = _choice(names, {n: cache.get(keys[n]) for n in names}, groups, shape)
    else:
        choice = planning.Choice(None, reason=why)
    STATE.settle(plan.call_key, _decision_of(choice, plan.cc, shape, dtype, cfg.memory_margin_mb << 20))
    return choice
