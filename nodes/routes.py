"""Server routes: ``POST /wan_sage/estimate`` (the memory estimate for given model info or a
preset) and ``GET /wan_sage/stats`` (the last sampling run's attention stats per patch).
Bad JSON or values answer 400 with the offending field; nothing here raises a 500."""
from __future__ import annotations

import json
import logging

from ..attention import kernels, stats
from ..memory.api import RequestError, estimate_from_json
from . import comfy_bridge

log = logging.getLogger("wan_sage")

MODEL_FOLDERS = ("diffusion_models", "unet_gguf", "unet", "checkpoints")


def resolve_model_file(name: str):
    try:
        import folder_paths
    except Exception:
        return None
    for folder in MODEL_FOLDERS:
        try:
            p = folder_paths.get_full_path(folder, name)
        except Exception:
            p = None
        if p:
            return p
    return None


def _device_defaults():
    try:
        import torch
        import comfy.model_management as mm
        dev = mm.get_torch_device()
        if dev.type == "cuda":
            cc = kernels.device_cc(dev)
            return int(mm.get_total_memory(dev)), cc
    except Exception:
        pass
    return None, None


def handle_estimate(payload) -> tuple:
    """(status, body dict): what the route answers, testable without a server."""
    try:
        vram, cc = _device_defaults()
        return 200, estimate_from_json(payload, resolve_model_file, vram, cc)
    except RequestError as e:
        return 400, {"error": str(e), "field": e.field}
    except Exception as e:  # never a 500 for a request the estimator cannot handle
        log.exception("wan-sage: estimate route failed")
        return 400, {"error": f"{type(e).__name__}: {e}", "field": "body"}


def stats_body() -> dict:
    """GET /wan_sage/stats: the last runs' attention stats, and ``sage_status``: what the Sage panel
    says before any run (the installed SageAttention, its import error, and the kernels the
    self-test turned off, ``{kernel: reason}``)."""
    from ..attention import dispatch

    p = kernels.probe()
    failures = {}
    read_failures = getattr(dispatch, "self_test_failures", None)
    if callable(read_failures):
        try:
            failures = {str(k): str(v) for k, v in (read_failures() or {}).items()}
        except Exception:  # the status is informative; never fail the route over it
            log.exception("wan-sage: reading the self-test failures failed")
    status = {"sage_version": p.sage_version, "sage_error": p.sage_error,
              "sm90_binding_broken": bool(p.sm90_binding_broken), "ck_available": bool(p.ck_available),
              "self_test_failures": failures}
    return {"runs": stats.last_runs(), "sageattention": p.sage_version, "comfy_kitchen": p.ck_version,
            "sage_status": status}


def register(server=None) -> bool:
    """Add the routes to ComfyUI's PromptServer; False when there is no server (headless)."""
    try:
        from aiohttp import web
        if server is None:
            from server import PromptServer
            server = getattr(PromptServer, "instance", None)
    except Exception:
        return False
    if server is None or getattr(server, "_wan_sage_routes", False):
        return False

    @server.routes.post("/wan_sage/estimate")
    async def estimate_route(request):
        try:
            payload = await request.json()
        except (json.JSONDecodeError, ValueError, UnicodeDecodeError):
            return web.json_response({"error": "the body is not valid JSON", "field": "body"}, status=400)
        status, body = handle_estimate(payload)
        return web.json_response(body, status=status)

    @server.routes.get("/wan_sage/stats")
    async def stats_route(request):
        return web.json_response(stats_body())

    server._wan_sage_routes = True
    return True
