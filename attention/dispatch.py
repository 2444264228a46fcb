"""The attention override: route each call to a Sage-family kernel or to SDPA, safely.

``SageAttentionOverride`` is what the ComfyUI adapter installs as
``transformer_options["optimized_attention_override"]``.  It is immutable and deepcopy-safe
(copies return the same object), holds no tensors, and keeps all mutable state (per-device
resolution, self-test results, failure cache, calibration spend, stats) in module-level
structures under a lock.  For every call it:

1. checks eligibility (:mod:`.policy`), naming a reason for every refusal;
2. picks the fastest available kernel for the shape bucket from measurements (timing both on
   the real shape once, within a bounded budget), or SDPA when SDPA is faster;
3. checks the kernel's exact extra bytes (:mod:`.memory`) against free VRAM, splitting the
   call over head groups when needed, and SDPA when not even one group fits;
4. runs the kernel, falling back to SDPA on ``torch.OutOfMemoryError``, on any other error
   (remembered), and on non-finite output.

Declined calls go to the override that was installed before ours, if any, else to SDPA.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from . import kernel_bytes, kernels, policy, selftest, stats, timing
from .sdpa import attention_sdpa

__all__ = ["PatchConfig", "SageAttentionOverride", "Plan", "reset_state"]

log = logging.getLogger("wan_sage")

_FP = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PatchConfig:
    """User-facing options of the patch.  Immutable."""

    kernel: str = "auto"
    min_tokens: int = 1024  # below this many query tokens, SDPA (launch/quantisation overhead)
    calibrate: bool = True  # time kernel vs SDPA on the real shape the first time a bucket is seen
    calibration_budget_s: float = 30.0  # per process, over all buckets
    memory_margin_mb: int = 256  # kept free on top of the kernel's exact extra bytes
    check_finite: bool = True  # recompute non-finite outputs on SDPA
    self_test: bool = True
    cache_dir: str | None = None
    label: str = ""
    node_id: str | None = None  # the ComfyUI node that made the patch (for the UI's stats)

    def __post_init__(self):
        if self.kernel != "auto" and self.kernel not in kernels.KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}; choose auto or one of {', '.join(kernels.KERNELS)}")
        if self.min_tokens < 0 or self.memory_margin_mb < 0 or self.calibration_budget_s < 0:
            raise ValueError("min_tokens, memory_margin_mb and calibration_budget_s must be >= 0")


@dataclass
class Plan:
    kernel: str | None  # None: decline
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
    need: int = 0


@dataclass(frozen=True)
class _Device:
    cc: int
    gpu: str
    candidates: tuple  # available kernel names, preference order (self-test pending)
    reason: str | None  # why there is none


# ---------------------------------------------------------------- module-level state
_lock = threading.Lock()
_devices: dict = {}  # (device index, kernel choice) -> _Device
_tested: dict = {}  # (device index, kernel, dtype) -> None | failure text
_failed: dict = {}  # (device index, kernel, dtype, head dim) -> failure text
_stores: dict = {}  # cache dir -> CalibrationStore
_spent = {"calibration_s": 0.0}
_once: set = set()
# Settled decisions per call shape: (config, device, dtype, B, H, Nq, Nk, D, layout) ->
# (kernel or None, reason, saved_ms).  Keeps the per-call CPU cost to a dict lookup plus the
# memory check; cleared whenever a kernel fails or state is reset.
_decided: dict = {}


def reset_state() -> None:
    """Forget per-process decisions (tests; after reinstalling a kernel)."""
    with _lock:
        _devices.clear()
        _tested.clear()
        _failed.clear()
        _stores.clear()
        _spent["calibration_s"] = 0.0
        _once.clear()
        _decided.clear()


def _log_once(key, level, msg, *args) -> None:
    with _lock:
        if key in _once:
            return
        _once.add(key)
    log.log(level, msg, *args)


def _store(cache_dir: str | None) -> timing.CalibrationStore:
    key = cache_dir or str(timing.default_dir())
    st = _stores.get(key)
    if st is None:
        with _lock:
            st = _stores.setdefault(key, timing.CalibrationStore(key))
    return st


def _kernel_version(name: str) -> str:
    p = kernels.probe()
    return (p.ck_version or "?") if name == "ck_int8" else (p.sage_version or "?")


def _device(dev: torch.device, choice: str) -> _Device:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    key = (idx, choice)
    d = _devices.get(key)
    if d is not None:
        return d
    cc = kernels.device_cc(dev)
    gpu = torch.cuda.get_device_name(dev)
    p = kernels.probe()
    if choice == "auto":
        cands = kernels.auto_candidates(cc)
        reason = None if cands else (
            f"no quantised attention kernel is usable on {gpu} (sm{cc}): "
            f"sageattention: {p.sage_error or p.sage_version}; comfy-kitchen: {p.ck_error or 'no kernel for this GPU'}. "
            + kernels.install_hint())
    else:
        why = kernels.unavailable_reason(choice, cc)
        cands, reason = ((), why) if why else ((choice,), None)
    d = _Device(cc, gpu, cands, reason)
    with _lock:
        _devices[key] = d
    if reason:
        _log_once(("nokernel", key), logging.WARNING, "wan-sage: kernel %r unavailable on cuda:%s: %s. "
                  "Attention runs on PyTorch SDPA.", choice, idx, reason)
    else:
        log.info("wan-sage: %s (sm%d) on cuda:%s: attention kernels %s (sageattention %s, comfy-kitchen %s)",
                 gpu, cc, idx, ", ".join(cands), p.sage_version or "not installed", p.ck_version or "not installed")
    return d


def _passes_self_test(name: str, dev: torch.device, dtype: torch.dtype, cc: int, gpu: str) -> bool:
    idx = dev.index
    key = (idx, name, dtype)
    if key in _tested:
        return _tested[key] is None
    with _lock:  # one thread tests; others wait for the verdict
        if key in _tested:
            return _tested[key] is None
        why = selftest.self_test(name, dev, dtype, cc)
        _tested[key] = why
    if why:
        log.error("wan-sage: SageAttention kernel %s (sageattention %s) failed its self-test on %s: %s. It is "
                  "disabled for this session; attention runs on PyTorch SDPA. If you built SageAttention 2.2.0 "
                  "between 2025-10-08 and 2025-12-22, its Hopper kernel is broken: rebuild from thu-ml/SageAttention "
                  "main at or after commit ff71e1e (pip install --no-build-isolation . in the checkout).",
                  name, _kernel_version(name), gpu, why)
    return why is None


def _free_bytes(dev: torch.device, need: int, free_fn) -> bool:
    """Does ``need`` fit?  Driver free first (cheap); torch's cached-but-unused only if needed."""
    if free_fn is not None:
        return free_fn(dev) >= need
    free, _total = torch.cuda.mem_get_info(dev)
    if free >= need:
        return True
    st = torch.cuda.memory_stats(dev)
    return free + st.get("reserved_bytes.all.current", 0) - st.get("allocated_bytes.all.current", 0) >= need


def _all_finite(t: torch.Tensor) -> bool:
    """NaN/Inf check by one min/max reduction: no tensor of the output's size is allocated
    (``isfinite(t).all()`` would add a bool copy of the whole output), one host sync."""
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(torch.stack((lo, hi))).all())


class SageAttentionOverride:
    """Callable installed in ``transformer_options["optimized_attention_override"]``."""

    __slots__ = ("config", "prev", "sdpa", "free_memory", "patch_id")

    def __init__(self, config: PatchConfig | None = None, prev: Callable | None = None,
                 sdpa: Callable | None = None, free_memory: Callable | None = None,
                 patch_id: str | None = None):
        object.__setattr__(self, "config", config or PatchConfig())
        object.__setattr__(self, "prev", prev)
        object.__setattr__(self, "sdpa", sdpa or attention_sdpa)
        object.__setattr__(self, "free_memory", free_memory)
        object.__setattr__(self, "patch_id", patch_id or uuid.uuid4().hex[:12])

    def __setattr__(self, name, value):
        raise AttributeError("SageAttentionOverride is immutable")

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        return (SageAttentionOverride, (self.config, self.prev, self.sdpa, self.free_memory, self.patch_id))

    def __repr__(self):
        return f"SageAttentionOverride(id={self.patch_id}, kernel={self.config.kernel}, chained={self.prev is not None})"

    # ------------------------------------------------------------------ the hot path
    def __call__(self, func, *args, **kwargs):
        q, k, v = args[0], args[1], args[2]
        heads = kwargs["heads"] if "heads" in kwargs else args[3]
        plan = self.plan(q, k, v, heads, args, kwargs)
        if plan.kernel is None:
            return self._decline(func, args, kwargs, plan.reason)
        return self._execute(plan, func, q, k, v, args, kwargs)

    def _decline(self, func, args, kwargs, reason, fallback=None):
        stats.record(self.patch_id, reason=reason, fallback=fallback)
        if self.prev is not None:
            return self.prev(func, *args, **kwargs)
        return self.sdpa(*args, **kwargs)

    def plan(self, q, k, v, heads, args=(), kwargs=None) -> Plan:
        """Decide backend, head groups and calibration for one call (no kernel runs here)."""
        kwargs = kwargs or {}
        cfg = self.config
        mask = kwargs["mask"] if "mask" in kwargs else (args[4] if len(args) > 4 else None)
        skip_reshape = kwargs["skip_reshape"] if "skip_reshape" in kwargs else (args[6] if len(args) > 6 else False)
        reason = policy.static_reason(q, k, v, mask, kwargs, _FP)
        if reason:
            return Plan(None, reason)
        # Shapes, in both of ComfyUI's layouts; k/v may be 4-D (Animate face block).
        if skip_reshape:
            B, H, Nq, D = q.shape
            if k.ndim != 4 or k.shape[1] != H:
                return Plan(None, "gqa")
            Nk = k.shape[2]
            layout = "HND"
        else:
            if q.ndim != 3 or q.shape[-1] % heads:
                return Plan(None, "layout")
            B, Nq = q.shape[0], q.shape[1]
            H = heads
            D = q.shape[-1] // heads
            if k.numel() % (B * H * D) or (k.ndim == 3 and k.shape[-1] != H * D) or (k.ndim == 4 and k.shape[-2] != H):
                return Plan(None, "gqa")
            Nk = k.numel() // (B * H * D)
            layout = "NHD"
        if Nq < cfg.min_tokens:
            return Plan(None, "short")
        dev = q.device
        dkey = (cfg, dev.index, q.dtype, B, H, Nq, Nk, D, layout)
        hit = _decided.get(dkey)
        if hit is not None:
            name, reason, saved, cc = hit
            if name is None:
                return Plan(None, reason)
            return self._fit_memory(Plan(name, None, layout, B, H, Nq, Nk, D, saved_ms=saved, cc=cc), dev, q.dtype)
        d = _device(dev, cfg.kernel)
        if d.reason:
            return Plan(None, "no_kernel")
        dtype = q.dtype
        idx = dev.index
        cands, why = [], "head_dim"
        for name in d.candidates:
            kern = kernels.KERNELS[name]
            if not kern.head_dim_ok(D):
                continue
            if (idx, name, dtype, D) in _failed:
                why = "failed"
                continue
            if cfg.self_test and not _passes_self_test(name, dev, dtype, d.cc, d.gpu):
                why = "disabled"
                continue
            cands.append(name)
        if not cands:
            _decided[dkey] = (None, why, 0.0, d.cc)
            return Plan(None, why)
        cross = policy.is_cross(Nq, Nk)
        store = _store(cfg.cache_dir)
        dt = "bf16" if dtype == torch.bfloat16 else "fp16"
        best, best_ms, sdpa_ms, missing = None, math.inf, None, []
        for name in cands:
            e = store.get(timing.make_key(d.gpu, d.cc, name, _kernel_version(name), dt, H, D, Nq, Nk))
            if e is None:
                missing.append(name)
                continue
            sdpa_ms = e["sdpa_ms"] if sdpa_ms is None else min(sdpa_ms, e["sdpa_ms"])
            if e["kernel_ms"] < best_ms:
                best, best_ms = name, e["kernel_ms"]
        plan = Plan(None, None, layout, B, H, Nq, Nk, D, cc=d.cc)
        if missing and cfg.calibrate and self._budget_ok(B, H, Nq, Nk, D, len(missing)):
            plan.calibrate = tuple(missing)
            plan.kernel = missing[0]
        elif best is not None and not missing:
            if best_ms < timing.FASTER_BY * sdpa_ms:
                plan.kernel, plan.saved_ms = best, sdpa_ms - best_ms
            else:
                plan.reason = "cross_slower" if cross else "slower"
                _decided[dkey] = (None, plan.reason, 0.0, d.cc)
                return plan
            _decided[dkey] = (plan.kernel, None, plan.saved_ms, d.cc)
        elif best is not None and best_ms < timing.FASTER_BY * sdpa_ms:
            plan.kernel, plan.saved_ms = best, sdpa_ms - best_ms
        else:
            # No measurement (calibration off or over budget): cross-attention stays on SDPA,
            # where every measured Sage path loses; self-attention uses the preferred kernel.
            if cross:
                plan.reason = "cross_slower"
                _decided[dkey] = (None, plan.reason, 0.0, d.cc)
                return plan
            plan.kernel = cands[0]
            _decided[dkey] = (plan.kernel, None, 0.0, d.cc)
        return self._fit_memory(plan, dev, dtype)

    def _budget_ok(self, B, H, Nq, Nk, D, n) -> bool:
        # Each kernel and SDPA runs twice (warm-up + timed); estimate SDPA at 100 TFLOP/s.
        est_s = 2 * (n + 1) * 4.0 * B * H * Nq * Nk * D / 100e12 + 0.05 * (n + 1)
        left = self.config.calibration_budget_s - _spent["calibration_s"]
        if est_s > left:
            _log_once(("budget", self.config.calibration_budget_s), logging.INFO,
                      "wan-sage: calibration budget (%.0f s) used up; unmeasured shapes use the default "
                      "rule (Sage for self-attention, SDPA for cross-attention). `wan-sage bench` measures "
                      "the Wan shapes ahead of time.", self.config.calibration_budget_s)
            return False
        return True

    def _fit_memory(self, plan: Plan, dev, dtype) -> Plan:
        s = 2
        kern = kernels.KERNELS[plan.kernel]
        out_copy = s * plan.B * plan.H * plan.Nq * plan.D if (plan.layout == "HND" or plan.kernel == "ck_int8") else 0
        margin = self.config.memory_margin_mb << 20
        shape = kernel_bytes.AttnShape(plan.B, plan.H, plan.Nq, plan.Nk, plan.D, s, None, dtype == torch.bfloat16)
        path = kern.memory_path(plan.cc)
        need = kernel_bytes.with_margin(kernel_bytes.extra_bytes(path, shape)) + out_copy + margin
        if plan.calibrate:
            need += s * plan.B * plan.H * plan.Nq * plan.D  # one kept output while timing the next
            if not _free_bytes(dev, need, self.free_memory):
                plan.calibrate = ()  # not now: decide by the default rule, measure another time
        elif _free_bytes(dev, need, self.free_memory):
            plan.need = need
            return plan
        if plan.calibrate:
            plan.need = need
            return plan
        out_full = s * plan.B * plan.H * plan.Nq * plan.D
        for g in range(2, plan.H + 1):
            hg = -(-plan.H // g)
            if g > 2 and hg == -(-plan.H // (g - 1)):
                continue
            need_g = out_full + kernel_bytes.with_margin(kernel_bytes.extra_bytes(path, shape.with_heads(hg))) + margin
            if _free_bytes(dev, need_g, self.free_memory):
                plan.groups, plan.need = -(-plan.H // hg), need_g
                return plan
        plan.kernel, plan.reason = None, "memory"
        return plan

    # ------------------------------------------------------------------ execution
    def _execute(self, plan: Plan, func, q, k, v, args, kwargs):
        scale = kwargs.get("scale")
        skip_out = kwargs["skip_output_reshape"] if "skip_output_reshape" in kwargs else (args[7] if len(args) > 7 else False)
        if plan.layout == "NHD":
            q4 = q.reshape(plan.B, plan.Nq, plan.H, plan.D)
            k4 = k.reshape(plan.B, plan.Nk, plan.H, plan.D)
            v4 = v.reshape(plan.B, plan.Nk, plan.H, plan.D)
        else:
            q4, k4, v4 = q, k, v
        calib_ms = 0.0
        name = plan.kernel
        fallback = None
        out = None
        try:
            if plan.calibrate:
                name, out, calib_ms, saved = self._calibrate(plan, q4, k4, v4, scale, args, kwargs)
                plan.saved_ms = saved
            elif plan.groups == 1:
                out = kernels.run(name, q4, k4, v4, plan.layout, scale, plan.cc)
            else:
                out = self._run_split(name, plan, q4, k4, v4, scale)
        except torch.OutOfMemoryError:
            fallback = "oom"
        except Exception as e:  # a kernel that raises is not retried on this (device, dtype, D)
            fallback = "error"
            with _lock:
                _failed[(q.device.index, name, q.dtype, plan.D)] = f"{type(e).__name__}: {e}"
            _decided.clear()
            _log_once(("err", q.device.index, name, q.dtype, plan.D), logging.WARNING,
                      "wan-sage: %s raised %s: %s; using SDPA for this shape from now on.", name,
                      type(e).__name__, e)
        if fallback:
            out = None  # drop anything the failed attempt held before SDPA allocates
            if fallback == "oom":
                _log_once(("oom", q.device.index), logging.WARNING,
                          "wan-sage: %s ran out of memory; this call was redone on SDPA "
                          "(counted in the run summary).", name)
            return self._decline(func, args, kwargs, fallback, fallback=fallback)
        if name is None:  # calibration chose SDPA; ``out`` is its result in ComfyUI layout
            stats.record(self.patch_id, reason="cross_slower" if policy.is_cross(plan.Nq, plan.Nk) else "slower",
                         calibration_ms=calib_ms)
            return out
        if self.config.check_finite and not _all_finite(out):
            out = None
            return self._decline(func, args, kwargs, "nonfinite", fallback="nonfinite")
        stats.record(self.patch_id, kernel=name, split=plan.groups > 1, saved_ms=plan.saved_ms,
                     calibration_ms=calib_ms)
        return self._to_comfy_layout(out, plan, skip_out)

    @staticmethod
    def _to_comfy_layout(out, plan: Plan, skip_out):
        if plan.layout == "NHD":
            if skip_out:
                return out.transpose(1, 2)
            return out.reshape(plan.B, plan.Nq, plan.H * plan.D)
        if skip_out:
            return out
        return out.transpose(1, 2).reshape(plan.B, plan.Nq, plan.H * plan.D)

    @staticmethod
    def _run_split(name, plan: Plan, q4, k4, v4, scale):
        hd = 2 if plan.layout == "NHD" else 1
        out = torch.empty_like(q4)
        hg = -(-plan.H // plan.groups)
        for h0 in range(0, plan.H, hg):
            sl = [slice(None)] * 4
            sl[hd] = slice(h0, min(plan.H, h0 + hg))
            sl = tuple(sl)
            o = kernels.run(name, q4[sl], k4[sl], v4[sl], plan.layout, scale, plan.cc)
            out[sl].copy_(o)
            del o
        return out

    def _calibrate(self, plan: Plan, q4, k4, v4, scale, args, kwargs):
        """Time each unmeasured kernel and SDPA once (after a warm-up) on this real shape."""
        t0 = time.perf_counter()
        cfg = self.config
        d = _device(q4.device, cfg.kernel)
        dt = "bf16" if q4.dtype == torch.bfloat16 else "fp16"
        store = _store(cfg.cache_dir)
        results = {}
        best_name, best_out, best_ms = None, None, math.inf
        for name in plan.calibrate:
            kernels.run(name, q4, k4, v4, plan.layout, scale, plan.cc)  # warm-up (JIT, autotune)
            holder = {}

            def call(name=name):
                holder["o"] = kernels.run(name, q4, k4, v4, plan.layout, scale, plan.cc)
                return None
            ms = timing.time_cuda(call)
            results[name] = ms
            if ms < best_ms:
                best_name, best_ms, best_out = name, ms, holder.pop("o")
            holder.clear()
        sdpa_kwargs = {k: v for k, v in kwargs.items()}
        self.sdpa(*args, **sdpa_kwargs)
        sdpa_holder = {}

        def sdpa_call():
            sdpa_holder["o"] = self.sdpa(*args, **sdpa_kwargs)
            return None
        sdpa_ms = timing.time_cuda(sdpa_call)
        for name, ms in results.items():
            store.put(timing.make_key(d.gpu, d.cc, name, _kernel_version(name), dt, plan.H, plan.D,
                                           plan.Nq, plan.Nk), ms, sdpa_ms, plan.Nq, plan.Nk, save=False)
        store.save()
        spent = time.perf_counter() - t0
        with _lock:
            _spent["calibration_s"] += spent
        log.info("wan-sage: calibrated %s on %s for [B=%d, H=%d, Nq=%d, Nk=%d, D=%d] in %.2f s: SDPA %.2f ms, %s",
                 dt, d.gpu, plan.B, plan.H, plan.Nq, plan.Nk, plan.D, spent, sdpa_ms,
                 ", ".join(f"{n} {m:.2f} ms" for n, m in results.items()))
        if best_ms < timing.FASTER_BY * sdpa_ms:
            return best_name, best_out, spent * 1000, sdpa_ms - best_ms
        return None, sdpa_holder.pop("o"), spent * 1000, 0.0
