"""Streamed blocks run compiled: each streamed layer's weight is put on the GPU before the block's compiled call.

Where ComfyUI streams a block (lowvram: a layer's weight stays on the host and its forward copies it onto the GPU at
every call), dynamo would trace that copy and guard on the weight's device, the layer's cast flag and its LoRA patch,
so a streamed block compiled a graph of its own (docs/attention.md, "Wan Compile Blocks").  Here, for one call of the
compiled block, the block is made to look resident, and is put back in ``finally``:

* a streamed module is *lifted* where it has no per-call patch function: its own tensors copied onto the GPU as its
  resident self holds them (a ComfyUI-GGUF weight as ComfyUI-GGUF's tensor, its LoRA riding along as on the host
  tensor) and ComfyUI's marks of a streamed module (``comfy_cast_weights``, ``prev_comfy_cast_weights``) taken off its
  ``__dict__``.  The block's own ``modulation`` (which ComfyUI's partial load leaves on the host) and its norms are
  always lifted; where every streamed Linear can be lifted too (ComfyUI-GGUF's, whose LoRA rides on the weight; a
  Linear without a LoRA), the block is what a resident block is and runs the resident block's graph, at the cost of
  the weights as stored (about 0.2 GiB for a Q4_K_M A14B block);
* otherwise every Linear of the block (ComfyUI's Linear and its manual-cast one with a LoRA patched in at each call,
  ComfyUI-GGUF's) is *staged*: it stands behind a :class:`StagedLinear` holding its weight and bias cast onto the GPU
  by its own cast, LoRA included, so the graph sees plain weights in the compute dtype (0.65 GiB for an A14B block in
  bf16) and every staged block runs one graph.

A model compiles at most two graphs, the resident block's and the staged block's, shared by every block of both
experts of Wan 2.2 A14B; a GGUF model, all of whose Linears are lifted, compiles one.  The compiled block holds less
than the eager one above its input (one A14B block at 1280x720x81 on the H200: 3.61 against 5.77 GiB), so the
estimator reserves the larger of the eager streamed forward and the compiled one with a block's weights in the
compute dtype (``memory.estimate.Setup.streamed_blocks_staged``).

A block runs compiled only when it is safe to: every Linear is of a kind this knows, a lifted one computes in the
compute dtype without ComfyUI's marks (a Linear that ModelComputeDtype marks to cast weights held in another dtype
is not lifted), a staged one's weight is in the compute dtype or quantized (an fp8 weight with a LoRA patched in at
each call keeps its block eager), and no other streamed module of the block has a patch function.  A copy or a cast
that fails (out of memory, another ComfyUI's cast) leaves the block eager for that call, with one warning; a cancel
goes on up.  The first layer of each kind met in a process is run both ways once (its own forward, and lifted or
through the staged weights); a difference in any bit keeps that kind's blocks eager from then on, with one warning.
Any other block runs eagerly, as ComfyUI runs it.
"""
from __future__ import annotations

import contextlib

import torch

from . import comfy_bridge, gguf_cast
from .log_once import warn_once

_agreed: dict = {}  # a layer class -> whether, lifted or staged, it gave its own forward's output bit for bit


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
        return (gguf_cast.checked_cast(layer, x) or type(layer).cast_bias_weight)(layer, x)
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
    """The weight is GGUF or already in the compute dtype, so a staged copy is what the layer's forward computes with
    at each call anyway.  A weight in another dtype that has to be staged (fp8 with a LoRA ComfyUI patches in at each
    call) keeps its block eager: the estimator's plan for such blocks is the eager one."""
    w = getattr(layer, "weight", None)
    if w is None:
        return False
    return getattr(w, "tensor_type", None) is not None or w.dtype == dtype


MARKS = ("comfy_cast_weights", "prev_comfy_cast_weights")  # ComfyUI's marks of a module it streams


def _quantized(layer) -> bool:
    """A ComfyUI-GGUF layer holding quantized tensors (it dequantizes them in its forward)."""
    return caster(layer) is _gguf_cast and bool(layer.is_ggml_quantized())


def _lifts_alike(layer, dtype) -> bool:
    """Whether ``layer``, with ComfyUI's marks taken off its ``__dict__``, computes in ``dtype`` as it does with
    them: it holds no mark, its class casts at each call anyway, it is ComfyUI-GGUF's (its forward casts its
    weights for the input either way), or its floating tensors are already in ``dtype``.  Not so where ComfyUI
    marked a module that holds its weights in another dtype to cast at each call (ModelComputeDtype's
    ``force_cast_weights``): lifted, it would run its weights as stored."""
    if not any(k in layer.__dict__ for k in MARKS) or getattr(type(layer), "comfy_cast_weights", False) is True:
        return True
    if caster(layer) is _gguf_cast:
        return True
    tensors = list(layer.parameters(recurse=False)) + list(layer.buffers(recurse=False))
    return all(t.dtype == dtype for t in tensors if t is not None and t.is_floating_point())


def _off(mod, device) -> bool:
    """Whether ComfyUI streams ``mod``: its mark, or a tensor of its own off ``device``."""
    if "prev_comfy_cast_weights" in mod.__dict__:
        return True
    return any(t.device != device for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)))


def _liftable(mod) -> bool:
    """No per-call patch function (ComfyUI's ``LowVramPatch`` of a LoRA): the module's own tensors, moved onto the
    GPU, are what its resident self holds."""
    return not mod.__dict__.get("weight_function") and not mod.__dict__.get("bias_function")


def plan(block: torch.nn.Module, device, dtype):
    """What makes ``block`` run compiled on ``device`` in ``dtype``: a list of ``("lift", module)`` and
    ``("stage", parent, name, layer, cast)``; None where nothing needs doing or it cannot be done
    (:func:`plan_why` says why)."""
    return plan_why(block, device, dtype)[0]


def plan_why(block: torch.nn.Module, device, dtype):
    """(:func:`plan`'s actions, None) or (None, why the block runs eagerly, in words; None where nothing streams).

    Every streamed module other than a Linear (a block's own ``modulation``, a norm) is lifted.  Where every streamed
    Linear can be lifted too (a kind this knows, no patch function), they are, and the block runs the resident
    block's graph; otherwise every Linear of the block is staged (each of a kind this knows, in the compute dtype or
    quantized), and it runs the staged block's graph.  Nothing is done where a streamed module other than a Linear
    has a patch function or a Linear cannot be staged, or nothing streams."""
    lifts, linears, off_linears = [], [], []
    for mod in block.modules():
        if isinstance(mod, torch.nn.Linear):
            continue
        if _off(mod, device):
            if not _liftable(mod):
                return None, f"a streamed {type(mod).__name__} has a LoRA or other patch applied at each call"
            lifts.append(("lift", mod))
    for parent in block.modules():
        for name, child in parent._modules.items():
            if isinstance(child, torch.nn.Linear):
                if _agreed.get(type(child)) is False:
                    return None, f"{type(child).__name__} did not give its own output when put on the GPU first"
                linears.append((parent, name, child))
                if _off(child, device):
                    off_linears.append(child)
    if all(caster(m) is not None and _liftable(m) and _lifts_alike(m, dtype) for m in off_linears):
        actions = lifts + [("lift", m) for m in off_linears]
        return (actions, None) if actions else (None, None)
    staged = []
    for parent, name, child in linears:
        cast = caster(child)
        if cast is None:
            return None, f"a Linear of a kind wan-sage does not stage ({type(child).__name__})"
        if not (_quantized(child) or _stored_ok(child, dtype)):
            w = getattr(child, "weight", None)
            held = str(getattr(w, "dtype", "no")).replace("torch.", "")
            if _liftable(child):
                return None, f"{held} weights cast to {str(dtype).replace('torch.', '')} at each call"
            return None, f"{held} weights with a LoRA applied at each call"
        staged.append(("stage", parent, name, child, cast))
    return lifts + staged, None


def _output(layer, x, features: int):
    """``layer``'s own output, as a plain tensor, for a small seeded probe of ``features`` in the input's dtype and
    on its device; None where it fails."""
    try:
        g = torch.Generator(device=x.device).manual_seed(0)
        probe = torch.randn(2, features, generator=g, device=x.device, dtype=torch.float32).to(x.dtype)
        out = layer(probe)
        return _plain(out) if isinstance(out, torch.Tensor) else None
    except Exception:
        return None


def _agrees(layer, before, after) -> bool:
    """Records whether ``layer``'s kind gave the same output both ways (its own forward ``before``, the output
    ``after`` lifting or staging), warning once where not; the verdict for the kind from then on."""
    ok = before is not None and after is not None and before.shape == after.shape and torch.equal(before, after)
    _agreed[type(layer)] = ok
    if not ok:
        name = type(layer).__qualname__
        warn_once(("staged", name), "wan-sage: %s's weights put on the GPU before the compiled block do not give "
                  "its own output; its streamed blocks run eagerly.", name)
    return ok


def moved(t: torch.Tensor, device, copy: bool = False) -> torch.Tensor:
    """``t`` on ``device`` as a resident module holds it: ComfyUI-GGUF's ``.to`` carries its tensor's type, shape and
    LoRA, and a ``Parameter`` stays one, as ComfyUI's load sets it (``comfy.utils.set_attr_param``).  ``copy``: a new
    tensor even on ``t``'s own device."""
    out = t.to(device, non_blocking=True, copy=copy)
    if isinstance(t, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=t.requires_grad)
    return out


class _Lifted:
    """One lifted module: its own tensors and marks as they were, to put back with :meth:`undo`."""

    def __init__(self, mod):
        self.mod = mod
        self.params = dict(mod._parameters)
        self.buffers = dict(mod._buffers)
        self.marks = {k: mod.__dict__[k] for k in MARKS if k in mod.__dict__}

    def apply(self, device):
        mod = self.mod
        for store in (mod._parameters, mod._buffers):
            for k, t in list(store.items()):
                if t is not None and t.device != device:
                    store[k] = moved(t, device)
        for k in self.marks:
            del mod.__dict__[k]

    def undo(self):
        self.mod._parameters.update(self.params)
        self.mod._buffers.update(self.buffers)
        self.mod.__dict__.update(self.marks)


class Staging:
    """What :func:`staged` did for one call: true where the block runs compiled; ``path`` is ``"lifted"`` (the
    resident block's graph) or ``"staged"`` (the staged block's graph) then, and ``linears`` how many of its Linears
    were lifted or staged for it (0 where only a module beside them streamed); ``why`` says, where it is false, why
    the block runs eagerly."""

    __slots__ = ("ok", "path", "why", "linears")

    def __init__(self, ok: bool, path: str | None = None, why: str | None = None, linears: int = 0):
        self.ok, self.path, self.why, self.linears = ok, path, why, linears

    def __bool__(self) -> bool:
        return self.ok


@contextlib.contextmanager
def staged(block: torch.nn.Module, x):
    """For the ``with`` body: ``block`` made to run compiled as :func:`plan` says (streamed modules lifted, or its
    Linears replaced by :class:`StagedLinear` layers holding their weights cast for ``x``), and a true
    :class:`Staging`; a false one (nothing changed, and why) where it cannot be.  Afterwards every layer is back as
    it was (also when the body fails) and the weights put on the GPU for the call are let go."""
    if isinstance(x, torch.Tensor):
        actions, why = plan_why(block, x.device, x.dtype)
    else:
        actions, why = None, "the block's input is not a tensor"
    swapped, lifted = [], []
    try:
        result = Staging(False, why=why or "nothing of the block streams")
        if actions is not None:
            path = "lifted" if all(a[0] == "lift" for a in actions) else "staged"
            linears = sum(isinstance(_layer(a), torch.nn.Linear) for a in actions)
            try:
                differs = _apply(actions, x, swapped, lifted)
                result = Staging(True, path, linears=linears) if differs is None else Staging(False, why=differs)
            except Exception as e:  # a copy that does not fit, a cast of another ComfyUI: the block runs eagerly
                if comfy_bridge.user_cancel(e):  # the user's cancel goes on up
                    raise
                first = (str(e).splitlines() or [type(e).__name__])[0][:200]
                warn_once(("staged-failed", type(e).__name__), "wan-sage: putting a streamed block's weights on the "
                          "GPU failed (%s); the block ran eagerly.", first)
                result = Staging(False, why=f"putting its weights on the GPU failed ({type(e).__name__})")
        if not result:
            _restore(swapped, lifted)  # the eager block runs as it was
        yield result
    finally:
        _restore(swapped, lifted)


def _restore(swapped: list, lifted: list) -> None:
    """Every staged layer and lifted module back as it was, in the reverse order they were changed; both lists
    emptied."""
    for parent, name, layer in reversed(swapped):
        parent._modules[name] = layer
    for lift in reversed(lifted):
        lift.undo()
    swapped.clear()
    lifted.clear()


def _layer(action):
    """The module a :func:`plan` action lifts or stages."""
    return action[1] if action[0] == "lift" else action[3]


def _apply(actions, x, swapped: list, lifted: list) -> str | None:
    """Lifts and stages ``actions`` for ``x``, recording each in ``swapped`` / ``lifted`` as it is done; None, or
    why the block runs eagerly where a layer kind's first check failed."""
    for action in actions:
        layer = _layer(action)
        linear = isinstance(layer, torch.nn.Linear)  # a lifted module of another kind moves its tensors only
        check = linear and type(layer) not in _agreed  # the first layer of its kind in this process
        before = _output(layer, x, layer.in_features) if check else None
        if action[0] == "lift":
            lift = _Lifted(layer)
            lifted.append(lift)  # first, so that a copy failing half-way is put back too
            lift.apply(x.device)
            after = _output(layer, x, layer.in_features) if check else None
        else:
            _, parent, name, layer, cast = action
            weight, bias = cast(layer, x)
            parent._modules[name] = StagedLinear(weight, bias)
            swapped.append((parent, name, layer))
            after = _output(parent._modules[name], x, layer.in_features) if check else None
        if check and not _agrees(layer, before, after):
            return f"{type(layer).__name__} did not give its own output when put on the GPU first"
    return None
