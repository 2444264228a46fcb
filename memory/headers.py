"""Read a Wan model file's header (safetensors or GGUF) and detect the Wan config it holds, without
loading weights.  Detection mirrors ComfyUI's ``model_detection`` for Wan (key ``head.modulation``).

Every failure is a :class:`ModelFileError` with one line that names the file as the caller shows
it (the CLI: the path it was given; the server route: the model's name, never a server path).
"""
from __future__ import annotations

import os
import re
import stat
from collections import Counter
from dataclasses import dataclass

from .activation_model import WanDims
from .gguf_header import read_gguf_header
from .errors import ModelFileError, NotAWanModel
from .safetensors_header import read_safetensors_header

__all__ = ["ModelFileInfo", "read_model_file", "dims_from_shapes", "ModelFileError", "NotAWanModel", "WAN_DIM_STEP"]

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
GGUF_MAGIC = b"GGUF"
# ComfyUI detects Wan's heads as dim // 128: every Wan dim is a multiple of 128.
WAN_DIM_STEP = 128
MAX_DIM = 1 << 16
MAX_FFN = 1 << 20
MAX_LAYERS = 1000
MAX_IN_DIM = 4096
# head.head's outputs: 4 (the 1x2x2 patch) times the latent channels, 16 (Wan 2.1 VAE) or 48 (Wan 2.2 VAE).
WAN_OUT_DIMS = (16, 48)


@dataclass(frozen=True)
class ModelFileInfo:
    path: str
    format: str  # "safetensors" or "gguf"
    dims: WanDims
    weights_bytes: int
    dtypes: dict  # dtype / quant type -> parameter count
    main_dtype: str  # most common by parameter count
    scaled_fp8: bool = False  # ComfyUI's scaled-fp8 marker tensor: the weights stay fp8 whatever the GPU

    @property
    def params(self) -> int:
        return sum(self.dtypes.values())

    @property
    def bytes_per_param(self) -> float:
        n = self.params
        return self.weights_bytes / n if n else 0.0


def _strip(keys_shapes: dict) -> dict:
    for p in _PREFIXES:
        if any(k.startswith(p + "head.modulation") for k in keys_shapes):
            return {k[len(p):]: v for k, v in keys_shapes.items() if k.startswith(p)}
    return keys_shapes


def _sized(s: dict, key: str, ndim: int, shown: str) -> tuple:
    if key not in s:
        raise NotAWanModel(f"{shown} looks like Wan but lacks the tensor {key!r}")
    shape = tuple(s[key])
    if len(shape) != ndim or not all(isinstance(x, int) and x > 0 for x in shape):
        raise NotAWanModel(f"{shown}: tensor {key} has shape {list(shape)[:8]}, expected {ndim} positive sizes; "
                           "not a Wan model")
    return shape


def _bounded(value: int, lo: int, hi: int, what: str, shown: str) -> int:
    if not lo <= value <= hi:
        raise NotAWanModel(f"{shown}: {what} {value} is outside {lo}..{hi}; not a Wan model")
    return value


def dims_from_shapes(shapes: dict, name: str = "model file") -> WanDims:
    """WanDims from {key: shape}; NotAWanModel says what is missing or impossible."""
    s = _strip(shapes)
    if "head.modulation" not in s:
        raise NotAWanModel(f"{name} is not a Wan diffusion model (no 'head.modulation' tensor); "
                           "a Wan 2.1/2.2 DiT file is needed")
    dim = _sized(s, "head.modulation", 3, name)[-1]
    if dim < WAN_DIM_STEP or dim % WAN_DIM_STEP or dim > MAX_DIM:
        raise NotAWanModel(f"{name}: dim {dim} is not a Wan model (a Wan dim is a multiple of {WAN_DIM_STEP})")
    ffn = _bounded(_sized(s, "blocks.0.ffn.0.weight", 2, name)[0], 1, MAX_FFN, "ffn_dim", name)
    patch = _sized(s, "patch_embedding.weight", 5, name)
    in_dim = _bounded(patch[1], 1, MAX_IN_DIM, "in_dim", name)
    head_out = _sized(s, "head.head.weight", 2, name)[0]
    if head_out % 4 or head_out // 4 not in WAN_OUT_DIMS:
        raise NotAWanModel(f"{name}: head.head.weight has {head_out} outputs; a Wan model has "
                           f"{' or '.join(str(4 * c) for c in WAN_OUT_DIMS)}")
    out_dim = head_out // 4
    layers = len({m.group(1) for k in s for m in [re.match(r"blocks\.(\d+)\.", k)] if m})
    _bounded(layers, 1, MAX_LAYERS, "the number of blocks", name)
    vace_layers = len({m.group(1) for k in s for m in [re.match(r"vace_blocks\.(\d+)\.", k)] if m})
    if "vace_patch_embedding.weight" in s:
        mtype = "vace"
    elif "control_adapter.conv.weight" in s:
        mtype = "camera"
    elif "casual_audio_encoder.encoder.final_linear.weight" in s:
        mtype = "s2v"
    elif "audio_proj.audio_proj_glob_1.layer.bias" in s:
        mtype = "humo"
    elif "face_adapter.fuser_blocks.0.k_norm.weight" in s:
        mtype = "animate"
    elif "img_emb.proj.0.bias" in s:
        mtype = "i2v"
    else:
        mtype = "t2v"
    wan22_vae = out_dim == 48
    return WanDims(
        name=os.path.basename(name), dim=dim, ffn_dim=ffn, num_heads=dim // WAN_DIM_STEP, num_layers=layers,
        in_dim=in_dim, out_dim=out_dim, vae_stride=(4, 16, 16) if wan22_vae else (4, 8, 8),
        latent_channels=48 if wan22_vae else 16, model_type="ti2v" if wan22_vae else mtype,
        has_img_emb="img_emb.proj.0.bias" in s, vace_layers=vace_layers)


def _open(path: str, shown: str):
    """(open binary file, its size); ModelFileError for anything that is not a readable regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ModelFileError(f"{shown}: no such file") from None
    except PermissionError:
        raise ModelFileError(f"{shown} cannot be read (permission denied)") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise ModelFileError(f"{shown} cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelFileError(f"{shown} is a directory, not a model file")
    if not stat.S_ISREG(st.st_mode):
        raise ModelFileError(f"{shown} is not a regular file")
    try:
        return open(path, "rb"), st.st_size
    except PermissionError:
        raise ModelFileError(f"{shown} cannot be read (permission denied)") from None
    except OSError as e:
        raise ModelFileError(f"{shown} cannot be read ({e.strerror or e})") from None


def read_model_file(path: str, shown: str | None = None) -> ModelFileInfo:
    """The Wan config and weight types in the header of ``path``; ``shown`` is how messages name it."""
    shown = shown if shown is not None else path
    f, size = _open(path, shown)
    with f:
        if size == 0:
            raise ModelFileError(f"{shown} is empty (0 bytes)")
        try:
            magic = f.read(4)
            f.seek(0)
            if magic == GGUF_MAGIC:
                fmt = "gguf"
                tensors = read_gguf_header(f, size, shown)
            elif path.lower().endswith(".gguf"):
                if GGUF_MAGIC.startswith(magic):
                    raise ModelFileError(f"{shown}: truncated GGUF header ({size} bytes; an interrupted download?)")
                raise ModelFileError(f"{shown} is not a GGUF file (it does not start with the GGUF magic)")
            else:
                fmt = "safetensors"
                tensors = read_safetensors_header(f, size, shown)
        except OSError as e:
            raise ModelFileError(f"{shown} cannot be read ({e.strerror or e})") from None
    dims = dims_from_shapes({k: shape for k, (_t, shape, _b) in tensors.items()}, shown)
    dtypes = Counter()
    for dtype, shape, _b in tensors.values():
        numel = 1
        for x in shape:
            numel *= x
        dtypes[dtype] += numel
    main = max(dtypes, key=dtypes.get)
    scaled = any(k.endswith("scaled_fp8") for k in tensors)
    return ModelFileInfo(path, fmt, dims, sum(b for _t, _s, b in tensors.values()), dict(dtypes), main, scaled)
