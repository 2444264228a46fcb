"""Wiring of the "Wan Working-Memory Estimator": reserve the predicted activation memory before sampling.

The node builds a :class:`memory.estimate.Setup` from the ModelPatcher (:func:`setup_for`: the real
config, the latent the sampler gets, the compute dtype, how the weights are held, the Sage patch and the
compile on the model, the VRAM this model may use) and calls :func:`memory.estimate.plan`, the one
estimate entry point; :func:`memory.report.report` words it.

Wiring (all scoped to the cloned MODEL, restored in ``finally``):

* a ``PREPARE_SAMPLING`` wrapper temporarily replaces the shared ``BaseModel.memory_required``
  with :class:`MemoryRequired`, so ``load_models_gpu`` keeps as many weights resident as fit and
  evicts or offloads the rest (legacy memory path: ComfyUI 0.3.64, GGUF, --disable-dynamic-vram); where an
  earlier sampling of the same setup kept what its calls held, the load is sized for that figure instead, where
  it is lower (:class:`StartAt`, :mod:`.held_record`), and the reservation is planned again between model calls
  (:mod:`.replan`);
* a ``CALC_COND_BATCH`` wrapper does the same around cond/uncond batching decisions;
* the clone's ``load`` and ``unpatch_model`` keep the host tensors its weights are loaded from and give them
  back when ComfyUI unloads the model, so nothing is copied back (:mod:`.host_copy`; legacy path only);
* with those, an ``OUTER_SAMPLE`` wrapper unloads the model when its sampling ends wherever the VAE decode's
  room is not free (:mod:`.decode_room`), so the reservation keeps none of that room while sampling;
* on the dynamic-VRAM path residency is managed by ComfyUI itself: the node then only informs
  batching, reports, and warns when the activations alone exceed the card.

A MODEL that is not a Wan video model is passed through unchanged with a warning (a workflow that swaps
models must not break; the report output says so).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

from ..attention import kernels, registry
from ..attention.override import SageAttentionOverride
from ..memory import activation_model, report
from ..memory.estimate import GiB, POLICIES, AttentionPlan, Estimate, Setup, attention_plan, plan
from ..memory.parallel import Parallel, problem
from ..memory.request import LEGACY_POLICIES
from . import (comfy_bridge, compile_blocks, cond_rows, decode_room, held_record, host_copy, pinned_host,
               raylight_bridge, replan, sage_patch)
from .log_once import reason, warn_once
from .sage_patch import find_override

log = logging.getLogger("wan_sage")

PREPARE_KEY = "wan_sage_reserve"
BATCH_KEY = "wan_sage_cond_batch"
SAGE_COUNT = ("auto-detect", "always", "never")
HOST_COPY_NOTE = ("unloading: the weights keep their host copies while loaded, so an unload (the next expert, the "
                  "VAE) copies nothing back; host memory stays within what the model held before its first load. "
                  "Where the VAE decode's room is not free when sampling ends, the model is unloaded for it then")


@dataclass(frozen=True)
class Settings:
    policy: str = POLICIES[0]
    margin_gib: float = 0.0
    fixed_gib: float = 10.0
    count_sage: str = SAGE_COUNT[0]

    def __post_init__(self):
        object.__setattr__(self, "policy", LEGACY_POLICIES.get(self.policy, self.policy))


def _cc(dev) -> int | None:
    if dev is None or getattr(dev, "type", None) != "cuda":
        return None
    try:
        return kernels.device_cc(dev)
    except (RuntimeError, AssertionError) as e:  # a CUDA device torch cannot query
        warn_once(("cc", type(e).__name__), "wan-sage: the compute capability of %s could not be read (%s); the "
                  "estimate assumes sm90's Sage kernel.", dev, reason(e))
        return None


def attention_for(model_options, settings: Settings, dev, tokens: int | None = None,
                  head_dim: int | None = None) -> AttentionPlan:
    """The attention the memory model counts, detecting the Sage patch on the model.

    Counted as the dispatcher runs the calls: the patch's kernel (for ``auto``, this GPU's
    available kernels in the registry's auto order), under the registry's rule for a shape with no
    timing (cross-attention on SDPA, reason ``cross_slower``; self-attention on the first kernel);
    a kernel that does not run on this GPU leaves both on SDPA, with the reason as the note."""
    ov = find_override((model_options or {}).get("transformer_options", {}))
    if settings.count_sage == "never" or (settings.count_sage == "auto-detect" and ov is None):
        return AttentionPlan()
    found_cc = _cc(dev)
    name = ov.config.kernel if ov is not None else "auto"
    if name != "auto" and name not in registry.KERNELS:
        return AttentionPlan(note=f"{name} is not a kernel of this version: attention stays on SDPA")
    # on a GPU, sage-auto plans the kernels installed here, in the registry's order
    installed = kernels.auto_candidates(found_cc) if name == "auto" and found_cc else None
    return attention_plan(name, found_cc, tokens, installed, head_dim)


def chained_attention(model, model_options, dims: activation_model.WanDims, tokens: int,
                      att: AttentionPlan) -> tuple:
    """(the attention plan, notes) once what else on the model decides the calls is read:

    * an override in the slot that does not reach the Sage patch (set_model_optimized_attention after it):
      named in a note (the plan is SDPA's already, as no patch is found);
    * ComfyUI's Model Sparse Attention over the Sage patch: the share of self-attention calls it leaves dense
      (run on the Sage patch) from its options.  The Sage extra is a per-call peak, reached in every dense
      call, so it is counted in full wherever that share is not 0; where it is 0 the sparse kernel's memory
      (not measured) is planned at the Sage kernel's figure;
    * an object patch that replaces the blocks' self-attention forward (KJNodes' WanVideo Mem Eff Sage
      Attention Patch): self-attention never reaches wan-sage; it is planned at SDPA's memory, which that
      patch's Sage call (it frees the bf16 q/k/v as it quantises them) stays within."""
    notes = []
    to = (model_options or {}).get("transformer_options", {}) or {}
    top, path = comfy_bridge.slot_chain(to, lambda ov: isinstance(ov, SageAttentionOverride))
    if top is not None and not path:
        notes.append(f"attention: {comfy_bridge.describe_override(top)} is in the attention slot and does not hand "
                     f"calls on to a Sage patch: planned as it runs them, on their own backend (SDPA's memory)")
    elif path and len(path) > 1 and att.kernel is not None:
        for patch in comfy_bridge.bsa_patches(path[:-1]):
            share, why = comfy_bridge.bsa_dense_share(patch, model, dims.num_layers, tokens, dims.head_dim)
            if share is None:
                notes.append(f"ComfyUI's Model Sparse Attention wraps the Sage patch ({why}): the calls it leaves "
                             f"dense run on {att.kernel}, whose extra is counted in full")
            elif share > 0:
                notes.append(f"ComfyUI's Model Sparse Attention wraps the Sage patch: {share:.0%} of self-attention "
                             f"calls stay dense and run on {att.kernel} ({why}); the Sage extra is counted in full, "
                             f"as every dense call reaches it")
            else:
                notes.append(f"ComfyUI's Model Sparse Attention wraps the Sage patch and runs every self-attention "
                             f"call sparse ({why}): none reaches {att.kernel}; the sparse kernel's memory is not "
                             f"measured and is planned at {att.kernel}'s figure")
    bypass = sage_patch.bypass_text(model)
    if bypass:
        notes.append(bypass)
        found = comfy_bridge.self_attention_patch(model)
        who = "KJNodes' Mem Eff Sage" if found and found[2] else "another node's self-attention"
        att = replace(att, self_path="sdpa", self_by=who)
    return att, notes


@dataclass(frozen=True)
class RunMode:
    """How the forward runs, beyond the attention paths: compiled blocks, and whether the Sage patch
    runs self-attention in its memory mode's head groups."""

    compiled: bool = False
    sage_grouped: bool = False


def run_mode(model, model_options, dims: activation_model.WanDims, shape, dev=None) -> RunMode:
    """The model's compile state, and whether the patch on it runs this shape's self-attention grouped.

    Grouping is counted where the dispatcher has settled this call shape grouped in this process (its
    memory mode runs the split where calibration measured it at most 2 % slower), or, before the shape's
    first call on ``dev``, where that call will settle it grouped from the timing cache kept across
    starts without measuring first, its kernel's self-test passed here or kept as passed in that cache
    (:func:`attention.override.self_attention_groups`).  Otherwise the
    ungrouped call, which needs more, is reserved for: a shape's timed first calls run ungrouped."""
    scope = comfy_bridge.compile_scope(model, model_options)
    compiled = scope is not None and scope[0] == comfy_bridge.BLOCKS
    ov = find_override((model_options or {}).get("transformer_options", {}))
    if ov is None or getattr(ov.config, "memory_mode", "fastest") == "fastest":
        return RunMode(compiled, False)
    from ..attention.override import self_attention_groups, settled_shapes
    L = activation_model.tokens(dims, int(shape[2]), int(shape[3]), int(shape[4]))
    settled = [s for s in settled_shapes() if s["Nq"] == s["Nk"] == L and s["H"] == dims.num_heads
               and s["D"] == dims.head_dim]
    if settled:
        return RunMode(compiled, any(s["kernel"] and s["groups"] > 1 for s in settled))
    if getattr(dev, "type", None) != "cuda":
        return RunMode(compiled, False)
    groups = self_attention_groups(ov, dev, comfy_bridge.compute_torch_dtype(model), int(shape[0]), dims.num_heads,
                                   L, dims.head_dim)
    return RunMode(compiled, bool(groups and groups > 1))


UNKNOWN_COMPILE_NOTE = ("compile scope unknown: planned as eager ({who} keeps the modules it compiles where wan-sage "
                        "cannot read them, so whether they are the blocks one by one is not known)")
FP8_MATMUL_SKIPPED_NOTE = ("fp8_e4m3fn_fast: this ComfyUI runs its fp8 matmuls only for layers in eval mode and "
                           "leaves the Wan model in training mode, so its fp8 weights are cast at every layer call "
                           "as on the ordinary fp8 path (planned so)")
KEPT_PATH_NOTE = ("Wan Compile Blocks: streamed blocks planned as blocks of this model's kind ran compiled ({path}) "
                  "in an earlier sampling (kept in the pack's cache folder); a block that runs eagerly or a sampling "
                  "that fails brings back the eager plan")
WHOLE_MODEL_COMPILE_NOTE = ("the whole diffusion model is one compiled graph, which is reserved for as eager: the "
                            "compiled figure is measured for blocks compiled one by one, and a whole-model compile "
                            "peaked above it")


def setup_for(model, shape, model_options, settings: Settings, *, assume_compiled: bool = False,
              streamed: bool | None = None, weights: bool = True, decode: bool = False) -> Setup:
    """The estimate's setup for this ModelPatcher (or BaseModel, with ``weights=False``) and latent ``shape``.

    ``assume_compiled``: plan as if its blocks were compiled (what a compile node after the estimator
    brings); ``streamed``: force the weights streamed or resident (None: as the VRAM budget finds);
    ``weights``: read the weights and the VRAM budget from the patcher (the cond-batch wrapper, which gets
    the BaseModel with its weights loaded already, leaves them out); ``decode``: plan room for the VAE decode
    that follows the sampling (the reservation that places the weights; not the cond/uncond batching test)."""
    dims = comfy_bridge.wan_dims(model)
    dtype = comfy_bridge.compute_dtype(model)
    dev = comfy_bridge.device_of(model) if weights else getattr(model, "load_device", None)
    mode = run_mode(model, model_options, dims, shape, dev)
    scope = comfy_bridge.compile_scope(model, model_options)
    compiled_by = comfy_bridge.compiled_by(model, model_options)
    notes = [compiled_by] if compiled_by else []
    if scope is not None and not mode.compiled and not assume_compiled:
        notes.append(UNKNOWN_COMPILE_NOTE.format(who=scope[1]) if scope[0] == comfy_bridge.UNKNOWN_SCOPE
                     else WHOLE_MODEL_COMPILE_NOTE)
    extra = {}
    if weights:
        dynamic = comfy_bridge.is_dynamic(model)
        if comfy_bridge.fp8_matmul_skipped(model.model):
            notes.append(FP8_MATMUL_SKIPPED_NOTE)
        extra = {"weights": comfy_bridge.weight_setup(model, False), "weights_bytes": int(model.model_size()),
                 "vram_bytes": (comfy_bridge.total_memory(comfy_bridge.device_of(model)) if dynamic
                                else comfy_bridge.capacity(model)),
                 "kept_free": comfy_bridge.extra_reserved(), "dynamic_vram": dynamic,
                 "legacy_reason": None if dynamic else comfy_bridge.legacy_reason(model),
                 "decode_dtype_size": comfy_bridge.vae_dtype_size(comfy_bridge.device_of(model)) if decode else None,
                 "decode_by_unload": decode and host_copy.installed(model)}
    else:
        extra = {"weights": activation_model.WeightSetup(streamed=bool(streamed))}
    tokens = activation_model.tokens(dims, int(shape[2]), int(shape[3]), int(shape[4]))
    att, chain_notes = chained_attention(model, model_options, dims, tokens,
                                         attention_for(model_options, settings, dev, tokens, dims.head_dim))
    notes += chain_notes
    degrees = raylight_bridge.parallel_degrees(model) if weights else None
    par = Parallel()
    if degrees is not None:
        # Raylight's degrees, read from this process's xFuser runtime and the model's FSDP wrapping
        # (raylight_bridge: Raylight does not write them into model_options)
        par = Parallel(ulysses=degrees["ulysses"], ring=degrees["ring"], fsdp=degrees["fsdp"],
                       cfg_parallel=degrees["cfg"] > 1)
        wrong = problem(par, dims.num_heads, 2.0)
        if wrong is not None:  # degrees this model cannot run: estimate one GPU and say why
            notes.append(f"Raylight degrees not used: {wrong[0]} {wrong[1]}")
            par = Parallel()
    blocks_node = comfy_bridge.compile_blocks_node(model, model_options)
    # the kept path is read for a patcher (the sampling's reservation); the cond-batch test, given the BaseModel,
    # plans from what this process saw
    streamed_path, kept = (("", False) if not blocks_node
                           else compile_blocks.streamed_path(model, model_options) if weights
                           else (compile_blocks.streamed_blocks_ran(model, model_options), False))
    if kept:
        notes.append(KEPT_PATH_NOTE.format(path=streamed_path))
    return Setup(dims=dims, parallel=par, latent=tuple(int(x) for x in shape[:5]), dtype=dtype,
                 attention=att, sage_grouped=mode.sage_grouped and att.self_path != "sdpa",
                 compiled=mode.compiled or assume_compiled,
                 other_compile=scope is not None and not (mode.compiled or assume_compiled),
                 streamed_blocks_staged=blocks_node,
                 streamed_blocks_ran=streamed_path,
                 margin_bytes=int(settings.margin_gib * GiB),
                 policy=settings.policy, fixed_bytes=int(settings.fixed_gib * GiB), streamed=streamed,
                 img_tokens=dims.img_tokens, per_frame_timesteps=dims.per_frame_timesteps,
                 comfy_flash=comfy_bridge.comfy_uses_flash(), kernel_set=comfy_bridge.kernel_set(),
                 q_handed_over=_q_handed_over(model, att),
                 sage_memory_mode=_memory_mode(model_options),
                 source="the loaded model", notes=tuple(notes), **extra)


def _q_handed_over(model, att) -> bool:
    """Whether the Sage self-attention of ``model`` writes its output into q: the call site hands q over
    (:func:`comfy_bridge.q_handed_over`) and the planned kernel's write-into-q pieces are installed."""
    if att.kernel is None or not comfy_bridge.q_handed_over(model):
        return False
    return kernels.into_q_module(att.kernel) is not None


def _memory_mode(model_options) -> str | None:
    ov = find_override((model_options or {}).get("transformer_options", {}))
    return None if ov is None else getattr(ov.config, "memory_mode", None)


@lru_cache(maxsize=128)
def _reservation(setup: Setup, shape: tuple) -> int:
    return plan(setup.with_latent(shape)).reservation


class MemoryRequired:
    """Stand-in for ``BaseModel.memory_required(input_shape, cond_shapes={}, **kw)``: the reservation
    :func:`memory.estimate.plan` gives ``setup`` for ComfyUI's ``input_shape``.  Immutable."""

    __slots__ = ("setup",)

    def __init__(self, setup: Setup):
        object.__setattr__(self, "setup", setup)

    def __setattr__(self, name, value):
        raise AttributeError("MemoryRequired is immutable")

    def __deepcopy__(self, memo):
        return self

    def __call__(self, input_shape, cond_shapes={}, **kwargs):
        return _reservation(self.setup, tuple(int(x) for x in input_shape[:5]))


def sampling_plan(model, shape, model_options, settings: Settings, cfg: float = 1.0, **assume) -> tuple:
    """(MemoryRequired, Estimate) for this model and latent shape: the estimate with the budget's verdict,
    and the reservation function that holds to it (weights streamed or resident, as the verdict found).  ``cfg``:
    the node's, as in its own report (the reservation is per row of ComfyUI's input either way)."""
    est = plan(replace(setup_for(model, shape, model_options, settings, decode=True, **assume), cfg=float(cfg)))
    return MemoryRequired(replace(est.setup, streamed=est.streamed)), est


def _later_change(model, shape, model_options, settings: Settings, est: Estimate, what: str, **assume):
    """(the estimate with ``what`` placed after this node, its reservation minus this one's in GiB), or None
    when planning it fails.  The notes built from it are a courtesy: the node never fails over them,
    and the reason is logged once."""
    try:
        other = plan(setup_for(model, shape, model_options, settings, decode=True, **assume))
    except Exception as e:
        warn_once(("later-note", what, type(e).__name__), "wan-sage: estimating what a %s after the "
                  "Working-Memory Estimator changes failed (%s); the report leaves the figure out.", what, reason(e))
        return None
    return other, round((other.reservation - est.reservation) / GiB, 2) + 0.0  # + 0.0: no "-0.00"


def _later_patch_note(model, shape, model_options, settings: Settings, est: Estimate) -> str:
    """What a Sage patch placed after this node would add.  The node runs before a patch further down
    the graph, so it sees none; the reservation is decided again when sampling starts, where it does."""
    found = _later_change(model, shape, model_options, replace(settings, count_sage="always"), est, "Sage patch")
    if found is None:
        return "Sage patch: none on the model here; one after this node is counted when sampling starts"
    with_sage, extra = found
    kernel = with_sage.setup.attention.kernel or "sdpa"
    return (f"Sage patch: none on the model here; a Wan 2.1/2.2 Sage Attention Patch after this node is counted "
            f"when sampling starts ({kernel}: reservation {extra:+.2f} GiB)")


def _later_compile_note(model, shape, model_options, settings: Settings, est: Estimate) -> str:
    """What a torch.compile node placed after this node would change.  Compiled blocks fuse RoPE and the
    FFN, so their peak is lower; the reservation is decided again when sampling starts, where the compile
    wrapper is seen."""
    found = _later_change(model, shape, model_options, settings, est, "compile node", assume_compiled=True)
    if found is None:
        return "torch.compile: not on the model here; a compile node after this node is counted when sampling starts"
    return (f"torch.compile: not on the model here; a per-block compile node after this node is counted when "
            f"sampling starts (reservation {found[1]:+.2f} GiB); ComfyUI's TorchCompileModel compiles the whole model, "
            f"which is reserved for as eager")


def _held(model) -> str | None:
    """How the weights are held, for the report: the first parameter's dtype or GGUF."""
    ws = comfy_bridge.weight_setup(model, False)
    return "gguf" if ws.gguf else ws.weight_dtype


def _prepare_wrapper(settings: Settings, cfg: float = 1.0):
    def prepare_sampling(executor, model, noise_shape, conds, *args, **kwargs):
        mo = kwargs.get("model_options", args[0] if args else None) or getattr(model, "model_options", {})
        base = model.model
        replan.end(base)
        try:
            fn, est = sampling_plan(model, noise_shape, mo, settings, cfg)
        except Exception as e:  # never block sampling on the estimate
            log.warning("wan-sage: working-memory estimate failed (%s: %s); using ComfyUI's own.", type(e).__name__, e)
            return executor(model, noise_shape, conds, *args, **kwargs)
        text = report.report(est, held=_held(model))
        if est.setup.dynamic_vram:
            # ComfyUI places a dynamic model's weights itself and evicts them on demand: no swap here. The
            # estimate is checked against the card and decides cond/uncond batching (the CALC_COND_BATCH wrapper).
            log.info("wan-sage estimate:\n%s", text)
            if est.level == "cannot":
                log.warning("wan-sage: %s. Lower frames or resolution%s.", est.verdict,
                            "; " + est.sage_advice if est.sage_advice else "")
            elif est.sage_advice:
                log.warning("wan-sage: %s.", est.sage_advice)
            return executor(model, noise_shape, conds, *args, **kwargs)
        log.info("wan-sage estimate:\n%s", text)
        if est.streamed:
            import comfy.model_management as mm
            mm.soft_empty_cache()  # hand the previous model's cached activations back first
        scope = comfy_bridge.compile_scope(model, mo)
        # a whole-model graph would compile again for weights moved between calls
        replans = (scope is None or scope[0] == comfy_bridge.BLOCKS) and replan.tracks(model)
        planned = fn(_one_row(noise_shape))
        keys = held_record.record_keys(fn.setup, comfy_bridge.device_of(model)) if replans and est.streamed else []
        start = replan.starting_reservation(keys, planned)
        if start < planned:
            log.info("wan-sage: reservation %.2f -> %.2f GiB at the start, from what an earlier sampling of this "
                     "setup held", planned / GiB, start / GiB)
        prev = comfy_bridge.swap_memory_required(base, fn if start >= planned else StartAt(fn, noise_shape[0], start))
        try:
            out = executor(model, noise_shape, conds, *args, **kwargs)
        finally:
            comfy_bridge.restore_memory_required(base, prev)
        _trim_after_load(comfy_bridge.device_of(model))
        if replans:
            replan.begin(model, noise_shape, _replanner(mo, settings, cfg, est.streamed), start,
                         key=keys[0] if keys else None, planned=planned)
        return out
    return prepare_sampling


class StartAt:
    """``memory_required`` for a sampling's load that starts below its plan (:func:`.replan.starting_reservation`):
    ``fn``'s figure, at most ``cap`` bytes for the noise's own ``rows``, where ComfyUI sizes the partial load.  The
    cond + uncond figure, which only decides what other models ComfyUI unloads first, stays ``fn``'s.  Immutable."""

    __slots__ = ("fn", "rows", "cap")

    def __init__(self, fn, rows: int, cap: int):
        for name, value in (("fn", fn), ("rows", int(rows)), ("cap", int(cap))):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError("StartAt is immutable")

    def __deepcopy__(self, memo):
        return self

    def __call__(self, input_shape, cond_shapes={}, **kwargs):
        found = self.fn(input_shape, cond_shapes, **kwargs)
        return min(found, self.cap) if int(input_shape[0]) <= self.rows else found


def _one_row(shape) -> list:
    """The input ComfyUI places the weights for: the noise's own rows (``minimum_memory_required``)."""
    return [int(shape[0])] + [int(x) for x in shape[1:]]


def _replanner(model_options, settings: Settings, cfg: float, streamed: bool):
    """The reservation of a sampling planned again between its model calls (:mod:`.replan`): the same plan as
    its start's, from what the model shows now, with the weights streamed or resident as its start found."""
    def reservation(patcher, shape) -> int:
        return sampling_plan(patcher, shape, model_options, settings, cfg, streamed=streamed)[0](_one_row(shape))
    return reservation


def _trim_after_load(dev) -> None:
    """Give the allocator's free blocks back once the weights are loaded.  Loading (unloading the
    text encoder, moving the weights, patching a LoRA into them) leaves free blocks between the
    weights: 0.25-2.09 GiB for fp8 A14B at a 24 GiB budget on the H200, and a run that started with
    the 2.09 ran out of memory in its first step.  One synchronisation per sampling call; CUDA only."""
    comfy_bridge.trim_allocator(dev, "after loading")


def batching_setup(base, shape, model_options, settings: Settings) -> Setup:
    """The setup ComfyUI's cond/uncond batching test (``memory_required(...) * 1.5 < free``) is answered from:
    the same setup as the reservation's, built from the patcher that samples this BaseModel
    (``current_patcher``), so the weights' casts and transients are counted as there; weights streamed as the
    load left them (legacy path: ``model_lowvram``) or as the verdict against the card finds (dynamic VRAM).
    Without a patcher: the BaseModel's own config, the weights taken as in the compute dtype."""
    patcher = getattr(base, "current_patcher", None)
    if patcher is None or getattr(patcher, "model", None) is not base:
        return setup_for(base, shape, model_options, settings, streamed=bool(getattr(base, "model_lowvram", False)),
                         weights=False)
    if comfy_bridge.is_dynamic(patcher):
        est = plan(setup_for(patcher, shape, model_options, settings))
        return replace(est.setup, streamed=est.streamed)
    return setup_for(patcher, shape, model_options, settings, streamed=bool(getattr(base, "model_lowvram", False)))


def _cond_batch_wrapper(settings: Settings):
    def calc_cond_batch(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
        base = model  # BaseModel here, its weights loaded already
        replan.before_call(base)
        try:
            fn = MemoryRequired(batching_setup(base, list(x_in.shape), model_options, settings))
        except Exception as e:  # never block sampling on the estimate; the reason is logged once
            warn_once(("cond-batch", type(e).__name__), "wan-sage: the working-memory estimate for cond/uncond "
                      "batching failed (%s); ComfyUI's own estimate decides the batching.", reason(e))
            return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
        # Wan Compile Blocks' cap on the batch stays in force where its wrapper is outside this one
        prev = comfy_bridge.swap_memory_required(base, cond_rows.keep_cap(base, fn))
        try:
            try:
                return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
            except kernels.out_of_memory_error() as e:
                if not replan.lowered_by_measure(base):
                    raise
                what = reason(e)
            # out of the except block, so that the failed call's tensors are freed before it runs again
            if not replan.after_out_of_memory(base, what):
                raise kernels.out_of_memory_error()(what)
            return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
        finally:
            comfy_bridge.restore_memory_required(base, prev)
    return calc_cond_batch


def apply_estimator(model, settings: Settings, shape, model_options=None, pixels=None, cfg: float = 1.0):
    """(clone with wrappers, Estimate or None, report text).  Non-Wan models pass through.
    ``pixels``: (width, height, frames) the shape was made from, when it came from the widgets; ``cfg``: the
    cfg the sampler runs (not 1: the report gives the cond + uncond batched figure too)."""
    if not comfy_bridge.is_wan(model):
        log.warning("wan-sage: the Working-Memory Estimator got a model that is not a Wan video model; "
                    "it is passed through unchanged.")
        return model, None, "not a Wan model: passed through unchanged (ComfyUI's own estimate applies)"
    m = model.clone()
    W = comfy_bridge.wrappers_mp()
    m.add_wrapper_with_key(W.PREPARE_SAMPLING, PREPARE_KEY, _prepare_wrapper(settings, float(cfg)))
    m.add_wrapper_with_key(W.CALC_COND_BATCH, BATCH_KEY, _cond_batch_wrapper(settings))
    kept = host_copy.install(m)
    if kept:
        m.add_wrapper_with_key(W.OUTER_SAMPLE, decode_room.KEY, decode_room.outer_sample)
    mo = model_options or m.model_options
    setup = setup_for(m, shape, mo, settings, decode=True)
    est = plan(replace(setup, pixels=pixels, cfg=float(cfg)))
    notes = []  # what a node after this one would change, and the weights' host copy
    if settings.count_sage == "auto-detect" and est.setup.attention.kernel is None:
        notes.append(_later_patch_note(m, shape, mo, settings, est))
    if not est.setup.compiled and not any(n.startswith("torch.compile") for n in est.setup.notes):
        notes.append(_later_compile_note(m, shape, mo, settings, est))
    if kept:
        notes.append(HOST_COPY_NOTE)
        pin_note = pinned_host.report_note(host_copy.comfy_pins_streamed_weights(m))
        if pin_note:
            notes.append(pin_note)
    return m, est, report.report(est, held=_held(m), notes=notes)
