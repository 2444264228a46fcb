"""Wan Text Encoder Host Copy: the text encoder's unload copies nothing back.

A Wan prompt loads the text encoder (umt5-xxl, 10.6 GiB in bf16), encodes, then loads the diffusion model,
and ComfyUI unloads the text encoder to make room: ``model.to(offload_device)``, a pageable copy of every
weight into newly allocated host memory. On the H200 that copy took 6.1-9.1 s of every first prompt of the
eager GGUF 720p81 records at 12, 16 and 24 GiB (docs/memory-model.md, "Unloading a model at an expert
switch"), and it comes again on every prompt whose text changed.

The clone this node returns keeps the host tensors its weights were loaded from (:mod:`.host_copy`, the
estimator's unload for the Wan model) and gives them back at the unload, so nothing is copied. The host memory
kept is that of the weights loaded on the GPU, and only while they are loaded: never more than the text
encoder held on the host before ComfyUI first loaded it. Where ComfyUI keeps the text encoder on one device,
created it on the GPU, or manages residency itself (dynamic VRAM), the CLIP passes through unchanged.
"""
from __future__ import annotations

from . import host_copy
from .comfy_bridge import same_device

NOT_CLIP = "not a ComfyUI CLIP (it has no model patcher): passed through unchanged"
NOT_KEPT = ("the text encoder loads and unloads on one device, or ComfyUI manages its residency itself (dynamic "
            "VRAM): passed through unchanged, ComfyUI's own unload applies")
ON_GPU = ("unloading: the text encoder's weights were created on the GPU (ComfyUI does so where VRAM is ample "
          "against free RAM), so its first unload copies them to the host as before; every later one copies nothing")
KEPT = ("unloading: the text encoder's weights keep their host copies while loaded, so the unload that makes room "
        "for the diffusion model copies nothing back; host memory stays within what it held before its first load")


def apply_text_encoder_host_copy(clip):
    """(clip, status text): a clone of ``clip`` whose unloads give its weights their host tensors back, or
    ``clip`` itself where that does not apply."""
    patcher = getattr(clip, "patcher", None)
    if patcher is None or not callable(getattr(clip, "clone", None)):
        return clip, NOT_CLIP
    c = clip.clone()
    if not host_copy.install(c.patcher):
        return clip, NOT_KEPT
    offload = c.patcher.offload_device
    on_host = any(same_device(t.device, offload) for t in c.patcher.model.parameters())
    return c, KEPT if on_host else ON_GPU
