"""wan-sage: SageAttention and a working-memory estimator for Wan 2.1 / 2.2 in ComfyUI.

Inside ComfyUI this module registers the nodes (V3 schema, ``comfy_entrypoint``) and the web
extension.  Outside ComfyUI (CLI, tests) importing it has no side effects.
"""
import importlib.util as _ilu

__version__ = "0.1.0"

WEB_DIRECTORY = "./web"

if _ilu.find_spec("comfy_api") is not None and _ilu.find_spec("comfy") is not None:
    from .nodes.extension import comfy_entrypoint  # noqa: F401

__all__ = ["WEB_DIRECTORY", "__version__"]
