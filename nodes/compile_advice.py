"""Whether torch.compile pays back for a sampling run of a compiled Wan model: what the Sage patch's
OUTER_SAMPLE wrapper reads from ComfyUI for :func:`memory.compile_payback.compile_payback`.

From ComfyUI's ``CFGGuider.outer_sample(noise, latent_image, sampler, sigmas, ...)`` call: the latent's size
(``noise``), this model's share of the sigma schedule (``len(sigmas) - 1`` steps, as KSamplerAdvanced slices it;
the tensor ComfyUI then puts in ``transformer_options["sample_sigmas"]``), the cfg (an uncond row where it is not
1), the compile scope on the model, and, after the run, whether its weights were streamed.  A share that ends
above sigma 0 hands the rest of the schedule to another model, and one sampled from zero noise
(KSamplerAdvanced's ``add_noise`` off) continues another model's: both are taken as one of two models of one
schedule (Wan 2.2 A14B's experts), which share the compiled block graph.  The share is read before the sampler
runs (:func:`shares_schedule`): ComfyUI's ``uni_pc`` samplers set the last sigma of a schedule ending at 0 to 0.001
in place, so after the run a whole schedule would read as a share."""
from __future__ import annotations

from ..memory import activation_model
from ..memory.compile_payback import Payback, compile_payback
from . import comfy_bridge, compile_blocks


def _arg(args, kwargs, i: int, name: str):
    return args[i] if len(args) > i else kwargs.get(name)


def _rows(guider, batch: int) -> int:
    """Rows per forward: the batch, twice where the cfg is not 1 (ComfyUI skips the uncond pass at cfg 1)."""
    try:
        cfg = float(getattr(guider, "cfg", 1.0))
    except (TypeError, ValueError):  # a guider whose cfg is not one number: counted as cond only
        cfg = 1.0
    return batch * (2 if activation_model.runs_uncond(cfg) else 1)


def _steps(sigmas) -> int | None:
    n = getattr(sigmas, "shape", None)
    return None if not n else max(0, int(n[-1]) - 1)


def _shares_schedule(noise, sigmas) -> bool:
    """Whether this model samples a share of a schedule another model samples the rest of."""
    if getattr(sigmas, "shape", None) and int(sigmas.shape[-1]) > 1 and float(sigmas[-1]) > 0:
        return True
    any_ = getattr(noise, "any", None)
    return any_ is not None and not bool(any_())


def shares_schedule(args, kwargs) -> bool:
    """:func:`_shares_schedule` of an ``outer_sample(noise, latent_image, sampler, sigmas, ...)`` call, to be read
    before the call runs (module docstring)."""
    return _shares_schedule(_arg(args, kwargs, 0, "noise"), _arg(args, kwargs, 3, "sigmas"))


def payback_for(guider, args, kwargs, kept: bool = False, shares: bool | None = None) -> Payback | None:
    """The compile payback of this OUTER_SAMPLE call, or None where the model runs eagerly, its compile scope
    cannot be read (then no cost is predicted), or the latent is not a video latent.  ``kept``: the pack keeps
    a compile file of this run for the next start (:func:`compile_cache.kept`); ``shares``: :func:`shares_schedule`
    as read before the call ran (None: read from ``args`` now)."""
    patcher = getattr(guider, "model_patcher", None)
    if patcher is None:
        return None
    scope = comfy_bridge.compile_scope(patcher, getattr(guider, "model_options", None))
    if scope is None or scope[0] == comfy_bridge.UNKNOWN_SCOPE:
        return None
    noise, sigmas = _arg(args, kwargs, 0, "noise"), _arg(args, kwargs, 3, "sigmas")
    shape = tuple(getattr(noise, "shape", ()))
    if len(shape) != 5:
        return None
    dims = comfy_bridge.wan_dims(patcher)
    tokens = activation_model.tokens(dims, int(shape[2]), int(shape[3]), int(shape[4]))
    streamed = bool(getattr(comfy_bridge.base_model(patcher), "model_lowvram", False))
    compiled_blocks = staged = None
    options = getattr(guider, "model_options", None)
    if comfy_bridge.compile_blocks_node(patcher, options):
        # Wan Compile Blocks: the blocks that ran the resident block's graph (resident, or streamed and lifted),
        # the staged graph, or eagerly; as counted while the model sampled, else as the model is loaded now
        ran = compile_blocks.blocks_ran(patcher, options)
        if ran is not None and ran.any_calls:
            counted = (ran.blocks["resident"] + ran.blocks["lifted"], ran.blocks["staged"])
        else:
            counted = compile_blocks.count_compiled_blocks(patcher) if streamed else None
        if counted is not None:
            if counted[0] + counted[1] == 0:
                return None  # every block ran eagerly: nothing ran compiled
            streamed, compiled_blocks, staged = False, counted[0] + counted[1], counted[1]
    if shares is None:
        shares = _shares_schedule(noise, sigmas)
    return compile_payback(dims, tokens, _rows(guider, int(shape[0])), _steps(sigmas),
                           whole_model=scope[0] == comfy_bridge.WHOLE_MODEL, streamed=streamed,
                           shared_by=2 if shares else 1, kept=kept,
                           compiled_blocks=compiled_blocks, staged_blocks=staged or 0)
