"""Everything wan-sage reads from or does to ComfyUI objects, feature-detected, in one place.

Works on ComfyUI 0.3.64 (the oldest supported) and on newer releases (dynamic VRAM, shared
``model_options`` callables); never compares version strings.
"""
from __future__ import annotations

import logging
import os
import weakref

import torch

from ..memory import activation_model
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

OVERRIDE_KEY = "optimized_attention_override"


def base_model(obj):
    """The shared BaseModel of a ModelPatcher (or the object itself if it already is one)."""
    inner = getattr(obj, "model", None)
    return inner if inner is not None and hasattr(inner, "diffusion_model") else obj


def diffusion_model(obj):
    if hasattr(obj, "get_model_object"):
        try:
            return obj.get_model_object("diffusion_model")
        except AttributeError:  # a patcher whose model has no diffusion_model: not a diffusion model
            pass
    return getattr(base_model(obj), "diffusion_model", None)


def wan_model_class():
    """ComfyUI's ``WanModel`` class, or None (logged once with the reason) when it cannot be imported."""
    try:
        from comfy.ldm.wan.model import WanModel
    except Exception as e:  # any failure inside ComfyUI's module: reported, and no model counts as Wan
        warn_once(("wan-import", type(e).__name__),
                  "wan-sage: ComfyUI's WanModel could not be imported (%s), so no model is recognised as a Wan "
                  "model and both wan-sage nodes pass models through unchanged. Update ComfyUI (0.3.60 or newer), "
                  "or fix what this error names.", reason(e))
        return None
    return WanModel


def is_wan(model) -> bool:
    wan_model = wan_model_class()
    return wan_model is not None and isinstance(diffusion_model(model), wan_model)


def compute_dtype(model) -> str:
    base = base_model(model)
    dt = getattr(base, "manual_cast_dtype", None)
    if dt is None:
        get = getattr(base, "get_dtype_inference", None) or base.get_dtype
        dt = get()
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, "fp32")


def wan_dims(model) -> activation_model.WanDims:
    """(ModelPatcher or BaseModel) The real config of the loaded Wan model (ComfyUI's detected unet_config plus the module)."""
    dm = diffusion_model(model)
    base = base_model(model)
    cfg = getattr(getattr(base, "model_config", None), "unet_config", {}) or {}
    latent_ch = getattr(getattr(base, "latent_format", None), "latent_channels", 16)
    dim = int(getattr(dm, "dim", cfg.get("dim", 5120)))
    return activation_model.WanDims(
        name=f"Wan {cfg.get('model_type', getattr(dm, 'model_type', 't2v'))} dim {dim}",
        dim=dim, ffn_dim=int(getattr(dm, "ffn_dim", cfg.get("ffn_dim", 4 * dim))),
        num_heads=int(getattr(dm, "num_heads", cfg.get("num_heads", dim // 128))),
        num_layers=len(getattr(dm, "blocks", ())) or int(cfg.get("num_layers", 40)),
        in_dim=int(getattr(dm, "in_dim", cfg.get("in_dim", 16))),
        out_dim=int(getattr(dm, "out_dim", cfg.get("out_dim", 16))),
        patch_size=tuple(getattr(dm, "patch_size", (1, 2, 2))),
        vae_stride=(4, 16, 16) if latent_ch == 48 else (4, 8, 8), latent_channels=latent_ch,
        model_type=str(cfg.get("model_type", "t2v")),
        has_img_emb=getattr(dm, "img_emb", None) is not None,
        vace_layers=len(getattr(dm, "vace_blocks", ()) or ()))


def weight_setup(model, partial: bool) -> activation_model.WeightSetup:
    """GGUF, fp8 or plain weights, and whether a LoRA is on the model (memory.activation_model.weight_transient
    decides where ComfyUI applies it per forward)."""
    base = model.model
    gguf = type(model).__name__.startswith("GGUF") or any(
        type(p).__name__ == "GGMLTensor" for p in list(base.parameters())[:64])
    lora = bool(getattr(model, "patches", None))
    wdt = base.get_dtype()
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(wdt, "fp8")
    if gguf:
        size = model.model_size() or 1
        numel = sum(getattr(p, "tensor_shape", p.shape).numel() for p in base.parameters()) or 1
        return activation_model.WeightSetup("gguf", gguf_bytes_per_param=size / numel, lora=lora, streamed=partial)
    return activation_model.WeightSetup(name, lora=lora, streamed=partial)


def device_of(model) -> torch.device:
    return model.load_device


def free_memory(dev) -> int:
    import comfy.model_management as mm
    return int(mm.get_free_memory(dev))


def capacity(model) -> int:
    """What this model could use on its device: free memory plus every loaded model's weights."""
    import comfy.model_management as mm
    dev = device_of(model)
    total = free_memory(dev)
    for lm in list(getattr(mm, "current_loaded_models", [])):
        try:
            if lm.device == dev:
                total += int(lm.model_loaded_memory())
        except AttributeError:  # a LoadedModel whose patcher was freed (its weak reference is dead): no weights
            pass
    return total


def extra_reserved() -> int:
    import comfy.model_management as mm
    return int(mm.extra_reserved_memory())


def comfy_uses_flash() -> bool:
    """Whether ComfyUI's own working-memory figure takes its flash-attention factor (xformers or PyTorch's
    flash attention on), as ``BaseModel.memory_required`` does; True outside ComfyUI (its CUDA default)."""
    try:
        import comfy.model_management as mm
    except ImportError:  # no ComfyUI in this process
        return True
    return bool(mm.xformers_enabled() or mm.pytorch_attention_flash_attention())


def is_dynamic(model) -> bool:
    """Whether ComfyUI manages this model's residency itself (dynamic VRAM, newer releases)."""
    try:
        return bool(getattr(model, "is_dynamic", lambda: False)())
    except Exception as e:  # a newer ComfyUI's check failing: reported, and the legacy memory path is used
        warn_once(("is-dynamic", type(e).__name__),
                  "wan-sage: asking the model whether dynamic VRAM is on failed (%s); the legacy memory path "
                  "is assumed.", reason(e))
        return False


COMPILE_WRAPPER_KEY = "torch.compile"  # comfy_api.torch_helpers' APPLY_MODEL wrapper key
COMPILE_KWARGS_KEY = "torch_compile_kwargs"  # where set_torch_compile_wrapper keeps its arguments


def _compiled_module(obj) -> bool:
    return type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod")


BLOCKS, WHOLE_MODEL = "blocks", "whole model"


def _wrapper_keys(wrapper) -> set | None:
    """The module keys a ComfyUI compile wrapper swaps compiled modules in for (the dict its factory
    closes over: ``diffusion_model`` or ``diffusion_model.blocks.N``); None where it cannot be read."""
    for cell in getattr(wrapper, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(v, dict) and v and all(isinstance(k, str) for k in v):
            return set(v)
    return None


def _scope_of_keys(keys) -> str:
    return BLOCKS if activation_model.compiles_per_block(keys) else WHOLE_MODEL


def compile_scope(model, model_options=None) -> tuple[str, str] | None:
    """(what torch.compile covers, how it was put there) for this model, or None when it runs eagerly.

    The scope is ``BLOCKS`` where each transformer block is its own compiled module (per-block compile
    nodes, ``TorchCompileModel`` given block keys) and ``WHOLE_MODEL`` where one graph covers the diffusion
    model (``TorchCompileModel``'s default) or where the compiled keys cannot be read."""
    options = model_options if model_options is not None else getattr(model, "model_options", {}) or {}
    # A ModelPatcher keeps its wrappers itself; while sampling, ComfyUI copies them into the
    # transformer options, where the BaseModel-level hooks find them.
    places = (getattr(model, "wrappers", None) or {}, (options.get("transformer_options") or {}).get("wrappers") or {})
    compile_wrappers = list(dict.fromkeys(w for wrappers in places for keyed in wrappers.values()
                                          for w in (keyed or {}).get(COMPILE_WRAPPER_KEY, ())))
    if compile_wrappers or options.get(COMPILE_KWARGS_KEY):
        keys = set()
        for w in compile_wrappers:
            found = _wrapper_keys(w)
            if found is None:
                return WHOLE_MODEL, "ComfyUI's compile wrapper"
            keys |= found
        return _scope_of_keys(keys), "ComfyUI's compile wrapper"
    patches = getattr(model, "object_patches", None) or {}
    patched = {k for k, v in patches.items() if k.startswith("diffusion_model") and _compiled_module(v)}
    if patched:
        return _scope_of_keys(patched), "compiled modules patched in"
    dm = diffusion_model(model)
    if _compiled_module(dm):
        return WHOLE_MODEL, "a compiled diffusion model"
    if any(_compiled_module(b) for b in getattr(dm, "blocks", ()) or ()):
        return BLOCKS, "compiled blocks"
    return None


def compiled_by(model, model_options=None) -> str | None:
    """How this model is compiled, in words for the report, or None when it runs eagerly."""
    found = compile_scope(model, model_options)
    return None if found is None else f"torch.compile, {found[0]} ({found[1]})"


def aimdo_enabled() -> bool:
    try:
        import comfy.memory_management as mem
    except ImportError:  # ComfyUI before dynamic VRAM (0.3.64 has no comfy.memory_management)
        return False
    return bool(getattr(mem, "aimdo_enabled", False))


def raw_sdpa():
    """ComfyUI's own PyTorch attention, unwrapped so it never re-enters an override; None (logged once)
    when it cannot be imported, and the patch then uses wan-sage's own SDPA call."""
    try:
        from comfy.ldm.modules import attention as comfy_attention
    except Exception as e:  # any failure inside ComfyUI's module: reported, with the fallback named
        warn_once(("raw-sdpa", type(e).__name__),
                  "wan-sage: ComfyUI's attention module could not be imported (%s); the calls the Sage patch "
                  "declines run on wan-sage's own PyTorch SDPA call.", reason(e))
        return None
    fn = getattr(comfy_attention, "attention_pytorch", None)
    return getattr(fn, "__wrapped__", fn)


class PatcherFreeMemory:
    """Free VRAM as the model's current patcher sees it (dynamic VRAM counts reclaimable
    weight pages as free).  Holds only a weak reference; immutable; shared by copies."""

    __slots__ = ("_ref", "__weakref__")

    def __init__(self, base_model):
        object.__setattr__(self, "_ref", weakref.ref(base_model))

    def __deepcopy__(self, memo):
        return self

    def __call__(self, dev) -> int:
        base = self._ref()
        patcher = getattr(base, "current_patcher", None) if base is not None else None
        if patcher is not None and hasattr(patcher, "get_free_memory"):
            return int(patcher.get_free_memory(dev))
        return free_memory(dev)


CACHE_ENV = "WAN_SAGE_CACHE_DIR"


def cache_dir() -> str | None:
    """Where the node keeps the kernel timing cache: ``$WAN_SAGE_CACHE_DIR`` when set (as for
    ``wan-sage bench``), else ComfyUI's user directory + ``wan_sage``; None outside ComfyUI (the
    timing cache then picks its own default)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return os.path.expanduser(env)
    try:
        import folder_paths
    except ImportError:  # not running inside ComfyUI
        return None
    return os.path.join(folder_paths.get_user_directory(), "wan_sage")


def wrappers_mp():
    import comfy.patcher_extension as pe
    return pe.WrappersMP


def send_event(event: str, data: dict) -> None:
    """Send ``event`` to the web panel; nothing without a ComfyUI server, and a failed send is logged
    once (the panel then misses the stats; sampling never fails over it)."""
    try:
        from server import PromptServer
    except ImportError:  # no ComfyUI server in this process (CLI, tests)
        return
    inst = getattr(PromptServer, "instance", None)
    if inst is None:
        return
    try:
        inst.send_sync(event, data)
    except Exception as e:  # the server's event loop is closing or gone
        warn_once(("send-event", type(e).__name__),
                  "wan-sage: sending %r to the web panel failed (%s); the panel misses this update.", event, reason(e))
