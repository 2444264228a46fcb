"""Wiring of the "Wan 2.2 Sage Attention Patch": clone the MODEL, install the attention override
(chained to any override already there), on a ComfyUI without attention containers the blocks' forward that
hands q over to it (:mod:`.handover`), the same patch as Raylight's inner-attention processor
(:mod:`.raylight_bridge`), and open/close a stats window around each sampling run, which also reports whether
torch.compile on the model pays back for the run (:mod:`.compile_advice`) and keeps a compiled model's
torch.compile caches across ComfyUI starts (:mod:`.compile_cache`)."""
from __future__ import annotations

import logging

from ..attention import kernels, registry, stats
from ..attention.config import PatchConfig
from ..attention.override import SageAttentionOverride
from ..memory import report
from . import comfy_bridge, compile_advice, compile_blocks, compile_cache, handover, raylight_bridge
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

STATS_EVENT = "wan_sage.stats"

# The memory_mode combo's values, as the canvas shows them, and the PatchConfig mode each one sets.
MEMORY_MODE_LABELS = ("within SDPA's memory", "fastest, more memory")
_MEMORY_MODE_IDS = {MEMORY_MODE_LABELS[0]: "sdpa", MEMORY_MODE_LABELS[1]: "fastest"}


def memory_mode_id(value) -> str | None:
    """The PatchConfig memory mode of a memory_mode combo value: one of :data:`MEMORY_MODE_LABELS`, or
    the mode ids themselves, which workflows saved before the labels hold; None for anything else."""
    if value in _MEMORY_MODE_IDS:
        return _MEMORY_MODE_IDS[value]
    return value if value in _MEMORY_MODE_IDS.values() else None
OUTER_KEY = "wan_sage_attention_stats"


def find_override(transformer_options) -> SageAttentionOverride | None:
    """Our override in the slot, also under overrides that wrap it: through ``prev``, the core Model Sparse
    Attention's ``_block_sparse_attention_previous``, or a readable closure over it
    (:func:`comfy_bridge.slot_chain`)."""
    _top, path = comfy_bridge.slot_chain(transformer_options, _is_ours)
    return path[-1] if path else None


def _is_ours(ov) -> bool:
    return isinstance(ov, SageAttentionOverride)


def chain_text(transformer_options) -> str | None:
    """What wraps our override in the slot, in words (None when it is on top or absent)."""
    _top, path = comfy_bridge.slot_chain(transformer_options, _is_ours)
    if not path or len(path) == 1:
        return None
    return " over ".join(comfy_bridge.describe_override(ov) for ov in path[:-1]) + " over the Sage patch"


KJ_BYPASS = "KJNodes' Sage patch on this model bypasses wan-sage"


def bypass_text(model) -> str | None:
    """The status line when another node replaced the blocks' self-attention forward (KJNodes' WanVideo Mem
    Eff Sage Attention Patch): wan-sage's override then never sees self-attention."""
    found = comfy_bridge.self_attention_patch(model)
    if found is None:
        return None
    who, blocks, kj = found
    if kj:
        return (f"{KJ_BYPASS}: its WanVideo Mem Eff Sage Attention Patch replaces the self-attention of {blocks} "
                f"blocks, so wan-sage serves only the calls left to ComfyUI's attention (cross-attention); keep one "
                f"of the two")
    return (f"another node replaces the self-attention forward of {blocks} blocks ({who}): wan-sage serves "
            f"self-attention only if that forward calls ComfyUI's attention")


def _stats_wrapper(patch_id: str, label: str, node_id: str | None = None):
    def outer_sample(executor, *args, **kwargs):
        guider = getattr(executor, "class_obj", None)
        mo = getattr(guider, "model_options", None) or {}
        to = mo.get("transformer_options", {})
        found = find_override(to)
        if found is None or found.patch_id != patch_id:
            top = (to or {}).get(comfy_bridge.OVERRIDE_KEY)
            who = "another node" if top is None else comfy_bridge.describe_override(top)
            warn_once(("displaced", patch_id), "wan-sage: %s replaced the Sage attention override on this model "
                      "after the Wan 2.1/2.2 Sage Attention Patch (the slot keeps only the last writer, and it does "
                      "not hand calls on to the Sage patch). Put the patch after that node to use SageAttention.", who)
        else:
            over = chain_text(to)
            if over:
                warn_once(("wrapped", patch_id, over), "wan-sage: %s: the calls it leaves dense run on the Sage "
                          "patch.", over, level=logging.INFO)
        bypass = bypass_text(getattr(guider, "model_patcher", None))
        if bypass:
            warn_once(("bypass", patch_id), "wan-sage: %s.", bypass)
        noise = args[0] if args else kwargs.get("noise")
        compile_file = compile_cache.before_sampling(getattr(guider, "model_patcher", None), mo,
                                                     tuple(getattr(noise, "shape", ())))
        try:
            shares = compile_advice.shares_schedule(args, kwargs)  # before the sampler changes the sigmas
        except Exception:  # the payback reads it again after the run, and logs what fails there
            shares = None
        stats.begin_run(patch_id, label)
        try:
            return executor(*args, **kwargs)
        finally:
            compile_cache.after_sampling(compile_file)
            # The sampling's cached free blocks go back to the device before the next node (the VAE decode)
            # runs: left in the allocator, the decode after Sage sampling ran 2-3x slower on the H200 (fp8
            # A14B 720p81 at 24 GiB, ComfyUI alone + Sage: 12.0 s against 4.5 s with them handed back).
            comfy_bridge.trim_allocator(getattr(getattr(guider, "model_patcher", None), "load_device", None),
                                        "after sampling")
            summary = stats.end_run(patch_id)
            if summary.get("sage_calls", 0) + summary.get("sdpa_calls", 0):
                log.info("wan-sage %s: %s", label or patch_id, stats.format_summary(summary))
                payback = _compile_payback(guider, args, kwargs, compile_cache.kept(compile_file), shares)
                if payback is not None:
                    log.info("wan-sage %s: %s", label or patch_id, payback["text"])
                comfy_bridge.send_event(STATS_EVENT, {"patch_id": patch_id, "node_id": node_id, "summary": summary,
                                           "text": stats.format_summary(summary), "compile": payback})
    return outer_sample


def _compile_payback(guider, args, kwargs, kept: bool = False, shares: bool | None = None) -> dict | None:
    """The compile payback of a compiled model's sampling run, for the log and the panel
    (:func:`memory.report.compile_payback_summary`), for a fresh process that finds the pack's compile file of
    this run where ``kept``; None where it runs eagerly.  A courtesy: a failure to read it is logged once and
    never fails the sampling."""
    try:
        found = compile_advice.payback_for(guider, args, kwargs, kept, shares)
    except Exception as e:
        warn_once(("compile-payback", type(e).__name__), "wan-sage: the compile payback of this sampling run "
                  "could not be worked out (%s); the report leaves it out.", reason(e))
        return None
    if found is None:
        return None
    summary = report.compile_payback_summary(found)
    try:
        ran = compile_blocks.blocks_ran(getattr(guider, "model_patcher", None), getattr(guider, "model_options", None))
    except Exception:  # the count is a detail of the line: the payback stands without it
        ran = None
    if ran is not None and ran.any_calls:
        summary["blocks"] = {"blocks": ran.blocks, "calls": ran.calls, "why": ran.why}
        summary["text"] += ". " + compile_blocks.blocks_ran_text(ran)
    return summary


def status_text(kernel: str) -> str:
    p = kernels.probe()
    parts = [f"kernel: {kernel}", f"sageattention: {p.sage_version or 'not installed'}",
             f"comfy-kitchen int8: {'yes' if p.ck_available else 'no'}"]
    import torch
    try:
        cc = kernels.device_cc(torch.device("cuda")) if torch.cuda.is_available() else None
    except (RuntimeError, AssertionError) as e:  # a CUDA torch that cannot reach its GPU
        warn_once(("status-cuda", type(e).__name__), "wan-sage: the GPU's compute capability could not be read "
                  "for the Sage patch's status (%s).", reason(e))
        parts.append(f"GPU: unreadable ({reason(e)})")
        return "; ".join(parts)
    if cc is not None:
        if kernel == "auto":
            c = kernels.auto_candidates(cc)
            parts.append(f"sm{cc} candidates: {', '.join(c) if c else 'none'}")
        else:
            why = kernels.unavailable_reason(kernel, cc)
            parts.append(f"sm{cc}: {'available' if why is None else why}")
    return "; ".join(parts)


def apply_patch(model, kernel="auto", min_tokens=1024, calibrate=True, memory_margin_mb=256,
                check_finite=True, node_id=None, memory_mode="sdpa"):
    """Returns (patched clone or the input model, report text).  ``memory_mode``: "sdpa" (Sage
    split into head groups to need about SDPA's memory where that costs <= 2 %) or "fastest"."""
    if not comfy_bridge.is_wan(model):
        warn_once("notwan", "wan-sage: the Sage Attention Patch got a model that is not a Wan video model; "
                  "it is passed through unchanged.")
        return model, "not a Wan model: passed through unchanged"
    if not kernels.any_kernel_importable():
        p = kernels.probe()
        warn_once("nosage", "wan-sage: SageAttention is not installed (%s), so the Sage Attention Patch passes "
                  "the model through. %s", p.sage_error, registry.install_hint())
        return model, "SageAttention not installed: passed through. " + registry.install_hint()
    if kernel != "auto":
        why = kernels.unavailable_reason(kernel)
        if why:
            warn_once(("kernel", kernel), "wan-sage: kernel %r is unavailable: %s. Calls will use SDPA.", kernel, why)
    m = model.clone()
    to = m.model_options.setdefault("transformer_options", {})
    prev = to.get(comfy_bridge.OVERRIDE_KEY)
    if isinstance(prev, SageAttentionOverride):
        prev = prev.prev  # re-patching replaces our own earlier patch instead of stacking it
    elif getattr(prev, comfy_bridge.BSA_PATCH_ATTR, None) is not None:
        warn_once(("displacing-bsa",), "wan-sage: ComfyUI's Model Sparse Attention is on this model before the Sage "
                  "patch; it puts itself back on top at every step, so while sampling it wraps the Sage patch and the "
                  "calls it leaves dense run on SageAttention.", level=logging.INFO)
    elif prev is not None:
        who = comfy_bridge.describe_override(prev)
        warn_once(("displacing", type(prev).__qualname__),
                  "wan-sage: this model already has an attention override (%s). The slot keeps only the last "
                  "writer, so the Sage patch takes it and hands the calls it cannot take (CPU, masks, short "
                  "sequences, dtypes the kernels lack) to that override; calls it takes but then serves on SDPA "
                  "(slower, memory, errors) use PyTorch SDPA.", who)
    cfg = PatchConfig(kernel=kernel, min_tokens=int(min_tokens), calibrate=bool(calibrate),
                      memory_margin_mb=int(memory_margin_mb), check_finite=bool(check_finite),
                      memory_mode=memory_mode,
                      cache_dir=comfy_bridge.cache_dir(), label="Wan Sage patch" + (f" #{node_id}" if node_id else ""),
                      node_id=None if node_id is None else str(node_id))
    free_fn = comfy_bridge.PatcherFreeMemory(m.model) if (comfy_bridge.is_dynamic(m) or comfy_bridge.aimdo_enabled()) else None
    ov = SageAttentionOverride(cfg, prev=prev, sdpa=comfy_bridge.raw_sdpa(), free_memory=free_fn)
    to[comfy_bridge.OVERRIDE_KEY] = ov
    try:
        dtype = comfy_bridge.compute_torch_dtype(m)
    except (AttributeError, TypeError):  # a model without ComfyUI's dtype accessors: the first call warms up
        dtype = None
    ov.warm_up(getattr(m, "load_device", None), dtype)
    if not comfy_bridge.has_attention_containers():
        handover.install(m, comfy_bridge.diffusion_model(m))
    ring_note = raylight_bridge.install_inner_attention(to, ov, m)
    m.add_wrapper_with_key(comfy_bridge.wrappers_mp().OUTER_SAMPLE, OUTER_KEY, _stats_wrapper(ov.patch_id, cfg.label, cfg.node_id))
    text = f"patched (id {ov.patch_id}); " + status_text(kernel)
    if ring_note:
        text += "\n" + ring_note
    bypass = bypass_text(model)
    if bypass:
        warn_once(("bypass-at-patch", id(model)), "wan-sage: %s.", bypass)
        text += "\n" + bypass
    return m, text
