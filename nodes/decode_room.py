"""Make the VAE decode's room when a sampling ends, by unloading the sampled model.

The Wan VAE decode after a sampling takes more of the GPU than the sampling's own working memory at
1280x720 (:mod:`memory.vae_decode`: 13.9 GiB for 81 frames).  Where it is not free when the decode starts,
ComfyUI evicts weights kept resident one module at a time (``partially_unload``: each a copy back to the
host), and the decode's convolutions may be left without their fast engine's workspace.

A model that passed through the Working-Memory Estimator keeps its weights' host copies
(:mod:`.host_copy`), so a whole unload copies nothing back.  The estimator's ``OUTER_SAMPLE`` wrapper
(:func:`outer_sample`) therefore unloads the sampled model when its sampling ends wherever the decode's
room, with what ComfyUI keeps free, is not free then.  The reservation in force keeps none of that room
(``memory.estimate.Setup.decode_by_unload``), and the weights use it while the model samples.

A sampling followed by another of the same model (a second pass) loads it again: the resident weights'
copy to the GPU, never more than the first load.  Not done where the model is unloaded by ComfyUI's copy
(host copies not kept: dynamic VRAM, one device for load and offload), nor for a latent no Wan VAE
decodes, nor on the CPU.
"""
from __future__ import annotations

import logging

from ..memory import vae_decode
from . import comfy_bridge, host_copy
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

KEY = "wan_sage_decode_room"

__all__ = ["KEY", "outer_sample", "needed", "make_room"]


def needed(patcher, latent_shape) -> int | None:
    """The bytes that must be free for the decode of ``latent_shape`` after ``patcher``'s sampling (the decode's
    room and what ComfyUI keeps free), where this module makes that room; None where it does not."""
    if not host_copy.installed(patcher) or comfy_bridge.is_dynamic(patcher):
        return None
    dev = comfy_bridge.device_of(patcher)
    size = comfy_bridge.vae_dtype_size(dev)
    if size is None:
        return None
    room = vae_decode.decode_bytes(tuple(int(x) for x in latent_shape[:5]), size)
    return None if room is None else room + comfy_bridge.extra_reserved()


def make_room(patcher, latent_shape, free_bytes=None) -> bool:
    """Unload ``patcher``'s model where the decode's room is not free (``free_bytes(device)``, default ComfyUI's
    free memory there); True where it was unloaded."""
    need = needed(patcher, latent_shape)
    if need is None:
        return False
    dev = comfy_bridge.device_of(patcher)
    free = (free_bytes or comfy_bridge.free_memory)(dev)
    if free >= need:
        return False
    kept = host_copy.kept_bytes(patcher)
    if not comfy_bridge.unload(patcher):
        return False
    log.info("wan-sage: sampling done; unloaded the model for the VAE decode (%.2f GiB free, %.2f GiB needed); "
             "%.2f GiB of weights went back to their host copies, nothing copied", free / 2**30, need / 2**30,
             kept / 2**30)
    return True


def outer_sample(executor, noise, *args, **kwargs):
    """``OUTER_SAMPLE`` wrapper: the sampling, then :func:`make_room` for the decode of its latent.  Never fails
    the sampling over it: a failure is logged once and the model stays loaded."""
    out = executor(noise, *args, **kwargs)
    patcher = getattr(getattr(executor, "class_obj", None), "model_patcher", None)
    if patcher is not None:
        try:
            make_room(patcher, noise.shape)
        except Exception as e:
            warn_once(("decode-room", type(e).__name__), "wan-sage: unloading the model for the VAE decode "
                      "failed (%s); it stays loaded and ComfyUI frees the decode's memory itself.", reason(e))
    return out
