"""wan-sage: SageAttention and a working-memory estimator for Wan 2.1 / 2.2 in ComfyUI.

Inside ComfyUI the loader calls :func:`comfy_entrypoint` (V3 schema) and serves ``web/``.
Importing the package has no side effects and does not import ComfyUI, so the CLI, the tests
and the benchmark harness can use it anywhere.
"""

__version__ = "0.1.0"

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    """ComfyUI's V3 entry point: returns the extension that lists wan-sage's nodes."""
    from .nodes.extension import comfy_entrypoint as _entry
    return await _entry()


__all__ = ["WEB_DIRECTORY", "__version__", "comfy_entrypoint"]
