"""The estimate as a JSON request/response: one function the server route and ``wan-sage plan
--json`` share with the node (all three end in :func:`memory.estimate.estimate`)."""
from __future__ import annotations

import re

from . import activation_model
from .estimate import EstimateRequest, GiB, estimate
from ..attention import registry

# The estimator node's reservation policies (nodes/estimator.py uses the same strings).
POLICIES = ("wan-sage estimate", "max(wan-sage, ComfyUI)", "fixed GB per row")

__all__ = ["POLICIES", "RequestError", "estimate_from_json", "guess_preset", "WEIGHT_BYTES", "summary_of"]

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "q8_0": 1.0625, "q6_k": 0.8203,
                "q5_k_m": 0.6875, "q4_k_m": 0.5625, "q3_k_m": 0.4297}


class RequestError(ValueError):
    """A bad field: ``field`` names it, the message says what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def guess_preset(name: str) -> str | None:
    """A preset from a model file name, e.g. 'wan2.2_t2v_high_noise_14B_Q4_K_M.gguf'."""
    n = name.lower()
    if "5b" in n or "ti2v" in n:
        return "wan2.2-ti2v-5b"
    if "1.3b" in n or "1_3b" in n or "1-3b" in n:
        return "wan2.1-1.3b"
    if "14b" in n:
        if "i2v" in n and "2.1" in n.replace("_", "."):
            return "wan2.1-i2v-14b"
        return "wan2.2-a14b" if ("2.2" in n.replace("_", ".") or "a14b" in n) else "wan2.1-14b"
    return None


_HEADER_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}


def weights_for_file(info, lora: bool) -> tuple:
    """(WeightSetup, weight bytes) of a model file read by :func:`memory.headers.read_model_file`."""
    gguf = info.format == "gguf" and info.main_dtype not in ("F16", "BF16", "F32")
    if gguf:
        return activation_model.WeightSetup("gguf", gguf_bytes_per_param=info.bytes_per_param, lora=lora), info.weights_bytes
    return activation_model.WeightSetup(_HEADER_DTYPES.get(info.main_dtype, info.main_dtype), lora=lora), info.weights_bytes


def weights_for_key(dims: activation_model.WanDims, wkey: str, lora: bool) -> tuple:
    """(WeightSetup, weight bytes) for a weight type name such as bf16, fp8 or q4_k_m."""
    if wkey not in WEIGHT_BYTES:
        raise RequestError("weights", f"weights must be one of {', '.join(WEIGHT_BYTES)}, got {wkey!r}")
    gguf = wkey.startswith("q")
    ws = activation_model.WeightSetup("gguf" if gguf else wkey, gguf_bytes_per_param=WEIGHT_BYTES[wkey] if gguf else 0.0, lora=lora)
    return ws, int(dims.params() * WEIGHT_BYTES[wkey])


def weights_from_name(name: str) -> str | None:
    m = re.search(r"(q[3-8]_(?:k_m|k|0)|fp8|bf16|fp16|fp32)", name.lower())
    if not m:
        return None
    w = m.group(1)
    return {"q4_k": "q4_k_m", "q5_k": "q5_k_m", "q6_k": "q6_k", "q3_k": "q3_k_m"}.get(w, w)


def _int(p, field, default=None):
    v = p.get(field, default)
    if v is None:
        raise RequestError(field, f"{field} is required")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise RequestError(field, f"{field} must be an integer, got {v!r}")
    return int(v)


def _float(p, field, default=None):
    v = p.get(field, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(field, f"{field} must be a number, got {v!r}")
    return float(v)


def summary_of(est) -> dict:
    partial = not est.verdict.startswith("fits")
    res = est.reservation_partial if partial else est.reservation_resident
    terms = est.partial if partial else est.resident
    level = "fits" if est.verdict.startswith("fits") else "offloads" if est.verdict.startswith("offloads") else \
        "cannot" if est.verdict.startswith("cannot") else "unknown"
    return {"tokens": est.tokens, "activation_gb": (terms["phase_peak"] + terms["persistent"]) / GiB,
            "sage_extra_gb": terms["sage_extra"] / GiB, "reservation_gb": res / GiB,
            "comfy_gb": est.comfy_estimate / GiB, "weights_gb": (est.weights_bytes or 0) / GiB,
            "vram_gb": (est.vram_bytes or 0) / GiB if est.vram_bytes else None, "verdict": est.verdict,
            "level": level, "offload_gb": est.offload_bytes / GiB, "dominant_phase": terms["dominant_phase"],
            "notes": list(est.notes)}


def estimate_from_json(p: dict, resolve_model_file=None, default_vram_bytes=None, default_cc=None) -> dict:
    """Validate a JSON payload and return {"estimate", "summary", "text"}.

    Fields: ``preset`` | ``model_file`` | ``model`` (dims), ``width``, ``height``, ``frames``,
    ``batch``, ``cfg``, ``dtype``, ``attention``, ``arch``, ``vram_gb``, ``weights``, ``lora``,
    ``margin_gb``.  ``resolve_model_file(name)`` returns a path or None (the server passes
    ComfyUI's folder lookup).
    """
    if not isinstance(p, dict):
        raise RequestError("body", "the request body must be a JSON object")
    weights_bytes, ws = None, None
    source = ""
    lora = bool(p.get("lora", False))
    wkey = p.get("weights")
    if p.get("model_file"):
        name = str(p["model_file"])
        path = resolve_model_file(name) if resolve_model_file else None
        info, why = None, "was not found"
        if path:
            from .headers import NotAWanModel, read_model_file
            try:
                info = read_model_file(path)
            except (NotAWanModel, ValueError, OSError, RuntimeError) as e:
                why = f"has an unreadable header ({e})"
        if info is not None:
            dims = info.dims
            ws, weights_bytes = weights_for_file(info, lora)
            source = f"header of {name}"
        else:
            preset = p.get("preset") or guess_preset(name)
            if preset is None:
                raise RequestError("model_file", f"model file {name!r} {why} and its name names no Wan model; "
                                                 "pass 'preset'")
            dims = activation_model.PRESETS[preset]
            wkey = wkey or weights_from_name(name)
            source = f"preset {preset} (guessed from {name}, which {why})"
    elif p.get("model"):
        m = p["model"]
        if not isinstance(m, dict):
            raise RequestError("model", "model must be an object of Wan dims")
        try:
            dims = activation_model.WanDims(name=str(m.get("name", "custom Wan")), dim=int(m["dim"]), ffn_dim=int(m["ffn_dim"]),
                             num_heads=int(m.get("num_heads", int(m["dim"]) // 128)),
                             num_layers=int(m.get("num_layers", 40)), in_dim=int(m.get("in_dim", 16)),
                             out_dim=int(m.get("out_dim", 16)), latent_channels=int(m.get("latent_channels", 16)),
                             vae_stride=(4, 16, 16) if int(m.get("latent_channels", 16)) == 48 else (4, 8, 8))
        except (KeyError, TypeError, ValueError) as e:
            raise RequestError("model", f"model needs integer dim and ffn_dim ({e})") from None
        if dims.dim <= 0 or dims.ffn_dim <= 0 or dims.num_heads <= 0 or dims.dim % dims.num_heads:
            raise RequestError("model", "model dims must be positive and dim divisible by num_heads")
        source = "given dims"
    else:
        preset = p.get("preset", "wan2.2-a14b")
        if preset not in activation_model.PRESETS:
            raise RequestError("preset", f"preset must be one of {', '.join(activation_model.PRESETS)}, got {preset!r}")
        dims = activation_model.PRESETS[preset]
        source = f"preset {preset}"
    if ws is None:
        ws, weights_bytes = weights_for_key(dims, (wkey or "bf16").lower(), lora)
    attention = p.get("attention", "sdpa")
    if attention not in ("sdpa", "sage-auto", "auto", *registry.KERNELS):
        raise RequestError("attention", f"attention must be sdpa, sage-auto or one of {', '.join(registry.KERNELS)}")
    cc = default_cc
    if p.get("arch"):
        try:
            cc = int(str(p["arch"]).lower().removeprefix("sm"))
        except ValueError:
            raise RequestError("arch", f"arch must look like sm90, got {p['arch']!r}") from None
    vram = _float(p, "vram_gb")
    vram_bytes = int(vram * GiB) if vram is not None else default_vram_bytes
    dtype = p.get("dtype", "bf16")
    margin = _float(p, "margin_gb", 0.0)
    try:
        req = EstimateRequest(dims=dims, width=_int(p, "width"), height=_int(p, "height"), frames=_int(p, "frames"),
                              batch=_int(p, "batch", 1), cfg=_float(p, "cfg", 1.0), dtype=dtype, attention=attention,
                              cc=cc, vram_bytes=vram_bytes, weights_bytes=weights_bytes, weights=ws,
                              img_tokens=257 if dims.has_img_emb else 0, margin_bytes=int((margin or 0) * GiB))
        est = estimate(req)
    except RequestError:
        raise
    except ValueError as e:
        msg = str(e)
        field = next((f for f in ("width", "height", "frames", "batch", "cfg", "dtype", "vram", "margin")
                      if msg.startswith(f)), "body")
        raise RequestError("vram_gb" if field == "vram" else "margin_gb" if field == "margin" else field, msg) from None
    s = summary_of(est)
    s["source"] = source
    policy = p.get("policy", "wan-sage estimate")
    if policy not in POLICIES:
        raise RequestError("policy", f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    s["policy"] = policy
    rows = est.rows_sequential
    if policy == POLICIES[2]:
        fixed = _float(p, "fixed_gb", 10.0)
        if fixed is None or fixed < 0:
            raise RequestError("fixed_gb", "fixed_gb must be a number >= 0")
        s["reservation_gb"] = fixed * rows
    elif policy == POLICIES[1]:
        s["reservation_gb"] = max(s["reservation_gb"], s["comfy_gb"])
    text = (f"{est.tokens:,} tokens; activation peak {s['activation_gb']:.2f} GiB; Sage extra {s['sage_extra_gb']:+.2f} GiB; "
            f"reservation {s['reservation_gb']:.2f} GiB (ComfyUI {s['comfy_gb']:.2f}); weights {s['weights_gb']:.2f} GiB"
            + (f"; VRAM {s['vram_gb']:.1f} GiB" if s["vram_gb"] else "") + f"; {est.verdict}")
    return {"estimate": est.as_dict(), "summary": s, "text": text}
