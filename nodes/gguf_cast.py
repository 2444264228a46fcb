"""ComfyUI-GGUF's weight cast on plain tensors, for the blocks Wan Compile Blocks runs compiled.

ComfyUI-GGUF holds each quantized weight as a ``GGMLTensor``, a ``torch.Tensor`` subclass, and dequantizes it in
Python inside every layer call (``GGMLLayer.cast_bias_weight``, ``get_weight``).  Under torch.compile dynamo traces
that dequantization op by op, and for each op on a ``GGMLTensor`` it also interprets the subclass's
``__torch_function__``, ``.to`` and ``.shape``.  On the H200 that tracing took 7.1 s of the first step of a compiled
GGUF A14B prompt (``e2e compile phases:`` in bench/records/whole-prompt, the 20-step compiled round ``c``); on the
CPU, one block of the miniature A14B (Q4_K and Q6_K weights, a rank-64 LoRA, A14B's 10 Linears) traced in 4.0-4.3 s
through ComfyUI-GGUF's cast and in 1.1-1.4 s through this one (bytecode tracing, two runs each).

:func:`cast_bias_weight` is ComfyUI-GGUF's cast step for step: the same LoRA patches moved with ComfyUI-GGUF's
``move_patch_to_device``, the same ``dequantize`` (or ``.to`` for the types torch holds natively), ComfyUI's
``calculate_weight``, ``cast_to``.  It only takes each weight's bytes as a plain tensor view first, so no op of the
dequantization runs on the subclass: the result is the same bit for bit.

:func:`plain_casts` gives it to the ComfyUI-GGUF layers of one block for one call: as an attribute of each layer
object, taken away again in ``finally``.  The first layer of each ComfyUI-GGUF met is cast both ways once, eagerly,
and a difference in any bit (a ComfyUI-GGUF whose cast has changed) keeps its own cast from then on.  So a block
that runs eagerly (weights streamed), every other model that shares the layers, and every layer of a type it does
not know run ComfyUI-GGUF's own code.
"""
from __future__ import annotations

import contextlib
import sys
import types

import torch

from .log_once import warn_once

ATTR = "cast_bias_weight"

_casts: dict = {}  # ComfyUI-GGUF's ops module -> the cast made for it (one function object), or None
_checked_fns: dict = {}  # a cast made here -> whether it agreed with ComfyUI-GGUF's own (:func:`_checked`)


def _gguf_parts(layer):
    """(ComfyUI-GGUF's ops module, its dequant module) for a ComfyUI-GGUF layer, or None: a layer of another kind,
    or a ComfyUI-GGUF whose functions this does not find (then its own cast runs)."""
    ops = sys.modules.get(type(layer).__module__)
    deq_fn = getattr(ops, "dequantize_tensor", None)
    dq = sys.modules.get(getattr(deq_fn, "__module__", None) or "")
    if (dq is None or not callable(getattr(ops, "move_patch_to_device", None))
            or not callable(getattr(dq, "dequantize", None))
            or not isinstance(getattr(dq, "dequantize_functions", None), dict)
            or getattr(dq, "TORCH_COMPATIBLE_QTYPES", None) is None):
        return None
    return ops, dq


def cast_for(layer):
    """The plain-tensor cast for ``layer`` (one function per ComfyUI-GGUF, unbound), or None where ``layer`` is not a
    ComfyUI-GGUF layer this can stand in for."""
    if not (callable(getattr(type(layer), "is_ggml_quantized", None)) and callable(getattr(type(layer), ATTR, None))
            and hasattr(layer, "dequant_dtype") and hasattr(layer, "patch_dtype")):
        return None
    ops = sys.modules.get(type(layer).__module__)
    if ops not in _casts:
        parts = _gguf_parts(layer)
        _casts[ops] = None if parts is None else _make_cast(*parts)
    return _casts[ops]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The weight's bytes as a plain tensor view (no subclass op runs to make it)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.view(t.dtype)


def _make_cast(ops, dq):
    """ComfyUI-GGUF's ``GGMLLayer.cast_bias_weight`` for the ops module ``ops`` and dequant module ``dq``, with the
    dequantization on plain tensors (module docstring).  The modules it calls are bound here, outside any trace."""
    import comfy.lora
    import comfy.model_management
    import comfy.ops

    calculate_weight = comfy.lora.calculate_weight
    cast_to = comfy.ops.cast_to
    supports_non_blocking = comfy.model_management.device_supports_non_blocking
    move_patch_to_device = ops.move_patch_to_device
    dequantize = dq.dequantize
    native = dq.TORCH_COMPATIBLE_QTYPES
    known = dq.dequantize_functions

    def weight_of(s, t, dtype, device):
        """ComfyUI-GGUF's ``get_weight(t.to(device), dtype)`` on plain tensors."""
        qtype = getattr(t, "tensor_type", None)
        oshape = getattr(t, "tensor_shape", None)
        patches = getattr(t, "patches", [])
        raw = _bytes(t)
        if oshape is None:
            oshape = raw.shape
        raw = raw.to(device)
        patch_list, key = [], None
        for p, key in patches:
            patch_list += move_patch_to_device(p, device)
        if qtype in native:
            weight = raw.to(dtype)
        else:
            deq = dtype if s.dequant_dtype == "target" else s.dequant_dtype
            weight = dequantize(raw, qtype, oshape, dtype=deq).to(dtype)
        if patch_list:
            if s.patch_dtype is None:
                weight = calculate_weight(patch_list, weight, key)
            else:
                patch_dtype = dtype if s.patch_dtype == "target" else s.patch_dtype
                weight = calculate_weight(patch_list, weight, key, patch_dtype)
        return weight

    def cast_bias_weight(s, input=None, dtype=None, device=None, bias_dtype=None):
        for t in (s.weight, s.bias):
            qtype = None if t is None else getattr(t, "tensor_type", None)
            if qtype is not None and qtype not in native and qtype not in known:  # ComfyUI-GGUF's numpy fallback
                return type(s).cast_bias_weight(s, input, dtype, device, bias_dtype)
        if input is not None:
            if dtype is None:
                dtype = getattr(input, "dtype", torch.float32)
            if bias_dtype is None:
                bias_dtype = dtype
            if device is None:
                device = input.device
        bias = None
        non_blocking = supports_non_blocking(device)
        if s.bias is not None:
            bias = weight_of(s, s.bias, dtype, device)
            bias = cast_to(bias, bias_dtype, device, non_blocking=non_blocking, copy=False)
        weight = weight_of(s, s.weight, dtype, device)
        weight = cast_to(weight, dtype, device, non_blocking=non_blocking, copy=False)
        return weight, bias

    return cast_bias_weight


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    with torch._C.DisableTorchFunctionSubclass():
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _agrees(fn, layer, x) -> bool:
    """Whether ``fn`` gives ``layer``'s weight and bias for input ``x`` bit for bit as the layer's class casts them
    (ComfyUI-GGUF's own cast, run here eagerly).  Never raises."""
    try:
        own = type(layer).cast_bias_weight(layer, x)
        plain = fn(layer, x)
        return all(_same(a, b) for a, b in zip(own, plain))
    except Exception:
        return False


def _checked(fn, layer, x):
    """``fn`` where it agrees with ComfyUI-GGUF's own cast on ``layer``, checked once per function and process (the
    first layer of each ComfyUI-GGUF met); None where it does not, and from then on."""
    if fn in _checked_fns:
        return fn if _checked_fns[fn] else None
    ok = _agrees(fn, layer, x)
    _checked_fns[fn] = ok
    if not ok:
        warn_once(("gguf-cast",), "wan-sage: ComfyUI-GGUF's weights differ through the pack's plain-tensor cast on "
                  "%s; compiled blocks use ComfyUI-GGUF's own cast (slower to compile, same results).",
                  type(layer).__qualname__)
    return fn if ok else None


def checked_cast(layer, x):
    """The plain-tensor cast for ``layer`` where it agrees with ComfyUI-GGUF's own (:func:`_checked`, on input
    ``x``); None where ``layer`` is not a ComfyUI-GGUF layer this stands in for, or the cast differed."""
    fn = cast_for(layer)
    return None if fn is None else _checked(fn, layer, x)


@contextlib.contextmanager
def plain_casts(block: torch.nn.Module, x: torch.Tensor | None):
    """For the ``with`` body: the plain-tensor cast on each ComfyUI-GGUF layer of ``block`` that has a weight and whose
    own attributes do not already hold a cast; afterwards each layer as it was (also when the body fails).  ``x``: the
    block's input, for the one-time check against ComfyUI-GGUF's own cast (none given: no layer gets it).  Yields how
    many.

    For the call each of those layers' tensors also holds a copy of its LoRA list (``patches``), put back afterwards.
    ComfyUI-GGUF's loader gives every tensor one default list and its ``.to`` gives the moved tensor a copy, so the
    layers of a block never moved share one list where those of a block loaded onto the GPU do not; dynamo guards on
    what the traced block shared, and the other kind of block would compile again (once per expert on the H200)."""
    given, lists = [], []
    try:
        for mod in block.modules():
            if x is None or ATTR in mod.__dict__:
                continue
            if getattr(mod, "weight", None) is None:  # no weight (an affine-free norm): nothing to cast
                continue
            fn = checked_cast(mod, x)
            if fn is not None:
                mod.__dict__[ATTR] = types.MethodType(fn, mod)
                given.append(mod)
                for t in (mod.weight, getattr(mod, "bias", None)):
                    own = getattr(t, "patches", None)
                    if isinstance(own, list):  # a copy of its own for the call (above)
                        lists.append((t, own))
                        t.patches = list(own)
        yield len(given)
    finally:
        for t, own in reversed(lists):  # last first: a tensor two layers share gets its first list back
            t.patches = own
        for mod in given:
            mod.__dict__.pop(ATTR, None)


def as_input_class(out, x):
    """The compiled block's output as a plain tensor where its input ``x`` is one.  Eagerly the block returns a plain
    tensor; dynamo (torch 2.14 on the CPU) reconstructs the compiled output as ComfyUI-GGUF's subclass when the graph
    read the weights' bytes this way, and the next block's input would then fail its guard and compile again."""
    if isinstance(out, torch.Tensor) and type(out) is not torch.Tensor and type(x) is torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():  # eager, outside the graph; the same storage and strides
            return out.as_subclass(torch.Tensor)
    return out
