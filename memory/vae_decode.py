"""The VAE decode that follows a Wan sampling, as ComfyUI plans it: the memory it frees on the GPU first.

ComfyUI's ``VAE.decode`` (comfy/sd.py) asks ``load_models_gpu`` for the VAE with ``memory_required`` set to
the VAE's ``memory_used_decode`` figure for the latent; ``load_models_gpu`` then frees 1.1 x the VAE's weights
plus that figure plus the memory it always keeps free.  Weights of the sampled model that are resident past
that point are evicted there, and the decode runs among the holes they leave.
"""
from __future__ import annotations

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
