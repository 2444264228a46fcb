"""The callable ComfyUI calls for every attention call of a patched model:
:class:`SageAttentionOverride`, installed as ``transformer_options["optimized_attention_override"]``.

While ``torch.compile`` traces it, its ``__call__`` does only what can be traced: the static
checks of :mod:`.policy` (tensor attributes, kwargs, the patch's ``min_tokens``).  A call they
decline goes to the override that was installed before this one (``prev(func, ...)``), else to
SDPA, exactly as ComfyUI would run it.  An eligible call goes to the run-time part
(:func:`.execution.run_attention`): directly in eager mode, through the custom op
``wan_sage::attention`` (:mod:`.op`) while being compiled, so the compiler sees one node.

In eager mode a call like one seen before skips the static shape checks (its call key, or its
static refusal, is found by the facts that decide them; its per-call options are checked again),
and a call whose shape is settled on SDPA does not reach the run-time part: one lookup of its call
key, its count, and SDPA.  Calls declined at run time (slower, cross_slower, memory, oom, error,
nonfinite, inaccurate, no_kernel, disabled, failed, head_dim) run SDPA inside the run-time part,
or here when settled; ``prev`` receives only the calls declined statically.

On ComfyUI 0.38 and newer a call site that wraps q/k/v in ``AttentionTensorContainer``s reaches
:meth:`SageAttentionOverride.container_function` instead, which takes the tensors and dispatches them
the same way.

The override is immutable, holds no tensors, deep-copies to itself and pickles by its arguments;
all mutable state lives in :mod:`.state`.
"""
from __future__ import annotations

import logging
import sys
import threading
import uuid
from typing import Callable

import torch

from . import execution, op, planning, policy, stats
from .config import PatchConfig
from .planning import Plan
from .sdpa import attention_sdpa
from .state import STATE

__all__ = ["SageAttentionOverride", "self_test_failures", "settled_shapes", "self_attention_groups"]

# The keyword arguments of Wan's attention calls as the override receives them: ComfyUI's ``wrap_attn``
# adds ``_inside_attn_wrapper`` (and pops 0.38's ``preferred_attention``); a direct call has neither.
_WAN_KWARGS = frozenset(("heads", "transformer_options", "_inside_attn_wrapper"))
_WAN_KWARGS_DIRECT = frozenset(("heads", "transformer_options"))

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _holders(t) -> tuple:
    """(Python references to ``t``, tensors on ``t``'s storage), counted the same way for every caller."""
    return sys.getrefcount(t), _storage_use_count(t.untyped_storage()._cdata)


def _counted(t) -> tuple:
    return _holders(t)  # one call deep, as _handed_over reads it


def _sole_holder_counts() -> tuple | None:
    """What :func:`_handed_over` reads for a tensor held by one local variable of its caller and by nothing
    else (None where torch cannot count a storage's tensors)."""
    if _storage_use_count is None:
        return None
    t = torch.empty(1)
    return _counted(t)


_SOLE = _sole_holder_counts()


def _into_q_op_takes(shape) -> bool:
    """Whether the write-into-q op (registered) takes a statically eligible call of this shape: self-attention
    with q, k and v ``[B, N, H*D]`` and the output in the same layout."""
    return (op.INTO_Q_OP is not None and shape.layout == "NHD" and shape.out_layout == "NHD"
            and not policy.is_cross(shape.Nq, shape.Nk))


def _handed_over(q) -> bool:
    """Whether q, taken out of its container into one local variable of the caller, is held by nothing
    else: no other Python reference, no other tensor on its memory (a view's base, a patch's copy of
    q), so the call may write its output into it.  Contiguous only (its [B, N, H, D] view is then q's
    own memory), and never while autograd records."""
    return (_SOLE is not None and q.is_contiguous() and not q.requires_grad and _holders(q) == _SOLE)


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


def self_attention_groups(ov: "SageAttentionOverride", device, dtype, B: int, H: int, N: int, D: int) -> int | None:
    """The head groups a self-attention call of ``ov`` (q, k, v [B, N, H*D], as Wan's blocks make it) runs
    in on ``device``: settled, or what its first call will settle from the timing cache
    (:func:`.execution.first_decision`); 0 where it runs on SDPA; None where the first call measures
    first or a kernel's self-test verdict is not known here nor kept as passed.  Runs no kernel."""
    shape = policy.CallShape(int(B), int(H), int(N), int(N), int(D), "NHD", "NHD")
    decision = execution.first_decision(ov, device, dtype, shape)
    if decision is None:
        return None
    return decision.groups if decision.kernel else 0


def _parse(args, kwargs):
    """(q, k, v, heads, mask, skip_reshape, skip_output_reshape) of a call in ComfyUI's signature."""
    q, k, v = args[0], args[1], args[2]
    n = len(args)
    heads = kwargs["heads"] if "heads" in kwargs else args[3]
    mask = kwargs.get("mask", args[4] if n > 4 else None)
    skip_reshape = bool(kwargs.get("skip_reshape", args[6] if n > 6 else False))
    skip_out = bool(kwargs.get("skip_output_reshape", args[7] if n > 7 else False))
    return q, k, v, heads, mask, skip_reshape, skip_out


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

    def warm_up(self, device, dtype) -> threading.Thread | None:
        """Start, in a daemon thread, what this patch's first call on ``device`` would otherwise pay
        inside the first sampling step: the kernels' import, build identity and self-test
        (:func:`planning.prepare`).  Called when the patch is applied, it overlaps the text encode and
        the model load that come before the first step.  None (nothing started) off the GPU, for a
        dtype no kernel takes, or with the self-test turned off.  A failure is the first call's to
        report: the thread logs it at debug level only."""
        if not self.config.self_test or dtype not in policy.ELIGIBLE_DTYPES:
            return None
        device = torch.device(device) if device is not None else None
        if device is None or device.type not in policy.ACCEL_DEVICE_TYPES:
            return None
        if device.type == "cuda" and not torch.cuda.is_available():
            return None
        choice = self.config.kernel

        def run():
            try:
                planning.prepare(device, choice, dtype, cache_dir=self.config.cache_dir)
            except Exception as e:  # the first real call plans again and reports what fails
                logging.getLogger("wan_sage").debug("wan-sage: warming the attention kernels up failed: %s: %s",
                                                    type(e).__name__, e)
        thread = threading.Thread(target=run, name="wan-sage-warm-up", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------------ the static checks
    def _check(self, q, k, v, heads, mask, skip_reshape, skip_out, kwargs):
        """(call shape, None) for a statically eligible call, else (None, reason)."""
        reason = policy.static_reason(q, k, v, mask, kwargs)
        if reason is not None:
            return None, reason
        shape = policy.call_shape(q, k, heads, skip_reshape, skip_out)
        if isinstance(shape, str):
            return None, shape
        if shape.Nq < self.config.min_tokens:
            return None, "short"
        return shape, None

    def _static(self, args, kwargs):
        """(q, k, v, heads, skip_reshape, skip_output_reshape, call shape, reason or None)."""
        q, k, v, heads, mask, skip_reshape, skip_out = _parse(args, kwargs)
        shape, reason = self._check(q, k, v, heads, mask, skip_reshape, skip_out, kwargs)
        return q, k, v, heads, skip_reshape, skip_out, shape, reason

    def _declined(self, func, args, kwargs):
        if self.prev is not None:
            return self.prev(func, *args, **kwargs)
        return self.sdpa(*args, **kwargs)

    # ------------------------------------------------------------------ calls
    def __call__(self, func, *args, **kwargs):
        if _is_compiling():
            return self._traced(func, args, kwargs)
        keys = kwargs.keys()
        if len(args) == 3 and (keys == _WAN_KWARGS or keys == _WAN_KWARGS_DIRECT):
            # Wan's call sites pass q, k, v and nothing by keyword but heads and transformer_options: no
            # mask, scale, layout flag or precision switch to read, so their facts make a short key (the
            # same key in container_function; two items shorter than the general one, so the two never
            # meet).  A call found declined goes to SDPA whether or not it records autograd (SDPA serves
            # both), so the autograd check waits until the call could go to a kernel.
            q, k, v = args
            heads, mask, skip_reshape, skip_out = kwargs["heads"], None, False, False
            fast = (self.patch_id, q.device, q.dtype, k.dtype, v.dtype, q.shape, k.shape, heads)
            declined = STATE.declined_calls.get(fast)
            if declined is not None:
                # the hot path of a settled model: one lookup, then SDPA called as plainly as it can be
                declined.calls += 1
                if declined.static and self.prev is not None:
                    return self.prev(func, q, k, v, **kwargs)
                return self.sdpa(q, k, v, heads)
        else:
            if len(args) == 3:
                q, k, v = args
                heads, mask = kwargs["heads"], kwargs.get("mask")
                skip_reshape = bool(kwargs.get("skip_reshape", False))
                skip_out = bool(kwargs.get("skip_output_reshape", False))
            else:
                q, k, v, heads, mask, skip_reshape, skip_out = _parse(args, kwargs)
            fast = None
            if (mask is None and kwargs.get("low_precision_attention", True) is not False
                    and not kwargs.get("enable_gqa", False)
                    and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
                fast = (self.patch_id, q.device, q.dtype, k.dtype, v.dtype, q.shape, k.shape, heads, skip_reshape,
                        skip_out)
            if fast is not None:
                declined = STATE.declined_calls.get(fast)
                if declined is not None:
                    declined.calls += 1
                    if declined.static:
                        return self._declined(func, args, kwargs)
                    return self.sdpa(*args, **kwargs)
        seen = None
        if fast is not None:
            # the same facts under the patch's options rather than the patch: patches of equal options share
            # what their static checks found
            if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
                seen = (self.config_key,) + fast[1:]
        found = None if seen is None else STATE.seen_calls.get(seen)
        # A call like one seen before (the same facts its static shape checks read) skips those checks;
        # only its per-call options are checked again.  One that goes straight to SDPA (a static shape
        # refusal, or a shape settled on SDPA) was found in STATE.declined_calls above by one lookup.
        if found is None:
            shape, reason = self._check(q, k, v, heads, mask, skip_reshape, skip_out, kwargs)
            if shape is not None:
                found = execution.call_key(self, q, shape)
            elif reason in policy.SHAPE_REASONS:
                found = reason
            if seen is not None and found is not None:
                STATE.remember_call(seen, found)
                if reason is not None and fast is not None:
                    STATE.remember_declined(fast, self.patch_id, reason, True)
            if reason is not None:
                stats.count_sdpa(self.patch_id, reason)
                return self._declined(func, args, kwargs)
        elif found.__class__ is str:  # a shape refusal seen before
            stats.count_sdpa(self.patch_id, found)
            return self._declined(func, args, kwargs)
        # A shape settled on SDPA is declined here, before any run-time work: the call goes to the
        # patch's SDPA exactly as ComfyUI makes it, so it returns what plain SDPA returns.
        settled = STATE.decisions.get(found)
        if settled is not None and settled.kernel is None:
            if fast is not None:
                STATE.remember_declined(fast, self.patch_id, settled.reason, False, found, settled)
            stats.count_sdpa(self.patch_id, settled.reason)
            return self.sdpa(*args, **kwargs)
        scale = kwargs.get("scale")
        scale = None if scale is None else float(scale)
        return execution.run_attention(self, q, k, v, heads, skip_reshape, skip_out, scale, found.shape, found)

    def _traced(self, func, args, kwargs):
        """The call while ``torch.compile`` traces it: the static checks, then the custom op."""
        q, k, v, heads, skip_reshape, skip_out, shape, reason = self._static(args, kwargs)
        if reason is not None:
            return self._declined(func, args, kwargs)
        scale = kwargs.get("scale")
        scale = None if scale is None else float(scale)
        return op.call_attention(q, k, v, heads, skip_reshape, skip_out, scale, self.graph_key)

    def _dispatch(self, q, k, v, heads, skip_reshape, skip_out, shape, kwargs):
        """Run a statically eligible call of ``shape``: the custom op while compiling, else SDPA for a shape
        settled on it, else the run-time part (what :meth:`__call__` does after its checks)."""
        scale = kwargs.get("scale")
        scale = None if scale is None else float(scale)
        if _is_compiling():
            return op.call_attention(q, k, v, heads, skip_reshape, skip_out, scale, self.graph_key)
        key = execution.call_key(self, q, shape)
        settled = STATE.decisions.get(key)
        if settled is not None and settled.kernel is None:
            stats.count_sdpa(self.patch_id, settled.reason)
            return execution.run_sdpa(self, q, k, v, heads, skip_reshape, skip_out, scale)
        return execution.run_attention(self, q, k, v, heads, skip_reshape, skip_out, scale, shape, key)

    def container_function(self, *args, **kwargs):
        """The entry point ComfyUI (0.38 and newer) calls instead of ``override(func, ...)`` when the call
        site handed q, k and v over in ``AttentionTensorContainer``s (single-owner boxes: ``peek()`` reads the
        tensor, ``take()`` hands it over and empties the box).  ComfyUI's ``wrap_attn`` calls it with the
        containers as they are and without ``func``.

        The static checks of :meth:`__call__` run on the tensors the containers hold (read, not taken).  A
        call they decline goes where ``override(func, ...)`` sends it: to the previous override, through its
        own ``container_function`` with the containers untouched where it has one (as ComfyUI would call it
        if it were alone in the slot), else as ``prev(func, q, k, v, ...)`` with the tensors taken and
        ``func`` the raw SDPA function this override falls back to (ComfyUI's ``attention_pytorch``, what
        Wan's call sites run without an override); with no previous override, to that SDPA.  An eligible
        call takes the tensors out of the containers and is dispatched exactly as :meth:`__call__`
        dispatches it (the custom op under ``torch.compile``, the run-time part in eager mode).

        What owning q buys: once taken, the call site's container is empty, and when nothing else holds q
        (:func:`_handed_over`) the call's shape is marked ``into_q``: a kernel with a write-into-q path
        (:meth:`.registry.KernelSpec.into_q_path`) writes the output into q's memory head group by head
        group, so the call allocates no output and its peak stays at or below SDPA's
        (:func:`.execution._run_into_q`).  Traceable by ``torch.compile`` without a graph break (the
        containers are plain Python objects; tests/unit/test_current_comfy_attention.py): there Wan's
        self-attention is the write-into-q op (:meth:`_compiled_q_is_dead` says when), which inductor
        reinplaces on q's buffer, and every other call the ordinary op."""
        boxes = args[:3]
        fast = None
        if not _is_compiling():
            keys = kwargs.keys()
            if len(args) == 3 and (keys == _WAN_KWARGS or keys == _WAN_KWARGS_DIRECT):
                # Wan's calls: the declined table under __call__'s short key, one lookup.
                q, k, v = boxes[0].peek(), boxes[1].peek(), boxes[2].peek()
                fast = (self.patch_id, q.device, q.dtype, k.dtype, v.dtype, q.shape, k.shape, kwargs["heads"])
                declined = STATE.declined_calls.get(fast)
                if declined is not None:
                    del q, k, v
                    declined.calls += 1
                    if declined.static:
                        return self._declined_containers(args, kwargs)
                    return self.sdpa(boxes[0].take(), boxes[1].take(), boxes[2].take(), kwargs["heads"])
                del q, k, v
        q, k, v, heads, skip_reshape, skip_out, shape, reason = self._static(
            (boxes[0].peek(), boxes[1].peek(), boxes[2].peek()) + args[3:], kwargs)
        if reason is not None:
            del q, k, v  # the previous override or SDPA may take the containers: hold no reference
            if not _is_compiling():
                stats.count_sdpa(self.patch_id, reason)
                if fast is not None and reason in policy.SHAPE_REASONS:
                    STATE.remember_declined(fast, self.patch_id, reason, True)
            return self._declined_containers(args, kwargs)
        q, k, v = boxes[0].take(), boxes[1].take(), boxes[2].take()
        if _is_compiling() and self._compiled_q_is_dead(q, shape, kwargs):
            op.call_attention_into_q(q, k, v, heads, None, self.graph_key)
            return q
        if fast is not None:
            key = execution.call_key(self, q, shape)
            settled = STATE.decisions.get(key)
            if settled is not None and settled.kernel is None:
                STATE.remember_declined(fast, self.patch_id, settled.reason, False, key, settled)
        if shape.layout == "NHD" and shape.out_layout == "NHD" and not _is_compiling() and _handed_over(q):
            shape = shape._replace(into_q=True)
        return self._dispatch(q, k, v, heads, skip_reshape, skip_out, shape, kwargs)

    @staticmethod
    def _compiled_q_is_dead(q, shape, kwargs) -> bool:
        """Whether a container call being compiled may write its output into q: Wan's self-attention, whose q the
        call site hands over in its container and never reads again, in the layout the write-into-q op takes.
        A graph has no reference count, so the call site's contract stands in for :func:`_handed_over`: ComfyUI
        0.38's ``WanSelfAttention.forward`` (comfy/ldm/wan/model.py at 0c9a69ae) puts the roped q in the container
        and rebinds its name, keeping q only as ``q_patch`` for the ``attn1_patch`` patches, so a model with such
        patches keeps the ordinary op.  Cross-attention keeps it too (the I2V site hands the same q to two calls),
        and so does a call with a mask, a scale or any other option (the op takes none)."""
        if not _into_q_op_takes(shape) or any(key not in _WAN_KWARGS for key in kwargs):
            return False  # a loop, not a set difference of dict keys, which torch 2.11's dynamo cannot trace
        options = kwargs.get("transformer_options") or {}
        return not (options.get("patches") or {}).get("attn1_patch") and q.is_contiguous()

    def dead_q_call(self, q, k, v, *, heads: int, transformer_options):
        """A Wan self-attention call (q, k, v ``[B, N, H*D]``) from a call site that never reads q again: the
        patch's own forward (nodes/handover.py), which computes q for this call alone.  Under
        ``torch.compile`` an eligible self-attention call is the write-into-q op (:mod:`.op`), which leaves
        the output in q; inductor reinplaces it on q's buffer, so the compiled call allocates no output.
        Elsewhere, and for a call the static checks decline, it is the call ``override(func, ...)`` makes."""
        if _is_compiling() and op.INTO_Q_OP is not None:
            kwargs = {"heads": heads, "transformer_options": transformer_options}
            shape, reason = self._static((q, k, v), kwargs)[6:]
            if reason is None and _into_q_op_takes(shape):
                op.call_attention_into_q(q, k, v, heads, None, self.graph_key)
                return q
        return self(self.sdpa, q, k, v, heads=heads, transformer_options=transformer_options)

    def _declined_containers(self, args, kwargs):
        """Where a container call the static checks decline goes (see :meth:`container_function`)."""
        prev = self.prev
        if prev is not None and getattr(prev, "container_function", None) is not None:
            return prev.container_function(*args, **kwargs)
        taken = (args[0].take(), args[1].take(), args[2].take()) + args[3:]
        if prev is not None:
            return prev(self.sdpa, *taken, **kwargs)
        return self.sdpa(*taken, **kwargs)

    def plan(self, q, k, v, heads, args=(), kwargs=None) -> Plan:
        """What a call would do, without running a kernel (except a kernel's one-time self-test):
        the static checks plus the run-time decision, including the free-memory check."""
        kwargs = dict(kwargs or {})
        kwargs.setdefault("heads", heads)
        q, k, v, heads, skip_reshape, skip_out, shape, reason = self._static(tuple(args) or (q, k, v), kwargs)
        if reason is not None:
            return Plan(kernel=None, reason=reason)
        return execution.decide(self, q, shape, claim=False)
