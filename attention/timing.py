"""Kernel timings against SDPA: measuring them on the calls of a shape (:class:`ShapeTrial`: each of
the shape's first calls runs one variant or SDPA for its own output, timed with CUDA events, so
the timing adds no run) and the timing cache that keeps them (:class:`TimingCache`).

Cache key: GPU name, compute capability, kernel with its package build identity (version plus a
hash of the compiled extension files), the software environment (torch, CUDA and cuDNN
versions), dtype, heads, head dim, and the token buckets of Nq and Nk (:func:`token_bucket`:
quarter octaves of the token count, so 720p and 704p share a bucket unless their lengths differ by
more than ~19 %).

Entry: the ungrouped kernel time, the grouped time with its group count (the memory mode's
split), SDPA's time and how many measurements were merged into it (``repeats``; times are the
minimum over them).  An entry measured once is provisional: a later process that meets the key
first measures it again before it is trusted for good.

The same file keeps the kernel self-tests passed on this GPU (:meth:`TimingCache.passed_self_test`), per
GPU, kernel build, software environment and dtype: a process reads them to plan before its own
self-test has finished (that test still decides which kernel its calls run).

The cache is one JSON file (:data:`FILE_NAME`).  Writes merge this process's new measurements into
what is on disk, under a cross-process file lock (:mod:`.file_lock`), and replace the file
atomically (temp file plus rename), so ComfyUI and ``wan-sage bench`` can share it.  A corrupt or
unwritable file is reported once in the log; the cache then rebuilds it, or keeps its entries in
memory.  The directory is ComfyUI's user directory when the pack runs inside ComfyUI, else a
per-user cache directory.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .file_lock import file_lock, replace_atomically

__all__ = ["token_bucket", "make_key", "environment", "TimingCache", "default_dir", "set_host_dir", "CudaTimer",
           "timer", "trusted", "Step", "Trial", "ShapeTrial", "schedule", "TIMED_RUNS", "FASTER_BY",
           "GROUPING_MAX_COST", "TRUSTED_REPEATS", "FILE_NAME", "self_test_key"]

log = logging.getLogger("wan_sage")

FILE_NAME = "attention_calibration.json"  # kept from earlier releases, so users keep their timings
FORMAT = 2
PASSED = "self_tests_passed"  # the file's section of passed self-tests: {key: when}
# A kernel replaces SDPA only when it is at least this much faster (ratio of times): noise in a
# single timing must not turn "equal" into "slower".
FASTER_BY = 0.98
# The memory mode's head split is used when it costs at most this much against ungrouped.
GROUPING_MAX_COST = 1.02
# Measurements merged into an entry before it is trusted without measuring again.
TRUSTED_REPEATS = 2

_host_dir: str | None = None


def set_host_dir(path: str | None) -> None:
    """Called by the ComfyUI adapter with ComfyUI's user directory (``.../user/wan_sage``)."""
    global _host_dir
    _host_dir = path


def default_dir() -> Path:
    env = os.environ.get("WAN_SAGE_CACHE_DIR")
    if env:
        return Path(env)
    if _host_dir:
        return Path(_host_dir)
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = str(Path.home() / "Library" / "Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wan-sage"


def token_bucket(n: int) -> int:
    """Quarter-octave bucket of a token count (n >= 1): the token-count range of a cache key."""
    return int(round(4 * math.log2(max(1, n))))


def environment() -> str:
    """The software a timing depends on besides the kernel build: torch, CUDA and cuDNN."""
    import torch
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"torch {torch.__version__}, cuda {torch.version.cuda}, cudnn {cudnn}"


def make_key(gpu: str, cc: int, kernel: str, build: str, dtype: str, heads: int, head_dim: int, nq: int,
             nk: int, env: str) -> str:
    return "|".join((self_test_key(gpu, cc, kernel, build, dtype, env), f"h{heads}", f"d{head_dim}",
                     f"q{token_bucket(nq)}", f"k{token_bucket(nk)}"))


def self_test_key(gpu: str, cc: int, kernel: str, build: str, dtype: str, env: str) -> str:
    """The key of a kernel's self-test verdict: what a timing key holds but the shape (its first fields)."""
    return "|".join((gpu, f"sm{cc}", f"{kernel}={build}", env, dtype))


def trusted(entry: dict) -> bool:
    return entry.get("repeats", 1) >= TRUSTED_REPEATS


def _min_known(a, b):
    known = [x for x in (a, b) if x is not None]
    return min(known) if known else None


def _merge(old: dict | None, new: dict) -> dict:
    """One more measurement of a cache key: times are the minimum, repeats add up."""
    if old is None:
        return dict(new)
    merged = dict(new)
    merged["repeats"] = old.get("repeats", 1) + new.get("repeats", 1)
    merged["sdpa_ms"] = min(old["sdpa_ms"], new["sdpa_ms"])
    merged["kernel_ms"] = _min_known(old.get("kernel_ms"), new.get("kernel_ms"))
    if old.get("groups", 1) == new.get("groups", 1):
        merged["grouped_ms"] = _min_known(old.get("grouped_ms"), new.get("grouped_ms"))
    elif new.get("grouped_ms") is None:
        merged["groups"], merged["grouped_ms"] = old.get("groups", 1), old.get("grouped_ms")
    return merged


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _valid(entry) -> bool:
    if not isinstance(entry, dict) or not _number(entry.get("sdpa_ms")):
        return False
    times = [entry.get("kernel_ms"), entry.get("grouped_ms")]
    if not any(_number(t) for t in times) or any(t is not None and not _number(t) for t in times):
        return False
    repeats, groups = entry.get("repeats", 1), entry.get("groups", 1)
    return isinstance(repeats, int) and repeats >= 1 and isinstance(groups, int) and groups >= 1


class TimingCache:
    """The timing cache: a thread-safe JSON file of {key: {"kernel_ms", "grouped_ms", "groups", "sdpa_ms", "repeats",
    "nq", "nk", "when"}}, and of the self-tests passed ({self-test key: when})."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self._dir = Path(directory) if directory else None
        self._lock = threading.Lock()
        self._entries: dict[str, dict] | None = None
        self._passed: dict[str, str] = {}
        self._pending: dict[str, list] = {}  # measurements not yet written
        self._pending_passed: dict[str, str] = {}  # self-tests passed, not yet written
        self._reported: set = set()
        self.load_error: str | None = None

    @property
    def path(self) -> Path:
        return (self._dir or default_dir()) / FILE_NAME

    def _report(self, kind: str, text: str) -> None:
        self.load_error = text
        if kind not in self._reported:
            self._reported.add(kind)
            log.warning("wan-sage: %s", text)

    def _read_disk(self) -> tuple[dict, dict] | None:
        """(timing entries, passed self-tests) on disk; empty when there is no file; None when it is unreadable
        (reported)."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}, {}
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's limit
            self._report("read", f"ignored unreadable timing cache {self.path}: {e}; it is rebuilt")
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            self._report("read", f"ignored timing cache {self.path} of an unknown or older format; it is rebuilt")
            return None
        passed = data.get(PASSED)
        passed = {k: v for k, v in passed.items() if isinstance(v, str)} if isinstance(passed, dict) else {}
        return {k: v for k, v in data["entries"].items() if _valid(v)}, passed

    def _ensure(self) -> dict:
        if self._entries is None:
            self._entries, self._passed = self._read_disk() or ({}, {})
        return self._entries

    def get(self, key: str) -> dict | None:
        e = self._entries
        if e is None:
            with self._lock:
                e = self._ensure()
        return e.get(key)

    def put(self, key: str, kernel_ms: float | None, sdpa_ms: float, nq: int, nk: int, save: bool = True, *,
            grouped_ms: float | None = None, groups: int = 1, repeats: int = 1) -> dict:
        """Merge one measurement (``repeats`` timings of it) into the entry of ``key``."""
        new = {"kernel_ms": None if kernel_ms is None else round(float(kernel_ms), 4),
               "grouped_ms": None if grouped_ms is None else round(float(grouped_ms), 4),
               "groups": int(groups), "sdpa_ms": round(float(sdpa_ms), 4), "repeats": int(repeats),
               "nq": int(nq), "nk": int(nk), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if not _valid(new):
            raise ValueError(f"not a timing: {new}")
        with self._lock:
            entries = self._ensure()
            entries[key] = _merge(entries.get(key), new)
            self._pending.setdefault(key, []).append(new)
            if save:
                self._save_locked()
            return dict(entries[key])

    def passed_self_test(self, key: str) -> bool:
        """Whether a process with this cache passed the self-test of ``key`` (:func:`self_test_key`)."""
        with self._lock:
            self._ensure()
            return key in self._passed

    def put_self_test_passed(self, key: str) -> None:
        """Keep a passed self-test (written at once: the warm-up that runs it has no later save); a pass the
        file already holds is not written again, so a start that passes as the last one did writes nothing."""
        with self._lock:
            self._ensure()
            if key in self._passed:
                return
            when = time.strftime("%Y-%m-%dT%H:%M:%S")
            self._passed[key] = self._pending_passed[key] = when
            self._save_locked()

    def save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        if not self._pending and not self._pending_passed:
            return
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with file_lock(path) as held:
                if not held:
                    self._report("lock", f"timing cache {path} stayed locked by another process; "
                                 "writing without the lock")
                disk = self._read_disk()
                if disk is None:  # unreadable: rebuilt from what this process knows
                    merged, passed = dict(self._entries or {}), dict(self._passed)
                else:
                    merged, passed = disk
                    for key, measurements in self._pending.items():
                        entry = merged.get(key)
                        for m in measurements:
                            entry = _merge(entry, m)
                        merged[key] = entry
                    passed.update(self._pending_passed)
                replace_atomically(path, json.dumps({"format": FORMAT, "entries": merged, PASSED: passed}, indent=1,
                                                    sort_keys=True).encode(), ".calib-")
            self._entries, self._passed = merged, passed
        except OSError as e:  # a read-only home must not break sampling: keep the timings in memory
            self._report("write", f"could not write timing cache {path}: {e}; timings are kept in memory")
        self._pending.clear()
        self._pending_passed.clear()

    def entries(self) -> dict:
        with self._lock:
            return {k: dict(v) for k, v in self._ensure().items()}


class CudaTimer:
    """The device time of the work one call queues on the current CUDA stream, between its start and
    :meth:`stop`, from two CUDA events.  Every timed call is measured alike, as it runs inside a
    sampling, where the host queues calls ahead of the device and their launches are hidden: the
    timer waits for the work queued before it (a call queued behind busy work would be timed from an
    earlier point than one behind an output check's host sync), then queues a short device-side wait
    (:data:`LAUNCH_COVER_CYCLES`) ahead of its start event, so the call's launches are queued while
    the device waits and its kernels run back to back from the start event on.  Nothing else waits
    until :meth:`ms` is read."""

    def __init__(self):
        import torch
        torch.cuda.current_stream().synchronize()
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record()

    def stop(self) -> None:
        self._end.record()

    def ms(self) -> float:
        self._end.synchronize()
        return self._start.elapsed_time(self._end)


# The device-side wait ahead of a timed call: about 1 ms at the 1.5-2 GHz clocks of current GPUs, over
# ten times the host time a patched call spends before its last launch (tens of microseconds).
LAUNCH_COVER_CYCLES = 2_000_000


def timer():
    """A started timer of the current stream (:class:`CudaTimer`; the unit tier's fake device replaces it)."""
    return CudaTimer()


# ------------------------------------------------------------------ timing a shape on its own calls
# Timed runs of each variant (and of SDPA) whose minimum is kept, after one untimed run each (the
# first launch: JIT, autotune, module loading).
TIMED_RUNS = 2


@dataclass(frozen=True)
class Step:
    """One call's part in a shape's timing: what runs it (``kernel`` None: SDPA), in how many head
    groups, and whether its time counts (the first run of each variant is a warm-up)."""

    kernel: str | None
    groups: int = 1
    timed: bool = True


@dataclass(frozen=True)
class Trial:
    kernel: str
    groups: int
    ms: float | None = None
    # "memory" (not run: it did not fit), "oom", "error", or the output check's failure:
    # "inaccurate" (beyond the accuracy bound against SDPA) or "nonfinite" (NaN/Inf)
    failure: str | None = None
    error: str | None = None  # what it raised, or what the output check measured (text only)
    need: int = 0  # for "oom": the bytes the variant needed


def schedule(variants) -> list:
    """The steps that time ``variants`` ((kernel, groups) pairs, in order) against SDPA: each
    variant's warm-up, then its :data:`TIMED_RUNS` timed runs; SDPA's warm-up after the first
    variant's, and SDPA's timed runs alternating with the first variant's."""
    steps = []
    for i, (kernel, groups) in enumerate(variants):
        steps.append(Step(kernel, groups, timed=False))
        if i == 0:
            steps.append(Step(None, timed=False))
        for _ in range(TIMED_RUNS):
            steps.append(Step(kernel, groups))
            if i == 0:
                steps.append(Step(None))
    return steps


class ShapeTrial:
    """The timing of one call shape on the calls themselves: each call of the shape takes the next
    :class:`Step` (:meth:`take`), runs it for its own output, and reports back (:meth:`done`), so the
    timing runs nothing the calls would not run anyway.  A variant that fails (memory, out of memory,
    error, wrong output) loses its remaining steps; after an error or a wrong output, so do the
    kernel's other variants; once no kernel step is left, SDPA's are dropped too.  Thread-safe; the
    caller that reports the last step gets True from :meth:`done` and reads :meth:`result`."""

    def __init__(self, steps):
        self._lock = threading.Lock()
        self._steps = list(steps)
        self._running = 0
        self._finished = False
        self._timers: dict = {}  # (kernel, groups) -> [timer]; (None, 1): SDPA
        self._failures: dict = {}  # (kernel, groups) -> Trial with its failure
        self._order = list(dict.fromkeys((s.kernel, s.groups) for s in self._steps if s.kernel is not None))
        self.started = time.perf_counter()

    def take(self) -> Step | None:
        """The next step, or None when none is left (the caller then runs the shape as it settles)."""
        with self._lock:
            if not self._steps or self._finished:
                return None
            self._running += 1
            return self._steps.pop(0)

    @property
    def kernels(self) -> tuple:
        """The kernels the trial times, in order."""
        return tuple(dict.fromkeys(v[0] for v in self._order))

    def done(self, step: Step, timer=None, failure: str | None = None, error: str | None = None,
             whole_kernel: bool = False, need: int = 0) -> bool:
        """Report a step: its timer (when timed and it ran), or its ``failure`` (``whole_kernel``: the
        kernel's other variants lose their steps too; ``need``: the bytes it needed, for "oom").
        True exactly once: for the report that ends the trial."""
        with self._lock:
            self._running -= 1
            variant = (step.kernel, step.groups)
            if failure is not None:
                self._failures.setdefault(variant, Trial(step.kernel, step.groups, failure=failure, error=error,
                                                          need=need))
                self._steps = [s for s in self._steps if s.kernel != step.kernel
                               or (not whole_kernel and s.groups != step.groups)]
                if whole_kernel:
                    for v in self._order:
                        if v[0] == step.kernel and v not in self._failures:
                            self._failures[v] = Trial(v[0], v[1], failure=failure, error=error)
            elif timer is not None and step.timed:
                self._timers.setdefault(variant, []).append(timer)
            if not any(s.kernel is not None for s in self._steps):
                self._steps = []
            if self._steps or self._running or self._finished:
                return False
            self._finished = True
            return True

    def result(self) -> tuple:
        """(SDPA's ms or None, [Trial] per variant in schedule order): the least time of each
        variant's timed runs (read now: waits for the last of them), or its failure."""
        def least(timers):
            return min(t.ms() for t in timers) if timers else None
        sdpa_ms = least(self._timers.get((None, 1), []))
        trials = []
        for variant in self._order:
            if variant in self._failures:
                trials.append(self._failures[variant])
            elif variant in self._timers:
                trials.append(Trial(variant[0], variant[1], ms=least(self._timers[variant])))
        return sdpa_ms, trials
