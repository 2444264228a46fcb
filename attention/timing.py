"""Measured speed of each kernel against SDPA per shape bucket, cached on disk.

Key: (GPU name, compute capability, kernel + package version, dtype, heads, head dim, Nq
bucket, Nk bucket).  Buckets are quarter octaves of the token count, so 720p and 704p land
in different buckets only when their lengths differ by more than ~19 %.  The store is one
JSON file, written atomically (temp file + rename) and merged with what is on disk, so two
processes (ComfyUI and ``wan-sage bench``) can share it.  The directory is ComfyUI's user
directory when the node pack runs inside ComfyUI, else a per-user cache directory.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["bucket", "make_key", "CalibrationStore", "default_dir", "set_host_dir", "time_cuda",
           "FASTER_BY"]

FILE_NAME = "attention_calibration.json"
FORMAT = 1
# A kernel replaces SDPA only when it is at least this much faster (ratio of times): noise in a
# single timing must not turn "equal" into "slower".
FASTER_BY = 0.98

_host_dir: str | None = None


def set_host_dir(path: str | None) -> None:
    """Called by the ComfyUI adapter with ComfyUI's user directory (``.../user/wan_sage``)."""
    global _host_dir
    _host_dir = path


def default_dir() -> Path:
    env = os.environ.get("WAN_SAGE_CACHE_DIR")
    if env:
        return Path(env)
    if _host_dir:
        return Path(_host_dir)
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = str(Path.home() / "Library" / "Caches")
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "wan-sage"


def bucket(n: int) -> int:
    """Quarter-octave bucket of a token count (n >= 1)."""
    return int(round(4 * math.log2(max(1, n))))


def make_key(gpu: str, cc: int, kernel: str, kernel_version: str, dtype: str, heads: int,
             head_dim: int, nq: int, nk: int) -> str:
    return "|".join((gpu, f"sm{cc}", f"{kernel}={kernel_version}", dtype, f"h{heads}",
                     f"d{head_dim}", f"q{bucket(nq)}", f"k{bucket(nk)}"))


class CalibrationStore:
    """Thread-safe JSON cache of {key: {"kernel_ms", "sdpa_ms", "nq", "nk", "when"}}."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self._dir = Path(directory) if directory else None
        self._lock = threading.Lock()
        self._entries: dict[str, dict] | None = None
        self.load_error: str | None = None

    @property
    def path(self) -> Path:
        return (self._dir or default_dir()) / FILE_NAME

    def _read_disk(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            self.load_error = f"ignored unreadable calibration cache {self.path}: {e}"
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            self.load_error = f"ignored calibration cache {self.path} of an unknown format"
            return {}
        return {k: v for k, v in data["entries"].items() if isinstance(v, dict)
                and isinstance(v.get("kernel_ms"), (int, float)) and isinstance(v.get("sdpa_ms"), (int, float))}

    def _ensure(self) -> dict:
        if self._entries is None:
            self._entries = self._read_disk()
        return self._entries

    def get(self, key: str) -> dict | None:
        e = self._entries
        if e is None:
            with self._lock:
                e = self._ensure()
        return e.get(key)

    def put(self, key: str, kernel_ms: float, sdpa_ms: float, nq: int, nk: int, save: bool = True) -> dict:
        entry = {"kernel_ms": round(float(kernel_ms), 4), "sdpa_ms": round(float(sdpa_ms), 4),
                 "nq": int(nq), "nk": int(nk), "when": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with self._lock:
            self._ensure()[key] = entry
            if save:
                self._save_locked()
        return entry

    def save(self) -> None:
        with self._lock:
            self._save_locked()

    def _save_locked(self) -> None:
        merged = self._read_disk()
        merged.update(self._entries or {})
        self._entries = merged
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".calib-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "entries": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:  # a read-only home must not break sampling
            self.load_error = f"could not write calibration cache {path}: {e}"

    def entries(self) -> dict:
        with self._lock:
            return dict(self._ensure())


def time_cuda(fn, repeats: int = 1) -> float:
    """Milliseconds of ``fn()`` on the current CUDA stream, measured with CUDA events (min)."""
    import torch
    best = math.inf
    for _ in range(max(1, repeats)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        del out
        best = min(best, start.elapsed_time(end))
    return best
