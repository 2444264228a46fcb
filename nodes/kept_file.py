"""A small JSON file of {key: value} in the pack's cache folder, kept across ComfyUI starts: how a model kind's
streamed blocks ran (:mod:`.streamed_record`) and what a setup's model calls held (:mod:`.held_record`).

The file is ``{"format": 1, <field>: {key: value}}``.  It is read again only where it changed on disk since this
process last read or wrote it, and changed under its file lock, merged with what another process wrote, and
replaced atomically, so that a reader finds the old file or the new one whole.  A file that cannot be read, or of
another format, reads as empty (said once): the next change writes it afresh.
"""
from __future__ import annotations

import json
import os
import threading

from ..attention.file_lock import file_lock, replace_atomically
from . import comfy_bridge
from .log_once import reason, warn_once

FORMAT = 1


def _stamp(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


class KeptFile:
    """``<cache folder>/<subdir>/<name>``, whose ``field`` holds the entries; ``valid(value)`` says which values
    are read; ``tag`` names its warnings and temporary files; ``shows`` completes "the next sampling that shows ...
    writes it afresh"."""

    def __init__(self, subdir: str, name: str, field: str, valid, tag: str, shows: str):
        self.subdir, self.name, self.field, self.valid, self.tag, self.shows = subdir, name, field, valid, tag, shows
        self.read: dict = {}  # file path -> ((mtime_ns, size), {key: value}) as this process last read or wrote it
        self._lock = threading.Lock()

    def path(self) -> str | None:
        """The file's path, None outside ComfyUI with no cache folder set."""
        base = comfy_bridge.cache_dir()
        return None if base is None else os.path.join(base, self.subdir, self.name)

    def _read_disk(self, path: str) -> dict:
        """The file's {key: value}; {} where it is missing, unreadable or of another format (said once)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested past Python's limit
            warn_once((f"{self.tag}-record-unreadable", path), "wan-sage: ignored %s (%s); the next sampling that "
                      "shows %s writes it afresh.", path, reason(e), self.shows)
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get(self.field), dict):
            warn_once((f"{self.tag}-record-format", path), "wan-sage: ignored %s, of an unknown or older format; the "
                      "next sampling that shows %s writes it afresh.", path, self.shows)
            return {}
        return {k: v for k, v in data[self.field].items() if self.valid(v)}

    def entries(self, path: str) -> dict:
        """The file's {key: value}, read again where it changed on disk since this process last read it."""
        stamp = _stamp(path)
        with self._lock:
            found = self.read.get(path)
        if found is not None and found[0] == stamp:
            return found[1]
        entries = self._read_disk(path) if stamp is not None else {}
        with self._lock:
            self.read[path] = (stamp, entries)
        return entries

    def change(self, path: str, fn) -> bool:
        """Change the file's entries under its lock: ``fn(entries)`` changes the dict in place and says whether it
        did; the file is replaced where it did.  True where the file changed."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with file_lock(path) as locked:
            if not locked:
                warn_once((f"{self.tag}-record-lock", path), "wan-sage: %s stayed locked by another process; writing "
                          "without the lock.", path)
            entries = self._read_disk(path)
            changed = bool(fn(entries))
            if changed:
                replace_atomically(path, json.dumps({"format": FORMAT, self.field: entries}, indent=1,
                                                    sort_keys=True).encode(), f".{self.tag}-", mode=0o644)
        with self._lock:
            self.read[path] = (_stamp(path), entries)
        return changed

    def remove(self, path: str) -> bool:
        """Remove the file, where a value it must not go on giving could not be written; True where it is gone."""
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        with self._lock:
            self.read.pop(path, None)
        return True
