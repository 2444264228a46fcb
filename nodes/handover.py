"""q, k and v handed over to the Sage patch on ComfyUI versions whose Wan call sites keep them.

ComfyUI 0.38 and newer wrap Wan's q, k and v in attention containers and give them up to the override
(``container_function``), so the Sage patch may write the output into q's memory and hold less than SDPA
(attention/execution.py, ``_run_into_q``).  ComfyUI 0.3.64's ``WanSelfAttention.forward`` keeps q and k in
its locals until it returns, so the patch could not.  On such a ComfyUI the patch sets, on the model clone
it returns, an object patch of each block's ``self_attn.forward``: :func:`hand_over_forward` computes q, k
and v as that forward does (Comfy-Org/ComfyUI comfy/ldm/wan/model.py@a125cd84, ``WanSelfAttention.forward``:
the q/k/v projections, the q/k RMS norms, RoPE on q and k, the output projection) and hands them to the
patch's ``container_function`` in containers of its own, keeping no reference.

It runs the forward of the module's class unchanged (so the calls reach ComfyUI's attention as before)
whenever the override on top of the slot is not the Sage patch (another override wraps it, or it is gone).
Under ``torch.compile`` it hands the tensors over as well: the patch's write-into-q op then runs in the
graph (attention/op.py).  It is installed only where the class forward reads exactly the
names of 0.3.64's (:data:`FORWARD_NAMES`) and no other node has patched the same forward.
"""
from __future__ import annotations

import re
import types

from torch.compiler import is_compiling

from ..attention.override import SageAttentionOverride

__all__ = ["Container", "hand_over_forward", "is_hand_over", "install", "FORWARD_NAMES", "installed_blocks", "would_install"]

OVERRIDE_KEY = "optimized_attention_override"
SELF_ATTN_KEY = "diffusion_model.blocks.{}.self_attn.forward"
SELF_ATTN_PATCH = re.compile(r"diffusion_model\.blocks\.\d+\.self_attn\.forward")

# The names ComfyUI 0.3.64's WanSelfAttention.forward (with its nested q and k functions) reads; a class
# forward that reads others (attention containers, attn1 patches) is a version this module does not mirror.
FORWARD_NAMES = frozenset({"apply_rope1", "head_dim", "k", "norm_k", "norm_q", "num_heads", "o",
                           "optimized_attention", "q", "shape", "v", "view"})


class Container:
    """ComfyUI's attention-container protocol (0.38's ``AttentionTensorContainer``): ``peek`` reads the
    tensor, ``take`` hands it over and empties the container."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def peek(self):
        return self.tensor

    def take(self):
        tensor, self.tensor = self.tensor, None
        return tensor


def _names(code) -> set:
    found = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            found |= _names(const)
    return found


def mirrors(cls) -> bool:
    """Whether ``cls.forward`` reads exactly the names of 0.3.64's Wan self-attention forward."""
    forward = getattr(cls, "forward", None)
    code = getattr(forward, "__code__", None)
    return code is not None and _names(code) == FORWARD_NAMES


def hand_over_forward(self, x, freqs, transformer_options={}):  # noqa: B006 (ComfyUI's signature)
    """The forward set on each block's self-attention module, bound to it (``types.MethodType``, as other
    packs bind theirs): one function for every block, so that ``torch.compile`` guards on its code and on
    the module, and compiled blocks share their graphs as they do with the class forward.  Under
    ``torch.compile`` too the tensors are handed over: q is dead after the call here, so the override's
    write-into-q op may take it (:meth:`.SageAttentionOverride.dead_q_call`)."""
    override = transformer_options.get(OVERRIDE_KEY)
    if not isinstance(override, SageAttentionOverride):
        return type(self).forward(self, x, freqs, transformer_options=transformer_options)
    from comfy.ldm.flux.math import apply_rope1
    b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
    boxes = (Container(apply_rope1(self.norm_q(self.q(x)).view(b, s, n, d), freqs).view(b, s, n * d)),
             Container(apply_rope1(self.norm_k(self.k(x)).view(b, s, n, d), freqs).view(b, s, n * d)),
             Container(self.v(x).view(b, s, n * d)))
    if is_compiling():
        q, k, v = (box.take() for box in boxes)
        return self.o(override.dead_q_call(q, k, v, heads=self.num_heads, transformer_options=transformer_options))
    return self.o(override.container_function(*boxes, heads=self.num_heads, transformer_options=transformer_options))


def is_hand_over(obj) -> bool:
    """Whether an object patch is :func:`hand_over_forward` bound to a module."""
    return getattr(obj, "__func__", None) is hand_over_forward


def installed_blocks(model) -> int:
    """How many blocks of ``model`` (a ModelPatcher) carry :func:`hand_over_forward`."""
    patches = getattr(model, "object_patches", None) or {}
    return sum(1 for k, v in patches.items() if isinstance(k, str) and SELF_ATTN_PATCH.fullmatch(k)
               and is_hand_over(v))


def install(model, diffusion_model) -> int:
    """Object-patch the self-attention forward of every block of ``diffusion_model`` on ``model`` (a clone)
    that mirrors 0.3.64's and that no other node patched; returns how many were patched."""
    patches = getattr(model, "object_patches", None) or {}
    count = 0
    for i, block in enumerate(getattr(diffusion_model, "blocks", ()) or ()):
        attn = getattr(block, "self_attn", None)
        key = SELF_ATTN_KEY.format(i)
        if attn is None or not mirrors(type(attn)):
            continue
        if key in patches and not is_hand_over(patches[key]):
            continue
        model.add_object_patch(key, types.MethodType(hand_over_forward, attn))
        count += 1
    return count


def would_install(model, diffusion_model) -> bool:
    """Whether :func:`install` patches (or has patched) the first block of ``diffusion_model`` on ``model``."""
    blocks = getattr(diffusion_model, "blocks", ()) or ()
    if not blocks:
        return False
    attn = getattr(blocks[0], "self_attn", None)
    patch = (getattr(model, "object_patches", None) or {}).get(SELF_ATTN_KEY.format(0))
    return attn is not None and mirrors(type(attn)) and (patch is None or is_hand_over(patch))
