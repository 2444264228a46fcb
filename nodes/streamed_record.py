"""How a Wan Compile Blocks model's streamed blocks ran, kept across ComfyUI starts beside the compile cache.

The estimator plans a streamed load under Wan Compile Blocks as the eager forward (the eager floor) until the
model's streamed Linears have run compiled, with no call eager and no sampling failed
(``compile_blocks.streamed_blocks_ran``); after that, as the compiled forward plus the one block's weights its path
holds.  A new process has none of that evidence, so its first prompt would plan the eager floor: on the H200 at
16 GiB the seed workflow's high-noise expert held 6.8 GiB above its weights on such a prompt against 8.3 GiB
planned, and 1.6 GiB of the budget stayed unused while 23 % of its weights streamed (docs/attention.md, "Wan
Compile Blocks").

When a sampling ends, what it showed is written under a key of what decides it: the torch build and GPU, the
versions of the pack and of ComfyUI, the model's dims and compute dtype, the weights its patches (LoRA) change by
their name within a block, and the kind of every weighted module of its blocks (class, weight class, dtype,
quantization, and whether the pack knows how to cast it).  The value is the path ("lifted" or "staged") where its
streamed Linears ran compiled, or ``eager`` where a block call ran eagerly or the sampling failed; ``eager`` is
never overwritten, so a model kind that once needed the eager floor keeps it until the key changes (another torch,
ComfyUI or pack version).  A model reads its key while its own blocks have not streamed compiled yet, in a new
process or in this one (Wan 2.2's two experts are of one kind: the low-noise expert's first sampling reads what
the high-noise one's wrote); once they have, or once one ran eagerly, what the model saw decides.

The file is ``<cache folder>/compile/streamed-blocks.json``.  Reading or writing it never fails a sampling: a file
that cannot be read is as no file (the eager floor); where ``eager`` cannot be written the file is removed, and
where that fails too the warning says that the next start may plan too little.
"""
from __future__ import annotations

import hashlib
import logging
import re

from .. import __version__
from . import comfy_bridge, compile_cache, staged_blocks
from .kept_file import KeptFile
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

FILE_NAME = "streamed-blocks.json"
PATHS = ("lifted", "staged")  # the compiled ways a streamed block runs (nodes/compile_blocks.py)
EAGER = "eager"  # a block call ran eagerly or a sampling failed: the eager floor, for good
_BLOCK_KEY = re.compile(r"^diffusion_model\.blocks\.\d+\.")

_file = KeptFile(compile_cache.SUBDIR, FILE_NAME, "paths", lambda v: v in PATHS + (EAGER,), "streamed",
                 "how the streamed blocks ran")


def _module_kinds(blocks) -> list:
    """Every distinct (module class, weight class, weight dtype, quantization, cast known) among the weighted
    modules of ``blocks``: what decides whether a streamed block is lifted, staged or run eagerly
    (nodes/staged_blocks.py)."""
    kinds = set()
    for block in blocks:
        for m in block.modules():
            w = m.__dict__.get("_parameters", {}).get("weight")
            if w is None:
                continue
            kinds.add((f"{type(m).__module__}.{type(m).__qualname__}", type(w).__name__, str(w.dtype),
                       str(getattr(w, "tensor_type", "")), staged_blocks.caster(m) is not None))
    return sorted(kinds)


def _patched(model) -> list:
    """The weights within a block that ``model``'s patches change (a LoRA's ``self_attn.q.weight``), and those its
    weight wrappers wrap, by name without the block's index: a streamed module with a per-call patch runs staged
    or eagerly, one without lifted."""
    names = set()
    for which, attr in (("patch", "patches"), ("wrapper", "weight_wrapper_patches")):
        for key in getattr(model, attr, None) or {}:
            name = key if isinstance(key, str) else str(key)
            if _BLOCK_KEY.match(name):
                names.add((which, _BLOCK_KEY.sub("", name)))
            else:
                names.add((which, "outside the blocks"))
    return sorted(names)


def record_key(model, blocks) -> str:
    """The key of ``model``'s streamed path, whose transformer blocks are ``blocks`` (hashed short)."""
    import torch
    text = repr((compile_cache.build_prefix(torch, comfy_bridge.device_of(model)), __version__,
                 comfy_bridge.host_version(), comfy_bridge.wan_dims(model), comfy_bridge.compute_dtype(model),
                 _patched(model), _module_kinds(blocks)))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _write(path: str, key: str, value: str) -> bool:
    """Merge ``key``: ``value`` into the file, ``eager`` never overwritten; True where the file changed."""
    def merge(paths: dict) -> bool:
        if paths.get(key) in (value, EAGER):
            return False
        paths[key] = value
        return True
    return _file.change(path, merge)


def recorded(model, blocks) -> str:
    """The streamed path an earlier sampling of this model's kind showed ("lifted", "staged"), "" where none did or
    one ran eagerly or failed.  Never raises."""
    try:
        path = _file.path()
        found = "" if path is None else _file.entries(path).get(record_key(model, blocks), "")
        return found if found in PATHS else ""
    except Exception as e:
        warn_once(("streamed-record-read", type(e).__name__), "wan-sage: how this model's streamed blocks ran in "
                  "an earlier sampling could not be read (%s); its first prompt plans them as eager.", reason(e))
        return ""


def keep(model, blocks, ran: str) -> None:
    """Write what a sampling showed: ``ran`` ("lifted", "staged"), or "" where a block call ran eagerly or the
    sampling failed (kept as ``eager``).  Never raises."""
    value = ran if ran in PATHS else EAGER
    path = None
    try:
        path = _file.path()
        if path is None:
            return
        if _write(path, record_key(model, blocks), value) and value != EAGER:
            log.info("wan-sage: this model's streamed blocks ran compiled (%s): kept in %s, so that the first prompt "
                     "of the next ComfyUI start plans them so", value, path)
    except Exception as e:
        if value == EAGER and path is not None:
            if _file.remove(path):  # the file must not go on saying a compiled path: without it the eager floor stands
                return
            warn_once(("streamed-record-eager", type(e).__name__), "wan-sage: a block of this model ran eagerly or "
                      "its sampling failed, and %s could not be changed to say so (%s); the next start may plan its "
                      "streamed blocks as compiled: remove that file.", path, reason(e))
            return
        warn_once(("streamed-record-write", type(e).__name__), "wan-sage: how this model's streamed blocks ran "
                  "could not be kept for the next start (%s); its first prompt there plans them as eager.", reason(e))
