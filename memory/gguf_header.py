"""Read and validate a GGUF file's header: each tensor's name, type, shape and byte span.

The header (magic, version, counts, metadata, tensor table) is parsed here with a bounds check on
every read, so a truncated download, garbage bytes or a hand-edited file give one
:class:`ModelFileError` naming the file.  The ``gguf`` package supplies only the table of tensor
types and their block sizes.  Shapes are returned in PyTorch order: ComfyUI-GGUF's
``comfy.gguf.orig_shape.<name>`` metadata where present (tensors reshaped to fit GGUF), else the
GGUF dimensions reversed.
"""
from __future__ import annotations

import struct

from .errors import ModelFileError

__all__ = ["read_gguf_header", "MAX_HEADER_BYTES"]

# Real Wan GGUF headers are well under 1 MiB.
MAX_HEADER_BYTES = 64 << 20
MAX_NDIM = 8
MAX_SIZE = 1 << 40
MAX_ARRAY_DEPTH = 3
VERSIONS = (2, 3)
ORIG_SHAPE = "comfy.gguf.orig_shape."

# GGUF metadata value types: id -> (name, fixed byte size or None)
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_SCALAR = {_UINT8: "<B", _INT8: "<b", _UINT16: "<H", _INT16: "<h", _UINT32: "<I", _INT32: "<i", _FLOAT32: "<f",
           _BOOL: "<?", _UINT64: "<Q", _INT64: "<q", _FLOAT64: "<d"}
_INTEGER = (_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _UINT64, _INT64)


class _Truncated(Exception):
    """A read ran past the bytes that were read from the file."""


class _Cursor:
    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise _Truncated
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def left(self) -> int:
        return len(self.data) - self.pos

    def string(self, what: str, shown: str) -> str:
        n = self.u64()
        if n > self.left():
            raise _Truncated
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{shown}: {what} is not UTF-8 text") from None


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _value(cur: _Cursor, vtype: int, key: str, shown: str, depth: int = 0):
    """One metadata value.  Arrays of fixed-size items are skipped in one step unless they hold
    integers (the orig_shape arrays); the values that are not needed come back as None."""
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, cur.take(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return cur.string(f"metadata value of {_short(key)}", shown)
    if vtype != _ARRAY:
        raise ModelFileError(f"{shown}: metadata entry {_short(key)} has an unknown value type {vtype}")
    if depth >= MAX_ARRAY_DEPTH:
        raise ModelFileError(f"{shown}: metadata entry {_short(key)} nests arrays too deeply")
    item, count = cur.u32(), cur.u64()
    if item in _SCALAR:
        size = struct.calcsize(_SCALAR[item])
        if count * size > cur.left():
            raise _Truncated
        raw = cur.take(count * size)
        if item in _INTEGER and key.startswith(ORIG_SHAPE) and count <= MAX_NDIM:
            return list(struct.unpack("<" + _SCALAR[item][1] * count, raw))
        return None
    if count > cur.left() // 8:  # every string or array item takes at least 8 bytes
        raise _Truncated
    for _ in range(count):
        _value(cur, item, key, shown, depth + 1)
    return None


def _quant_sizes(shown: str) -> dict:
    """{GGML type id: (name, values per block, bytes per block)}."""
    try:
        from gguf.constants import GGML_QUANT_SIZES
    except ImportError:
        raise ModelFileError(f"{shown}: reading a GGUF file needs the 'gguf' package (pip install gguf)") from None
    return {int(t): (t.name, block, size) for t, (block, size) in GGML_QUANT_SIZES.items()}


def _parse(cur: _Cursor, file_size: int, shown: str) -> dict:
    if cur.take(4) != b"GGUF":
        raise ModelFileError(f"{shown} is not a GGUF file (it does not start with the GGUF magic)")
    version = cur.u32()
    if version not in VERSIONS:
        raise ModelFileError(f"{shown}: unsupported GGUF version {version} (readable: {', '.join(map(str, VERSIONS))})")
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_kv > cur.left() // 13 or n_tensors > cur.left() // 24:  # the smallest entry of each kind
        raise _Truncated
    meta = {}
    for _ in range(n_kv):
        key = cur.string("a metadata key", shown)
        vtype = cur.u32()
        value = _value(cur, vtype, key, shown)
        if key == "general.alignment" or key.startswith(ORIG_SHAPE):
            meta[key] = value
    types = _quant_sizes(shown)
    infos = []
    for _ in range(n_tensors):
        name = cur.string("a tensor name", shown)
        ndim = cur.u32()
        if not 1 <= ndim <= MAX_NDIM:
            raise ModelFileError(f"{shown}: tensor {_short(name)} has {ndim} dimensions (1 to {MAX_NDIM} allowed)")
        dims = [cur.u64() for _ in range(ndim)]
        ttype, offset = cur.u32(), cur.u64()
        if ttype not in types:
            raise ModelFileError(f"{shown}: tensor {_short(name)} has an unknown GGML type {ttype}")
        if any(not 1 <= d <= MAX_SIZE for d in dims):
            raise ModelFileError(f"{shown}: tensor {_short(name)} has an impossible shape {_short(dims)}")
        infos.append((name, dims, ttype, offset))
    alignment = meta.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 20:
        raise ModelFileError(f"{shown}: general.alignment {_short(alignment)} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    data_len = file_size - data_start
    tensors = {}
    for name, dims, ttype, offset in infos:
        tname, block, type_size = types[ttype]
        numel = 1
        for d in dims:
            numel *= d
        if dims[0] % block:
            raise ModelFileError(f"{shown}: tensor {_short(name)} of type {tname} has a row of {dims[0]} values, "
                                 f"not a multiple of its block size {block}")
        nbytes = numel // block * type_size
        if name in tensors:
            raise ModelFileError(f"{shown}: tensor {_short(name)} appears twice")
        if offset % alignment:
            raise ModelFileError(f"{shown}: tensor {_short(name)} starts at offset {offset}, not aligned to {alignment}")
        if offset + nbytes > data_len:
            raise ModelFileError(f"{shown} is truncated: tensor {_short(name)} ends beyond the end of the file "
                                 "(an interrupted download?)")
        shape = tuple(reversed(dims))
        orig = meta.get(ORIG_SHAPE + name)
        if orig is not None:
            orig_numel = 1
            for d in orig:
                orig_numel *= d if isinstance(d, int) and d > 0 else 0
            if not orig or orig_numel != numel:
                raise ModelFileError(f"{shown}: {ORIG_SHAPE}{_short(name)} gives shape {_short(orig)}, which does "
                                     f"not hold the tensor's {numel} values")
            shape = tuple(orig)
        tensors[name] = (tname, shape, nbytes)
    return tensors


def read_gguf_header(f, file_size: int, shown: str) -> dict:
    """{tensor name: (GGML type name, shape, bytes)} from the open binary file ``f`` of ``file_size`` bytes."""
    data = f.read(min(file_size, MAX_HEADER_BYTES))
    try:
        return _parse(_Cursor(data), file_size, shown)
    except _Truncated:
        if len(data) < file_size:
            raise ModelFileError(f"{shown}: GGUF header larger than {MAX_HEADER_BYTES >> 20} MiB, not a Wan model") from None
        raise ModelFileError(f"{shown}: truncated GGUF header (the file ends inside its header; "
                             "an interrupted download?)") from None
