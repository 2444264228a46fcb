"""Read and validate a safetensors file's header: every tensor's name, dtype, shape and byte span.

Only the header is read.  Every value is checked against the format (an 8-byte little-endian
header length, a JSON object of ``name: {dtype, shape, data_offsets}``) and against the file's
size, so a truncated download, a foreign file or a hand-edited header gives one
:class:`ModelFileError` naming the file, never another exception.
"""
from __future__ import annotations

import json
import struct

from .errors import ModelFileError, brief

__all__ = ["read_safetensors_header", "ST_DTYPE_BITS", "MAX_HEADER_BYTES"]

# safetensors itself refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000
MAX_NDIM = 8
MAX_SIZE = 1 << 40  # per dimension
MAX_NUMEL = 1 << 48

# Bits per element of every dtype the safetensors format defines.
ST_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
                 "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
                 "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _shape(name: str, entry: dict, shown: str) -> tuple:
    if "shape" not in entry:
        raise ModelFileError(f"{shown}: header entry {_short(name)} has no shape")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
        raise ModelFileError(f"{shown}: header entry {_short(name)} has shape {_short(shape)}, not a list of sizes")
    if len(shape) > MAX_NDIM:
        raise ModelFileError(f"{shown}: header entry {_short(name)} has {len(shape)} dimensions (at most {MAX_NDIM})")
    numel = 1
    for size in shape:
        if size < 0:
            raise ModelFileError(f"{shown}: header entry {_short(name)} has a negative size {size} in its shape")
        if size > MAX_SIZE:
            raise ModelFileError(f"{shown}: header entry {_short(name)} has an impossible size {_short(size)} in its shape")
        numel *= size
    if numel > MAX_NUMEL:
        raise ModelFileError(f"{shown}: header entry {_short(name)} has an impossible shape {_short(shape)}")
    return tuple(shape), numel


def _entry(name: str, entry, data_len: int, shown: str) -> tuple:
    """(dtype, shape, bytes) of one header entry, all checked."""
    if not isinstance(entry, dict):
        raise ModelFileError(f"{shown}: header entry {_short(name)} is {type(entry).__name__}, not an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in ST_DTYPE_BITS:
        raise ModelFileError(f"{shown}: header entry {_short(name)} has an unknown dtype {_short(dtype)}")
    shape, numel = _shape(name, entry, shown)
    offsets = entry.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise ModelFileError(f"{shown}: header entry {_short(name)} has bad data_offsets {_short(offsets)} "
                             "(expected [begin, end] with 0 <= begin <= end)")
    begin, end = offsets
    need = (numel * ST_DTYPE_BITS[dtype] + 7) // 8
    if end - begin != need:
        raise ModelFileError(f"{shown}: header entry {_short(name)} spans {end - begin} bytes, but shape "
                             f"{list(shape)} of {dtype} needs {need}")
    if end > data_len:
        raise ModelFileError(f"{shown} is truncated: tensor {_short(name)} ends at byte {end} of the data, which "
                             f"has {data_len} bytes (an interrupted download?)")
    return dtype, shape, end - begin


def read_safetensors_header(f, file_size: int, shown: str) -> dict:
    """{tensor name: (dtype, shape, bytes)} from the open binary file ``f`` of ``file_size`` bytes."""
    head = f.read(8)
    if len(head) != 8:
        raise ModelFileError(f"{shown} is too short to be a safetensors file ({file_size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n < 2 or n > MAX_HEADER_BYTES:
        # the length itself is not quoted: it would echo the first 8 bytes of whatever file was named
        raise ModelFileError(f"{shown} is not a safetensors file (its first 8 bytes are not a header length of "
                             f"2 to {MAX_HEADER_BYTES:,} bytes)")
    if n > file_size - 8:
        raise ModelFileError(f"{shown}: truncated safetensors header: it declares {n} bytes, the file has "
                             f"{file_size - 8} after the length (an interrupted download?)")
    raw = f.read(n)
    if len(raw) != n:
        raise ModelFileError(f"{shown}: truncated safetensors header (read {len(raw)} of {n} bytes)")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelFileError(f"{shown} is not a safetensors file (its header is not UTF-8 text)") from None
    except RecursionError:
        raise ModelFileError(f"{shown} is not a safetensors file (its header nests too deeply)") from None
    except ValueError as e:  # json.JSONDecodeError, and int() limits on huge numbers
        raise ModelFileError(f"{shown} is not a safetensors file (its header is not JSON: {brief(e)})") from None
    if not isinstance(meta, dict):
        raise ModelFileError(f"{shown} is not a safetensors file (its header is a JSON {type(meta).__name__}, "
                             "not an object)")
    data_len = file_size - 8 - n
    tensors = {}
    for name, entry in meta.items():
        if name == "__metadata__":
            if not isinstance(entry, dict):
                raise ModelFileError(f"{shown}: header __metadata__ is {type(entry).__name__}, not an object")
            continue
        tensors[name] = _entry(name, entry, data_len, shown)
    return tensors
