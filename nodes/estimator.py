"""Wiring of the "Wan Working-Memory Estimator": reserve the predicted activation memory before sampling.

Wiring (all scoped to the cloned MODEL, restored in ``finally``):

* a ``PREPARE_SAMPLING`` wrapper temporarily replaces the shared ``BaseModel.memory_required``
  with the wan-sage estimate, so ``load_models_gpu`` keeps as many weights resident as fit and
  evicts or offloads the rest (legacy memory path: ComfyUI 0.3.64, GGUF, --disable-dynamic-vram);
* a ``CALC_COND_BATCH`` wrapper does the same around cond/uncond batching decisions;
* on the dynamic-VRAM path residency is managed by ComfyUI itself: the node then only informs
  batching, reports, and warns when the activations alone exceed the card.

A MODEL that is not a Wan video model is passed through unchanged with a warning (documented
choice: a workflow that swaps models must not break; the report output says so).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, replace

from ..attention import kernels, registry
from ..memory import activation_model
from ..memory.api import POLICIES  # one list for the node, the route and the panel
from ..memory.estimate import COMPILED_AS_EAGER_NOTES, DEFAULT_CC, GiB, activation_bytes, sage_groups, verdict_for
from . import comfy_bridge
from .log_once import reason, warn_once
from .sage_patch import find_override

log = logging.getLogger("wan_sage")

PREPARE_KEY = "wan_sage_reserve"
BATCH_KEY = "wan_sage_cond_batch"
SAGE_COUNT = ("auto-detect", "always", "never")
_MISSING = object()


@dataclass(frozen=True)
class Settings:
    policy: str = POLICIES[0]
    margin_gib: float = 0.0
    fixed_gib: float = 10.0
    count_sage: str = SAGE_COUNT[0]


def _cc(dev) -> int | None:
    if dev is None or getattr(dev, "type", None) != "cuda":
        return None
    try:
        return kernels.device_cc(dev)
    except (RuntimeError, AssertionError) as e:  # a CUDA device torch cannot query
        warn_once(("cc", type(e).__name__), "wan-sage: the compute capability of %s could not be read (%s); the "
                  "estimate assumes sm90's Sage kernel.", dev, reason(e))
        return None


def attention_for(model_options, settings: Settings, dev) -> tuple:
    """(self path, cross path, label) for the memory model, detecting the Sage patch.

    Counted as the dispatcher runs the calls: the patch's kernel (for ``auto``, this GPU's
    available kernels in the registry's auto order), under the registry's rule for a shape with no
    timing (cross-attention on SDPA, reason ``cross_slower``; self-attention on the first kernel);
    a kernel that does not run on this GPU leaves both on SDPA."""
    ov = find_override((model_options or {}).get("transformer_options", {}))
    if settings.count_sage == "never" or (settings.count_sage == "auto-detect" and ov is None):
        return "sdpa", "sdpa", "sdpa"
    found_cc = _cc(dev)
    cc = found_cc or DEFAULT_CC
    name = ov.config.kernel if ov is not None else "auto"
    if name != "auto" and name not in registry.KERNELS:
        return "sdpa", "sdpa", f"sdpa ({name} is not a kernel of this version)"
    names, why = registry.planned_candidates(name, cc)
    if name == "auto" and found_cc:
        names = kernels.auto_candidates(cc) or names  # the kernels installed here, in the same order
    if not names:
        return "sdpa", "sdpa", f"sdpa ({why})"
    self_path, cross_path, kernel = registry.unmeasured_paths(names, cc)
    return self_path, cross_path, kernel


@dataclass(frozen=True)
class RunMode:
    """How the forward runs, beyond the attention paths: compiled blocks, and whether the Sage patch
    runs self-attention in its memory mode's head groups."""

    compiled: bool = False
    sage_grouped: bool = False


def _workload(dims: activation_model.WanDims, shape, dtype: str, self_p: str, cross_p: str,
              mode: RunMode = RunMode()) -> activation_model.Workload:
    rows, T, H, W = int(shape[0]), int(shape[2]), int(shape[3]), int(shape[4])
    L = activation_model.tokens(dims, T, H, W)
    return activation_model.Workload(L=L, rows=rows, dtype=dtype, self_attn=self_p, cross_attn=cross_p,
                      img_tokens=257 if dims.has_img_emb else 0,
                      per_frame_timesteps=T if dims.latent_channels == 48 else 0,
                      latent_elems_per_row=activation_model.latent_elems(shape), compiled=mode.compiled,
                      self_attn_groups=sage_groups(dims, self_p, rows, L, dtype) if mode.sage_grouped else 1)


def run_mode(model, model_options, dims: activation_model.WanDims, shape) -> RunMode:
    """The model's compile state, and whether the patch on it runs this shape's self-attention grouped.

    Grouping is counted only where the dispatcher has settled this call shape grouped in this
    process (its memory mode runs the split where calibration measured it at most 2 % slower); until
    then the ungrouped call, which needs more, is reserved for."""
    scope = comfy_bridge.compile_scope(model, model_options)
    compiled = scope is not None and scope[0] == comfy_bridge.BLOCKS
    ov = find_override((model_options or {}).get("transformer_options", {}))
    if ov is None or getattr(ov.config, "memory_mode", "fastest") == "fastest":
        return RunMode(compiled, False)
    from ..attention.override import settled_shapes
    L = activation_model.tokens(dims, int(shape[2]), int(shape[3]), int(shape[4]))
    grouped = any(s["kernel"] and s["groups"] > 1 and s["Nq"] == s["Nk"] == L and s["H"] == dims.num_heads
                  and s["D"] == dims.head_dim for s in settled_shapes())
    return RunMode(compiled, grouped)


class MemoryRequired:
    """Stand-in for ``BaseModel.memory_required(input_shape, cond_shapes={}, **kw)``.  Immutable."""

    __slots__ = ("dims", "dtype", "self_p", "cross_p", "ws", "partial", "settings", "orig", "mode")

    def __init__(self, dims, dtype, self_p, cross_p, ws, partial, settings, orig, mode: RunMode = RunMode()):
        for k, v in zip(self.__slots__, (dims, dtype, self_p, cross_p, ws, partial, settings, orig, mode)):
            object.__setattr__(self, k, v)

    def __deepcopy__(self, memo):
        return self

    def terms(self, input_shape) -> dict:
        w = _workload(self.dims, input_shape, self.dtype, self.self_p, self.cross_p, self.mode)
        return activation_bytes(self.dims, w, self.ws, self.partial)

    def __call__(self, input_shape, cond_shapes={}, **kwargs):
        rows = int(input_shape[0])
        if self.settings.policy == POLICIES[2]:
            return int(self.settings.fixed_gib * GiB) * rows
        ours = self.terms(input_shape)["total"] + int(self.settings.margin_gib * GiB)
        if self.settings.policy == POLICIES[1] and self.orig is not None:
            return max(ours, int(self.orig(input_shape, cond_shapes, **_accepted(self.orig, kwargs))))
        return ours


def _accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments ``fn`` accepts (newer ComfyUI passes ones older models lack)."""
    if not kwargs:
        return kwargs
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _swap(base, fn):
    prev = base.__dict__.get("memory_required", _MISSING)
    base.memory_required = fn
    return prev


def _restore(base, prev):
    if prev is _MISSING:
        base.__dict__.pop("memory_required", None)
    else:
        base.memory_required = prev


def _orig(base):
    return base.__dict__.get("memory_required") or type(base).memory_required.__get__(base)


def plan_reservation(model, noise_shape, model_options, settings: Settings, assume_compiled: bool = False):
    """(MemoryRequired, facts for the report) for this model and latent shape; ``assume_compiled``
    plans as if its blocks were compiled (what a compile node after the estimator brings)."""
    dims = comfy_bridge.wan_dims(model)
    dtype = comfy_bridge.compute_dtype(model)
    dev = comfy_bridge.device_of(model)
    self_p, cross_p, attn = attention_for(model_options, settings, dev)
    weights = int(model.model_size())
    cap = comfy_bridge.capacity(model)
    reserved = comfy_bridge.extra_reserved()
    mode = run_mode(model, model_options, dims, noise_shape)
    if assume_compiled:
        mode = replace(mode, compiled=True)
    res_fn = MemoryRequired(dims, dtype, self_p, cross_p, comfy_bridge.weight_setup(model, False), False, settings,
                            _orig(model.model), mode)
    need_res = res_fn(list(noise_shape))
    partial = weights + need_res + reserved > cap
    fn = res_fn if not partial else MemoryRequired(dims, dtype, self_p, cross_p, comfy_bridge.weight_setup(model, True), True,
                                                    settings, _orig(model.model), mode)
    facts = {"dims": dims, "dtype": dtype, "attention": attn, "weights": weights, "capacity": cap, "mode": mode,
             "compiled_by": comfy_bridge.compiled_by(model, model_options), "dynamic": comfy_bridge.is_dynamic(model),
             "reserved": reserved, "partial": partial, "reservation": fn(list(noise_shape)), "resident_need": need_res,
             "terms": fn.terms(list(noise_shape)), "tokens": _workload(dims, noise_shape, dtype, "sdpa", "sdpa").L,
             "comfy": int(_orig(model.model)(list(noise_shape)))}
    return fn, facts


def report_from_facts(f: dict, shape) -> str:
    t = f["terms"]
    verdict, _ = verdict_for(f["weights"], f["resident_need"], f["reservation"], f["capacity"] - f["reserved"])
    d = f["dims"]
    cross = "; cross-attention on SDPA" if f["attention"] in registry.KERNELS else ""
    mode = f.get("mode") or RunMode()
    groups = "; self-attention in head groups (memory mode)" if mode.sage_grouped else ""
    compiled = f"; {f['compiled_by']}" if f.get("compiled_by") else ""
    return (f"Wan dim {d.dim} x {d.num_layers} layers ({d.model_type}), latent {list(shape)}, {f['dtype']} compute{compiled}\n"
            f"tokens: {f['tokens']:,} per row, {int(shape[0])} row(s) per forward\n"
            f"activation peak: {(t['phase_peak'] + t['persistent']) / GiB:.2f} GiB ({t['dominant_phase']}); "
            f"Sage extra: {t['sage_extra'] / GiB:+.2f} GiB ({f['attention']}{cross}{groups})\n"
            f"reservation: {f['reservation'] / GiB:.2f} GiB (weights {'partly offloaded' if f['partial'] else 'resident'}"
            f"{'; ' + ('streaming + ' if f['partial'] else '') + 'fragmentation ' + format(t['fragmentation'] / GiB, '.2f') + ' GiB' if t['fragmentation'] else ''}); "
            f"ComfyUI's own estimate: {f['comfy'] / GiB:.2f} GiB\n"
            f"weights: {f['weights'] / GiB:.2f} GiB; VRAM for this model (free + evictable): {f['capacity'] / GiB:.2f} GiB\n"
            f"verdict: {verdict}" + (f"\nnote: {COMPILED_AS_EAGER_NOTES[t['compiled_as_eager']]}" if t.get("compiled_as_eager") else "")
            + (f"\nnote: {WHOLE_MODEL_COMPILE_NOTE}" if f.get("compiled_by") and not mode.compiled else "")
            + (DYNAMIC_NOTE if f.get("dynamic") else ""))


WHOLE_MODEL_COMPILE_NOTE = ("the whole diffusion model is one compiled graph, which is reserved for as eager: the "
                            "compiled figure is measured for blocks compiled one by one, and a whole-model compile "
                            "peaked above it")


DYNAMIC_NOTE = ("\nmemory path: dynamic VRAM. ComfyUI keeps or evicts this model's weights on demand, so the reservation "
                "does not change which weights stay on the GPU; the estimate above is information, and it decides "
                "whether cond and uncond run batched")


def _reservation_change(model, shape, model_options, settings: Settings, facts: dict, what: str, **assume):
    """(the plan with ``what`` placed after this node, its reservation minus this one's in GiB), or None
    when planning it fails.  The notes built from it are a courtesy: the node never fails over them,
    and the reason is logged once."""
    try:
        _fn, other = plan_reservation(model, shape, model_options, settings, **assume)
    except Exception as e:
        warn_once(("later-note", what, type(e).__name__), "wan-sage: estimating what a %s after the "
                  "Working-Memory Estimator changes failed (%s); the report leaves the figure out.", what, reason(e))
        return None
    return other, (other["reservation"] - facts["reservation"]) / GiB


def _later_patch_note(model, shape, model_options, settings: Settings, facts: dict) -> str:
    """What a Sage patch placed after this node would add.  The node runs before a patch further down
    the graph, so it sees none; the reservation is decided again when sampling starts, where it does."""
    found = _reservation_change(model, shape, model_options, replace(settings, count_sage="always"), facts,
                                "Sage patch")
    if found is None:
        return "Sage patch: none on the model here; one after this node is counted when sampling starts"
    with_sage, extra = found
    return (f"Sage patch: none on the model here; a Wan 2.2 Sage Attention Patch after this node is counted "
            f"when sampling starts ({with_sage['attention']}: reservation {extra:+.2f} GiB)")


def _later_compile_note(model, shape, model_options, settings: Settings, facts: dict) -> str:
    """What a torch.compile node placed after this node would change.  Compiled blocks fuse RoPE and the
    FFN, so their peak is lower; the reservation is decided again when sampling starts, where the compile
    wrapper is seen."""
    found = _reservation_change(model, shape, model_options, settings, facts, "compile node", assume_compiled=True)
    if found is None:
        return "torch.compile: not on the model here; a compile node after this node is counted when sampling starts"
    return (f"torch.compile: not on the model here; a per-block compile node after this node is counted when "
            f"sampling starts (reservation {found[1]:+.2f} GiB); ComfyUI's TorchCompileModel compiles the whole model, "
            f"which is reserved for as eager")


def _prepare_wrapper(settings: Settings):
    def prepare_sampling(executor, model, noise_shape, conds, *args, **kwargs):
        mo = kwargs.get("model_options", args[0] if args else None) or getattr(model, "model_options", {})
        base = model.model
        try:
            fn, facts = plan_reservation(model, noise_shape, mo, settings)
        except Exception as e:  # never block sampling on the estimate
            log.warning("wan-sage: working-memory estimate failed (%s: %s); using ComfyUI's own.", type(e).__name__, e)
            return executor(model, noise_shape, conds, *args, **kwargs)
        text = report_from_facts(facts, noise_shape)
        if comfy_bridge.is_dynamic(model):
            log.info("wan-sage estimate (dynamic VRAM: residency managed by ComfyUI; the estimate informs cond "
                     "batching only):\n%s", text)
            total = facts["capacity"] + facts["weights"]
            if facts["terms"]["total"] > total:
                log.warning("wan-sage: the activations alone (%.1f GiB) exceed this GPU; lower frames or resolution, "
                            "or raise --vram-headroom/--reserve-vram.", facts["terms"]["total"] / GiB)
            return executor(model, noise_shape, conds, *args, **kwargs)
        log.info("wan-sage estimate:\n%s", text)
        if facts["partial"]:
            import comfy.model_management as mm
            mm.soft_empty_cache()  # hand the previous model's cached activations back first
        prev = _swap(base, fn)
        try:
            out = executor(model, noise_shape, conds, *args, **kwargs)
        finally:
            _restore(base, prev)
        _trim_after_load(comfy_bridge.device_of(model))
        return out
    return prepare_sampling


def _trim_after_load(dev) -> None:
    """Give the allocator's free blocks back once the weights are loaded.  Loading (unloading the
    text encoder, moving the weights, patching a LoRA into them) leaves free blocks between the
    weights: 0.25-2.09 GiB for fp8 A14B at a 24 GiB budget on the H200, and a run that started with
    the 2.09 ran out of memory in its first step.  One synchronisation per sampling call; CUDA only."""
    if getattr(dev, "type", None) != "cuda":
        return
    try:
        import comfy.model_management as mm
        mm.soft_empty_cache()
    except Exception as e:  # never fail a sampling over a cache trim; the reason is logged once
        warn_once(("trim", type(e).__name__), "wan-sage: emptying the allocator cache after loading failed (%s); "
                  "sampling goes on with the cached blocks.", reason(e))


def _cond_batch_wrapper(settings: Settings):
    def calc_cond_batch(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
        base = model  # BaseModel here
        try:
            dims = comfy_bridge.wan_dims(base)
            dtype = comfy_bridge.compute_dtype(base)
            self_p, cross_p, _ = attention_for(model_options, settings, x_in.device)
            partial = bool(getattr(base, "model_lowvram", False))
            mode = run_mode(base, model_options, dims, list(x_in.shape))
            fn = MemoryRequired(dims, dtype, self_p, cross_p, activation_model.WeightSetup(streamed=partial), partial, settings,
                                _orig(base), mode)
        except Exception as e:  # never block sampling on the estimate; the reason is logged once
            warn_once(("cond-batch", type(e).__name__), "wan-sage: the working-memory estimate for cond/uncond "
                      "batching failed (%s); ComfyUI's own estimate decides the batching.", reason(e))
            return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
        prev = _swap(base, fn)
        try:
            return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
        finally:
            _restore(base, prev)
    return calc_cond_batch


def apply_estimator(model, settings: Settings, shape, model_options=None):
    """(clone with wrappers, numbers dict, report text).  Non-Wan models pass through."""
    if not comfy_bridge.is_wan(model):
        log.warning("wan-sage: the Working-Memory Estimator got a model that is not a Wan video model; "
                    "it is passed through unchanged.")
        return model, None, "not a Wan model: passed through unchanged (ComfyUI's own estimate applies)"
    m = model.clone()
    W = comfy_bridge.wrappers_mp()
    m.add_wrapper_with_key(W.PREPARE_SAMPLING, PREPARE_KEY, _prepare_wrapper(settings))
    m.add_wrapper_with_key(W.CALC_COND_BATCH, BATCH_KEY, _cond_batch_wrapper(settings))
    mo = model_options or m.model_options
    _fn, facts = plan_reservation(m, shape, mo, settings)
    text = report_from_facts(facts, shape)
    if settings.count_sage == "auto-detect" and facts["attention"] == "sdpa":
        text += "\n" + _later_patch_note(m, shape, mo, settings, facts)
    if not facts.get("compiled_by"):
        text += "\n" + _later_compile_note(m, shape, mo, settings, facts)
    nums = {"tokens": facts["tokens"], "activation_gb": (facts["terms"]["phase_peak"] + facts["terms"]["persistent"]) / GiB,
            "sage_extra_gb": facts["terms"]["sage_extra"] / GiB, "reservation_gb": facts["reservation"] / GiB}
    return m, nums, text
