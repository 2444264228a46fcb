"""What a sampling's model calls held, kept for the next sampling of the same setup, in this process and across
ComfyUI starts.

The re-plan between model calls (:mod:`.replan`) lowers a sampling's reservation to what its own calls held, once
its first call has run.  That first call runs on the plan, whose cast term keeps room for the allocator's holes at
the largest they were measured: fp8 A14B 720p81 left 1.6-2.6 GiB of a 12-20 GiB budget unused in its first step
on an H100.  A sampling of the same setup holds about what the last one held: Wan 2.2's low-noise expert after the
high-noise one, the repeat prompt, the first prompt of the next ComfyUI start.  So the most a sampling's calls held
is kept under a key of what decides it, and the next sampling of that key places its weights for that figure with
the re-plan's margin, where that is below the plan (:func:`.replan.starting_reservation`); a setup whose
self-attention Sage runs in head groups, with no figure of its own, takes the figure of the same setup run
ungrouped, which holds more (:func:`record_keys`).  The re-plan's fallback stands: a call that runs out of memory
there runs again with the weights placed for the plan.

The key is the estimate's setup (the model's dims and weights, the latent, the attention, the compile, whether the
weights stream), less what only decides how much of the weights streams (the VRAM the model may use) and the
report's words, with the torch build and GPU and the versions of the pack and ComfyUI.  How much streams changes
the allocator's holes a little; the margin covers that, and a call that holds more raises the figure.  The value
is the most the latest sampling of the key was seen to hold, in bytes.  A sampling whose figure cannot be trusted
(a call the allocator had to retry, one that ran out of memory) removes it: the next one starts from the plan.

The file is ``<cache folder>/memory/held.json``.  Reading or writing it never fails a sampling: a file that cannot
be read is as no file, and a figure that cannot be kept is said once and left out.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import replace

from .. import __version__
from . import comfy_bridge, compile_cache
from .kept_file import KeptFile
from .log_once import reason, warn_once

SUBDIR = "memory"
FILE_NAME = "held.json"
MOST = 1 << 44  # larger than any device's memory: a value above it is not a figure

_file = KeptFile(SUBDIR, FILE_NAME, "held",
                 lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v < MOST, "held",
                 "what its calls held")
_lock = threading.Lock()
_here: dict = {}  # key -> bytes this process saw, or None where it removed the key


def record_key(setup, dev) -> str:
    """The key of a sampling planned with ``setup`` (a :class:`memory.estimate.Setup`) on ``dev``, hashed short."""
    import torch
    plain = replace(setup, vram_bytes=None, legacy_reason=None, pixels=None, source="", notes=())
    text = repr((compile_cache.build_prefix(torch, dev), __version__, comfy_bridge.host_version(), plain))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def record_keys(setup, dev) -> list:
    """The key a sampling planned with ``setup`` on ``dev`` keeps its figure under, then the key whose figure may
    stand in for it where it has none.  Sage's self-attention run in head groups holds less than the same setup run
    ungrouped, as a shape's first, timed calls run: so a grouped setup may start from the ungrouped one's figure
    (Wan 2.2's low-noise expert from the high-noise one that timed the prompt's shapes), never the other way."""
    keys = [record_key(setup, dev)]
    if setup.sage_grouped:
        keys.append(record_key(replace(setup, sage_grouped=False), dev))
    return keys


def _set(path: str, key: str, value: int | None) -> None:
    """Set ``key`` to ``value`` in the file (None: remove it)."""
    def merge(held: dict) -> bool:
        if held.get(key) == value:
            return False
        if value is None:
            held.pop(key, None)
        else:
            held[key] = value
        return True
    _file.change(path, merge)


def recorded(key: str) -> int | None:
    """The most the latest sampling of ``key`` held, in bytes, or None where none is kept.  Never raises."""
    with _lock:
        if key in _here:
            return _here[key]
    try:
        path = _file.path()
        return None if path is None else _file.entries(path).get(key)
    except Exception as e:
        warn_once(("held-record-read", type(e).__name__), "wan-sage: what an earlier sampling of this setup held "
                  "could not be read (%s); its first step runs on the estimate.", reason(e))
        return None


def keep(key: str, held: int | None) -> None:
    """Keep ``held`` bytes as the figure of ``key`` (None: remove it), here and in the cache folder.  Never
    raises."""
    value = None if held is None else int(held)
    with _lock:
        if key in _here and _here[key] == value:
            return
        _here[key] = value
    path = None
    try:
        path = _file.path()
        if path is not None:
            _set(path, key, value)
    except Exception as e:
        # the file must not go on giving a figure this process found untrustworthy
        if value is None and path is not None and _file.remove(path):
            return
        warn_once(("held-record-write", type(e).__name__), "wan-sage: what this sampling's calls held could not be "
                  "kept for the next ComfyUI start (%s)%s.", reason(e),
                  "; remove " + path + ", or its next start may place weights for a figure found too low"
                  if value is None and path is not None else "")
