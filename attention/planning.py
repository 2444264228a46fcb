"""Which kernel serves a call shape, and in how many head groups: the kernels a device offers,
the candidates the registry's declared constraints (dtypes, head dims) and the self-test allow,
the memory mode's group count, and the choice from measured timings (or the default rule).

Nothing here runs a kernel except the one-time self-test, which runs outside the state lock.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import head_groups, kernel_bytes, kernels, registry, selftest, timing
from .policy import DTYPE_NAMES, CallShape
from .registry import KERNELS
from .state import STATE, CallKey, FailureKey, SelfTestKey

__all__ = ["Plan", "DeviceInfo", "Choice", "device_info", "kernel_build", "timing_cache", "timing_key",
           "self_test_key", "candidates", "prepare", "attn_shape", "output_copy", "mode_groups", "need_bytes",
           "into_q_groups", "more_groups", "choose", "default_choice", "calibration_estimate_s"]

log = logging.getLogger("wan_sage")

# How long a thread waits for another thread's self-test of the same kernel before it treats
# the kernel as unusable for its call.
SELF_TEST_WAIT_S = 120.0
UNTESTED = object()  # no self-test verdict yet (candidates without running one)


@dataclass(kw_only=True)
class Plan:
    """What one call will do: a kernel with its head groups, or SDPA for ``reason``, or a
    calibration of ``calibrate`` (kernel names) against SDPA.  Built by keywords only."""

    kernel: str | None  # None: SDPA
    reason: str | None = None
    layout: str = "NHD"
    B: int = 0
    H: int = 0
    Nq: int = 0
    Nk: int = 0
    D: int = 0
    groups: int = 1
    calibrate: tuple = ()
    saved_ms: float = 0.0
    cc: int = 0
    need: int = 0  # bytes checked free before the call
    out_layout: str = "NHD"
    output_copy: bool = False
    into_q: bool = False  # the kernel writes the output into q's memory, group by group
    call_key: CallKey | None = None


@dataclass(frozen=True)
class DeviceInfo:
    cc: int
    gpu: str
    candidates: tuple  # available kernel names, auto order (self-test pending)
    reason: str | None  # why there is none


@dataclass(frozen=True)
class Choice:
    kernel: str | None
    groups: int = 1
    saved_ms: float = 0.0
    reason: str | None = None


def device_info(device, index: int, choice: str) -> DeviceInfo:
    """The kernels ``choice`` ("auto" or a kernel name) can use on a CUDA device, found once."""
    key = (index, choice)
    found = STATE.devices.get(key)
    if found is not None:
        return found
    cc = kernels.device_cc(device)
    gpu = torch.cuda.get_device_name(device)
    probe = kernels.probe()
    if choice == "auto":
        names = kernels.auto_candidates(cc)
        reason = None if names else (
            f"no quantised attention kernel is usable on {gpu} (sm{cc}): "
            f"sageattention: {probe.sage_error or probe.sage_version}; comfy-kitchen: "
            f"{probe.ck_error or 'no kernel for this GPU'}. " + registry.install_hint())
    else:
        why = kernels.unavailable_reason(choice, cc)
        names, reason = ((), why) if why else ((choice,), None)
    info = DeviceInfo(cc, gpu, names, reason)
    STATE.set_device(key, info)
    if reason:
        if STATE.log_once(("nokernel", key)):
            log.warning("wan-sage: kernel %r unavailable on cuda:%s: %s. Attention runs on PyTorch SDPA.",
                        choice, index, reason)
    else:
        log.info("wan-sage: %s (sm%d) on cuda:%s: attention kernels %s (sageattention %s, comfy-kitchen %s)",
                 gpu, cc, index, ", ".join(names), probe.sage_version or "not installed",
                 probe.ck_version or "not installed")
    return info


def kernel_build(name: str) -> str:
    """The build identity of the package that provides kernel ``name`` (for cache keys and logs)."""
    return kernels.build_identity(KERNELS[name].package)


def timing_cache(cache_dir: str | None) -> timing.TimingCache:
    """The process's one timing cache for ``cache_dir`` (None: the default directory), shared by
    every patch and by ``wan-sage bench`` in the same process."""
    return STATE.timing_cache(cache_dir or str(timing.default_dir()), timing.TimingCache)


def timing_key(gpu: str, cc: int, name: str, dtype_name: str, heads: int, head_dim: int, nq: int, nk: int) -> str:
    """The timing-cache key of kernel ``name`` on a shape, as the node and ``wan-sage bench`` both
    write and read it: the kernel's build identity and this process's torch/CUDA/cuDNN included."""
    return timing.make_key(gpu, cc, name, kernel_build(name), dtype_name, heads, head_dim, nq, nk,
                           timing.environment())


def self_test_key(info: DeviceInfo, name: str, dtype) -> str:
    """The timing cache's key of ``name``'s self-test on this GPU, build and software, in ``dtype``."""
    return timing.self_test_key(info.gpu, info.cc, name, kernel_build(name), DTYPE_NAMES.get(dtype, str(dtype)),
                                timing.environment())


def _passes_self_test(name: str, device, index: int, dtype, info: DeviceInfo, cache_dir: str | None) -> bool:
    """Whether ``name`` passes its self-test: run once per process, device and dtype (other callers wait for
    it); a pass is kept in the timing cache of ``cache_dir`` for later processes to plan with."""
    key = SelfTestKey(index, name, dtype)
    ticket = STATE.begin_self_test(key)
    if ticket is None:
        return STATE.self_tests[key] is None
    if not ticket.run:
        ticket.done.wait(SELF_TEST_WAIT_S)
        return STATE.self_tests.get(key, "pending") is None
    verdict = "the self-test did not finish"
    try:
        verdict = selftest.self_test(name, device, dtype, info.cc)
    except Exception as e:  # the test itself failed (e.g. out of memory for its reference)
        verdict = f"the self-test could not run: {type(e).__name__}: {e}"
    finally:
        STATE.finish_self_test(key, verdict)
    if verdict is None:
        timing_cache(cache_dir).put_self_test_passed(self_test_key(info, name, dtype))
    if verdict:
        log.error("wan-sage: SageAttention kernel %s (%s) failed its self-test on %s: %s. It is disabled for "
                  "this session; attention runs on PyTorch SDPA. If you built SageAttention 2.2.0 between "
                  "2025-10-08 and 2025-12-22, its Hopper kernel is broken: rebuild from thu-ml/SageAttention main "
                  "at or after commit ff71e1e (pip install --no-build-isolation . in the checkout).",
                  name, kernel_build(name), info.gpu, verdict)
    return verdict is None


def prepare(device, choice: str, dtype, self_test: bool = True, cache_dir: str | None = None) -> tuple:
    """Do ahead what the first eligible call on ``device`` would do before its kernel runs: find the
    device's kernels for ``choice``, read each one's build identity, and run its self-test for ``dtype``
    (the first launch loads the kernel's compiled modules and compiles SageAttention's Triton
    quantisation kernels: 6-8 s on an H200, measured by ``python -m bench.first_call``), keeping a pass
    in the timing cache of ``cache_dir``.  Returns the kernels that passed.  Safe beside a real call: a
    self-test in progress is waited for, not run twice."""
    index = kernels.device_index(device)
    info = device_info(device, index, choice)
    dtype_name = DTYPE_NAMES.get(dtype, str(dtype))
    ready = []
    for name in info.candidates:
        if not KERNELS[name].dtype_ok(dtype_name):
            continue
        kernel_build(name)
        if not self_test or _passes_self_test(name, device, index, dtype, info, cache_dir):
            ready.append(name)
    return tuple(ready)


def candidates(info: DeviceInfo, device, key: CallKey, self_test: bool, run_self_test: bool = True,
               cache_dir: str | None = None) -> tuple:
    """(kernels that may serve the call of ``key``, reason when there are none).  The registry's
    declared dtypes, head dims and token limits decide first (a call longer than a kernel's limit
    on this arch: reason "inaccurate"); then kernels that raised here before, kernels whose output
    was rejected on this call key, and kernels that fail their self-test (run once per device and
    dtype; a pass is kept in the timing cache of ``cache_dir``) drop out.  ``run_self_test=False``
    runs no self-test and predicts: before this process's verdict, a pass kept from an earlier one
    with the same GPU, build and software counts as passed; (None, "untested") where neither is known."""
    shape, dtype, index = key.shape, key.dtype, key.device_index
    dtype_name = DTYPE_NAMES.get(dtype, str(dtype))
    names, why = [], "head_dim"
    for name in info.candidates:
        spec = KERNELS[name]
        if not (spec.dtype_ok(dtype_name) and spec.head_dim_ok(shape.D)):
            continue
        if not spec.allows(info.cc, shape.Nq, shape.Nk):
            why = "inaccurate"
            continue
        if FailureKey(index, name, dtype, shape.D) in STATE.failed:
            why = "failed"
            continue
        rejected = STATE.rejected.get((name, key))
        if rejected is not None:
            why = rejected
            continue
        if self_test and not run_self_test:
            verdict = STATE.self_tests.get(SelfTestKey(index, name, dtype), UNTESTED)
            if verdict is UNTESTED and timing_cache(cache_dir).passed_self_test(self_test_key(info, name, dtype)):
                verdict = None
            if verdict is UNTESTED:
                return None, "untested"
            if verdict is not None:
                why = "disabled"
                continue
        elif self_test and not _passes_self_test(name, device, index, dtype, info, cache_dir):
            why = "disabled"
            continue
        names.append(name)
    return tuple(names), why


def attn_shape(shape: CallShape, dtype) -> kernel_bytes.AttnShape:
    itemsize = 4 if dtype == torch.float32 else 2
    return kernel_bytes.AttnShape(shape.B, shape.H, shape.Nq, shape.Nk, shape.D, itemsize, None,
                                  dtype == torch.bfloat16)


def output_copy(name: str, layout: str, out_layout: str) -> bool:
    """Whether an ungrouped call's output must be copied into the caller's layout."""
    return KERNELS[name].native_layout(layout) != out_layout


def mode_groups(name: str, cc: int, shape: kernel_bytes.AttnShape, mode: str, copy: bool) -> head_groups.HeadGroups:
    return head_groups.head_groups(KERNELS[name].memory_path(cc), shape, mode, copy)


def need_bytes(name: str, cc: int, shape: kernel_bytes.AttnShape, groups: int, copy: bool, margin: int,
               into_q: bool = False) -> int:
    """Bytes that must be free to run ``name`` in ``groups`` groups (``into_q``: on its path that writes
    the output into q): the exact peak, the allocator's rounding and the patch's margin."""
    path = KERNELS[name].into_q_path(cc, shape.D) if into_q else KERNELS[name].memory_path(cc)
    peak = head_groups.split_bytes(path, shape, groups, copy)
    return kernel_bytes.with_margin(peak) + margin


def into_q_groups(name: str, cc: int, shape: kernel_bytes.AttnShape) -> head_groups.HeadGroups | None:
    """The head groups of ``name``'s write-into-q path that keep a call within SDPA's bytes (None: the
    kernel has no such path for this head dim, or no group count gets there)."""
    path = KERNELS[name].into_q_path(cc, shape.D)
    return head_groups.into_q_groups(path, shape) if path else None


def more_groups(name: str, cc: int, shape: kernel_bytes.AttnShape, groups: int, available: int,
                margin: int, into_q: bool = False) -> tuple | None:
    """(groups, need) of the fewest groups above ``groups`` whose need fits in ``available``."""
    for count in head_groups.group_counts(shape.Hq):
        if count > groups:
            need = need_bytes(name, cc, shape, count, False, margin, into_q)
            if need <= available:
                return count, need
    return None


def _variant_ms(entry: dict, groups: int) -> tuple:
    """(groups, ms) the kernel runs with, given its entry and the memory mode's ``groups``: the
    split when it costs at most GROUPING_MAX_COST against ungrouped (or was the only variant
    measured), else ungrouped."""
    ungrouped = entry.get("kernel_ms")
    grouped = entry.get("grouped_ms") if entry.get("groups", 1) == groups else None
    if groups > 1:
        if grouped is not None and ungrouped is not None:
            return (groups, grouped) if grouped <= timing.GROUPING_MAX_COST * ungrouped else (1, ungrouped)
        return groups, grouped if grouped is not None else ungrouped
    return 1, ungrouped if ungrouped is not None else entry.get("grouped_ms")


def choose(names, entries: dict, groups: dict, cross: bool) -> Choice | None:
    """The fastest measured kernel in the group count it runs with, if it beats SDPA by the
    hysteresis; else SDPA.  None when no candidate has an entry."""
    best, sdpa_ms = None, None
    for name in names:
        entry = entries.get(name)
        if entry is None:
            continue
        sdpa_ms = entry["sdpa_ms"] if sdpa_ms is None else min(sdpa_ms, entry["sdpa_ms"])
        run_groups, ms = _variant_ms(entry, groups[name])
        if best is None or ms < best[2]:
            best = (name, run_groups, ms)
    if best is None:
        return None
    name, run_groups, ms = best
    if ms < timing.FASTER_BY * sdpa_ms:
        return Choice(name, run_groups, sdpa_ms - ms)
    return Choice(None, reason="cross_slower" if cross else "slower")


def default_choice(names, cross: bool, groups: dict) -> Choice:
    """Without a measurement: the registry's :func:`~.registry.unmeasured_kernel` (SDPA for
    cross-attention, the first candidate for self-attention) in the memory mode's group count."""
    name = registry.unmeasured_kernel(names, cross)
    if name is None:
        return Choice(None, reason="cross_slower" if cross else "no_kernel")
    return Choice(name, groups[name])


def calibration_estimate_s(shape: CallShape, runs: int) -> float:
    """Rough seconds of ``runs`` attention calls of ``shape`` (SDPA-class speed, 100 TFLOP/s) plus overhead."""
    return runs * (4.0 * shape.B * shape.H * shape.Nq * shape.Nk * shape.D / 100e12 + 0.025)
