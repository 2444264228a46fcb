"""Streamed blocks run compiled: each layer's weight is cast onto the GPU before the block's compiled call.

Where ComfyUI streams a block (lowvram: a layer's weight stays on the host and its forward copies it onto the GPU at
every call), dynamo would trace that copy and guard on the weight's device, the layer's cast flag and its LoRA patch,
so a streamed block compiled a graph of its own (docs/attention.md, "Wan Compile Blocks").  Here, for one call of the
compiled block, every Linear of the block stands behind a :class:`StagedLinear` whose weight and bias the layer's own
cast has already put on the input's device, LoRA patches included (ComfyUI's ``cast_bias_weight``, or ComfyUI-GGUF's
dequantization).  The graph sees plain weights in the compute dtype: one graph for every streamed block of every
expert, whatever part of each block streams.  The layers are put back in ``finally``.

The block holds its Linears' weights in the compute dtype for the call (0.65 GiB for a Wan A14B block in bf16), and
the compiled block holds less than the eager one above its input (one A14B block at 1280x720x81: 3.61 against
5.77 GiB; ``bench.streamed_block_peak``), so the estimator reserves the larger of the eager streamed forward and the
compiled one with a block's weights staged (``memory.estimate.Setup.streamed_blocks_staged``).

A block is staged only when it is safe to: every Linear is of a kind whose forward is ``linear(x, *cast(x))``
(ComfyUI's Linear and its manual-cast one, ComfyUI-GGUF's Linear), its weight is in the compute dtype or GGUF, and
every other tensor of the block is on the input's device.  The first layer of each kind met in a process is run both
ways once (its own forward, and the staged weights through ``linear``); a difference in any bit keeps that kind's
blocks eager from then on, with one warning.  Any other block runs eagerly, as ComfyUI runs it.
"""
from __future__ import annotations

import contextlib

import torch

from . import gguf_cast
from .log_once import warn_once

_agreed: dict = {}  # a layer class -> whether its staged weights gave its own forward's output bit for bit


class StagedLinear(torch.nn.Module):
    """A Linear for one compiled call: its weight and bias already on the input's device, in the compute dtype.
    One class for every layer, so dynamo's guard on the module's type holds from block to block."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", _plain(weight), persistent=False)
        self.register_buffer("bias", _plain(bias), persistent=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


def _plain(t):
    """``t`` as a plain tensor on the same storage: a cast that had nothing to do returns the layer's own
    ``Parameter`` (or ComfyUI-GGUF's tensor), and dynamo guards on the class of each staged weight."""
    if t is None or type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().as_subclass(torch.Tensor)


def _comfy_cast(layer, x):
    import comfy.ops
    return comfy.ops.cast_bias_weight(layer, x)


def _gguf_cast(layer, x):
    """ComfyUI-GGUF's Linear: its dequantizing cast where the layer holds quantized tensors (the pack's plain-tensor
    cast where that agreed with ComfyUI-GGUF's own, :mod:`.gguf_cast`), ComfyUI's cast otherwise, as the layer's
    ``forward_comfy_cast_weights`` chooses."""
    if layer.is_ggml_quantized():
        fn = gguf_cast.cast_for(layer)
        fn = gguf_cast._checked(fn, layer, x) if fn is not None else None
        return (fn or type(layer).cast_bias_weight)(layer, x)
    return _comfy_cast(layer, x)


def caster(layer):
    """The cast that gives ``layer``'s weight and bias for an input as its own forward would, or None where
    ``layer`` is not a Linear of a kind this knows."""
    if not isinstance(layer, torch.nn.Linear):
        return None
    t = type(layer)
    if callable(getattr(t, "is_ggml_quantized", None)) and callable(getattr(t, "forward_ggml_cast_weights", None)):
        return _gguf_cast
    try:
        import comfy.ops
    except ImportError:
        return None
    base = comfy.ops.disable_weight_init.Linear
    if (getattr(t, "forward", None) is base.forward
            and getattr(t, "forward_comfy_cast_weights", None) is base.forward_comfy_cast_weights):
        return _comfy_cast
    return None


def _stored_ok(layer, dtype) -> bool:
    """The weight is GGUF or already in the compute dtype: staging then casts nothing the compiled block's graph
    would cast itself (a weight cast at every call, fp8, keeps its blocks eager)."""
    w = getattr(layer, "weight", None)
    if w is None:
        return False
    return getattr(w, "tensor_type", None) is not None or w.dtype == dtype


def plan(block: torch.nn.Module, device, dtype):
    """The Linears of ``block`` to stage, as ``(parent, name, layer, cast)``, when the block can run compiled staged
    on ``device`` in ``dtype``; None where it cannot (a layer of another kind, a module outside its Linears that
    ComfyUI streams or a tensor of one off ``device``, no Linear)."""
    linears, inside = [], set()
    for parent in block.modules():
        for name, child in parent._modules.items():
            if isinstance(child, torch.nn.Linear):
                cast = caster(child)
                if cast is None or not _stored_ok(child, dtype) or _agreed.get(type(child)) is False:
                    return None
                linears.append((parent, name, child, cast))
                inside.add(id(child))
    if not linears:
        return None
    for mod in block.modules():
        if id(mod) in inside:
            continue
        if "prev_comfy_cast_weights" in mod.__dict__:  # ComfyUI's mark of a module it streams
            return None
        for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
            if t.device != device:
                return None
    return linears


def _same_output(layer, weight, bias, x) -> bool:
    """Whether ``linear(probe, weight, bias)`` equals ``layer(probe)`` bit for bit for a small seeded probe in the
    input's dtype and on its device.  Never raises."""
    try:
        g = torch.Generator(device=x.device).manual_seed(0)
        probe = torch.randn(2, layer.in_features, generator=g, device=x.device, dtype=torch.float32).to(x.dtype)
        own = layer(probe)
        with torch._C.DisableTorchFunctionSubclass():
            own = own.as_subclass(torch.Tensor) if isinstance(own, torch.Tensor) else own
        return isinstance(own, torch.Tensor) and torch.equal(own, torch.nn.functional.linear(probe, weight, bias))
    except Exception:
        return False


def _checked(layer, weight, bias, x) -> bool:
    """Whether the staged weights of ``layer``'s kind give its own forward's output; checked on the first layer of
    each kind met in the process."""
    t = type(layer)
    if t not in _agreed:
        _agreed[t] = _same_output(layer, weight, bias, x)
        if not _agreed[t]:
            warn_once(("staged", t.__qualname__), "wan-sage: %s's weights cast before the compiled block do not give "
                      "its own output; its streamed blocks run eagerly.", t.__qualname__)
    return _agreed[t]


@contextlib.contextmanager
def staged(block: torch.nn.Module, x):
    """For the ``with`` body: ``block``'s Linears replaced by :class:`StagedLinear` layers holding their weights cast
    for ``x``, and True; False (nothing changed) where the block cannot run staged.  Afterwards every layer is
    back in place (also when the body fails) and the staged weights are let go."""
    linears = plan(block, getattr(x, "device", None), getattr(x, "dtype", None)) if isinstance(x, torch.Tensor) else None
    swapped = []
    try:
        if linears is not None:
            for parent, name, layer, cast in linears:
                weight, bias = cast(layer, x)
                if not _checked(layer, weight, bias, x):
                    break
                parent._modules[name] = StagedLinear(weight, bias)
                swapped.append((parent, name, layer))
            else:
                yield True
                return
        for parent, name, layer in reversed(swapped):
            parent._modules[name] = layer
        swapped = []
        yield False
    finally:
        for parent, name, layer in reversed(swapped):
            parent._modules[name] = layer
