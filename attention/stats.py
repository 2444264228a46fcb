"""Per-patch attention statistics: counts by backend and reason, fallbacks, time saved.

Counters are kept per patch id in :mod:`.state` (under its lock), so a patch's callable can stay
immutable and be shared or deep-copied freely.  A sampling run opens a window with
:func:`begin_run` and closes it with :func:`end_run`, which returns the summary the node logs
once and the server later serves.  Nothing is logged per call.  Under ``torch.compile`` the calls
the override declines statically (see :mod:`.policy`) are not counted: they run as part of the
compiled graph; every call that reaches the custom op is.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from .state import STATE

__all__ = ["record", "add_calibration", "count_sdpa", "begin_run", "end_run", "snapshot", "last_runs", "RunStats", "format_summary", "rank"]


@dataclass
class RunStats:
    patch_id: str
    label: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None
    sage_calls: int = 0
    sdpa_calls: int = 0
    by_kernel: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)  # why calls went to SDPA (or prev)
    fallbacks: Counter = field(default_factory=Counter)  # oom / error / nonfinite / inaccurate after a Sage try
    head_split_calls: int = 0
    saved_ms: float = 0.0
    calibration_ms: float = 0.0
    rank: int | None = field(default_factory=lambda: rank())  # this process's rank under torch.distributed

    def as_dict(self) -> dict:
        d = {
            "patch_id": self.patch_id, "label": self.label, "started": self.started,
            "ended": self.ended, "sage_calls": self.sage_calls, "sdpa_calls": self.sdpa_calls,
            "by_kernel": dict(self.by_kernel), "reasons": dict(self.reasons),
            "fallbacks": dict(self.fallbacks), "head_split_calls": self.head_split_calls,
            "saved_ms": round(self.saved_ms, 1), "calibration_ms": round(self.calibration_ms, 1),
        }
        if self.rank is not None:
            d["rank"] = self.rank
        return d


def rank() -> int | None:
    """This process's global rank when torch.distributed is initialised (multi-GPU runs count per rank:
    each rank's window holds its own calls), else None.  Reads torch.distributed only if it was imported."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


def _get(patch_id: str) -> RunStats:
    st = STATE.runs_current.get(patch_id)
    if st is None:
        st = STATE.runs_current[patch_id] = RunStats(patch_id)
    return st


def _take_declined(patch_id: str) -> None:
    """Add the calls the declined table served for ``patch_id`` to its window (under the lock): the hot
    path of a declined call counts on its table entry, not here."""
    counts = STATE.take_declined_counts(patch_id)
    if counts:
        st = _get(patch_id)
        for reason, n in counts.items():
            st.sdpa_calls += n
            st.reasons[reason] += n


def record(patch_id: str, *, kernel: str | None = None, reason: str | None = None,
           fallback: str | None = None, split: bool = False, saved_ms: float = 0.0,
           calibration_ms: float = 0.0) -> None:
    """Count one call: ``kernel`` set means it ran on that kernel, else on SDPA for ``reason``."""
    with STATE.lock:
        st = _get(patch_id)
        if kernel is not None:
            st.sage_calls += 1
            st.by_kernel[kernel] += 1
            st.saved_ms += saved_ms
            if split:
                st.head_split_calls += 1
        else:
            st.sdpa_calls += 1
            st.reasons[reason or "unknown"] += 1
        if fallback:
            st.fallbacks[fallback] += 1
        st.calibration_ms += calibration_ms


def add_calibration(patch_id: str, calibration_ms: float) -> None:
    """Add host time a shape's timing took (its end: reading the timers, caching, settling) to the
    window, without counting a call."""
    with STATE.lock:
        _get(patch_id).calibration_ms += calibration_ms


def count_sdpa(patch_id: str, reason: str) -> None:
    """Count one call that ran on SDPA for ``reason`` and nothing else: :func:`record` for the
    per-call paths that know no more (a static refusal, a shape settled on SDPA).  The hot path of a
    declined call: the window's counters are updated without the state lock (only its creation takes
    it), which is exact while one thread samples a patch at a time, as ComfyUI runs a prompt."""
    st = STATE.runs_current.get(patch_id)
    if st is None:
        with STATE.lock:
            st = _get(patch_id)
    st.sdpa_calls += 1
    reasons = st.reasons
    reasons[reason] = reasons.get(reason, 0) + 1


def begin_run(patch_id: str, label: str = "") -> None:
    with STATE.lock:
        STATE.take_declined_counts(patch_id)  # calls before the window are not the window's
        STATE.runs_current[patch_id] = RunStats(patch_id, label)


def end_run(patch_id: str) -> dict:
    """Close the run window and return its summary (also kept for :func:`last_runs`)."""
    with STATE.lock:
        _take_declined(patch_id)
        st = STATE.runs_current.pop(patch_id, None) or RunStats(patch_id)
        st.ended = time.time()
        d = st.as_dict()
        STATE.runs_last[patch_id] = d
        return d


def snapshot(patch_id: str) -> dict:
    with STATE.lock:
        _take_declined(patch_id)
        st = STATE.runs_current.get(patch_id)
        return st.as_dict() if st else dict(STATE.runs_last.get(patch_id, {}))


def last_runs() -> dict:
    """The last finished run per patch id (what the server's stats route serves)."""
    with STATE.lock:
        return {k: dict(v) for k, v in STATE.runs_last.items()}


def format_summary(d: dict) -> str:
    total = d.get("sage_calls", 0) + d.get("sdpa_calls", 0)
    kern = ", ".join(f"{k} {n}" for k, n in sorted(d.get("by_kernel", {}).items())) or "none"
    why = ", ".join(f"{k} {n}" for k, n in sorted(d.get("reasons", {}).items(), key=lambda x: -x[1])) or "none"
    fb = ", ".join(f"{k} {n}" for k, n in sorted(d.get("fallbacks", {}).items())) or "none"
    where = f"rank {d['rank']}: " if d.get("rank") is not None else ""
    return (f"{where}{d.get('sage_calls', 0)}/{total} attention calls on Sage ({kern}); "
            f"{d.get('sdpa_calls', 0)} on SDPA (by reason: {why}); fallbacks: {fb}; "
            f"head-split calls: {d.get('head_split_calls', 0)}; est. time saved "
            f"{d.get('saved_ms', 0.0) / 1000:.1f} s; calibration cost {d.get('calibration_ms', 0.0) / 1000:.2f} s")
