"""ComfyUI's per-call weight casts written into one reused device buffer: what cudaMallocAsync's holes around the
casts are, measured against a sampling that allocates no weight-sized tensor per Linear call.

ComfyUI 0.3.64 casts a weight stored in another dtype than the compute dtype (fp8 checkpoints) or held on the host
(a streamed layer) at every Linear call: ``comfy.ops.cast_bias_weight`` asks ``model_management.cast_to`` for a new
tensor of the weight's size, and it is freed after the matmul.  The estimator reserves for the allocator's holes
around those casts (``cast_frag_factor`` in ``memory/estimate.py``), and an fp8 sampling whose weights stream leaves
1.9-2.7 GiB of a 16 GiB budget unused (docs/attention.md, "The re-plan between model calls").

:func:`buffered_casts` makes each ComfyUI Linear of a model that casts its weight write it into a buffer kept for
the sampling instead: one per device and compute dtype, the size of the largest such weight, and for streamed
weights one more in their stored dtype, which the host copy lands in before the conversion.  A layer's weight
functions (a LoRA patched in at each call, ComfyUI's ``LowVramPatch``) run on the buffer's view as they run on
ComfyUI's fresh copy, and its bias is cast as ComfyUI casts it.  The values are ComfyUI's bit for bit: the same
conversion into the same dtype, the same functions, the same ``linear``.

Only where the cast is ComfyUI's own (a Linear whose ``forward_comfy_cast_weights`` is ``comfy.ops``' plain one:
not scaled fp8, not ComfyUI-GGUF) and ComfyUI runs one stream (no ``--async-offload``); any other layer and call
keeps ComfyUI's cast.  Used by ``python -m bench.partial_load`` (a config with ``+castbuf``).  Measured and not
adopted: it cuts the holes of a process's later samplings with Sage, not of its first, and not with SDPA
(docs/memory-model.md, the fp8 holes;
``bench/records/partial-load/void-cast-buffer-h100-9f16f7a.jsonl``), so the pack keeps ComfyUI's casts.
"""
from __future__ import annotations

import contextlib
import math
import sys

__all__ = ["buffered_casts", "Buffers"]


class Buffers:
    """One flat tensor per (role, device, dtype), allocated at its first use at the size of the largest weight."""

    def __init__(self, numel: int):
        self.numel = int(numel)
        self.tensors: dict = {}

    def view(self, role: str, device, dtype, shape):
        import torch
        key = (role, str(device), dtype)
        flat = self.tensors.get(key)
        if flat is None:
            flat = self.tensors[key] = torch.empty(self.numel, dtype=dtype, device=device)
        n = math.prod(shape)
        if n > flat.numel():
            raise ValueError(f"a weight of {n} elements does not fit the cast buffer of {flat.numel()}")
        return flat[:n].view(shape)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class _BufferedCast:
    """The stand-in for one Linear's ``forward_comfy_cast_weights``: ComfyUI's cast into the shared buffer."""

    def __init__(self, layer, buffers: Buffers):
        self.layer = layer
        self.buffers = buffers
        self.calls = 0

    def __call__(self, input, *args, **kwargs):
        import torch
        layer = self.layer
        mm = sys.modules["comfy.model_management"]
        weight = layer.weight
        cls_forward = type(layer).forward_comfy_cast_weights
        if args or kwargs or getattr(mm, "NUM_STREAMS", 1) > 1 or weight is None or weight.is_sparse:
            return cls_forward(layer, input, *args, **kwargs)
        device, dtype = input.device, input.dtype
        non_blocking = mm.device_supports_non_blocking(device)
        bias = None
        if layer.bias is not None:
            bias_fns = list(layer.bias_function)
            bias = mm.cast_to(layer.bias, dtype, device, non_blocking=non_blocking, copy=bool(bias_fns))
            for f in bias_fns:
                bias = f(bias)
        out = self.buffers.view("cast", device, dtype, tuple(weight.shape))
        if weight.device != device and weight.dtype != dtype:
            stage = self.buffers.view("stage", device, weight.dtype, tuple(weight.shape))
            stage.copy_(weight, non_blocking=non_blocking)
            out.copy_(stage)
        else:
            out.copy_(weight, non_blocking=non_blocking)
        for f in list(layer.weight_function):
            out = f(out)
        self.calls += 1
        return torch.nn.functional.linear(input, out, bias)


def _casting_linears(root):
    """The Linears under ``root`` whose cast is comfy.ops' plain one (every manual-cast and plain ComfyUI Linear)."""
    ops = sys.modules.get("comfy.ops")
    if ops is None:
        return []
    plain = ops.disable_weight_init.Linear.forward_comfy_cast_weights
    return [m for m in root.modules()
            if isinstance(m, ops.disable_weight_init.Linear) and type(m).forward_comfy_cast_weights is plain
            and getattr(m, "weight", None) is not None]


@contextlib.contextmanager
def buffered_casts(root):
    """While the block runs, every Linear of ``root`` (a diffusion model) that ComfyUI casts casts into one buffer;
    yields the :class:`Buffers` (``.nbytes()`` after the run) and the stand-ins; put back in ``finally``."""
    layers = _casting_linears(root)
    buffers = Buffers(max((m.weight.numel() for m in layers), default=0))
    stand_ins = []
    try:
        for layer in layers:
            s = _BufferedCast(layer, buffers)
            layer.forward_comfy_cast_weights = s
            stand_ins.append(s)
        yield buffers, stand_ins
    finally:
        for s in stand_ins:
            s.layer.__dict__.pop("forward_comfy_cast_weights", None)
        buffers.tensors.clear()
