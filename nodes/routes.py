"""Server routes: ``POST /wan_sage/estimate`` (the memory estimate for given model info or a
preset) and ``GET /wan_sage/stats`` (the last sampling run's attention stats per patch).

The estimate answers ``{"estimate", "summary", "text"}``: :func:`memory.answer.estimate_answer` of the body
(the same answer ``wan-sage plan --json`` prints, in the words of the node's report).  The fields are documented in docs/route.md.

A client error answers 4xx with ``{"error": one line, "field": the field's name}``: the body is
read with a size cap and its nesting depth checked before it is parsed, and every field is
checked by :mod:`memory.request`.  Client errors are not logged; only a fault of the estimator itself
answers 500, and it is logged with its traceback once per kind of fault.
"""
from __future__ import annotations

import logging

from ..attention import kernels, stats
from ..memory import request
from ..memory.answer import estimate_answer
from ..memory.errors import RequestError, brief
from ..memory.json_body import MAX_BODY_BYTES, BodyError, parse_body
from . import comfy_bridge
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

MODEL_FOLDERS = ("diffusion_models", "unet_gguf", "unet", "checkpoints")
_logged_faults: set = set()


def resolve_model_file(name: str):
    """The path of ``name`` in ComfyUI's model folders, or None (not found, or no ComfyUI)."""
    try:
        import folder_paths
    except ImportError:
        return None
    for folder in MODEL_FOLDERS:
        p = folder_paths.get_full_path(folder, name)
        if p:
            return p
    return None


def _device_defaults():
    """(total VRAM bytes, compute capability) of ComfyUI's device, or (None, None) off CUDA."""
    try:
        import comfy.model_management as mm
        dev = mm.get_torch_device()
        if dev.type == "cuda":
            return int(mm.get_total_memory(dev)), kernels.device_cc(dev)
    except ImportError:
        return None, None
    except (RuntimeError, AssertionError) as e:  # CUDA initialisation errors
        warn_once("route-device", "wan-sage: the estimate route cannot read the GPU (%s); it assumes none.", reason(e))
    return None, None


def handle_estimate(payload) -> tuple:
    """(status, body dict) for a parsed JSON payload: what the route answers, testable without a server."""
    try:
        vram, cc = _device_defaults()
        env = request.Env(vram_bytes=vram, cc=cc, resolve_model_file=resolve_model_file,
                          comfy_flash=comfy_bridge.comfy_uses_flash(), kernel_set=comfy_bridge.kernel_set())
        return 200, estimate_answer(payload, env)
    except RequestError as e:
        return 400, {"error": str(e), "field": e.field}
    except Exception as e:  # a fault of the estimator, not of the request: logged once per kind
        kind = (type(e).__name__, str(e)[:100])
        if kind not in _logged_faults:
            _logged_faults.add(kind)
            log.exception("wan-sage: the estimate route failed on a valid request")
        return 500, {"error": f"the estimator failed ({type(e).__name__}); the ComfyUI log has the details",
                     "field": "body"}


def handle_estimate_body(raw: bytes) -> tuple:
    """(status, body dict) for the raw request body."""
    try:
        payload = parse_body(raw)
    except BodyError as e:
        return e.status, {"error": str(e), "field": e.field}
    return handle_estimate(payload)


async def _read_capped(request) -> bytes | None:
    """The request body, or None when it is longer than MAX_BODY_BYTES (read no further).  BodyError where it
    cannot be read (a body sent as gzip that is not gzip, a connection cut short)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        return None
    chunks, size = [], 0
    while True:
        try:
            chunk = await request.content.read(MAX_BODY_BYTES + 1 - size)
        except Exception as e:  # aiohttp's payload errors; a cancel (BaseException) goes on up
            raise BodyError(f"the request body could not be read ({brief(reason(e))}); send it as plain JSON, "
                            "uncompressed") from None
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None


def stats_body() -> dict:
    """GET /wan_sage/stats: the last runs' attention stats, and ``sage_status``: what the Sage panel
    says before any run (the installed SageAttention, its import error, and the kernels the
    self-test turned off, ``{kernel: reason}``)."""
    from ..attention import override

    p = kernels.probe()
    failures = {}
    read_failures = getattr(override, "self_test_failures", None)
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
    except ImportError:
        return False
    if server is None or getattr(server, "_wan_sage_routes", False):
        return False

    @server.routes.post("/wan_sage/estimate")
    async def estimate_route(request):
        try:
            raw = await _read_capped(request)
        except BodyError as e:
            return web.json_response({"error": str(e), "field": e.field}, status=e.status)
        if raw is None:
            return web.json_response({"error": f"the request body is larger than {MAX_BODY_BYTES} bytes",
                                      "field": "body"}, status=413)
        status, body = handle_estimate_body(raw)
        return web.json_response(body, status=status)

    @server.routes.get("/wan_sage/stats")
    async def stats_route(request):
        return web.json_response(stats_body())

    server._wan_sage_routes = True
    return True
