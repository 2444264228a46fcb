"""Everything wan-sage reads from or does to ComfyUI objects, feature-detected, in one place.

Works on ComfyUI 0.3.64 (the oldest supported) and on newer releases (dynamic VRAM, shared
``model_options`` callables); never compares version strings.
"""
from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import weakref

import torch

from ..memory import activation_model
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

OVERRIDE_KEY = "optimized_attention_override"

# Attributes in which a wrapping override keeps the override it hands calls to: wan-sage's own ``prev``,
# and ComfyUI's core Model Sparse Attention (comfy_extras/sparse_attention_history.py,
# mark_attention_override: ``_block_sparse_attention_previous``).
PREVIOUS_ATTRS = ("prev", "_block_sparse_attention_previous")
BSA_PATCH_ATTR = "_block_sparse_attention_patch"
# ModelPatcher.set_model_optimized_attention's closure: it writes the slot without chaining, so the
# function it closes over is a backend, not a previous override.
SETTER_QUALNAME = "set_model_optimized_attention.<locals>.optimized_attention_override"
MAX_CHAIN = 8


def user_cancel(e: BaseException) -> bool:
    """Whether ``e`` is ComfyUI's cancel of the prompt (``comfy.model_management.InterruptProcessingException``),
    read by name so that nothing of ComfyUI is imported to ask."""
    return type(e).__name__ == "InterruptProcessingException"


def _closure_values(fn) -> list:
    out = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return out


def previous_overrides(ov) -> list:
    """The overrides ``ov`` may hand calls to: the known attributes, then (where none is set) the callables its
    closure holds (a wrapper written as a closure over the previous override).  Nothing for
    set_model_optimized_attention's closure, which does not chain."""
    found = [p for p in (getattr(ov, a, None) for a in PREVIOUS_ATTRS) if p is not None]
    if found or str(getattr(ov, "__qualname__", "")).endswith(SETTER_QUALNAME):
        return found
    return [v for v in _closure_values(ov) if callable(v) and not isinstance(v, type)]


def slot_chain(transformer_options, is_target) -> tuple:
    """(the override in the slot, the path from it down to the first override ``is_target`` accepts, outermost
    first, or None when none is reachable).  Walks :func:`previous_overrides` depth first, at most
    :data:`MAX_CHAIN` overrides deep, each override once."""
    top = (transformer_options or {}).get(OVERRIDE_KEY)
    if top is None:
        return None, None
    seen = set()

    def walk(ov, path):
        if id(ov) in seen or len(path) >= MAX_CHAIN:
            return None
        seen.add(id(ov))
        path = path + (ov,)
        if is_target(ov):
            return path
        for p in previous_overrides(ov):
            found = walk(p, path)
            if found is not None:
                return found
        return None
    return top, walk(top, ())


def _name_of(fn) -> str:
    fn = getattr(fn, "__func__", fn)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}" if module and module != "builtins" else name


def describe_override(ov) -> str:
    """Who put ``ov`` in the attention slot, in words for a warning or a report."""
    if getattr(ov, BSA_PATCH_ATTR, None) is not None:
        return "ComfyUI's Model Sparse Attention (BlockSparseAttention)"
    if str(getattr(ov, "__qualname__", "")).endswith(SETTER_QUALNAME):
        backends = [v for v in _closure_values(ov) if callable(v)]
        backend = getattr(getattr(backends[0], "__wrapped__", backends[0]), "__name__", "?") if backends else "?"
        return (f"ComfyUI's set_model_optimized_attention (the Model Attention Backend node or a pack calling "
                f"it) with {backend}")
    return _name_of(ov)


SELF_ATTN_PATCH = re.compile(r"diffusion_model\.blocks\.\d+\.self_attn\.forward")


def self_attention_patch(model) -> tuple | None:
    """(who, how many blocks, whether it is KJNodes' Sage patch) when object patches replace the blocks'
    self-attention forward (KJNodes' WanVideo Mem Eff Sage Attention Patch patches
    ``diffusion_model.blocks.N.self_attn.forward`` with its ``wan_sageattn_forward``, which runs its own
    Sage call and never ComfyUI's attention); None when none does."""
    from .handover import is_hand_over
    patches = getattr(model, "object_patches", None) or {}
    keys = [k for k in patches if isinstance(k, str) and SELF_ATTN_PATCH.fullmatch(k)
            and not is_hand_over(patches[k])]  # the Sage patch's own hand-over forward
    if not keys:
        return None
    fn = getattr(patches[keys[0]], "__func__", patches[keys[0]])
    name = getattr(fn, "__name__", type(fn).__name__)
    module = str(getattr(fn, "__module__", "") or "")
    kj = name == "wan_sageattn_forward" or ("kjnodes" in module.lower() and "sage" in name.lower())
    return _name_of(fn), len(keys), kj


def _percent_of_sigma(model_sampling, sigma: float) -> float:
    """The schedule percent at which ``model_sampling.percent_to_sigma`` reaches ``sigma`` (it falls from
    percent 0 to 1); bisection, so any model sampling with ``percent_to_sigma`` is read the same way."""
    f = model_sampling.percent_to_sigma
    if sigma >= float(f(0.0)):
        return 0.0
    if sigma <= float(f(1.0)):
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if float(f(mid)) > sigma:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _model_sampling(model):
    if hasattr(model, "get_model_object"):
        try:
            return model.get_model_object("model_sampling")
        except AttributeError:  # a patcher whose model has no model_sampling
            return None
    return getattr(base_model(model), "model_sampling", None)


SPARSE_HEAD_DIM = 128  # the head dim comfy-kitchen's sparse kernels take (nodes_sparse_attention.HEAD_DIM)


def bsa_dense_share(patch, model, num_layers: int, tokens: int, head_dim: int) -> tuple:
    """(share, words): the share of a sampling's self-attention calls that a core Model Sparse Attention patch
    leaves dense, read from its options as comfy_extras/nodes_sparse_attention.py decides per call
    (``dense_reason``, ``_ineligible``): every call in VSA mode, below ``min_tokens`` or at a head dim the
    sparse kernel does not take; else the steps outside its sigma window (start/end percent) and its
    ``dense_blocks``.  ``share`` is None where the schedule cannot be read (no ``percent_to_sigma``)."""
    if getattr(patch, "vsa", False):
        return 1.0, "VSA mode runs the generic override dense"
    min_tokens = int(getattr(patch, "min_tokens", 0) or 0)
    if tokens < min_tokens:
        return 1.0, f"{tokens:,} tokens < its min_tokens {min_tokens:,}"
    if head_dim != SPARSE_HEAD_DIM:
        return 1.0, f"head dim {head_dim}: its kernel takes {SPARSE_HEAD_DIM}"
    dense_blocks = {int(b) for b in (getattr(patch, "dense_blocks", None) or ()) if 0 <= int(b) < num_layers}
    block_share = len(dense_blocks) / num_layers if num_layers else 0.0
    blocks = f", dense_blocks {len(dense_blocks)} of {num_layers}" if dense_blocks else ""
    ms = _model_sampling(model)
    if ms is None or not hasattr(ms, "percent_to_sigma"):
        return None, "its sigma window could not be read (no model sampling)" + blocks
    start = _percent_of_sigma(ms, float(patch.sigma_start))
    end = _percent_of_sigma(ms, float(patch.sigma_end))
    sparse_steps = max(0.0, end - start)
    share = 1.0 - sparse_steps * (1.0 - block_share)
    return share, f"sparse from {start:.0%} to {end:.0%} of the schedule{blocks}"


def bsa_patches(path) -> list:
    """The core Model Sparse Attention patches (their options) among the overrides of ``path``."""
    out = []
    for ov in path or ():
        patch = getattr(ov, BSA_PATCH_ATTR, None)
        if patch is not None and all(patch is not p for p in out):
            out.append(patch)
    return out


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


def compute_torch_dtype(model):
    """The dtype the model computes (and so calls attention) in: its manual cast dtype, else its own."""
    base = base_model(model)
    dt = getattr(base, "manual_cast_dtype", None)
    if dt is None:
        get = getattr(base, "get_dtype_inference", None) or base.get_dtype
        dt = get()
    return dt


def compute_dtype(model) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute_torch_dtype(model), "fp32")


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


# ComfyUI 0.38's QuantizedTensor layouts (comfy/quant_ops.py), by class name, and the format each one is
# (a key of activation_model.QUANT_FORMATS).
QUANT_LAYOUTS = {"TensorCoreFP8Layout": "fp8 scaled", "TensorCoreFP8E4M3Layout": "fp8 scaled",
                 "TensorCoreFP8E5M2Layout": "fp8 scaled", "TensorCoreMXFP8Layout": "mxfp8",
                 "TensorCoreNVFP4Layout": "nvfp4", "TensorWiseINT8Layout": "int8",
                 "TensorCoreConvRotW4A4Layout": "convrot w4a4", "AsymW4A8Int8Layout": "w4a8 int8"}


def _is_quantized(p) -> bool:
    return type(p).__name__ == "QuantizedTensor" or (hasattr(p, "_qdata") and hasattr(p, "_layout_cls"))


def quant_format(params) -> str | None:
    """The QuantizedTensor format most of these parameters are held in (comfy/quant_ops.py in ComfyUI 0.38:
    a tensor subclass named QuantizedTensor with ``_qdata`` and ``_layout_cls``, the layout's class name),
    feature-detected without importing ComfyUI; None when no parameter is one.  int8 tensorwise weights whose
    ``_params.convrot`` is set are "int8 convrot".  A layout not known here is named by its class name."""
    counts: dict = {}
    for p in params:
        if not _is_quantized(p):
            continue
        layout = getattr(p, "_layout_cls", None)
        name = layout if isinstance(layout, str) else getattr(layout, "__name__", type(layout).__name__)
        fmt = QUANT_LAYOUTS.get(name, name)
        if fmt == "int8" and getattr(getattr(p, "_params", None), "convrot", False):
            fmt = "int8 convrot"  # TensorWiseINT8Layout.Params.convrot (comfy-kitchen 0.2.40, tensor/int8.py)
        counts[fmt] = counts.get(fmt, 0) + 1
    return max(counts, key=counts.get) if counts else None


def weight_setup(model, partial: bool) -> activation_model.WeightSetup:
    """GGUF, QuantizedTensor, fp8 or plain weights, and whether a LoRA is on the model
    (memory.activation_model.weight_transient decides where ComfyUI applies it per forward)."""
    base = model.model
    params = list(base.parameters())
    gguf = type(model).__name__.startswith("GGUF") or any(type(p).__name__ == "GGMLTensor" for p in params[:64])
    lora = bool(getattr(model, "patches", None))
    quant = None if gguf else quant_format(params)
    if quant is not None:
        return activation_model.WeightSetup(quant, quant_format=quant, lora=lora, streamed=partial)
    wdt = base.get_dtype()
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(wdt, "fp8")
    if gguf:
        size = model.model_size() or 1
        numel = sum(getattr(p, "tensor_shape", p.shape).numel() for p in base.parameters()) or 1
        return activation_model.WeightSetup("gguf", gguf_bytes_per_param=size / numel, lora=lora, streamed=partial)
    return activation_model.WeightSetup(name, lora=lora, streamed=partial,
                                        fp8_matmul=name == "fp8" and fp8_matmul(base))


def _first_linear(base):
    for module in getattr(getattr(base, "diffusion_model", None), "modules", lambda: ())():
        if isinstance(module, torch.nn.Linear):
            return module
    return None


def _fp8_linear_code(module):
    """The code of ``module``'s ``forward_comfy_cast_weights`` when it calls ``fp8_linear``, and its closure."""
    fn = getattr(type(module), "forward_comfy_cast_weights", None)
    code = getattr(fn, "__code__", None)
    if code is None or "fp8_linear" not in code.co_names:
        return None, {}
    return code, dict(zip(code.co_freevars, fn.__closure__ or ()))


def fp8_matmul(base) -> bool:
    """Whether the model's Linear layers multiply fp8 weights in fp8: ComfyUI built them from ``fp8_ops``
    (UNETLoader's ``fp8_e4m3fn_fast`` on a GPU with fp8 compute), or from a scaled-fp8 class with its
    ``fp8_matrix_mult`` switch on (comfy/ops.py@a125cd84, ``pick_operations``).  Read from the class's
    ``forward_comfy_cast_weights``: it calls ``fp8_linear``, unconditionally or behind that switch, and not
    for a layer in training mode (:func:`fp8_matmul_skipped`)."""
    module = _first_linear(base)
    code, cells = _fp8_linear_code(module)
    if code is None or _skipped_in_training(code, module):
        return False
    switch = cells.get("fp8_matrix_mult")
    return bool(switch.cell_contents) if switch is not None else True


def _skipped_in_training(code, module) -> bool:
    return "training" in code.co_names and bool(module.training)


def fp8_matmul_skipped(base) -> bool:
    """Whether the model's fp8 matmul layers skip ``fp8_linear`` because they are in training mode.
    ComfyUI 0.3.64's ``fp8_ops.Linear`` calls it only ``if not self.training`` (comfy/ops.py@a125cd84), and its
    Wan model is never put in eval mode, so there the fp8 weights are cast at every layer call as on the ordinary
    fp8 path.  Read from the class's code (``training`` among the names it reads) and
    the layer's own flag."""
    module = _first_linear(base)
    code, _cells = _fp8_linear_code(module)
    return code is not None and _skipped_in_training(code, module)


KITCHEN_NAMES = ("ck", "comfy_kitchen")


def _calls_kitchen(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return code is not None and any(n in code.co_names for n in KITCHEN_NAMES)


def kernel_set() -> str:
    """Which of activation_model.KERNEL_SETS this ComfyUI's Wan code runs: ``comfy-kitchen`` where RoPE
    (comfy.ldm.flux.math.apply_rope1) or Wan's modulation (comfy.ldm.wan.model.modulate) call into
    comfy-kitchen (``comfy.quant_ops.ck``, ComfyUI 0.38), else ``comfy-0.3.64``; read from the functions'
    code, never from a version string.  Outside ComfyUI: ``comfy-0.3.64``."""
    fns = []
    for module, name in (("comfy.ldm.flux.math", "apply_rope1"), ("comfy.ldm.wan.model", "modulate")):
        try:
            mod = __import__(module, fromlist=[name])
        except Exception:  # no ComfyUI here, or a module that fails to import: not this kernel's evidence
            continue
        fns.append(getattr(mod, name, None))
    return activation_model.KERNEL_SETS[1 if any(_calls_kitchen(f) for f in fns) else 0]


def device_of(model) -> torch.device:
    return model.load_device


_NO_OWN = object()  # swap_memory_required: the BaseModel had no memory_required of its own (its class's)


def swap_memory_required(base, fn):
    """Put ``fn`` in place of ``base.memory_required`` (ComfyUI's BaseModel, for one call of the caller's); returns
    what :func:`restore_memory_required` puts back."""
    prev = base.__dict__.get("memory_required", _NO_OWN)
    base.memory_required = fn
    return prev


def restore_memory_required(base, prev) -> None:
    """Undo :func:`swap_memory_required`: ``base``'s own ``memory_required`` as it was, or none (its class's)."""
    if prev is _NO_OWN:
        base.__dict__.pop("memory_required", None)
    else:
        base.memory_required = prev


def trim_allocator(dev, when: str) -> None:
    """Hand the allocator's free blocks back to the device (ComfyUI's ``soft_empty_cache``); CUDA only, one
    synchronisation.  ``when`` names the moment for the warning, logged once, if it fails; the caller goes on."""
    if getattr(dev, "type", None) != "cuda":
        return
    try:
        import comfy.model_management as mm
        mm.soft_empty_cache()
    except Exception as e:  # never fail a node over a cache trim
        warn_once(("trim", when, type(e).__name__), "wan-sage: emptying the allocator cache %s failed (%s); "
                  "the run goes on with the cached blocks.", when, reason(e))


def vae_dtype_size(dev) -> int | None:
    """Bytes per element of the dtype ComfyUI decodes a Wan VAE in on ``dev`` (``model_management.vae_dtype`` over
    the Wan VAEs' working dtypes, bf16, fp16 and fp32, as comfy/sd.py asks it; its ``--*-vae`` flags win); None on
    the CPU, where ``load_models_gpu`` frees nothing for a decode."""
    if getattr(dev, "type", "cpu") == "cpu":
        return None
    import comfy.model_management as mm
    return int(mm.dtype_size(mm.vae_dtype(dev, [torch.bfloat16, torch.float16, torch.float32])))


def free_memory(dev) -> int:
    import comfy.model_management as mm
    return int(mm.get_free_memory(dev))


def capacity(model) -> int:
    """What this model could use on its device: free memory plus what unloading every loaded model there
    would free.  ComfyUI counts a loaded model by its modules' sizes (``loaded_size``), which can be more than
    the device memory its weights hold (a GGUF Wan 2.2 expert on the H200: 9.285 GiB counted, under 9.03 GiB
    allocated); the weights of this model are placed against real free memory, so each loaded model counts
    as the lesser of the two (:func:`device_bytes`)."""
    import comfy.model_management as mm
    dev = device_of(model)
    total = free_memory(dev)
    for lm in list(getattr(mm, "current_loaded_models", [])):
        try:
            if lm.device == dev:
                counted = int(lm.model_loaded_memory())
                held = device_bytes(getattr(getattr(lm, "model", None), "model", None), dev)
                total += counted if held is None else min(counted, held)
        except AttributeError:  # a LoadedModel whose patcher was freed (its weak reference is dead): no weights
            pass
    return total


def unload(patcher) -> bool:
    """Unload the model ``patcher`` samples (every loaded patcher of its BaseModel) whole, through ComfyUI's
    ``free_memory`` with every other loaded model kept; True where one was loaded and is now unloaded."""
    import comfy.model_management as mm
    base = getattr(patcher, "model", None)
    ours, others = [], []
    for lm in getattr(mm, "current_loaded_models", []):
        (ours if getattr(getattr(lm, "model", None), "model", None) is base else others).append(lm)
    if base is None or not ours:
        return False
    # more than the device holds: free_memory unloads each model it does not keep whole (model_unload with
    # nothing left to free partially)
    mm.free_memory(float(1 << 62), ours[0].device, keep_loaded=others)
    return not any(lm in mm.current_loaded_models for lm in ours)


def same_device(a: torch.device, b) -> bool:
    """Whether device ``a`` is ``b`` (a device or its name); a device without an index matches any index."""
    b = torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def device_bytes(module, dev) -> int | None:
    """The bytes of ``module``'s parameters and buffers that lie on ``dev``, each storage once: what unloading
    it frees there.  None when ``module`` is not a torch module or a tensor's storage cannot be read."""
    if not isinstance(module, torch.nn.Module):
        return None
    dev = torch.device(dev)
    seen, total = set(), 0
    try:
        for t in itertools.chain(module.parameters(), module.buffers()):
            if not same_device(t.device, dev):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor type without a plain storage
        return None
    return total


def total_memory(dev) -> int:
    """The card's total memory (what a dynamic-VRAM model's activations are checked against: ComfyUI evicts
    weights on demand, so all of it but the kept-free memory is theirs)."""
    import comfy.model_management as mm
    return int(mm.get_total_memory(dev))


def legacy_reason(model) -> str:
    """Why the reservation places this model's weights (the legacy memory path), in words."""
    if type(model).__name__.startswith("GGUF") or weight_setup(model, False).gguf:
        return "GGUF models stay on it"
    if not aimdo_enabled():
        try:
            import comfy.memory_management  # noqa: F401  (present from the ComfyUI that has dynamic VRAM)
        except ImportError:
            return "this ComfyUI has no dynamic VRAM"
        return "dynamic VRAM is off: --disable-dynamic-vram, --highvram, --gpu-only, --novram or --cpu"
    if compile_scope(model) is not None:
        return "a compile node turned dynamic VRAM off for this model"
    return "this model's patcher is not dynamic"


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
COMPILE_BLOCKS_MARK = "wan_sage_compile_blocks"  # on the Wan Compile Blocks wrapper (nodes/compile_blocks.py)


def _compiled_module(obj) -> bool:
    return type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod")


BLOCKS, WHOLE_MODEL, UNKNOWN_SCOPE = "blocks", "whole model", "scope unknown"


def _compile_wrapper_name(wrapper) -> str:
    """Who installed a compile wrapper whose compiled keys cannot be read (KJNodes' TorchCompileModelAdvanced
    keeps them in a module-level dict by BaseModel, not in a closure)."""
    fn = getattr(wrapper, "__func__", wrapper)
    name = str(getattr(fn, "__name__", ""))
    module = str(getattr(fn, "__module__", "") or "")
    if name.startswith("_kj_") or "kjnodes" in module.lower():
        return "KJNodes' TorchCompileModelAdvanced"
    return f"a compile wrapper ({_name_of(fn)})"


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


def compile_wrappers(model, model_options=None) -> list:
    """The ``APPLY_MODEL`` compile wrappers on ``model`` (ComfyUI's compile key), each once."""
    options = model_options if model_options is not None else getattr(model, "model_options", {}) or {}
    # A ModelPatcher keeps its wrappers itself; while sampling, ComfyUI copies them into the
    # transformer options, where the BaseModel-level hooks find them.
    places = (getattr(model, "wrappers", None) or {}, (options.get("transformer_options") or {}).get("wrappers") or {})
    return list(dict.fromkeys(w for wrappers in places for keyed in wrappers.values()
                              for w in (keyed or {}).get(COMPILE_WRAPPER_KEY, ())))


def _compile_blocks_node(wrappers) -> bool:
    return any(getattr(w, COMPILE_BLOCKS_MARK, False) for w in wrappers)


def compile_blocks_node(model, model_options=None) -> bool:
    """Whether ``model`` is compiled by the pack's Wan Compile Blocks node, which runs a streamed block compiled with
    its weights staged, or eagerly where it cannot stage them."""
    return _compile_blocks_node(compile_wrappers(model, model_options))


def compile_scope(model, model_options=None) -> tuple[str, str] | None:
    """(what torch.compile covers, how it was put there) for this model, or None when it runs eagerly.

    The scope is ``BLOCKS`` where each transformer block is its own compiled module (per-block compile
    nodes, ``TorchCompileModel`` given block keys), ``WHOLE_MODEL`` where one graph covers the diffusion
    model (``TorchCompileModel``'s default), and ``UNKNOWN_SCOPE`` where a compile wrapper is on the model
    but its compiled keys cannot be read (KJNodes' TorchCompileModelAdvanced); only ``BLOCKS`` is planned
    with the compiled figure."""
    options = model_options if model_options is not None else getattr(model, "model_options", {}) or {}
    wrappers = compile_wrappers(model, options)
    if wrappers or options.get(COMPILE_KWARGS_KEY):
        keys = set()
        for w in wrappers:
            found = _wrapper_keys(w)
            if found is None:
                return UNKNOWN_SCOPE, _compile_wrapper_name(w)
            keys |= found
        if not keys:  # only the compile kwargs: the wrapper that uses them is not on the model here
            return UNKNOWN_SCOPE, "torch_compile_kwargs without a readable compile wrapper"
        if _compile_blocks_node(wrappers):
            return _scope_of_keys(keys), "Wan Compile Blocks, streamed blocks staged"
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


def has_attention_containers() -> bool:
    """Whether this ComfyUI hands attention inputs over in containers (0.38 and newer)."""
    try:
        import comfy.ldm.modules.attention as attention
    except ImportError:
        return False
    return hasattr(attention, "AttentionTensorContainer")


def q_handed_over(model) -> bool:
    """Whether Wan's self-attention on ``model`` hands q over to the Sage patch: ComfyUI's attention
    containers, or the patch's own forward (:mod:`.handover`), installed or about to be."""
    from . import handover
    return has_attention_containers() or handover.would_install(model, diffusion_model(model))


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


def host_version() -> str:
    """The ComfyUI version this process runs, "" where it does not say."""
    found = sys.modules.get("comfyui_version")
    return str(getattr(found, "__version__", "")) if found is not None else ""


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
