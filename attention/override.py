"""The callable ComfyUI calls for every attention call of a patched model:
:class:`SageAttentionOverride`, installed as ``transformer_options["optimized_attention_override"]``.

Its ``__call__`` does only what ``torch.compile`` can trace: the static checks of
:mod:`.policy` (tensor attributes, kwargs, the patch's ``min_tokens``).  A call they decline goes
to the override that was installed before this one (``prev(func, ...)``), else to SDPA, exactly
as ComfyUI would run it.  An eligible call goes to the run-time part
(:func:`.execution.run_attention`): directly in eager mode, through the custom op
``wan_sage::attention`` (:mod:`.op`) while being compiled, so the compiler sees one node.  Calls
declined at run time (slower, cross_slower, memory, oom, error, nonfinite, no_kernel, disabled,
failed, head_dim) run SDPA inside the run-time part; ``prev`` receives only the calls declined
statically.

The override is immutable, holds no tensors, deep-copies to itself and pickles by its arguments;
all mutable state lives in :mod:`.state`.
"""
from __future__ import annotations

import uuid
from typing import Callable

import torch

from . import execution, op, policy, stats
from .config import PatchConfig
from .planning import Plan
from .sdpa import attention_sdpa
from .state import STATE

__all__ = ["SageAttentionOverride", "self_test_failures", "settled_shapes"]

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


def self_test_failures() -> dict:
    """{kernel name: why its numerical self-test failed} for the kernels this process disabled."""
    with STATE.lock:
        return dict(STATE.self_test_names)


def settled_shapes() -> list:
    """The decisions this process has settled, one per call shape: the kernel (None: SDPA, with
    the reason) and the head groups it runs in, with the exact extra bytes checked before each
    call.  What the working-memory estimate can read to model the memory mode as it runs (where
    calibration measured the split too costly, a shape runs ungrouped)."""
    with STATE.lock:
        items = list(STATE.decisions.items())
    shapes = []
    for key, decision in items:
        s = key.shape
        shapes.append({"device_index": key.device_index, "dtype": str(key.dtype).replace("torch.", ""), "B": s.B,
                       "H": s.H, "Nq": s.Nq, "Nk": s.Nk, "D": s.D, "layout": s.layout, "kernel": decision.kernel,
                       "reason": decision.reason, "groups": decision.groups, "need_bytes": decision.need})
    return shapes


class SageAttentionOverride:
    """``override(func, q, k, v, heads, **kwargs)`` with ComfyUI's attention signature."""

    __slots__ = ("config", "prev", "sdpa", "free_memory", "patch_id", "config_key", "graph_key", "__weakref__")

    def __init__(self, config: PatchConfig | None = None, prev: Callable | None = None,
                 sdpa: Callable | None = None, free_memory: Callable | None = None,
                 patch_id: str | None = None):
        config = config or PatchConfig()
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "prev", prev)
        object.__setattr__(self, "sdpa", sdpa or attention_sdpa)
        object.__setattr__(self, "free_memory", free_memory)
        object.__setattr__(self, "patch_id", patch_id or uuid.uuid4().hex[:12])
        object.__setattr__(self, "config_key", STATE.config_key(config))
        object.__setattr__(self, "graph_key", STATE.graph_key(config))
        STATE.register_patch(self.patch_id, self)

    def __setattr__(self, name, value):
        raise AttributeError("SageAttentionOverride is immutable")

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        return (SageAttentionOverride, (self.config, self.prev, self.sdpa, self.free_memory, self.patch_id))

    def __repr__(self):
        return (f"SageAttentionOverride(id={self.patch_id}, kernel={self.config.kernel}, "
                f"chained={self.prev is not None})")

    # ------------------------------------------------------------------ the traced part
    def _static(self, args, kwargs):
        """(q, k, v, heads, skip_reshape, skip_output_reshape, call shape, reason or None)."""
        q, k, v = args[0], args[1], args[2]
        heads = kwargs["heads"] if "heads" in kwargs else args[3]
        mask = kwargs["mask"] if "mask" in kwargs else (args[4] if len(args) > 4 else None)
        skip_reshape = kwargs["skip_reshape"] if "skip_reshape" in kwargs else (args[6] if len(args) > 6 else False)
        skip_out = kwargs["skip_output_reshape"] if "skip_output_reshape" in kwargs else (
            args[7] if len(args) > 7 else False)
        reason = policy.static_reason(q, k, v, mask, kwargs)
        shape = None
        if reason is None:
            shape = policy.call_shape(q, k, heads, skip_reshape, skip_out)
            if isinstance(shape, str):
                reason = shape
            elif shape.Nq < self.config.min_tokens:
                reason = "short"
        return q, k, v, heads, bool(skip_reshape), bool(skip_out), shape, reason

    def __call__(self, func, *args, **kwargs):
        q, k, v, heads, skip_reshape, skip_out, shape, reason = self._static(args, kwargs)
        if reason is not None:
            if not _is_compiling():
                stats.record(self.patch_id, reason=reason)
            if self.prev is not None:
                return self.prev(func, *args, **kwargs)
            return self.sdpa(*args, **kwargs)
        scale = kwargs.get("scale")
        scale = None if scale is None else float(scale)
        if _is_compiling():
            return op.call_attention(q, k, v, heads, skip_reshape, skip_out, scale, self.graph_key)
        return execution.run_attention(self, q, k, v, heads, skip_reshape, skip_out, scale, shape)

    def plan(self, q, k, v, heads, args=(), kwargs=None) -> Plan:
        """What a call would do, without running a kernel (except a kernel's one-time self-test):
        the static checks plus the run-time decision, including the free-memory check."""
        kwargs = dict(kwargs or {})
        kwargs.setdefault("heads", heads)
        q, k, v, heads, skip_reshape, skip_out, shape, reason = self._static(tuple(args) or (q, k, v), kwargs)
        if reason is not None:
            return Plan(kernel=None, reason=reason)
        return execution.decide(self, q, shape, claim=False)
