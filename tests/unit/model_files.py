"""Small Wan-shaped model files for the header, CLI and route tests: safetensors written by hand
(so a header can be broken on purpose) and GGUF written with the gguf package."""
import json
import struct

import numpy as np


def wan_shapes(dim=256, ffn=8, layers=2, in_dim=16, out_dim=16):
    s = {"head.modulation": [1, 2, dim], "patch_embedding.weight": [dim, in_dim, 1, 2, 2],
         "head.head.weight": [out_dim * 4, dim]}
    for i in range(layers):
        s[f"blocks.{i}.ffn.0.weight"] = [ffn, dim]
    return s


def st_bytes(shapes: dict, dtype="F16", overrides=None) -> bytes:
    """A safetensors file with zero data for {name: shape}; ``overrides`` replaces header entries."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    header.update(overrides or {})
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * offset


def gguf_bytes(tmp_path, shapes: dict, orig_shapes: dict | None = None) -> bytes:
    import gguf
    p = tmp_path / "_w.gguf"
    w = gguf.GGUFWriter(str(p), "wan")
    for name, dims in (orig_shapes or {}).items():
        w.add_array(f"comfy.gguf.orig_shape.{name}", list(dims))
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p.read_bytes()


def write(tmp_path, name, data: bytes) -> str:
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)
