"""ComfyUI adapter of wan-sage: V3 node schemas (``schemas``), model-patcher wiring
(``sage_patch``, ``estimator``), ComfyUI access (``comfy_bridge``) and the entry point (``extension``).
Only ``schemas`` and ``extension`` import ``comfy_api``; the wiring runs in any in-process host."""
