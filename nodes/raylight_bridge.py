"""What wan-sage reads from, and hands to, Raylight (komikndr/raylight), feature-detected.

Nothing here imports Raylight, xFuser or yunchang: each is used only when its module is already
loaded in this process (``sys.modules``), which is the case inside a Raylight actor and nowhere else.
Nothing of theirs is patched.

* :func:`install_inner_attention` puts the Sage patch's :class:`~..attention.inner_attention.InnerAttention`
  in ``transformer_options["raylight_inner_attention"]`` of the model clone the patch returns: the object
  itself, as Raylight's ``set_inner_attention`` stores it (komikndr/raylight
  src/raylight/distributed_modules/inner_attention/registry.py@55ea37bbbc1ec241c794269703e62ad937806d7a).
  Raylight's attention reads it from the options of each call.  Raylight refuses a processor without
  ``supports_ring`` when the ring degree is above 1, so where this process's xFuser runtime says so, the
  processor is not installed and Raylight's own attention runs.
* :func:`parallel_degrees` reads the Ulysses, ring and CFG degrees and FSDP of the model being patched or
  estimated.  Raylight keeps them in its actors' ``parallel_dict`` and hands them to xFuser's
  ``initialize_model_parallel`` (komikndr/raylight
src/raylight/distributed_worker/parallel_group_manager.py@c0495710d960c413443727b5c640e22d6bd9ef61); it writes none of them into ``model_options``, so they are read from
  xFuser's runtime (``xfuser.core.distributed``'s getters) and FSDP from the model's
  ``torch.distributed.fsdp`` wrapping.
"""
from __future__ import annotations

import logging
import sys

from ..attention.inner_attention import INNER_ATTENTION_KEY, PROCESSOR_NAME, InnerAttention
from .log_once import warn_once

__all__ = ["install_inner_attention", "parallel_degrees", "register_processor", "XFUSER_MODULE",
           "RAYLIGHT_REGISTRY_MODULE"]

XFUSER_MODULE = "xfuser.core.distributed"
RAYLIGHT_REGISTRY_MODULE = "raylight.distributed_modules.inner_attention"


def _xfuser_degrees() -> dict | None:
    xd = sys.modules.get(XFUSER_MODULE)
    if xd is None:
        return None
    try:
        if not xd.model_parallel_is_initialized():
            return None
        return {"ulysses": int(xd.get_ulysses_parallel_world_size()), "ring": int(xd.get_ring_parallel_world_size()),
                "cfg": int(xd.get_classifier_free_guidance_world_size())}
    except Exception as e:  # another xFuser version: the degrees are unknown, the patch still works
        warn_once(("xfuser-degrees", type(e).__name__), "wan-sage: xFuser's parallel degrees could not be read "
                  "(%s: %s); the estimate is for one GPU.", type(e).__name__, str(e)[:120])
        return None


def _is_fsdp(model) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module = getattr(getattr(model, "model", None), "diffusion_model", None)
    cls = getattr(fsdp, "FSDPModule", None) if fsdp is not None else None
    if cls is not None and module is not None and isinstance(module, cls):
        return True
    return type(model).__name__ == "FSDPModelPatcher"


def parallel_degrees(model) -> dict | None:
    """{"ulysses", "ring", "cfg", "fsdp", "world_size"} of this process's Raylight/xFuser run, or None on
    one GPU (no xFuser runtime and no FSDP wrapping)."""
    degrees = _xfuser_degrees()
    fsdp = _is_fsdp(model)
    if degrees is None and not fsdp:
        return None
    degrees = degrees or {"ulysses": 1, "ring": 1, "cfg": 1}
    dist = sys.modules.get("torch.distributed")
    world = dist.get_world_size() if dist is not None and dist.is_available() and dist.is_initialized() else None
    return dict(degrees, fsdp=fsdp, world_size=world)


def register_processor() -> bool:
    """Register the processor factory under :data:`PROCESSOR_NAME` in Raylight's inner-attention registry
    when Raylight is loaded (once); True when it is registered there."""
    reg = sys.modules.get(RAYLIGHT_REGISTRY_MODULE)
    if reg is None or not hasattr(reg, "register_inner_attention"):
        return False
    try:
        available = reg.InnerAttentionRegistry.available()
        if PROCESSOR_NAME not in available:
            reg.register_inner_attention(PROCESSOR_NAME)(InnerAttention.create)
        return True
    except Exception as e:  # another Raylight version: the slot still carries the processor
        warn_once(("raylight-register", type(e).__name__), "wan-sage: registering %s with Raylight failed (%s: %s)",
                  PROCESSOR_NAME, type(e).__name__, str(e)[:120])
        return False


def install_inner_attention(transformer_options: dict, override, model=None) -> str | None:
    """Put the processor for ``override`` into ``transformer_options`` (a clone's, already copied), chained to
    a processor of another node that was there; re-patching replaces our own.  Returns a note when it is not
    installed (ring degree above 1)."""
    prev = transformer_options.get(INNER_ATTENTION_KEY)
    if isinstance(prev, InnerAttention):
        prev = prev.prev
    degrees = parallel_degrees(model)
    if degrees is not None and degrees["ring"] > 1:
        if prev is None:
            transformer_options.pop(INNER_ATTENTION_KEY, None)
        else:
            transformer_options[INNER_ATTENTION_KEY] = prev
        note = (f"ring degree {degrees['ring']}: the Sage patch does not serve Raylight's ring attention (its kernels "
                f"return no fp32 log-sum-exp), so Raylight's own attention runs")
        warn_once(("ring", degrees["ring"]), "wan-sage: %s.", note, level=logging.INFO)
        return note
    transformer_options[INNER_ATTENTION_KEY] = InnerAttention(override, prev)
    register_processor()
    return None
