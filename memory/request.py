"""An estimate request, from a JSON body (the server route) or from command-line flags (``wan-sage plan``):
the one validator of its fields and the one builder of its :class:`~.estimate.Setup`.

Every field is checked for its type and range before it is used; a bad one raises
:class:`~.errors.RequestError` naming the field (the CLI shows it as its flag), with a one-line message
that shows at most a short prefix of the value.  All sizes are in GiB (2**30 bytes).  The fields are
documented in docs/route.md; :data:`FIELDS` lists them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from . import activation_model
from .errors import ModelFileError, RequestError
from .estimate import GiB, POLICIES, Setup, attention_plan
from .headers import read_model_file
from .parallel import DEGREE_MAX, Parallel, problem
from .weights import HEADER_DTYPES, WEIGHT_BYTES, WeightPlan, weights_for_file, weights_for_key
from ..attention import registry

__all__ = ["Env", "Built", "build", "check_fields", "guess_preset", "weights_from_name", "shown", "FIELDS", "SIZE_LIMITS",
           "CFG_LIMITS", "MARGIN_GIB_MAX", "RENAMED_FIELDS", "LEGACY_POLICIES", "ATTENTION_CHOICES", "COMPUTE_DTYPES",
           "LATENT_CHANNELS"]

# Bounds of the sizes: (lowest, highest).  The node's widgets use the same.
SIZE_LIMITS = {"width": (16, 16384), "height": (16, 16384), "frames": (1, 4097), "batch": (1, 64)}
CFG_LIMITS = (0.0, 100.0)
VRAM_GIB_MAX = 4096.0
MARGIN_GIB_MAX = 1024.0
MAX_NAME = 512
COMPUTE_DTYPES = ("auto", *activation_model.DTYPE_BYTES)
ATTENTION_CHOICES = ("sdpa", "sage-auto", "auto", *registry.KERNELS)
LATENT_CHANNELS = (16, 48)  # the Wan 2.1 VAE and the Wan 2.2 (TI2V-5B) VAE
# Bounds of a `model` object's dims: (lowest, highest).
MODEL_LIMITS = {"dim": (1, 1 << 16), "ffn_dim": (1, 1 << 20), "num_heads": (1, 1 << 12), "num_layers": (1, 1000),
                "in_dim": (1, 4096), "out_dim": (1, 4096), "latent_channels": (1, 4096)}
# Fields whose names changed; a request still using one gets a 400 naming the new one.
RENAMED_FIELDS = {"vram_gb": "vram_gib", "margin_gb": "margin_gib", "fixed_gb": "fixed_gib"}
# Policy names saved by earlier workflows, and the policy each one is now.
LEGACY_POLICIES = {"fixed GB per row": POLICIES[2]}
# Every field of a request, in the order docs/route.md documents them.
FIELDS = ("preset", "model_file", "model", "width", "height", "frames", "batch", "cfg", "dtype", "weights", "lora",
          "attention", "arch", "compiled", "sage_grouped", "vram_gib", "margin_gib", "policy", "fixed_gib",
          "latent_channels", "kernel_set", "ulysses", "ring", "fsdp", "cfg_parallel", "no_decode")


# The bytes of the dtype a request plans the Wan VAE decode in: bf16 or fp16, what ComfyUI picks for it on
# every NVIDIA GPU with either (model_management.vae_dtype over the Wan VAEs' working dtypes).
VAE_DTYPE_SIZE = 2
# A request plans the node on the legacy memory path with a GPU, where the estimator's clone keeps its weights'
# host copies (nodes/host_copy.py) and unloads the model for the decode when its sampling ends.
DECODE_BY_UNLOAD = True


@dataclass(frozen=True)
class Env:
    """What the caller knows beyond the request: this machine's GPU and how to find a model file."""

    vram_bytes: int | None = None  # the VRAM a request without vram_gib plans for
    cc: int | None = None  # the GPU a request without arch plans for
    resolve_model_file: object = None  # name -> path or None (the server: ComfyUI's model folders)
    comfy_flash: bool = True  # ComfyUI's own figure with flash attention (its CUDA default)
    kernel_set: str = activation_model.KERNEL_SETS[0]  # the Wan kernels a request without kernel_set plans for


@dataclass(frozen=True)
class Built:
    """A request made into a setup, with what the answer says about the model beside the estimate."""

    setup: Setup
    weights: WeightPlan
    detected: dict  # the model the estimate is for: name, type, dim, layers, heads, weight dtype, guessed
    assumed: str | None  # what was assumed because the request did not say it


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
    """The weight type a model file's name says (q4_k_m, fp8, bf16 ...), or None."""
    m = re.search(r"(q[3-8]_(?:k_m|k|0)|fp8|bf16|fp16|fp32)", name.lower())
    if not m:
        return None
    w = m.group(1)
    key = {"q4_k": "q4_k_m", "q5_k": "q5_k_m", "q6_k": "q6_k", "q3_k": "q3_k_m"}.get(w, w)
    return key if key in WEIGHT_BYTES else None


# ------------------------------------------------------------------ the one validator

class _Fields:
    """Typed reads of a request's fields.  ``text``: the values are command-line strings (numbers are
    parsed from them); ``labels``: how a message names a field (the CLI: its flag)."""

    def __init__(self, p: dict, text: bool = False, labels: dict | None = None):
        self.p, self.text, self.labels = p, text, labels or {}

    def label(self, field: str) -> str:
        return self.labels.get(field, field)

    def given(self, field: str) -> bool:
        return self.p.get(field) is not None

    def number(self, field: str, default, lo: float, hi: float, integer: bool = False, unit: str = "",
               above_lo: bool = False):
        v, name = self.p.get(field), self.label(field)
        if v is None:
            return default
        kind = "an integer" if integer else "a number"
        if self.text and isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise RequestError(field, f"{name} must be {kind}{unit}, got {shown(self.p[field])}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RequestError(field, f"{name} must be {kind}{unit}, got {shown(v)}")
        if isinstance(v, float) and not math.isfinite(v):
            raise RequestError(field, f"{name} must be a finite number{unit}, got {self.p[field]}")
        got = shown(int(v) if v == int(v) and abs(v) < 1e9 else v)  # "--frames 0" and 0.0: got 0
        if above_lo and not lo < v <= hi:
            raise RequestError(field, f"{name} must be more than {lo:g} and at most {hi:g}{unit}, got {got}")
        if not lo <= v <= hi:
            raise RequestError(field, f"{name} must be between {lo:g} and {hi:g}{unit}, got {got}")
        if integer and v != int(v):
            raise RequestError(field, f"{name} must be an integer, got {got}")
        return int(v) if integer else float(v)

    def size(self, field: str, default=None) -> int:
        lo, hi = SIZE_LIMITS[field]
        if default is None and not self.given(field):
            raise RequestError(field, f"{self.label(field)} is required (an integer from {lo} to {hi})")
        return self.number(field, default, lo, hi, integer=True)

    def choice(self, field: str, choices, default, lower: bool = False, aliases: dict | None = None):
        v, name = self.p.get(field), self.label(field)
        if v is None:
            return default
        if not isinstance(v, str):
            raise RequestError(field, f"{name} must be a string, one of {', '.join(choices)}; got {shown(v)}")
        key = v.lower() if lower else v
        key = (aliases or {}).get(key, key)
        if key not in choices:
            raise RequestError(field, f"{name} must be one of {', '.join(choices)}; got {shown(v)}")
        return key

    def flag(self, field: str) -> bool:
        v = self.p.get(field)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise RequestError(field, f"{self.label(field)} must be true or false (a JSON boolean), got {shown(v)}")
        return v

    def name(self, field: str) -> str | None:
        v = self.p.get(field)
        if v is None:
            return None
        if not isinstance(v, str):
            raise RequestError(field, f"{field} must be a string (a file name), got {type(v).__name__}")
        if not v or len(v) > MAX_NAME:
            raise RequestError(field, f"{field} must be 1 to {MAX_NAME} characters long, got {len(v)}")
        if any(ord(c) < 32 or ord(c) == 127 for c in v):
            raise RequestError(field, f"{field} must not contain control characters (such as NUL or a newline)")
        return v

    def arch(self, default_cc):
        v = self.p.get("arch")
        if v is None:
            return default_cc
        try:
            return registry.parse_arch(v)
        except ValueError as e:
            raise RequestError("arch", f"{self.label('arch')}: {e}" if self.text else str(e)) from None


def _model_dims(m) -> activation_model.WanDims:
    if not isinstance(m, dict):
        raise RequestError("model", f"model must be an object of Wan dims, got {type(m).__name__}")
    unknown = [k for k in m if k not in MODEL_LIMITS and k != "name"]
    if unknown:
        raise RequestError("model", f"model has an unknown key {shown(unknown[0])}; "
                                    f"known: name, {', '.join(MODEL_LIMITS)}")
    vals, f = {}, _Fields(m)
    for key, (lo, hi) in MODEL_LIMITS.items():
        if key in ("dim", "ffn_dim") and m.get(key) is None:
            raise RequestError("model", f"model.{key} is required")
        try:
            vals[key] = f.number(key, None, lo, hi, integer=True)
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


def _from_file(info, shown_name: str, wkey, weights: dict) -> tuple:
    """(dims, WeightPlan, source, detected, notes) of a model file's header; ValueError for weights of a
    dtype ComfyUI does not load as Wan."""
    plan = weights_for_file(info, loader_dtype=wkey if wkey in ("fp8", "fp8_fast") else None, **weights)
    notes = []
    if wkey is not None and info.format == "gguf":
        notes.append(f"weights {wkey} ignored: a GGUF file's header gives its quant types")
    elif wkey not in (None, "fp8", "fp8_fast"):
        notes.append(f"weights {wkey} ignored: the file's header gives {_header_dtype(info)}")
    return (info.dims, plan, f"header of {shown_name}", _detected(info.dims, shown_name, _header_dtype(info), False),
            notes)


def _model(f: _Fields, env: Env, weights: dict, model_info) -> tuple:
    """(dims, WeightPlan or None, source text, detected dict, notes, assumed) of the request's model."""
    preset = f.choice("preset", tuple(activation_model.PRESETS), None)
    name = f.name("model_file")
    wkey = f.choice("weights", tuple(WEIGHT_BYTES), None, lower=True)
    if model_info is not None:  # the CLI read --model itself
        try:
            return _from_file(model_info, model_info.path, wkey, weights) + (None,)
        except ValueError as e:
            raise RequestError("model", f"{model_info.path}: {e}") from None
    if name is not None:
        path = env.resolve_model_file(name) if env.resolve_model_file else None
        if path:
            try:
                return _from_file(read_model_file(path, shown=name), name, wkey, weights) + (None,)
            except ModelFileError as e:
                why = str(e)
            except ValueError as e:  # weights of a dtype ComfyUI does not load as Wan
                why = f"{name}: {e}"
        else:
            why = f"{name} was not found in ComfyUI's model folders"
        guess = preset or guess_preset(name)
        if guess is None:
            raise RequestError("model_file", f"{why}; its name does not say which Wan model it is")
        dims = activation_model.PRESETS[guess]
        wkey = wkey or weights_from_name(name)
        source = f"guessed from the file name as {dims.name} ({why})"
        return dims, None, source, _detected(dims, guess, wkey or "bf16", True), [why], None
    if f.given("model"):
        dims = _model_dims(f.p["model"])
        return dims, None, "given dims", _detected(dims, dims.name, wkey or "bf16", False), [], None
    assumed = None
    if preset is None:
        preset = "wan2.2-a14b"
        assumed = "no preset, model_file or model was given: the estimate is for preset wan2.2-a14b"
    dims = activation_model.PRESETS[preset]
    source = f"preset {preset}" + (" (assumed)" if assumed else "")
    return dims, None, source, _detected(dims, preset, wkey or "bf16", True), [], assumed


def _settings(f: _Fields, sizes_required: bool = True) -> tuple:
    """(width, height, frames, batch, cfg, margin, fixed, policy) of a request, each checked; a size not given is
    an error, or with ``sizes_required`` off 0 (:func:`check_fields`, which keeps no value)."""
    size = f.size if sizes_required else (lambda field: f.size(field, 0))
    return (size("width"), size("height"), size("frames"), f.size("batch", 1),
            f.number("cfg", 1.0, *CFG_LIMITS), f.number("margin_gib", 0.0, 0.0, MARGIN_GIB_MAX, unit=" (GiB)"),
            f.number("fixed_gib", 10.0, 0.0, MARGIN_GIB_MAX, unit=" (GiB)"),
            f.choice("policy", POLICIES, POLICIES[0], aliases=LEGACY_POLICIES))


def check_fields(p: dict, labels: dict | None = None) -> None:
    """Check the size, cfg, margin, fixed and policy fields of ``p`` (the estimator node's widgets) as
    :func:`build` checks them; RequestError naming the first bad one (by ``labels`` where given).  A field not in
    ``p`` is not checked (a widget linked from another node, not known yet)."""
    _settings(_Fields(p, labels=labels), sizes_required=False)


# ------------------------------------------------------------------ the one builder

COMPILED_NOTE = "torch.compile of the blocks on the model chain: the estimate is the compiled forward's (fused RoPE and FFN)"


def build(p, env: Env = Env(), *, text: bool = False, labels: dict | None = None, model_info=None) -> Built:
    """Validate request ``p`` (a dict of the :data:`FIELDS`) and make its setup.

    ``text``/``labels``: the fields are command-line strings and how their flags are named (the CLI);
    ``model_info``: a model file the caller read itself (``wan-sage plan --model``)."""
    if not isinstance(p, dict):
        raise RequestError("body", f"the request body must be a JSON object, got {type(p).__name__}")
    for old, new in RENAMED_FIELDS.items():
        if old in p:
            raise RequestError(old, f"{old} is no longer accepted: send {new} (GiB)")
    unknown = [k for k in p if k not in FIELDS]
    if unknown:
        raise RequestError(str(unknown[0])[:40], f"unknown field {shown(unknown[0])}; the fields are "
                                                  f"{', '.join(FIELDS)} (docs/route.md)")
    f = _Fields(p, text, labels)
    width, height, frames, batch, cfg, margin, fixed, policy = _settings(f)
    dtype = f.choice("dtype", COMPUTE_DTYPES, "auto")
    attention = f.choice("attention", ATTENTION_CHOICES, "sdpa")
    cc = f.arch(env.cc)
    vram = f.number("vram_gib", None, 0.0, VRAM_GIB_MAX, unit=" (GiB)", above_lo=True)
    vram_bytes = int(vram * GiB) if vram is not None else env.vram_bytes
    lora, compiled, sage_grouped = f.flag("lora"), f.flag("compiled"), f.flag("sage_grouped")
    channels = f.number("latent_channels", None, *MODEL_LIMITS["latent_channels"], integer=True)
    kernel_set = f.choice("kernel_set", activation_model.KERNEL_SETS, env.kernel_set)
    weights = {"lora": lora, "compute": None if dtype == "auto" else dtype, "cc": cc, "vram_bytes": vram_bytes}
    dims, wplan, source, detected, notes, assumed = _model(f, env, weights, model_info)
    if wplan is None:
        try:
            wplan = weights_for_key(dims, detected["weight_dtype"], **weights)
        except ValueError as e:
            raise RequestError("weights", str(e)) from None
    par = Parallel(ulysses=f.number("ulysses", 1, 1, DEGREE_MAX, integer=True),
                   ring=f.number("ring", 1, 1, DEGREE_MAX, integer=True), fsdp=f.flag("fsdp"),
                   cfg_parallel=f.flag("cfg_parallel"))
    wrong = problem(par, dims.num_heads, cfg)
    if wrong is None and par.fsdp and par.world_size == 1:  # a request's degrees: FSDP needs ranks to shard over
        wrong = ("fsdp", "shards the weights over the ranks, and these degrees make one rank: add a Ulysses, ring or "
                         "CFG-parallel degree, or drop it for one GPU")
    if wrong is not None:
        raise RequestError(wrong[0], f"{f.label(wrong[0])} {wrong[1]}")
    latent = activation_model.latent_shape(dims, width, height, frames, batch)
    if channels is not None:
        latent = (latent[0], channels) + tuple(latent[2:])
    setup = Setup(
        dims=dims, latent=latent, dtype=wplan.compute, cfg=cfg, attention=attention_plan(attention, cc, activation_model.tokens(dims, *latent[2:5]), head_dim=dims.head_dim),
        sage_grouped=sage_grouped, compiled=compiled, weights=wplan.setup, weights_bytes=wplan.nbytes,
        vram_bytes=vram_bytes, margin_bytes=int(margin * GiB), policy=policy, fixed_bytes=int(fixed * GiB),
        img_tokens=dims.img_tokens, per_frame_timesteps=dims.per_frame_timesteps, comfy_flash=env.comfy_flash,
        kernel_set=kernel_set, pixels=(width, height, frames), parallel=par,
        decode_dtype_size=None if f.flag("no_decode") else VAE_DTYPE_SIZE, decode_by_unload=DECODE_BY_UNLOAD,
        source=source, notes=tuple(([assumed] if assumed else []) + notes + list(wplan.notes)
                                   + ([COMPILED_NOTE] if compiled else [])))
    return Built(setup, wplan, detected, assumed)
