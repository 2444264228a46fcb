"""The VAE decode that follows a Wan sampling, as ComfyUI plans it: the memory it frees on the GPU first, and the
convolutions whose cuDNN engine it picks late.

ComfyUI's ``VAE.decode`` (comfy/sd.py) asks ``load_models_gpu`` for the VAE with ``memory_required`` set to
the VAE's ``memory_used_decode`` figure for the latent; ``load_models_gpu`` then frees 1.1 x the VAE's weights
plus that figure plus the memory it always keeps free.  Weights of the sampled model that are resident past
that point are evicted there, and the decode runs among the holes they leave.

PyTorch's cuDNN bindings pick a convolution's engine the first time they see its shapes in a process, among the
engines whose workspace fits what the allocator reports then (with cudaMallocAsync, ComfyUI's default: the
device's free memory, or half of it where an allocation of all of it fails), and keep it.  The Wan 2.1 VAE
decodes a latent frame at a time; the convolutions of the second frame onwards at the output's full and half
resolution are first seen when the decode's own pool already holds most of the free memory.  Planned there, the
last 96-channel convolution of a 1280x720 decode settles on an engine without workspace that takes 87 ms a call
against 7.9 ms (:func:`late_convs`).
"""
from __future__ import annotations

from typing import NamedTuple

GiB = 1 << 30

# Per latent channel count: the VAE, its ``memory_used_decode`` in bytes per latent pixel (the latent's
# height x width; its frames do not enter it) per byte of the VAE's dtype, and its parameter count (the
# configs comfy/sd.py builds them from, counted on ComfyUI 0.3.64's own classes).
WAN_VAES = {
    16: ("Wan 2.1 VAE", 7000 * 64, 126_892_531),   # A14B, 14B, 1.3B
    48: ("Wan 2.2 VAE", 8000 * 256, 704_688_668),  # TI2V-5B
}
LOAD_FACTOR = 1.1  # load_models_gpu frees this many times a model's weights before loading it


def comfy_figure_bytes(latent, dtype_size: int = 2) -> int | None:
    """ComfyUI's ``memory_used_decode`` for ``latent`` ([B, C, T, H, W]) with the Wan VAE of its channel count in
    a dtype of ``dtype_size`` bytes; None for a latent no Wan VAE decodes."""
    found = WAN_VAES.get(int(latent[1]))
    return None if found is None else found[1] * int(latent[3]) * int(latent[4]) * dtype_size


def decode_bytes(latent, dtype_size: int = 2) -> int | None:
    """What ComfyUI frees on the GPU, beyond the memory it always keeps free, before it decodes ``latent``
    ([B, C, T, H, W]) with the Wan VAE of its channel count in a dtype of ``dtype_size`` bytes: the VAE's
    ``memory_used_decode`` figure plus 1.1 x its weights.  None for a latent no Wan VAE decodes."""
    figure = comfy_figure_bytes(latent, dtype_size)
    if figure is None:
        return None
    return int(figure + LOAD_FACTOR * WAN_VAES[int(latent[1])][2] * dtype_size)


def vae_name(latent) -> str | None:
    found = WAN_VAES.get(int(latent[1]))
    return None if found is None else found[0]


class Conv(NamedTuple):
    """One convolution as cuDNN sees it: input and weight shapes, and the convolution's own zero padding (the
    causal 3-D convolutions pad their input before it and run with none)."""
    input: tuple
    weight: tuple
    padding: int

    def output(self) -> tuple:
        return (self.input[0], self.weight[0]) + tuple(s + 2 * self.padding - k + 1
                                                       for s, k in zip(self.input[2:], self.weight[2:]))

    def plan_bytes(self, dtype_size: int) -> int:
        """Free memory, before the first call, under which cuDNN is offered its workspace engines: the input, the
        weight and the output, and twice :data:`WORKSPACE_FACTOR` x the input and output (the allocator may offer
        only half of what is free)."""
        n_in, n_out = _numel(self.input), _numel(self.output())
        io = (n_in + n_out) * dtype_size
        return int(io + _numel(self.weight) * dtype_size + 2 * WORKSPACE_FACTOR * io)


# The workspace of cuDNN's fast engines for these convolutions, as a multiple of the input plus output bytes
# (their NDHWC copies).  bench.conv_workspace on the H200 (cudaMallocAsync, bf16) found the fast engine of the
# 96-channel 1280x720 convolution planned with 2.5 GiB free before the call and not with 2.0 (output 0.66 GiB,
# so its workspace is 1.34-1.84 GiB against 1.65 GiB of input and output); at 832x480 and 1024x576 the
# bracket is 1.0-1.7 and 0.55-1.02 times theirs.  1.7 covers all three.
WORKSPACE_FACTOR = 1.7


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def late_convs(latent) -> list[Conv]:
    """The Wan 2.1 VAE decoder's convolutions (comfy/ldm/wan/vae.py's ``Decoder3d``: 384, 192 and 96 channels at a
    quarter, half and full output resolution) that a decode of ``latent`` ([B, C, T, H, W]) first runs with its
    second latent frame, at half and full resolution, in the order it runs them: the upsampling 2-D convolutions of the four
    output frames and the causal 3-D ones over those frames plus two cached.  Empty where no such decode follows:
    another VAE, a batch of more than one, or a single latent frame."""
    if len(latent) < 5 or int(latent[1]) != 16 or int(latent[0]) != 1 or int(latent[2]) < 2:
        return []
    h, w = int(latent[3]), int(latent[4])
    half, full = (4 * h, 4 * w), (8 * h, 8 * w)
    return [
        Conv((4, 384) + half, (192, 384, 3, 3), 1),
        Conv((1, 192, 6, half[0] + 2, half[1] + 2), (192, 192, 3, 3, 3), 0),
        Conv((4, 192) + full, (96, 192, 3, 3), 1),
        Conv((1, 96, 6, full[0] + 2, full[1] + 2), (3, 96, 3, 3, 3), 0),
        Conv((1, 96, 6, full[0] + 2, full[1] + 2), (96, 96, 3, 3, 3), 0),
    ]
