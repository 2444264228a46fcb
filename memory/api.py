"""The estimate as a JSON request/response: one function the server route and ``wan-sage plan
--json`` share with the node (all three end in :func:`memory.estimate.estimate`).

Every field of a request is checked for its JSON type and range before it is used; a bad one
raises :class:`RequestError` naming the field, with a one-line message of bounded length that
shows at most a short prefix of the value.  All sizes are in GiB (2**30 bytes).
"""
from __future__ import annotations

import math
import re

from . import activation_model
from .estimate import CFG_LIMITS, SIZE_LIMITS, EstimateRequest, GiB, estimate
from .headers import ModelFileError, read_model_file
from .weights import HEADER_DTYPES, WEIGHT_BYTES, weights_for_file, weights_for_key
from ..attention import registry

# The estimator node's reservation policies (nodes/estimator.py uses the same strings).
POLICIES = ("wan-sage estimate", "max(wan-sage, ComfyUI)", "fixed GB per row")

__all__ = ["POLICIES", "RequestError", "estimate_from_json", "guess_preset", "WEIGHT_BYTES", "summary_of",
           "weights_for_file", "weights_for_key", "RENAMED_FIELDS", "MESSAGE_CAP"]

MESSAGE_CAP = 300
# Request fields whose names changed; a request still using one gets a 400 naming the new one.
RENAMED_FIELDS = {"vram_gb": "vram_gib", "margin_gb": "margin_gib", "fixed_gb": "fixed_gib"}
COMPUTE_DTYPES = ("auto", *activation_model.DTYPE_BYTES)
ATTENTION_CHOICES = ("sdpa", "sage-auto", "auto", *registry.KERNELS)
MAX_NAME = 512
VRAM_GIB_MAX = 4096.0
MARGIN_GIB_MAX = 1024.0
# Bounds of a `model` object's dims: (lowest, highest).
MODEL_LIMITS = {"dim": (1, 1 << 16), "ffn_dim": (1, 1 << 20), "num_heads": (1, 1 << 12), "num_layers": (1, 1000),
                "in_dim": (1, 4096), "out_dim": (1, 4096), "latent_channels": (1, 4096)}
LATENT_CHANNELS = (16, 48)  # the Wan 2.1 VAE and the Wan 2.2 (TI2V-5B) VAE


class RequestError(ValueError):
    """A bad field: ``field`` names it, the one-line message says what is allowed."""

    def __init__(self, field: str, message: str):
        line = " ".join(str(message).split())
        super().__init__(line if len(line) <= MESSAGE_CAP else line[:MESSAGE_CAP - 3] + "...")
        self.field = field


def shown(value, limit: int = 40) -> str:
    """A value as a message may show it: its repr, cut to ``limit`` characters."""
    if isinstance(value, float) and math.isfinite(value) and abs(value) >= 1e9:
        return f"{value:.3g}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 9:
        return f"{float(value):.3g}" if abs(value) < 10 ** 300 else "a number of %d digits" % len(str(abs(value)))
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


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


def weights_from_name(name: str) -> str | None:
    m = re.search(r"(q[3-8]_(?:k_m|k|0)|fp8|bf16|fp16|fp32)", name.lower())
    if not m:
        return None
    w = m.group(1)
    key = {"q4_k": "q4_k_m", "q5_k": "q5_k_m", "q6_k": "q6_k", "q3_k": "q3_k_m"}.get(w, w)
    return key if key in WEIGHT_BYTES else None


# ------------------------------------------------------------------ typed fields

def _present(p: dict, field: str) -> bool:
    return p.get(field) is not None


def _number(p: dict, field: str, default, lo: float, hi: float, integer: bool = False, unit: str = ""):
    v = p.get(field)
    if v is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(field, f"{field} must be {kind}{unit}, got {shown(v)}")
    if isinstance(v, float) and not math.isfinite(v):
        raise RequestError(field, f"{field} must be a finite number{unit}, got {v}")
    if integer and v != int(v):
        raise RequestError(field, f"{field} must be an integer, got {shown(v)}")
    if not lo <= v <= hi:
        raise RequestError(field, f"{field} must be between {lo:g} and {hi:g}{unit}, got {shown(v)}")
    return int(v) if integer else float(v)


def _size(p: dict, field: str, default=None) -> int:
    lo, hi = SIZE_LIMITS[field]
    if default is None and not _present(p, field):
        raise RequestError(field, f"{field} is required (an integer from {lo} to {hi})")
    return _number(p, field, default, lo, hi, integer=True)


def _choice(p: dict, field: str, choices, default, lower: bool = False):
    v = p.get(field)
    if v is None:
        return default
    if not isinstance(v, str):
        raise RequestError(field, f"{field} must be a string, one of {', '.join(choices)}; got {shown(v)}")
    key = v.lower() if lower else v
    if key not in choices:
        raise RequestError(field, f"{field} must be one of {', '.join(choices)}; got {shown(v)}")
    return key


def _flag(p: dict, field: str) -> bool:
    v = p.get(field)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise RequestError(field, f"{field} must be true or false (a JSON boolean), got {shown(v)}")
    return v


def _plain_string(p: dict, field: str) -> str | None:
    v = p.get(field)
    if v is None:
        return None
    if not isinstance(v, str):
        raise RequestError(field, f"{field} must be a string (a file name), got {type(v).__name__}")
    if not v or len(v) > MAX_NAME:
        raise RequestError(field, f"{field} must be 1 to {MAX_NAME} characters long, got {len(v)}")
    if any(ord(c) < 32 or ord(c) == 127 for c in v):
        raise RequestError(field, f"{field} must not contain control characters (such as NUL or a newline)")
    return v


def _arch(p: dict, default_cc):
    v = p.get("arch")
    if v is None:
        return default_cc
    try:
        return registry.parse_arch(v)
    except ValueError as e:
        raise RequestError("arch", str(e)) from None


def _model_dims(m) -> activation_model.WanDims:
    if not isinstance(m, dict):
        raise RequestError("model", f"model must be an object of Wan dims, got {type(m).__name__}")
    unknown = [k for k in m if k not in MODEL_LIMITS and k != "name"]
    if unknown:
        raise RequestError("model", f"model has an unknown key {shown(unknown[0])}; "
                                    f"known: name, {', '.join(MODEL_LIMITS)}")
    vals = {}
    for key, (lo, hi) in MODEL_LIMITS.items():
        if key in ("dim", "ffn_dim") and m.get(key) is None:
            raise RequestError("model", f"model.{key} is required")
        try:
            vals[key] = _number(m, key, None, lo, hi, integer=True)
        except RequestError as e:
            raise RequestError("model", f"model.{e}") from None
    name = m.get("name", "custom Wan")
    if not isinstance(name, str) or len(name) > 100 or any(ord(c) < 32 for c in name):
        raise RequestError("model", "model.name must be a plain string of at most 100 characters")
    dim = vals["dim"]
    heads = vals["num_heads"] or max(1, dim // 128)
    if dim % heads:
        raise RequestError("model", f"model.num_heads {heads} does not divide model.dim {dim}")
    channels = vals["latent_channels"] or 16
    if channels not in LATENT_CHANNELS:
        raise RequestError("model", f"model.latent_channels must be one of {', '.join(map(str, LATENT_CHANNELS))} "
                                    f"(Wan's VAEs), got {channels}")
    return activation_model.WanDims(
        name=name, dim=dim, ffn_dim=vals["ffn_dim"], num_heads=heads, num_layers=vals["num_layers"] or 40,
        in_dim=vals["in_dim"] or 16, out_dim=vals["out_dim"] or channels, latent_channels=channels,
        vae_stride=(4, 16, 16) if channels == 48 else (4, 8, 8), model_type="ti2v" if channels == 48 else "t2v")


# ------------------------------------------------------------------ the model

def _detected(dims: activation_model.WanDims, model: str, weight_dtype: str, guessed: bool) -> dict:
    return {"model": model, "model_type": dims.model_type, "dim": dims.dim, "num_layers": dims.num_layers,
            "num_heads": dims.num_heads, "weight_dtype": weight_dtype, "guessed": guessed}


def _header_dtype(info) -> str:
    return HEADER_DTYPES.get(info.main_dtype, info.main_dtype.lower())


def _model(p: dict, resolve_model_file, weights: dict) -> tuple:
    """(dims, WeightPlan or None, source text, detected dict, notes) of the request's model."""
    preset = _choice(p, "preset", tuple(activation_model.PRESETS), None)
    name = _plain_string(p, "model_file")
    wkey = _choice(p, "weights", tuple(WEIGHT_BYTES), None, lower=True)
    if name is not None:
        path = resolve_model_file(name) if resolve_model_file else None
        if path:
            try:
                info = read_model_file(path, shown=name)
                plan = weights_for_file(info, loader_dtype="fp8" if wkey == "fp8" else None, **weights)
            except ModelFileError as e:
                why = str(e)
            except ValueError as e:  # weights of a dtype ComfyUI does not load as Wan
                why = f"{name}: {e}"
            else:
                notes = []
                if wkey is not None and info.format == "gguf":
                    notes.append(f"weights {wkey} ignored: a GGUF file's header gives its quant types")
                elif wkey not in (None, "fp8"):
                    notes.append(f"weights {wkey} ignored: the file's header gives {_header_dtype(info)}")
                return (info.dims, plan, f"header of {name}", _detected(info.dims, name, _header_dtype(info), False),
                        notes)
        else:
            why = f"{name} was not found in ComfyUI's model folders"
        guess = preset or guess_preset(name)
        if guess is None:
            raise RequestError("model_file", f"{why}; its name does not say which Wan model it is")
        dims = activation_model.PRESETS[guess]
        wkey = wkey or weights_from_name(name)
        source = f"guessed from the file name as {dims.name} ({why})"
        return dims, None, source, _detected(dims, guess, wkey or "bf16", True), [why]
    if p.get("model") is not None:
        dims = _model_dims(p["model"])
        return dims, None, "given dims", _detected(dims, dims.name, wkey or "bf16", False), []
    preset = preset or "wan2.2-a14b"
    dims = activation_model.PRESETS[preset]
    return dims, None, f"preset {preset}", _detected(dims, preset, wkey or "bf16", True), []


# ------------------------------------------------------------------ the response

def summary_of(est) -> dict:
    """The response's ``summary``: the figures in GiB, the verdict and its level."""
    partial = not est.verdict.startswith("fits")
    res = est.reservation_partial if partial else est.reservation_resident
    terms = est.partial if partial else est.resident
    level = "fits" if est.verdict.startswith("fits") else "offloads" if est.verdict.startswith("offloads") else \
        "cannot" if est.verdict.startswith("cannot") else "unknown"
    return {"tokens": est.tokens, "activation_gib": (terms["phase_peak"] + terms["persistent"]) / GiB,
            "sage_extra_gib": terms["sage_extra"] / GiB, "reservation_gib": res / GiB,
            "comfy_gib": est.comfy_estimate / GiB, "weights_gib": (est.weights_bytes or 0) / GiB,
            "vram_gib": est.vram_bytes / GiB if est.vram_bytes else None, "offload_gib": est.offload_bytes / GiB,
            "verdict": est.verdict, "level": level, "dominant_phase": terms["dominant_phase"],
            "notes": list(est.notes)}


def estimate_from_json(p, resolve_model_file=None, default_vram_bytes=None, default_cc=None) -> dict:
    """Validate a JSON payload and return {"estimate", "summary", "text"}.

    Fields: ``preset`` | ``model_file`` | ``model`` (dims), ``width``, ``height``, ``frames``,
    ``batch``, ``cfg``, ``dtype`` (``auto``: as ComfyUI picks for the weights), ``attention``,
    ``arch``, ``vram_gib``, ``weights``, ``lora`` (a boolean), ``margin_gib``, ``policy``,
    ``fixed_gib``, ``compiled`` (a boolean: the transformer blocks run under torch.compile, each its own
    graph; a whole-model compile is estimated as eager, so it leaves this out) and ``sage_grouped``
    (a boolean: the Sage patch's memory mode splits self-attention into head groups).  ``resolve_model_file(name)`` returns a path or None (the server passes
    ComfyUI's folder lookup); a file found there is read from its header, and a name that cannot be
    read falls back to a guess from the name, marked ``detected.guessed``.
    """
    if not isinstance(p, dict):
        raise RequestError("body", f"the request body must be a JSON object, got {type(p).__name__}")
    for old, new in RENAMED_FIELDS.items():
        if old in p:
            raise RequestError(old, f"{old} is no longer accepted: send {new} (GiB)")
    width, height, frames = _size(p, "width"), _size(p, "height"), _size(p, "frames")
    batch = _size(p, "batch", 1)
    cfg = _number(p, "cfg", 1.0, *CFG_LIMITS)
    dtype = _choice(p, "dtype", COMPUTE_DTYPES, "auto")
    attention = _choice(p, "attention", ATTENTION_CHOICES, "sdpa")
    cc = _arch(p, default_cc)
    vram = _number(p, "vram_gib", None, 0.0, VRAM_GIB_MAX, unit=" (GiB)")
    if vram is not None and vram <= 0:
        raise RequestError("vram_gib", f"vram_gib must be more than 0 GiB, got {shown(vram)}")
    vram_bytes = int(vram * GiB) if vram is not None else default_vram_bytes
    margin = _number(p, "margin_gib", 0.0, 0.0, MARGIN_GIB_MAX, unit=" (GiB)")
    fixed = _number(p, "fixed_gib", 10.0, 0.0, MARGIN_GIB_MAX, unit=" (GiB)")
    policy = _choice(p, "policy", POLICIES, POLICIES[0])
    lora = _flag(p, "lora")
    compiled = _flag(p, "compiled")
    sage_grouped = _flag(p, "sage_grouped")
    compute = None if dtype == "auto" else dtype
    weights = {"lora": lora, "compute": compute, "cc": cc, "vram_bytes": vram_bytes}
    dims, plan, source, detected, model_notes = _model(p, resolve_model_file, weights)
    if plan is None:
        try:
            plan = weights_for_key(dims, detected["weight_dtype"], **weights)
        except ValueError as e:
            raise RequestError("weights", str(e)) from None
    req = EstimateRequest(dims=dims, width=width, height=height, frames=frames, batch=batch, cfg=cfg,
                          dtype=plan.compute, attention=attention, cc=cc, vram_bytes=vram_bytes,
                          weights_bytes=plan.nbytes, weights=plan.setup, img_tokens=257 if dims.has_img_emb else 0,
                          margin_bytes=int(margin * GiB), compiled=compiled, sage_grouped=sage_grouped)
    try:
        est = estimate(req)
    except ValueError as e:  # every field was checked above; this names what the estimate refused
        raise RequestError("body", str(e)) from None
    s = summary_of(est)
    s["notes"] = model_notes + s["notes"] + list(plan.notes) + (
        ["torch.compile of the blocks on the model chain: the estimate is the compiled forward's (fused RoPE and FFN)"]
        if compiled else [])
    s["compiled"] = compiled
    s["source"] = source
    s["policy"] = policy
    s["detected"] = detected
    if policy == POLICIES[2]:
        s["reservation_gib"] = fixed * est.rows_sequential
    elif policy == POLICIES[1]:
        s["reservation_gib"] = max(s["reservation_gib"], s["comfy_gib"])
    text = (f"{est.tokens:,} tokens; activation peak {s['activation_gib']:.2f} GiB; "
            f"Sage extra {s['sage_extra_gib']:+.2f} GiB; reservation {s['reservation_gib']:.2f} GiB "
            f"(ComfyUI {s['comfy_gib']:.2f} GiB); weights {s['weights_gib']:.2f} GiB"
            + (f"; VRAM {s['vram_gib']:.1f} GiB" if s["vram_gib"] else "") + f"; {est.verdict}")
    return {"estimate": est.as_dict(), "summary": s, "text": text}

