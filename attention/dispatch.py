"""The names the nodes, the bench harness and the tests import as ``attention.dispatch``: the
patch options, the override, the plan of a call, and the process-wide resets and reports.

The dispatch itself is split by job: :mod:`.policy` (static eligibility), :mod:`.planning`
(candidates and the choice from timings), :mod:`.execution` (memory fit, head split, the run,
fallbacks, the NaN/Inf guard), :mod:`.timing` (calibration and its cache), :mod:`.state` (all
mutable state), :mod:`.op` (the custom op) and :mod:`.override` (the callable).
"""
from .config import PatchConfig
from .override import SageAttentionOverride, reset_state, self_test_failures, settled_shapes
from .planning import Plan

__all__ = ["PatchConfig", "SageAttentionOverride", "Plan", "reset_state", "self_test_failures", "settled_shapes"]
