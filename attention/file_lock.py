"""A cross-process exclusive lock on a file, for the timing cache that ComfyUI and
``wan-sage bench`` share, and the atomic replace those cache files are written with.

``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows, and elsewhere a lock file created with
``O_EXCL`` that is taken over when older than a stale timeout.  Waiting is bounded: when the lock
cannot be had in time, :func:`file_lock` yields False and the caller goes on without it (a cache
write must never hang sampling).  Torch-free.
"""
from __future__ import annotations

import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
try:
    import msvcrt
except ImportError:  # POSIX
    msvcrt = None

__all__ = ["file_lock", "lock_path", "replace_atomically"]

POLL_S = 0.01


def lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        return True
    except OSError:  # held by another process
        return False


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


@contextmanager
def _os_lock(path: Path, timeout: float):
    fd = os.open(lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    held = False
    try:
        deadline = time.monotonic() + timeout
        while not (held := _try_lock(fd)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        yield held
    finally:
        if held:
            _unlock(fd)
        os.close(fd)


@contextmanager
def _exclusive_file_lock(path: Path, timeout: float, stale_s: float):
    lock = lock_path(path)
    held = False
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                held = True
                break
            except FileExistsError:
                try:
                    if time.time() - lock.stat().st_mtime > stale_s:
                        lock.unlink()  # left by a process that died while holding it
                        continue
                except FileNotFoundError:
                    continue
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        yield held
    finally:
        if held:
            try:
                lock.unlink()
            except FileNotFoundError:
                pass


def file_lock(path: Path, timeout: float = 10.0, stale_s: float = 60.0, portable: bool | None = None):
    """Context manager holding an exclusive lock on ``path`` across processes; yields whether the
    lock is held.  ``portable=True`` forces the ``O_EXCL`` lock file (also used where neither
    fcntl nor msvcrt exists)."""
    if portable is None:
        portable = fcntl is None and msvcrt is None
    if portable:
        return _exclusive_file_lock(Path(path), timeout, stale_s)
    return _os_lock(Path(path), timeout)


def replace_atomically(path: Path, data: bytes, prefix: str, mode: int | None = None) -> None:
    """Write ``data`` to a temporary file beside ``path`` (named ``prefix...``, created owner-only) and rename it
    over ``path``, so a reader finds the old file or the new one whole; ``mode``: the permissions to give it
    first.  The temporary file is removed when anything fails, and the error goes on to the caller."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
