"""Paths as the benchmark records name them: without the machine's part (no absolute path of the
machine that ran them), for traceback frames and for the file names inside dynamo's messages."""
from __future__ import annotations

import re
from pathlib import Path

from ._host import ROOT    # this checkout (the pack's root)
# directories a frame's file is named from (the rightmost one in its path): ComfyUI's packages and the
# libraries installed outside a site-packages folder (the device's --target site)
FRAME_ROOTS = ("ComfyUI", "ComfyUI-GGUF", "custom_nodes", "comfy", "comfy_extras", "comfy_api", "comfy_execution",
               "torch", "triton", "sageattention", "gguf")


def short_path(filename: str, root: Path | str | None = ROOT) -> str:
    """``filename`` without the machine's part: from after ``site-packages/`` (or
    ``dist-packages/``), else relative to ``root`` (this checkout, wherever it sits, a ComfyUI
    ``custom_nodes`` folder included), else from the rightmost :data:`FRAME_ROOTS` directory, else the
    bare file name.  Names without a ``/`` (``<string>``,
    ``<frozen runpy>``) are kept."""
    p = str(filename).replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        i = p.rfind(marker)
        if i >= 0:
            return p[i + len(marker):]
    if root is not None:
        r = str(root).replace("\\", "/").rstrip("/") + "/"
        if p.startswith(r):
            return p[len(r):]
    parts = p.split("/")
    for k in range(len(parts) - 2, -1, -1):
        if parts[k] in FRAME_ROOTS:
            return "/".join(parts[k:])
    return parts[-1]


# an absolute path to a file: a "/" that does not continue a word, a relative path, a URL ("://") or an
# expression ("//", ")/", "]/"), then at least two more components, the last with an extension
_ABSOLUTE = re.compile(r"(?<![\w.\-/:)\]])/(?=[\w.~-])(?:[^\s:'\"()\[\],/]+/)+[^\s:'\"()\[\],/]+\.\w{1,8}\b")


def machine_free(text: str, root: Path | str | None = ROOT) -> str:
    """``text`` with every absolute file path in it replaced by its :func:`short_path`."""
    return _ABSOLUTE.sub(lambda m: short_path(m.group(0), root) or m.group(0), str(text))
