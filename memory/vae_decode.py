"""The VAE decode that follows a Wan sampling, as ComfyUI plans it: the memory it frees on the GPU first.

ComfyUI's ``VAE.decode`` (comfy/sd.py) asks ``load_models_gpu`` for the VAE with ``memory_required`` set to
the VAE's ``memory_used_decode`` figure for the latent; ``load_models_gpu`` then frees 1.1 x the VAE's weights
plus that figure plus the memory it always keeps free.  Weights of the sampled model that are resident past
that point are evicted there, and the decode runs among the holes they leave.

That figure leaves no room for the workspace of cuDNN's fast engine for the decoder's largest convolution (the
last stage's 3-D convolution at full resolution, 1x96x6x722x1282 at 1280x720 for the Wan 2.1 VAE).  PyTorch
keeps the first engine whose workspace it can allocate, and where a later call's workspace does not allocate it
falls back to one with none and keeps that for the process: at 1280x720 that convolution then takes 87 ms a
call against 8 ms, 120 calls a decode.  :func:`decode_bytes` adds that workspace, taken as the convolution's
input plus its output (the free memory its fast engine needed alone, bench/records/decode-room/).
"""
from __future__ import annotations

GiB = 1 << 30

# Per latent channel count: the VAE, its ``memory_used_decode`` in bytes per latent pixel (the latent's
# height x width; its frames do not enter it) per byte of the VAE's dtype, its parameter count (the configs
# comfy/sd.py builds them from, counted on ComfyUI 0.3.64's own classes), and the channels of its decoder's
# last stage (comfy/ldm/wan/vae.py: dim 96; vae2_2.py: dec_dim 256, ahead of its 2 x 2 unpatchify).
WAN_VAES = {
    16: ("Wan 2.1 VAE", 7000 * 64, 126_892_531, 96),    # A14B, 14B, 1.3B
    48: ("Wan 2.2 VAE", 8000 * 256, 704_688_668, 256),  # TI2V-5B
}
LOAD_FACTOR = 1.1  # load_models_gpu frees this many times a model's weights before loading it
# The decoder's last stage runs at 8 x the latent's height and width in both VAEs (the 2.2 VAE's 16 x spatial
# ratio ends in a 2 x 2 unpatchify), on chunks of one latent frame: 4 frames out, and in those 4 with the 2
# cached frames of its causal padding (CACHE_T), 1 pixel of spatial padding on each side.
LAST_STAGE_SCALE, CHUNK_FRAMES_OUT, CACHE_FRAMES = 8, 4, 2


def comfy_figure_bytes(latent, dtype_size: int = 2) -> int | None:
    """ComfyUI's ``memory_used_decode`` for ``latent`` ([B, C, T, H, W]) with the Wan VAE of its channel count in
    a dtype of ``dtype_size`` bytes; None for a latent no Wan VAE decodes."""
    found = WAN_VAES.get(int(latent[1]))
    return None if found is None else found[1] * int(latent[3]) * int(latent[4]) * dtype_size


def conv_workspace_bytes(latent, dtype_size: int = 2) -> int | None:
    """The workspace of cuDNN's fast engine for the largest convolution of the decoder of ``latent``'s Wan VAE,
    taken as that convolution's input plus its output; None for a latent no Wan VAE decodes.  Against the free
    memory the fast engine needed in a fresh process (bench/records/decode-room/conv-workspace-*.jsonl:
    1280x720 fast from 2.5 GiB free, slow at 2.0; 1024x576 and 832x480 fast from 1.5, slow at 1.0; the input
    already allocated), the workspace lies in 1.34-1.84, 0.58-1.08 and 0.71-1.21 GiB, and input plus output is
    1.65, 1.05 and 0.72 GiB."""
    found = WAN_VAES.get(int(latent[1]))
    if found is None:
        return None
    h, w = LAST_STAGE_SCALE * int(latent[3]), LAST_STAGE_SCALE * int(latent[4])
    conv_in = (CHUNK_FRAMES_OUT + CACHE_FRAMES) * (h + 2) * (w + 2)
    conv_out = CHUNK_FRAMES_OUT * h * w
    return found[3] * (conv_in + conv_out) * dtype_size


def comfy_frees_bytes(latent, dtype_size: int = 2) -> int | None:
    """What ComfyUI frees on the GPU, beyond the memory it always keeps free, before it decodes ``latent``
    ([B, C, T, H, W]) with the Wan VAE of its channel count in a dtype of ``dtype_size`` bytes: the VAE's
    ``memory_used_decode`` figure plus 1.1 x its weights.  None for a latent no Wan VAE decodes."""
    figure = comfy_figure_bytes(latent, dtype_size)
    if figure is None:
        return None
    return int(figure + LOAD_FACTOR * WAN_VAES[int(latent[1])][2] * dtype_size)


def decode_bytes(latent, dtype_size: int = 2) -> int | None:
    """The room the decode of ``latent`` takes on the GPU beyond the memory ComfyUI always keeps free: what
    ComfyUI frees for it (:func:`comfy_frees_bytes`) plus the workspace of its largest convolution's fast engine
    (:func:`conv_workspace_bytes`).  None for a latent no Wan VAE decodes."""
    frees = comfy_frees_bytes(latent, dtype_size)
    return None if frees is None else frees + conv_workspace_bytes(latent, dtype_size)


def vae_name(latent) -> str | None:
    found = WAN_VAES.get(int(latent[1]))
    return None if found is None else found[0]
