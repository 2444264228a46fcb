"""Eligibility rules: which attention calls may leave SDPA, and the named reason when not.

Every refusal has a short reason code that the stats count and the UI shows:

=================  ==========================================================================
cpu                the tensors are not on a CUDA device
mask               an attention mask is present (the Sage entry points ignore masks)
low_precision_off  the call site passed ``low_precision_attention=False``
gqa                grouped-query attention / k-v heads differ from q heads
dtype              not fp16 or bf16
layout             q is not [B, N, H*D] or [B, H, N, D]
head_dim           no available kernel supports this head dim
short              fewer query tokens than the patch's threshold
cross_slower       cross-attention (short K: 512 text, 257+512 with an image) where SDPA is faster
slower             calibration measured SDPA as faster for this shape bucket
no_kernel          no kernel is usable on this device (the log says why, once)
disabled           the kernel failed its numerical self-test
failed             the kernel raised on this (device, dtype, head dim) before; not retried
memory             not even one head group fits in free VRAM
oom / error / nonfinite   the kernel ran out of memory, raised, or returned NaN/Inf; redone on SDPA
=================  ==========================================================================
"""
from __future__ import annotations

__all__ = ["static_reason", "is_cross", "REASONS", "CROSS_MAX_NK"]

REASONS = ("cpu", "mask", "low_precision_off", "gqa", "dtype", "layout", "head_dim", "short",
           "cross_slower", "slower", "no_kernel", "disabled", "failed", "memory", "oom", "error", "nonfinite")

# Wan's text context is 512 tokens (T5 min_length) and CLIP image context 257 (514 for FLF2V);
# anything up to 2048 keys against a much longer query is treated as cross-attention.
CROSS_MAX_NK = 2048

# Device types the Sage kernels run on.  (The unit tests widen this to exercise the dispatch
# logic with injected kernels on a CPU.)
ACCEL_DEVICE_TYPES = ("cuda",)


def static_reason(q, k, v, mask, kwargs, fp_dtypes) -> str | None:
    """Reasons that need no shape or device knowledge beyond the tensors' own attributes."""
    if q.device.type not in ACCEL_DEVICE_TYPES:
        return "cpu"
    if mask is not None:
        return "mask"
    if kwargs.get("low_precision_attention", True) is False:
        return "low_precision_off"
    if kwargs.get("enable_gqa", False):
        return "gqa"
    if q.dtype not in fp_dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        return "dtype"
    return None


def is_cross(nq: int, nk: int) -> bool:
    return nk != nq and nk <= CROSS_MAX_NK
