"""The user-facing options of one Sage attention patch (:class:`PatchConfig`)."""
from __future__ import annotations

from dataclasses import dataclass

from .head_groups import MEMORY_MODES
from .registry import KERNELS

__all__ = ["PatchConfig"]


@dataclass(frozen=True)
class PatchConfig:
    """Options of the patch.  Immutable and hashable (decisions are kept per config)."""

    kernel: str = "auto"  # "auto" or a registry kernel name
    min_tokens: int = 1024  # below this many query tokens, SDPA (launch/quantisation overhead)
    calibrate: bool = True  # time kernels vs SDPA on the real call the first time its timing-cache key is seen
    calibration_budget_s: float = 30.0  # per process, over all shapes, failed calibrations included
    memory_margin_mb: int = 256  # kept free on top of the kernel's exact extra bytes
    # check outputs (the first calls per shape, then a sample): NaN/Inf, and a slice of query rows
    # against SDPA within the accuracy bound (calibration checks every candidate whatever this says)
    check_finite: bool = True
    self_test: bool = True
    cache_dir: str | None = None
    label: str = ""
    node_id: str | None = None  # the ComfyUI node that made the patch (for the UI's stats)
    # "sdpa": split Sage calls into head groups so that they need about SDPA's memory (used where
    # calibration measures the split at most 2 % slower); "fastest": never split unless VRAM is short.
    memory_mode: str = "sdpa"

    def __post_init__(self):
        if self.kernel != "auto" and self.kernel not in KERNELS:
            raise ValueError(f"unknown kernel {self.kernel!r}; choose auto or one of {', '.join(KERNELS)}")
        for name in ("min_tokens", "memory_margin_mb", "calibration_budget_s"):
            value = getattr(self, name)
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must be 0 or more, got {value!r}")
        if self.memory_mode not in MEMORY_MODES:
            raise ValueError(f"memory_mode must be one of {', '.join(MEMORY_MODES)}; got {self.memory_mode!r}")
