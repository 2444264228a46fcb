"""The errors of wan-sage's estimate: one line, at most :data:`MESSAGE_CAP` characters, naming what is
wrong.  The server route answers them as a 4xx body and ``wan-sage plan`` prints them on stderr."""
from __future__ import annotations

__all__ = ["MESSAGE_CAP", "one_line", "brief", "ModelFileError", "NotAWanModel", "RequestError"]

MESSAGE_CAP = 300


def one_line(message) -> str:
    """``message`` on one line (whitespace runs folded), cut to :data:`MESSAGE_CAP` characters."""
    line = " ".join(str(message).split())
    return line if len(line) <= MESSAGE_CAP else line[:MESSAGE_CAP - 3] + "..."


def brief(text, limit: int = 80) -> str:
    """``text`` (another library's message quoted inside one of ours) on one line, at most ``limit`` characters,
    cut after a whole word with "..." where it is longer."""
    line = " ".join(str(text).split())
    if len(line) <= limit:
        return line
    cut = line[:limit - 3]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" ,;:") + "..."


class ModelFileError(ValueError):
    """A model file that cannot be used: missing, unreadable, truncated, malformed or not a Wan model.
    The message names the file as the caller showed it."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class NotAWanModel(ModelFileError):
    """A well-formed file that holds no Wan 2.1/2.2 diffusion model."""


class RequestError(ValueError):
    """A bad field of an estimate request: ``field`` names it (the JSON field, or for the CLI the flag's
    field), and the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(one_line(message))
        self.field = field
