"""Warnings logged once per process and key: a failure that repeats on every run is seen, and does
not flood the log."""
from __future__ import annotations

import logging

log = logging.getLogger("wan_sage")
warned: set = set()  # the keys already logged


def warn_once(key, msg: str, *args, level: int = logging.WARNING) -> bool:
    """Log ``msg % args`` (a warning, or ``level``) the first time ``key`` is seen; True if it was logged now."""
    if key in warned:
        return False
    warned.add(key)
    log.log(level, msg, *args)
    return True


def reason(exc: BaseException) -> str:
    """``ExcType: message`` for a log line."""
    return f"{type(exc).__name__}: {exc}"
