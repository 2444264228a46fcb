"""Read a Wan model file's header (safetensors or GGUF) for dims and quant types, without
loading weights.  Detection mirrors ComfyUI's ``model_detection`` for Wan (key ``head.modulation``)."""
from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from dataclasses import dataclass

from .activation_model import WanDims

__all__ = ["ModelFileInfo", "read_model_file", "dims_from_shapes", "NotAWanModel"]

_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")
_ST_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8,
                   "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class NotAWanModel(ValueError):
    pass


@dataclass(frozen=True)
class ModelFileInfo:
    path: str
    format: str  # "safetensors" or "gguf"
    dims: WanDims
    weights_bytes: int
    dtypes: dict  # dtype / quant type -> parameter count
    main_dtype: str  # most common by parameter count

    @property
    def bytes_per_param(self) -> float:
        n = sum(self.dtypes.values())
        return self.weights_bytes / n if n else 0.0


def _strip(keys_shapes: dict) -> dict:
    for p in _PREFIXES:
        if any(k.startswith(p + "head.modulation") for k in keys_shapes):
            return {k[len(p):]: v for k, v in keys_shapes.items() if k.startswith(p)}
    return keys_shapes


def dims_from_shapes(shapes: dict, name: str = "model file") -> WanDims:
    """WanDims from {key: shape}; raises NotAWanModel with what was missing."""
    s = _strip(shapes)
    if "head.modulation" not in s:
        raise NotAWanModel(f"{name} is not a Wan diffusion model (no 'head.modulation' tensor); "
                           "give a Wan 2.1/2.2 DiT file, or use --preset")
    dim = int(s["head.modulation"][-1])
    try:
        ffn = int(s["blocks.0.ffn.0.weight"][0])
        in_dim = int(s["patch_embedding.weight"][1])
        out_dim = int(s["head.head.weight"][0]) // 4
    except KeyError as e:
        raise NotAWanModel(f"{name} looks like Wan but lacks {e.args[0]!r}") from None
    layers = len({int(m.group(1)) for k in s for m in [re.match(r"blocks\.(\d+)\.", k)] if m})
    vace_layers = len({int(m.group(1)) for k in s for m in [re.match(r"vace_blocks\.(\d+)\.", k)] if m})
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
        name=os.path.basename(name), dim=dim, ffn_dim=ffn, num_heads=dim // 128, num_layers=layers,
        in_dim=in_dim, out_dim=out_dim, vae_stride=(4, 16, 16) if wan22_vae else (4, 8, 8),
        latent_channels=48 if wan22_vae else 16, model_type="ti2v" if wan22_vae else mtype,
        has_img_emb="img_emb.proj.0.bias" in s, vace_layers=vace_layers)


def _read_safetensors(path: str):
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or n > 256 << 20:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        meta = json.loads(f.read(n))
    shapes, dtypes, total = {}, Counter(), 0
    for k, v in meta.items():
        if k == "__metadata__":
            continue
        shape = tuple(v["shape"])
        numel = 1
        for x in shape:
            numel *= x
        b0, b1 = v["data_offsets"]
        total += b1 - b0
        dtypes[v["dtype"]] += numel
        shapes[k] = shape
    return shapes, dict(dtypes), total


def _read_gguf(path: str):
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise RuntimeError("reading GGUF needs the 'gguf' package: pip install gguf") from e
    r = GGUFReader(path)
    shapes, dtypes, total = {}, Counter(), 0
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        numel = 1
        for x in shape:
            numel *= x
        shapes[t.name] = shape
        dtypes[t.tensor_type.name] += numel
        total += int(t.n_bytes)
    return shapes, dict(dtypes), total


def read_model_file(path: str) -> ModelFileInfo:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        fmt = "gguf"
        shapes, dtypes, total = _read_gguf(path)
    else:
        fmt = "safetensors"
        shapes, dtypes, total = _read_safetensors(path)
    dims = dims_from_shapes(shapes, path)
    main = max(dtypes, key=dtypes.get) if dtypes else "?"
    return ModelFileInfo(path, fmt, dims, total, dtypes, main)
