"""Parse a JSON request body with its size and nesting depth limited before parsing.

The depth is measured by one pass over the bytes (brackets outside strings), without recursion,
so a body such as 5,000 nested ``[`` is refused before :func:`json.loads` could exhaust the
stack.  Every failure is a :class:`BodyError` with a one-line message.
"""
from __future__ import annotations

import json
import re

__all__ = ["BodyError", "parse_body", "nesting_depth", "MAX_BODY_BYTES", "MAX_DEPTH"]

# An estimate request is a flat object of a dozen fields (one nested ``model`` object): well
# under 4 KiB and 2 levels deep.
MAX_BODY_BYTES = 64 << 10
MAX_DEPTH = 8

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class BodyError(ValueError):
    """A body that is too large, too deep or not JSON; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of a JSON text, strings skipped; no recursion."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_body(raw: bytes, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_DEPTH):
    """The JSON value of ``raw``; BodyError (413 when too large, else 400) when it cannot be used."""
    if len(raw) > max_bytes:
        raise BodyError(f"the request body is larger than {max_bytes} bytes", status=413)
    if nesting_depth(raw) > max_depth:
        raise BodyError(f"the request body nests deeper than {max_depth} levels")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("the request body is not UTF-8 text") from None
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, and integers beyond Python's digit limit
        raise BodyError(f"the request body is not valid JSON ({str(e)[:80]})") from None
