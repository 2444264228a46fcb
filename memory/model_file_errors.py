"""The errors a model-file header reader raises: one line that names the file and what is wrong."""
from __future__ import annotations

__all__ = ["ModelFileError", "NotAWanModel", "MESSAGE_CAP"]

MESSAGE_CAP = 300


class ModelFileError(ValueError):
    """A model file that cannot be used: missing, unreadable, truncated, malformed or not a Wan model.
    The message is one line, names the file as the caller showed it, and is at most MESSAGE_CAP long."""

    def __init__(self, message: str):
        line = " ".join(str(message).split())
        super().__init__(line if len(line) <= MESSAGE_CAP else line[:MESSAGE_CAP - 3] + "...")


class NotAWanModel(ModelFileError):
    """A well-formed file that holds no Wan 2.1/2.2 diffusion model."""
