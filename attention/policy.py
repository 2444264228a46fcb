"""Static eligibility: which attention calls may leave SDPA, judged from the call alone, and the
named reason for every refusal.

Everything here reads only tensor attributes (device type, dtype, ndim, shape, requires_grad),
the call's kwargs and the patch's options, so ``torch.compile`` traces it without a graph break;
the rest of the decision is made at run time inside the custom op (:mod:`.execution`).

Every refusal has a short reason code that the stats count and the UI shows:

=================  ==========================================================================
cpu                the tensors are not on a CUDA device
mask               an attention mask is present (the Sage entry points ignore masks)
low_precision_off  the call site passed ``low_precision_attention=False``
gqa                grouped-query attention / k-v heads differ from q heads
dtype              not a dtype any registered kernel takes (fp16, bf16)
grad               autograd is recording through q, k or v (the kernels have no backward)
layout             q is not [B, N, H*D] or [B, H, N, D]
short              fewer query tokens than the patch's threshold
head_dim           no available kernel supports this head dim (or dtype)
cross_slower       cross-attention (short K: 512 text, 257+512 with an image) where SDPA is faster
slower             SDPA measured faster for this shape (on its first calls, or in the timing cache)
timing             the shape is being timed on its first calls, and this call was SDPA's turn
no_kernel          no kernel is usable on this device (the log says why, once)
disabled           the kernel failed its numerical self-test
failed             the kernel raised on this (device, dtype, head dim) before; not retried
memory             not even one head group fits in free VRAM (checked, or learnt from an
                   out-of-memory error on this shape until free memory grows by what it needs)
oom / error / nonfinite   the kernel ran out of memory, raised, or returned NaN/Inf; redone on SDPA
inaccurate         the kernel's output is beyond the accuracy bound against SDPA (calibration, or
                   a sampled check, which redoes that call on SDPA; :mod:`.accuracy`),
                   or the call is longer than the kernel's token limit on this architecture
=================  ==========================================================================

The first eight are static (the override hands those calls to the previous override or SDPA);
the rest are decided at run time (the op runs SDPA itself).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .registry import KERNELS

__all__ = ["static_reason", "options_allow", "call_shape", "CallShape", "is_cross", "REASONS", "STATIC_REASONS",
           "SHAPE_REASONS", "CROSS_MAX_NK", "ELIGIBLE_DTYPES", "DTYPE_NAMES"]

STATIC_REASONS = ("cpu", "mask", "low_precision_off", "gqa", "dtype", "grad", "layout", "short")
# The static refusals decided by the dtypes and shapes of q/k/v, the heads, the layout flags and the
# patch's options alone, once :func:`options_allow` holds: the same for every call alike.
SHAPE_REASONS = ("dtype", "layout", "gqa", "short")
REASONS = STATIC_REASONS + ("head_dim", "cross_slower", "slower", "timing", "no_kernel", "disabled", "failed", "memory",
                            "oom", "error", "nonfinite", "inaccurate")

# Wan's text context is 512 tokens (T5 min_length) and CLIP image context 257 (514 for FLF2V);
# anything up to 2048 keys against a much longer query is treated as cross-attention.
CROSS_MAX_NK = 2048

# Device types the Sage kernels run on.  (The unit tests widen this to exercise the dispatcher's
# logic with injected kernels on a CPU.)
ACCEL_DEVICE_TYPES = ("cuda",)

DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Dtypes at least one registered kernel declares; each kernel's own list is checked at run time.
ELIGIBLE_DTYPES = tuple(dtype for dtype, name in DTYPE_NAMES.items()
                        if any(name in spec.dtypes for spec in KERNELS.values()))


def static_reason(q, k, v, mask, kwargs) -> str | None:
    """Reasons that need nothing beyond the tensors' own attributes and the kwargs.  (Runs on
    every call: each attribute is read once, and ``is_cuda`` spares a CUDA tensor the device
    object.)"""
    if not q.is_cuda and q.device.type not in ACCEL_DEVICE_TYPES:
        return "cpu"
    if mask is not None:
        return "mask"
    if kwargs.get("low_precision_attention", True) is False:
        return "low_precision_off"
    if kwargs.get("enable_gqa", False):
        return "gqa"
    dtype = q.dtype
    if dtype not in ELIGIBLE_DTYPES or k.dtype != dtype or v.dtype != dtype:
        return "dtype"
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return "grad"
    return None


def options_allow(q, k, v, mask, kwargs) -> bool:
    """Whether the per-call part of :func:`static_reason` lets the call through: no mask, low
    precision not turned off, no grouped-query kwarg, no autograd recording.  (The rest of the
    static checks reads only what decides them once for a shape: device, dtypes and shapes.)"""
    return (mask is None and kwargs.get("low_precision_attention", True) is not False
            and not kwargs.get("enable_gqa", False)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


class CallShape(NamedTuple):
    """The shape of one attention call: batch, heads, query and key lengths, head dim, the layout
    q/k/v arrive in (``layout``) and the layout the caller wants the output in (``out_layout``).

    Built by :func:`call_shape` once per call, also inside ``torch.compile``'s traced region (the
    override's static checks): dynamo traces the construction of this named tuple without a graph
    break (tests/unit/test_compile.py).  A named tuple is cheap to build and hashes in C, which the
    per-call lookup of a settled decision needs; its fields are read by name."""

    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    layout: str  # "NHD": q/k/v [B, N, H*D] (k/v possibly [B, N, H, D]); "HND": [B, H, N, D]
    out_layout: str  # "NHD": output [B, N, H*D]; "HND": [B, H, N, D]
    # The call site handed q over (ComfyUI's attention containers, q held nowhere else), so a kernel may
    # write the output into q's memory; a call of the same shape that did not is another call shape.
    into_q: bool = False


# A named tuple built from its fields in order without its Python-level __new__ (a third of the cost).
_new = tuple.__new__


def call_shape(q, k, heads: int, skip_reshape: bool, skip_output_reshape: bool) -> CallShape | str:
    """The :class:`CallShape` of a call in either of ComfyUI's layouts, or the reason code when the
    shapes do not make one attention call.  ``layout`` is "NHD" for [B, N, H*D] (k/v possibly 4-D,
    as in Wan's Animate face block) and "HND" for [B, H, N, D] (``skip_reshape``); ``out_layout``
    is "HND" with ``skip_output_reshape``, else "NHD"."""
    out_layout = "HND" if skip_output_reshape else "NHD"
    q_shape, k_shape = q.shape, k.shape
    if skip_reshape:
        if len(q_shape) != 4 or len(k_shape) != 4:
            return "layout"
        B, H, Nq, D = q_shape
        if k_shape[1] != H:
            return "gqa"
        return _new(CallShape, (B, H, Nq, k_shape[2], D, "HND", out_layout, False))
    if len(q_shape) != 3 or q_shape[2] % heads:
        return "layout"
    B, Nq, C = q_shape
    D = C // heads
    n, row = k.numel(), B * C  # k's elements, and those of one key token over the batch (B * H * D)
    if n % row or (len(k_shape) == 3 and k_shape[2] != C) or (len(k_shape) == 4 and k_shape[2] != heads):
        return "gqa"
    return _new(CallShape, (B, heads, Nq, n // row, D, "NHD", out_layout, False))


def is_cross(nq: int, nk: int) -> bool:
    return nk != nq and nk <= CROSS_MAX_NK
