"""Attention core of wan-sage: kernels, exact memory formulas, eligibility, calibration, the
override callable, and run statistics.  Imports no ComfyUI, so it is testable on a CPU."""
from .dispatch import PatchConfig, SageAttentionOverride, reset_state  # noqa: F401
from .kernel_bytes import AttnShape, extra_bytes  # noqa: F401
from . import kernels, stats, timing, policy  # noqa: F401
