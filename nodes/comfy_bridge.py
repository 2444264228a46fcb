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
        except Exception:
            pass
    return getattr(base_model(obj), "diffusion_model", None)


def is_wan(model) -> bool:
    try:
        from comfy.ldm.wan.model import WanModel
    except Exception:
        return False
    return isinstance(diffusion_model(model), WanModel)


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
        except Exception:
            pass
    return total


def extra_reserved() -> int:
    import comfy.model_management as mm
    return int(mm.extra_reserved_memory())


def is_dynamic(model) -> bool:
    try:
        return bool(getattr(model, "is_dynamic", lambda: False)())
    except Exception:
        return False


def aimdo_enabled() -> bool:
    try:
        import comfy.memory_management as mem
        return bool(getattr(mem, "aimdo_enabled", False))
    except Exception:
        return False


def raw_sdpa():
    """ComfyUI's own PyTorch attention, unwrapped so it never re-enters an override."""
    try:
        from comfy.ldm.modules import attention as comfy_attention
    except Exception:
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


def cache_dir() -> str | None:
    try:
        import folder_paths
        return os.path.join(folder_paths.get_user_directory(), "wan_sage")
    except Exception:
        return None


def wrappers_mp():
    import comfy.patcher_extension as pe
    return pe.WrappersMP


def send_event(event: str, data: dict) -> None:
    try:
        from server import PromptServer
        inst = getattr(PromptServer, "instance", None)
        if inst is not None:
            inst.send_sync(event, data)
    except Exception:
        pass
