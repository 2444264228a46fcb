"""All mutable state of wan-sage's attention dispatcher, in one object behind one lock.

What the process has learnt lives here: the kernels each device offers, self-test verdicts,
kernels that raised, kernels whose output was rejected on a call shape, the settled
:class:`Decision` per :class:`CallKey`, the call key (or static refusal) of eager calls seen
before, calibration spend, remembered out-of-memory errors, output-check counters, the timing
caches, the registry of live patches (looked up by the custom op through graph keys), the probe
of installed kernel packages and the run statistics.

Rules: every write holds :attr:`DispatchState.lock`; reads on the hot path are single dict
lookups without it; nothing here runs GPU work, and callers never run GPU work (self-tests,
timing, kernels) while holding the lock.  (A timing cache, :class:`.timing.TimingCache`, is also
used on its own by ``wan-sage bench``; it guards its entries and file writes with a lock of its
own.)  Torch-free.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .policy import CallShape

__all__ = ["DispatchState", "STATE", "CallKey", "SelfTestKey", "FailureKey", "Decision", "OomMemory",
           "SelfTestTicket"]


class CallKey(NamedTuple):
    """What a decision is kept per: the patch's options (their :meth:`DispatchState.config_key`),
    the normalised device index, the dtype and the call's shape.  Built once per call, so it is a
    named tuple: cheap to build, hashed in C; its fields are read by name."""

    config_key: int
    device_index: int
    dtype: object  # torch.dtype
    shape: CallShape


@dataclass(frozen=True, slots=True)
class SelfTestKey:
    """What a self-test verdict is kept per."""

    device_index: int
    kernel: str
    dtype: object  # torch.dtype


@dataclass(frozen=True, slots=True)
class FailureKey:
    """Where a kernel raised: it is not used there again."""

    device_index: int
    kernel: str
    dtype: object  # torch.dtype
    head_dim: int


@dataclass(frozen=True)
class Decision:
    """What the dispatcher settled for one call key (patch options, device, dtype, call shape)."""

    kernel: str | None  # None: SDPA for ``reason``
    reason: str | None = None
    groups: int = 1  # head groups in force: the memory mode's (or calibration's) count, raised when VRAM is short
    need: int = 0  # bytes that must be free before a call with ``groups`` (formula, margins, output copy)
    saved_ms: float = 0.0  # measured SDPA time minus kernel time (0 when not measured)
    cc: int = 0
    output_copy: bool = False  # the ungrouped kernel output needs a copy into the caller's layout
    into_q: bool = False  # the kernel writes the output into q's memory (the call site handed q over)


@dataclass(frozen=True)
class OomMemory:
    """A kernel ran out of memory on a call shape: what was available then and what it needed."""

    available: int
    need: int


class SelfTestTicket:
    """Handed out by :meth:`DispatchState.begin_self_test`: ``run`` is True for the one caller
    that must run the test; the others wait on ``done``."""

    __slots__ = ("run", "done")

    def __init__(self, run: bool, done: threading.Event):
        self.run = run
        self.done = done


class Declined:
    """A call that goes straight to SDPA: the patch, why, whether to the previous override (``static``),
    and the calls served so since :mod:`.stats` last took the count (counted without the lock, as
    :func:`.stats.count_sdpa` counts)."""

    __slots__ = ("patch_id", "reason", "static", "calls")

    def __init__(self, patch_id: str, reason: str, static: bool):
        self.patch_id, self.reason, self.static, self.calls = patch_id, reason, static, 0


class DispatchState:
    def __init__(self):
        self.lock = threading.Lock()
        self.patches = weakref.WeakValueDictionary()  # patch id -> live SageAttentionOverride
        # graph key -> {patch id: None} in order of registration: the patches that behave alike, which
        # one compiled graph serves (see graph_key)
        self.graph_members: dict = {}
        self.runs_current: dict = {}  # patch id -> stats.RunStats (open window)
        self.runs_last: dict = {}  # patch id -> summary of the last closed window
        self.probe = None  # kernels.Probe of the installed packages
        self.entry_points: dict = {}  # kernel name -> callable entry point
        self.into_q_modules: dict = {}  # kernel name -> module of its write-into-q pieces, or None
        self.build_ids: dict = {}  # package -> build identity
        self.config_keys: dict = {}  # PatchConfig -> small int used in call keys
        self.declined_calls: dict = {}  # see _clear_decisions
        self.declined_counts: dict = {}  # patch id -> {reason: calls} counted by dropped Declined entries
        self._clear_decisions()

    def _clear_decisions(self) -> None:
        self.devices: dict = {}  # (device index, kernel choice) -> planning.DeviceInfo
        self.self_tests: dict = {}  # SelfTestKey -> None (passed) | failure text
        self.self_tests_pending: dict = {}  # SelfTestKey -> threading.Event while a test runs
        self.self_test_names: dict = {}  # kernel -> failure text of its last failed self-test
        self.failed: dict = {}  # FailureKey -> what it raised
        self.timing_caches: dict = {}  # cache directory -> timing.TimingCache
        self.calibration_spent_s = 0.0
        self.logged: set = set()
        self.decisions: dict = {}  # CallKey -> Decision
        self.calibration_claimed: set = set()  # CallKeys whose timing has started (once per process)
        self.trials: dict = {}  # CallKey -> timing.ShapeTrial in progress (the shape's first calls)
        self.timed_here: set = set()  # timing-cache keys this process measured
        self.ooms: dict = {}  # CallKey -> OomMemory
        self.calls: dict = {}  # (kernel, CallKey) -> calls run (output-check sampling)
        self.rejected: dict = {}  # (kernel, CallKey) -> why its output was rejected there (not used there again)
        # facts of an eager call that decide its static shape checks (patch options, device, dtypes,
        # shapes, heads, layout flags) -> its CallKey, or the static refusal they make (SHAPE_REASONS)
        self.seen_calls: dict = {}
        # a patch's call that goes straight to SDPA -> its Declined entry: a static shape refusal (static:
        # to the previous override, as the full checks send it) or a shape settled on SDPA; one lookup on
        # the hot path.  Keyed by the patch id and the call's facts (override.py builds the keys).  Emptied
        # whenever a decision is written, so it never outlives one; the calls it counted move to
        # declined_counts first.
        self._drop_declined()

    def reset(self) -> None:
        """Forget every decision (tests; after reinstalling a kernel).  Live patches, the package
        probe and run statistics stay."""
        with self.lock:
            self._clear_decisions()

    # ---------------------------------------------------------------- small writes
    def config_key(self, config) -> int:
        key = self.config_keys.get(config)
        if key is None:
            with self.lock:
                key = self.config_keys.setdefault(config, len(self.config_keys))
        return key

    def log_once(self, key) -> bool:
        """True the first time ``key`` is seen (the caller logs), False afterwards."""
        if key in self.logged:
            return False
        with self.lock:
            if key in self.logged:
                return False
            self.logged.add(key)
            return True

    def set_device(self, key, info) -> None:
        with self.lock:
            self.devices[key] = info

    def timing_cache(self, directory: str, factory):
        found = self.timing_caches.get(directory)
        if found is None:
            with self.lock:
                found = self.timing_caches.get(directory)
                if found is None:
                    found = self.timing_caches[directory] = factory(directory)
        return found

    def charge_calibration(self, seconds: float) -> None:
        with self.lock:
            self.calibration_spent_s += seconds

    def mark_failed(self, key: FailureKey, text: str) -> None:
        """A kernel raised on (device, dtype, head dim): never retried there; decisions that used
        it are forgotten so that their shapes plan again without it."""
        with self.lock:
            self.failed[key] = text
            for call_key, decision in list(self.decisions.items()):
                if decision.kernel == key.kernel:
                    del self.decisions[call_key]
            self._drop_declined()

    def settle(self, call_key, decision: Decision) -> None:
        with self.lock:
            self.decisions[call_key] = decision
            self._drop_declined()

    def settle_if_absent(self, call_key, decision: Decision) -> Decision:
        """Settle ``call_key`` unless it is settled already; returns the decision in force."""
        with self.lock:
            found = self.decisions.setdefault(call_key, decision)
            if found is decision:
                self._drop_declined()
            return found

    def claim_calibration(self, call_key, trial=None) -> bool:
        """True for the first caller, whose ``trial`` (a :class:`.timing.ShapeTrial`) then times the
        shape on its calls; False when this shape was claimed before."""
        with self.lock:
            if call_key in self.calibration_claimed:
                return False
            self.calibration_claimed.add(call_key)
            if trial is not None:
                self.trials[call_key] = trial
            return True

    def end_trial(self, call_key) -> None:
        with self.lock:
            self.trials.pop(call_key, None)

    def add_timed(self, keys) -> None:
        with self.lock:
            self.timed_here.update(keys)

    def reject(self, kernel: str, call_key, failure: str) -> None:
        """Kernel ``kernel`` gave a wrong output (``failure``: "inaccurate" or "nonfinite") on
        ``call_key``: it does not serve that call key again in this process."""
        with self.lock:
            self.rejected[(kernel, call_key)] = failure

    def remember_call(self, seen: tuple, found) -> None:
        with self.lock:
            self.seen_calls[seen] = found

    def remember_declined(self, key: tuple, patch_id: str, reason: str, static: bool, call_key=None,
                          decision=None) -> None:
        """Patch ``patch_id``'s call ``key`` goes straight to SDPA for ``reason`` from now on; for a
        shape settled on SDPA (``decision``, the one read for ``call_key``), only while that decision is
        still the one in force (a decision written meanwhile empties the table)."""
        with self.lock:
            if decision is None or self.decisions.get(call_key) is decision:
                self.declined_calls[key] = Declined(patch_id, reason, static)

    def _fold_declined(self) -> None:
        """Move the calls the declined table's entries counted into ``declined_counts`` (under the lock)."""
        for entry in self.declined_calls.values():
            if entry.calls:
                counts = self.declined_counts.setdefault(entry.patch_id, {})
                counts[entry.reason] = counts.get(entry.reason, 0) + entry.calls
                entry.calls = 0

    def _drop_declined(self) -> None:
        """Empty the declined table, keeping the calls its entries counted (under the lock)."""
        self._fold_declined()
        self.declined_calls.clear()

    def take_declined_counts(self, patch_id: str) -> dict:
        """{reason: calls} that went straight to SDPA for ``patch_id`` since the last take (under the
        lock; :mod:`.stats` adds them to the patch's window)."""
        self._fold_declined()
        return self.declined_counts.pop(patch_id, {})

    def remember_oom(self, call_key, memory: OomMemory) -> None:
        with self.lock:
            self.ooms[call_key] = memory

    def forget_oom(self, call_key) -> None:
        with self.lock:
            self.ooms.pop(call_key, None)

    def count_call(self, key) -> int:
        """Count one kernel call of (kernel, call key); returns the count including this one."""
        with self.lock:
            n = self.calls.get(key, 0) + 1
            self.calls[key] = n
            return n

    # ---------------------------------------------------------------- self-tests
    def begin_self_test(self, key: SelfTestKey) -> SelfTestTicket | None:
        """None when the verdict is known; else a ticket (run it, or wait for the one who does)."""
        with self.lock:
            if key in self.self_tests:
                return None
            event = self.self_tests_pending.get(key)
            if event is not None:
                return SelfTestTicket(False, event)
            event = self.self_tests_pending[key] = threading.Event()
            return SelfTestTicket(True, event)

    def finish_self_test(self, key: SelfTestKey, verdict: str | None) -> None:
        with self.lock:
            self.self_tests[key] = verdict
            if verdict is not None:
                self.self_test_names[key.kernel] = verdict
            event = self.self_tests_pending.pop(key, None)
        if event is not None:
            event.set()

    # ---------------------------------------------------------------- patches
    def register_patch(self, patch_id: str, override) -> None:
        with self.lock:
            self.patches[patch_id] = override
            members = self.graph_members.setdefault(override.graph_key, {})
            for gone in [pid for pid in members if pid not in self.patches]:
                del members[gone]
            members.pop(patch_id, None)
            members[patch_id] = None

    def graph_key(self, config) -> str:
        """The name a compiled graph calls a patch by: the same for every patch with these options,
        whatever node made it (its label and node id are left out), so that a second expert, or the
        same patch made again, reuses the compiled graph instead of recompiling it."""
        return f"g{self.config_key(replace(config, label='', node_id=None))}"

    def override_for(self, key: str):
        """The live patch a compiled call named ``key`` runs as: of the patches behind that graph key,
        the one whose stats window opened last (the model being sampled), else the one made last.  A
        plain patch id names its own patch.  None when none is alive."""
        members = self.graph_members.get(key)
        if members is None:
            return self.patches.get(key)
        for pid in reversed(list(self.runs_current)):
            if pid in members and (ov := self.patches.get(pid)) is not None:
                return ov
        for pid in reversed(list(members)):
            if (ov := self.patches.get(pid)) is not None:
                return ov
        return None


STATE = DispatchState()
