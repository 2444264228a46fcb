"""How an :class:`~.estimate.Estimate` is shown: :func:`summary` (the figures in GiB, for the route's JSON,
the node's outputs and the panel) and :func:`report` (the text table that ``wan-sage plan`` prints, the
node's ``report`` output shows and the server logs).  Every figure has one definition, here:

* activation peak: the largest phase of a block plus what persists across blocks;
* Sage extra: what Sage adds to that peak over SDPA (never negative);
* reservation: what ComfyUI is told to keep free per forward, under the policy, with weights resident or
  streamed, as the verdict finds;
* room for the VAE decode: what the Wan VAE decode after the sampling takes (what ComfyUI frees for it and the
  workspace of its largest convolution); on the legacy path the reservation in force is at least this where it
  fits, so the decode evicts none of the resident weights; where the model is unloaded for the decode when its
  sampling ends (its unload copies nothing back), the reservation keeps none of it;
* room for weights: the VRAM for this model minus what ComfyUI keeps free minus the reservation in force, so
  that weights minus room is what is offloaded.

:func:`compile_payback_line` and :func:`compile_payback_summary` word a :class:`~.compile_payback.Payback` (the Sage
patch's report and panel after a compiled sampling run).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from .compile_payback import Payback
from . import vae_decode
from .estimate import GiB, Estimate

__all__ = ["summary", "report", "memory_path_line", "per_rank_lines", "compile_payback_line", "compile_payback_summary",
           "DYNAMIC_LINE", "KERNEL_LINES", "KITCHEN_UNMEASURED_TEXT"]

KITCHEN_UNMEASURED_TEXT = "the FFN modelled from its structure, not measured, except its int8 kernel"
# The report's line for each of activation_model.KERNEL_SETS.
KERNEL_LINES = {
    "comfy-0.3.64": "kernels: ComfyUI 0.3.64's Wan kernels (eager RoPE, modulation and GELU), as the forward-peak "
                    "records measured them",
    "comfy-kitchen": "kernels: comfy-kitchen's fused RoPE and adaln, the FFN through linear_input_act (ComfyUI 0.38): "
                     "RoPE and modulation from the fused kernels' measured bytes (each allocates its output and "
                     "nothing more); " + KITCHEN_UNMEASURED_TEXT + " (int8 weights: the GELU's output quantised "
                     "in the down-projection, measured; the FFN's input stays alive through it); embedding, attention and "
                     "cross-attention as 0.3.64's",
}

DYNAMIC_LINE = "memory path: dynamic VRAM: ComfyUI evicts weights on demand, so wan-sage reserves nothing for their placement"
_FIT_WORDS = {"fits": "they fit with every weight resident",
              "offloads": "they fit with about {off:.1f} GiB of weights evicted",
              "cannot": "they do not fit even with every weight evicted"}


def memory_path_line(est: Estimate) -> str | None:
    """What the estimate does on this memory path, in one line (None where the adapter does not know it)."""
    s = est.setup
    batched = ""
    if est.reservation_batched_resident is not None:
        b = est.reservation_batched_partial if est.streamed else est.reservation_batched_resident
        batched = (f"; cond/uncond batching gets {b / GiB:.2f} GiB for the batched forward (ComfyUI batches when "
                   f"1.5 x that is free)")
    if s.dynamic_vram:
        fit = _FIT_WORDS.get(est.level, "the card is not known").format(off=est.offload_bytes / GiB)
        card = "" if s.vram_bytes is None else f" ({s.vram_bytes / GiB:.1f} GiB less {s.kept_free / GiB:.1f} GiB kept free)"
        return f"{DYNAMIC_LINE}; it checked the activations against the card{card}: {fit}{batched}"
    if s.legacy_reason:
        return (f"memory path: legacy ({s.legacy_reason}): the reservation of {est.reservation / GiB:.2f} GiB per "
                f"forward decides which weights stay on the GPU{batched}")
    return None


def _gib(x) -> float | None:
    return None if x is None else x / GiB


def summary(est: Estimate, notes: Sequence[str] = ()) -> dict:
    """The estimate's figures in GiB and its words: what the panel and the node's outputs show.  ``notes``: the
    caller's facts beyond the estimate's own notes (what it found on this machine), listed after them."""
    s = est.setup
    return {"tokens": est.tokens, "activation_gib": est.activation_peak / GiB, "sage_extra_gib": est.sage_extra / GiB,
            "reservation_gib": est.reservation / GiB, "comfy_gib": est.comfy_estimate / GiB,
            "decode_room_gib": est.decode_floor / GiB, "decode_unload_gib": est.decode_unload / GiB,
            "weights_gib": (s.weights_bytes or 0) / GiB, "vram_gib": _gib(s.vram_bytes),
            "kept_free_gib": s.kept_free / GiB, "room_for_weights_gib": _gib(est.room_for_weights),
            "offload_gib": est.offload_bytes / GiB, "streamed": est.streamed, "verdict": est.verdict,
            "level": est.level, "dominant_phase": est.terms["dominant_phase"], "policy": s.policy,
            "compiled": s.compiled, "sage_head_groups": est.sage_head_groups, "dynamic_vram": s.dynamic_vram,
            "kernel_set": s.kernel_set, "sage_advice": est.sage_advice, "memory_path": memory_path_line(est),
            "source": s.source, "notes": list(est.notes) + list(notes), "problems": list(est.problems),
            "per_rank": None if est.per_rank is None else dict(est.per_rank)}


def _g(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f} GiB"


def _attention(est: Estimate) -> str:
    a = est.setup.attention
    if a.self_by:
        cross = "SDPA" if a.cross_path == "sdpa" or a.kernel is None else a.kernel
        return f"{a.self_by} for self-attention (planned at SDPA's memory), {cross} for cross-attention"
    if a.kernel is None:
        return "SDPA"
    split = f" in {est.sage_head_groups} head groups (memory mode)" if est.sage_head_groups > 1 else ""
    return f"{a.kernel}{split} for self-attention, SDPA for cross-attention"


def _rows(est: Estimate) -> str:
    cfg = est.setup.cfg
    if est.rows_batched == est.rows_sequential:
        return f"{est.rows_sequential} (cfg {cfg:g}: no uncond pass)"
    return (f"{est.rows_sequential} assumed (cfg {cfg:g}: cond and uncond one after the other; "
            f"{est.rows_batched} when ComfyUI batches them)")


def report(est: Estimate, held: str | None = None, gpu: str | None = None, notes: Sequence[str] = ()) -> str:
    """The estimate as a text table.  ``held``: how the weights are held (fp16, fp8, q4_k ...);
    ``gpu``: the GPU's name when the VRAM figure is the card's; ``notes``: as for :func:`summary`."""
    s, d = est.setup, est.setup.dims
    res, par = est.resident, est.partial
    size = f" ({s.pixels[0]}x{s.pixels[1]}x{s.pixels[2]})" if s.pixels else ""
    lines = [f"Wan {d.model_type}, dim {d.dim} x {d.num_layers} layers, {d.num_heads} heads ({d.name}); "
             f"latent {list(s.latent)}{size}, cfg {s.cfg:g}"]
    if s.source:
        lines.append(f"model: {s.source}")
    lines.append(f"compute: {s.dtype}" + (f"; weights held as {held}" if held else "") + f"; attention: {_attention(est)}"
                 + ("; blocks compiled (torch.compile, each block its own graph)" if s.compiled else ""))
    lines.append(KERNEL_LINES[s.kernel_set])
    rows = [
        ("tokens per row", f"{est.tokens:,}", ""),
        ("rows per forward", _rows(est), ""),
        ("", "weights resident", "weights streamed"),
        ("activation peak", _g(res["phase_peak"] + res["persistent"]), _g(par["phase_peak"] + par["persistent"])),
        (f"  largest phase ({res['dominant_phase']})", _g(res["phase_peak"]), _g(par["phase_peak"])),
        ("  persistent (RoPE, context)", _g(res["persistent"]), _g(par["persistent"])),
        ("  of which Sage extra", _g(max(0, res["sage_extra"])), _g(max(0, par["sage_extra"]))),
        ("weight transients", _g(res["weight_transient"]), _g(par["weight_transient"])),
        ("streaming + fragmentation", _g(res["fragmentation"]), _g(par["fragmentation"])),
        ("allocator slack", _g(res["slack"]), _g(par["slack"])),
    ]
    if par.get("staged_block"):
        rows.append(("a streamed block's weights, compiled" if par.get("streamed_compiled")
                     else "compiled with a block staged, above eager", "", _g(par["staged_block"])))
    if s.margin_bytes:
        rows.append(("margin", _g(s.margin_bytes), _g(s.margin_bytes)))
    label = "reservation per forward" + ("" if s.policy.startswith("wan-sage") else f" ({s.policy})")
    rows.append((f"{label}, {est.rows_sequential} row{'s' if est.rows_sequential > 1 else ''}",
                 _g(est.reservation_resident), _g(est.reservation_partial)))
    if est.reservation_batched_resident is not None:
        rows.append((f"  cfg batched ({est.rows_batched} rows)", _g(est.reservation_batched_resident),
                     _g(est.reservation_batched_partial)))
    rows.append(("ComfyUI's own estimate", _g(est.comfy_estimate), ""))
    if est.decode_floor:
        rows.append((f"{vae_decode.vae_name(s.latent)} decode after sampling", _g(est.decode_floor), ""))
    elif est.decode_unload:
        rows.append((f"{vae_decode.vae_name(s.latent)} decode after sampling",
                     _g(est.decode_unload) + " (model unloaded first)", ""))
    if s.vram_bytes is not None:
        rows += [("VRAM for this model", _g(s.vram_bytes) + (f" ({gpu})" if gpu else ""), ""),
                 ("  kept free by ComfyUI", "- " + _g(s.kept_free), ""),
                 (f"  reservation in force (weights {'streamed' if est.streamed else 'resident'})",
                  "- " + _g(est.reservation), ""),
                 ("  room for weights", "= " + _g(est.room_for_weights), "")]
    rows.append(("weights", _g(s.weights_bytes), ""))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows if r[2])
    lines += [f"  {k:<{w0}}  {v1:<{w1}}  {v2}".rstrip() for k, v1, v2 in rows]
    lines += [f"problem: {p}" for p in est.problems]
    per = est.per_rank or {}
    if per.get("verdict"):  # several GPUs: what each rank needs decides; one GPU's verdict beside it
        lines.append(f"verdict: {per['verdict']} (per rank, {per['world_size']} ranks); on one GPU: {est.verdict}")
    else:
        lines.append(f"verdict: {est.verdict}")
    lines += [f"note: {n}" for n in (*est.notes, *notes)]
    if est.sage_advice:
        lines.append(est.sage_advice)
    path = memory_path_line(est)
    if path:
        lines.append(path)
    lines += per_rank_lines(est)
    return "\n".join(lines)


def per_rank_lines(est: Estimate) -> list:
    """The per-rank figures of a multi-GPU estimate (memory.parallel), as lines; empty on one GPU."""
    r = est.per_rank
    if not r:
        return []
    how = [f"Ulysses {r['ulysses']}", f"ring {r['ring']}"] + (["FSDP"] if r["fsdp"] else []) + (
        ["CFG parallel"] if r["cfg_parallel"] else [])
    ranks = f"{r['world_size']} rank{'s' if r['world_size'] != 1 else ''}"
    lines = [f"per rank ({ranks}: {', '.join(how)}; modelled, not measured on multiple GPUs):",
             f"  tokens per rank {r['tokens_per_rank']:,} of {r['tokens']:,}; attention: {r['heads_per_rank']} heads "
             f"over {r['attention_tokens']:,} tokens, {r['rows_per_rank']} row(s), {r['forwards_per_step']} "
             f"forward(s) per step",
             f"  activations of its slice {_g(r['activation_bytes'])}; all-to-all buffers {_g(r['all_to_all_bytes'])}; "
             f"attention call {_g(r['attention_bytes'])}; working memory {_g(r['working_bytes'])}"
             + (f" ({_g(r['streamed_working_bytes'])} with weights streamed)"
                if r.get("streamed_working_bytes", r["working_bytes"]) != r["working_bytes"] else "")]
    if r["weights_bytes"] is not None:
        held = "sharded, plus one block gathered" if r["fsdp"] else "all weights on every rank"
        lines.append(f"  weights {_g(r['weights_bytes'])} ({held}); total per rank {_g(r['total_bytes'])}")
    return lines


def compile_payback_line(p: Payback) -> str:
    """Compiling this model against running it eagerly, in one line: the compile cost in a fresh process, the
    step count per model at which it pays back, and the verdict for the steps this model samples."""
    if p.whole_model:
        graphs = "1 graph for the whole model"
    elif p.graphs > 1:
        graphs = f"weights streamed: up to {p.graphs} graphs, one per block"
    else:
        graphs = "1 graph for the blocks"
    if p.shared_by > 1:
        graphs += f", shared with the other model of this schedule: {p.compile_s / p.shared_by:.0f} s each"
    fresh = "a fresh process with the pack's compile file of this run" if p.kept else "a fresh process"
    line = (f"compile: about {p.compile_s:.0f} s to compile in {fresh} ({graphs}); saves about "
            f"{p.step_gain_s:.2f} s per step; pays back after {p.payback_steps} steps per model")
    if p.steps is None:
        return line + "; the steps of this run are not known"
    line = f"{line}; this model samples {p.steps}: {'compile pays back' if p.pays_back else 'run eager'}"
    if not p.pays_back and p.payback_prompt is not None:
        # one prompt does not pay it back; a process that runs several prompts of these steps may
        line += f" for one prompt; over one process's prompts of these steps it pays back by prompt {p.payback_prompt}"
    return line


def blocks_ran_line(blocks: dict, calls: dict, why: dict) -> str:
    """How the blocks of a model compiled by Wan Compile Blocks ran in one sampling, in one line: ``blocks`` and
    ``calls`` by path (``resident``, ``lifted``, ``staged``, ``eager``), ``why`` the eager calls by reason."""
    total = sum(blocks.values())
    compiled = total - blocks.get("eager", 0)
    kinds = [f"{blocks.get('resident', 0)} resident"]
    if blocks.get("lifted"):
        kinds.append(f"{blocks['lifted']} streamed, lifted into the resident block's graph")
    if blocks.get("staged"):
        kinds.append(f"{blocks['staged']} streamed, staged")
    line = f"Wan Compile Blocks: {compiled} of {total} blocks ran compiled ({', '.join(kinds)})"
    if blocks.get("eager"):
        line += f", {blocks['eager']} eagerly"
    eager_calls = calls.get("eager", 0)
    if eager_calls:
        reasons = sorted(why.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = "; ".join(f"{r} ({n})" for r, n in reasons[:3])
        more = f"; {len(reasons) - 3} more" if len(reasons) > 3 else ""
        line += f"; {eager_calls} of {sum(calls.values())} block calls ran eagerly: {shown}{more}"
    return line


def compile_payback_summary(p: Payback) -> dict:
    """The payback's figures, its verdict (``pays_back``: True, False, or None with the steps unknown) and its
    line, for the panel."""
    return {**asdict(p), "pays_back": p.pays_back, "text": compile_payback_line(p)}
