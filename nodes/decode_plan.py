"""Plan the cuDNN engines of the Wan VAE decode's late convolutions while the memory is there for them.

After a sampling, the decode that follows first runs some large convolutions only when its own pool already
holds most of the free memory, and PyTorch then keeps an engine without workspace for them for the whole process
(:mod:`..memory.vae_decode`).  Right after the sampling, with the allocator's cache handed back, each of those
convolutions runs once on empty tensors of the decode's shapes and dtype, where the free memory covers
:meth:`~..memory.vae_decode.Conv.plan_bytes`: PyTorch keeps the engine picked then, and the decode finds it.
A shape whose room is not there is left to the decode, as without this step.  Once per shape, device and dtype
in a process; a failure is logged once and never fails the sampling."""
from __future__ import annotations

import logging

import torch

from ..memory import vae_decode
from . import comfy_bridge
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

_planned: set = set()


def plan_decode(latent, dev) -> list[tuple]:
    """Run the late convolutions of a Wan VAE decode of ``latent`` (a shape) once each on ``dev`` in the VAE's
    dtype where the free memory covers their plan; returns the (input, weight) shapes it ran."""
    if getattr(dev, "type", None) != "cuda" or not torch.backends.cudnn.is_available():
        return []
    ran = []
    try:
        dtype = comfy_bridge.vae_dtype(dev)
        size = torch.empty((), dtype=dtype).element_size()
        for conv in vae_decode.late_convs(tuple(latent)):
            key = (conv, str(dev), dtype)
            if key in _planned:
                continue
            free, _ = torch.cuda.mem_get_info(dev)
            if free < conv.plan_bytes(size):
                log.debug("wan-sage: %.2f GiB free, under the %.2f GiB the decode's %s convolution plans in; left "
                          "to the decode", free / vae_decode.GiB, conv.plan_bytes(size) / vae_decode.GiB,
                          "x".join(map(str, conv.input)))
                continue
            try:
                _run(conv, dev, dtype)
            except torch.OutOfMemoryError:
                continue     # left to the decode, as without this step
            _planned.add(key)
            ran.append((conv.input, conv.weight))
    except Exception as e:  # never fail a sampling over a decode's engine choice
        warn_once(("decode-plan", type(e).__name__), "wan-sage: planning the VAE decode's convolutions failed (%s); "
                  "the decode picks its engines itself.", reason(e))
    finally:
        if ran:
            comfy_bridge.trim_allocator(dev, "after planning the decode")
    return ran


def _run(conv, dev, dtype) -> None:
    fn = torch.nn.functional.conv3d if len(conv.input) == 5 else torch.nn.functional.conv2d
    with torch.inference_mode():
        x = torch.empty(conv.input, device=dev, dtype=dtype)
        w = torch.empty(conv.weight, device=dev, dtype=dtype)
        fn(x, w, padding=conv.padding)
