"""Parse a JSON request body with its size and nesting depth limited before parsing.

The depth is measured by one pass over the bytes (brackets outside strings), without recursion,
so a body such as 5,000 nested ``[`` is refused before :func:`json.loads` could exhaust the
stack.  Every failure is a :class:`BodyError` with a one-line message and the field it is in: the
top-level field whose value nests too deep, else ``body``.
"""
from __future__ import annotations

import json
import re

from .errors import brief

__all__ = ["BodyError", "parse_body", "nesting_depth", "too_deep_in", "MAX_BODY_BYTES", "MAX_DEPTH"]

# An estimate request is a flat object of a dozen fields (one nested ``model`` object): well
# under 4 KiB and 2 levels deep.
MAX_BODY_BYTES = 64 << 10
MAX_DEPTH = 8

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}:]', re.DOTALL)


class BodyError(ValueError):
    """A body that is too large, too deep or not JSON; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, field: str = "body"):
        super().__init__(message)
        self.status = status
        self.field = field


def nesting_depth(raw: bytes) -> int:
    """The deepest bracket nesting of a JSON text, strings skipped; no recursion."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        depth += 1 if b in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def too_deep_in(raw: bytes, max_depth: int) -> str | None:
    """The top-level key of a JSON object whose value nests deeper than ``max_depth`` (counting the
    object itself as level 1), or None when the nesting is not inside one top-level field."""
    depth, key, last_string = 0, None, None
    for m in _TOKENS.finditer(raw):
        tok = m.group(0)
        if tok in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return key
        elif tok in (b"]", b"}"):
            depth -= 1
        elif tok == b":":
            if depth == 1 and last_string is not None:
                try:
                    key = json.loads(last_string)
                except ValueError:
                    key = None
        else:
            last_string = tok
            continue
        last_string = None
    return None


def parse_body(raw: bytes, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_DEPTH):
    """The JSON value of ``raw``; BodyError (413 when too large, else 400) when it cannot be used."""
    if len(raw) > max_bytes:
        raise BodyError(f"the request body is larger than {max_bytes} bytes", status=413)
    if nesting_depth(raw) > max_depth:
        key = too_deep_in(raw, max_depth) if raw.lstrip()[:1] == b"{" else None
        if isinstance(key, str) and key:
            raise BodyError(f"{key[:40]} nests deeper than {max_depth} levels", field=key[:40])
        raise BodyError(f"the request body nests deeper than {max_depth} levels")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError("the request body is not UTF-8 text") from None
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, and integers beyond Python's digit limit
        raise BodyError(f"the request body is not valid JSON ({brief(e)})") from None
