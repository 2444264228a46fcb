"""How a Wan Compile Blocks model's streamed blocks ran, kept across ComfyUI starts beside the compile cache.

The estimator plans a streamed load under Wan Compile Blocks as the eager forward until the model's streamed Linears
have run compiled, with no call eager and no sampling failed (``compile_blocks.streamed_blocks_ran``); after
that, as the compiled forward plus the one block's weights its path holds.  That evidence lives in the process, so
without this file every ComfyUI start's first prompt planned the eager floor again: on the H200 at 16 GiB the seed
workflow's high-noise expert held 6.8 GiB above its weights on the first prompt after a restart against 8.3 GiB
planned, and 1.6 GiB of the budget stayed unused while 23 % of its weights streamed (docs/benchmarks.md).

When a sampling ends with the in-process evidence (streamed Linears run compiled, none eager, none failed), the
path it names ("lifted" or "staged") is written under a key of what decides it: the torch build and GPU, the pack's
version, the model's dims and compute dtype, whether ComfyUI patches its weights (a LoRA), and the kind of every
weighted module of its blocks (class, weight class, dtype and quantization).  A sampling in which a block call ran
eagerly, or that failed, removes the key.  A model reads the key while its own blocks have not streamed compiled
yet, in a new process or in this one (Wan 2.2's two experts are of one kind: the low-noise expert's first sampling
reads what the high-noise one's wrote); once they have, or once one ran eagerly, what the model saw decides.

The file is ``<cache folder>/compile/streamed-blocks.json``.  Reading or writing it never fails a sampling: a file
that cannot be read is as no file (the eager floor), and a failed write is logged once.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

from .. import __version__
from ..attention.file_lock import file_lock, replace_atomically
from . import comfy_bridge, compile_cache
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

FILE_NAME = "streamed-blocks.json"
FORMAT = 1
PATHS = ("lifted", "staged")  # the compiled ways a streamed block runs (nodes/compile_blocks.py)

_lock = threading.Lock()
_read: dict = {}  # file path -> {key: path} as this process last read or wrote it


def _module_kinds(blocks) -> list:
    """Every distinct (module class, weight class, weight dtype, quantization) among the weighted modules of
    ``blocks``: what decides whether a streamed block is lifted, staged or run eagerly (nodes/staged_blocks.py)."""
    kinds = set()
    for block in blocks:
        for m in block.modules():
            w = m.__dict__.get("_parameters", {}).get("weight")
            if w is None:
                continue
            kinds.add((f"{type(m).__module__}.{type(m).__qualname__}", type(w).__name__, str(w.dtype),
                       str(getattr(w, "tensor_type", ""))))
    return sorted(kinds)


def record_key(model, blocks) -> str:
    """The key of ``model``'s streamed path, whose transformer blocks are ``blocks`` (hashed short)."""
    import torch
    text = repr((compile_cache.build_prefix(torch, comfy_bridge.device_of(model)), __version__,
                 comfy_bridge.wan_dims(model), comfy_bridge.compute_dtype(model),
                 bool(getattr(model, "patches", None)), _module_kinds(blocks)))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _path() -> str | None:
    base = comfy_bridge.cache_dir()
    return None if base is None else os.path.join(base, compile_cache.SUBDIR, FILE_NAME)


def _read_disk(path: str) -> dict:
    """The file's {key: path}; {} where it is missing, unreadable or of another format."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("paths"), dict):
        return {}
    return {k: v for k, v in data["paths"].items() if v in PATHS}


def _entries(path: str) -> dict:
    with _lock:
        found = _read.get(path)
    if found is None:
        found = _read_disk(path)
        with _lock:
            _read[path] = found
    return found


def _write(path: str, key: str, value: str | None) -> None:
    """Set (``value``) or remove (None) ``key`` in the file, merged with what is on disk, atomically."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with file_lock(path):
        paths = _read_disk(path)
        if value is None:
            paths.pop(key, None)
        else:
            paths[key] = value
        replace_atomically(path, json.dumps({"format": FORMAT, "paths": paths}, indent=1, sort_keys=True).encode(),
                           ".streamed-", mode=0o644)
    with _lock:
        _read[path] = paths


def recorded(model, blocks) -> str:
    """The streamed path an earlier sampling of this model wrote ("lifted", "staged"), "" where none.  Never
    raises."""
    try:
        path = _path()
        return "" if path is None else _entries(path).get(record_key(model, blocks), "")
    except Exception as e:
        warn_once(("streamed-record-read", type(e).__name__), "wan-sage: how this model's streamed blocks ran in "
                  "an earlier start could not be read (%s); its first prompt plans them as eager.", reason(e))
        return ""


def keep(model, blocks, ran: str) -> None:
    """Write ``ran`` ("lifted", "staged") as this model's streamed path, or remove its key ("": a block call ran
    eagerly or a sampling failed), where the file says otherwise.  Never raises."""
    try:
        path = _path()
        if path is None:
            return
        key = record_key(model, blocks)
        if _entries(path).get(key, "") == ran:
            return
        _write(path, key, ran or None)
        if ran:
            log.info("wan-sage: this model's streamed blocks ran compiled (%s): kept in %s, so that the first prompt "
                     "of the next ComfyUI start plans them so", ran, path)
    except Exception as e:
        warn_once(("streamed-record-write", type(e).__name__), "wan-sage: how this model's streamed blocks ran "
                  "could not be kept for the next start (%s); its first prompt there plans them as eager.", reason(e))
