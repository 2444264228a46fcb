"""The working-memory estimate: activation peak, Sage extra, allocator fragmentation, verdict.

This is the one function the node's reservation, the CLI (``wan-sage plan``) and the server
route all call.  Constants that came from measurement (allocator slack, the partial-load
fragmentation factor) live in :data:`CALIBRATED`, next to where they were measured.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from . import activation_model
from ..attention import registry

__all__ = ["rounding_notes", "verdict_for", "EstimateRequest", "Estimate", "estimate", "activation_bytes", "comfy_estimate_bytes",
           "attention_paths", "attention_plan", "CALIBRATED", "GiB", "validate_request", "fragmentation_bytes",
           "SIZE_LIMITS", "CFG_LIMITS", "DEFAULT_CC", "sage_groups"]

GiB = 1 << 30
MiB = 1 << 20

# Constants set from H200 records (ComfyUI 0.3.64), each with the records it was set from and the ones
# that check it: the allocator/cuBLAS slack on top of the phase model, and the fragmentation terms
# (streamed layers and per-call weight casts under memory pressure) as multiples of the largest single
# activation block.  docs/memory-calibration.md renders the checks.
CALIBRATED = {
    # The cuBLAS workspace a process's first forward allocates (and a forward of a newly compiled
    # graph may allocate again), plus 1 % of the activations.  Set from the fit table
    # (memory/calibration/h200_forward.jsonl): its first row, the process's first forward, measured
    # 33.9 MiB above the phase model where the other rows measured 0.14 %.  Checked on the held-out
    # rows, except one that was seen before this value was set and so is not held out for it: TI2V-5B
    # compiled 832x480x161, which allocated 37 MiB in a later forward (docs/memory-calibration.md).
    "slack_fixed": 34 * MiB,
    # A margin, not a fit: the fit table's rows after the first measured about 0.14 % above the phase
    # model; 1 % covers that with room.  Checked on the held-out and compiled rows
    # (tests/unit/test_memory_calibration.py).
    "slack_rel": 0.01,
    # Weights partly offloaded: set with partial_fixed from the reference budget run
    # (docs/measurements/2026-11-29-reference-budget.jsonl, PyTorch's native allocator: the reservation
    # per row between out of memory and safe).  Checked on records it was not set from, the
    # partial-load benchmark and the GGUF end-to-end runs with streamed weights
    # (tests/unit/test_constants_held_out.py).
    "partial_frag_factor": 1.5,
    # Weights stored in another dtype than the compute dtype (fp8 checkpoints, cast per Linear call),
    # even when all are resident: the casts interleave with the activations and cudaMallocAsync's pool
    # keeps holes.  Measured end to end on the H200 (docs/benchmarks.md; fp8 A14B + rank-64 LoRA,
    # 1280x720x81, weights resident): peak reserved minus (weights + predicted working memory) was
    # 1.13-3.12 GiB over 16 completed expert samplings, and one sampling at a 24 GiB budget ran out of
    # memory holding 3.47 GiB of it (a lower bound).  The largest block there is 1.95 GiB, so the factor
    # is at least 1.78.  GGUF's dequantisation transient already covers its 0.4-0.7 GiB.  Weights in
    # the compute dtype (bf16 resident) make no casts and were not measured for it.
    "cast_frag_factor": 2.0,
    # Added to either fragmentation term; set and checked with partial_frag_factor above.
    "partial_fixed": 256 * MiB,
}

# ComfyUI keeps this much free on top of a model's reservation (EXTRA_RESERVED_VRAM, Linux).
COMFY_EXTRA_RESERVED = 400 * MiB

# The GPU assumed when none is given or found.
DEFAULT_CC = 90

# Bounds of the request sizes: (lowest, highest).  The CLI, the route and the estimate share them.
SIZE_LIMITS = {"width": (16, 16384), "height": (16, 16384), "frames": (1, 4097), "batch": (1, 64)}
CFG_LIMITS = (0.0, 100.0)


def attention_plan(attention: str, cc: int | None = None) -> tuple:
    """(self-attention path, cross-attention path, kernel name or None, note or None): the
    attention.kernel_bytes formulas the dispatcher's calls run on, for an --attention choice on
    compute capability ``cc`` (None: sm90).

    The candidates are the registry's :func:`~attention.registry.planned_candidates` (the arch's auto
    order for ``sage-auto``, none where no kernel runs there; the named kernel where it runs); the paths are the
    registry's :func:`~attention.registry.unmeasured_paths` over them, the rule the dispatcher
    applies to a shape with no timing: cross-attention on SDPA (reason ``cross_slower``),
    self-attention on the first candidate."""
    arch = cc or DEFAULT_CC
    if attention == "sdpa":
        return "sdpa", "sdpa", None, None
    if attention in ("sage-auto", "auto", "sage"):
        kernel = "auto"
    elif attention in registry.KERNELS:
        kernel = attention
    else:
        raise ValueError(f"attention must be sdpa, sage-auto or one of {', '.join(registry.KERNELS)}")
    names, why = registry.planned_candidates(kernel, arch)
    note = None if why is None else f"{why}: attention stays on SDPA"
    self_path, cross_path, name = registry.unmeasured_paths(names, arch)
    return self_path, cross_path, name, note


def attention_paths(attention: str, cc: int | None = None) -> tuple:
    """(self-attention path, cross-attention path) of :func:`attention_plan`."""
    self_path, cross_path, _name, _note = attention_plan(attention, cc)
    return self_path, cross_path


def comfy_estimate_bytes(dims: activation_model.WanDims, latent: tuple, dtype: str = "bf16", vace: bool = False) -> int:
    """ComfyUI 0.3.64's own figure: latent area x dtype bytes x 0.01 x dim/2222 MiB."""
    B, _C, T, H, W = latent
    factor = dims.dim / 2222 * (1.2 if vace else 1.0)
    return int(B * T * H * W * activation_model.DTYPE_BYTES[dtype] * 0.01 * factor * MiB)


def fragmentation_bytes(dims: activation_model.WanDims, w: activation_model.Workload, ws: activation_model.WeightSetup, partial: bool) -> int:
    """What the allocator holds above the allocated peak: streamed layers under partial loading
    (``partial_frag_factor``), per-call weight casts (``cast_frag_factor``), the larger of the two,
    as a multiple of the largest activation block plus a fixed part; 0 for resident weights in the
    compute dtype and for GGUF."""
    factor = max(CALIBRATED["partial_frag_factor"] if partial else 0.0,
                 CALIBRATED["cast_frag_factor"] if ws.casts_to(w.dtype) else 0.0)
    return int(factor * activation_model.largest_block(dims, w)) + CALIBRATED["partial_fixed"] if factor else 0


COMPILED_STREAMED_NOTE = ("weights partly offloaded: compiled blocks are reserved for as eager ones (streaming "
                          "under compile leaves the allocator holding more above the compiled peak; measured with "
                          "GGUF and fp8 weights)")


COMPILED_CAST_NOTE = ("weights cast at every layer call (fp8): compiled blocks are reserved for as eager ones (the "
                      "allocator's holes around the casts stay under compile; docs/memory-calibration.md, "
                      "\"Compiled blocks with cast weights\")")
COMPILED_AS_EAGER_NOTES = {"streamed": COMPILED_STREAMED_NOTE, "cast": COMPILED_CAST_NOTE}


def compiled_as_eager(w: activation_model.Workload, ws: activation_model.WeightSetup, partial: bool) -> str:
    """Why compiled blocks are reserved for as eager ones ("" where the compiled figure stands):

    * "streamed": their weights stream (partial loading), and ComfyUI casts each streamed weight inside
      the compiled graph.  Measured end to end with GGUF and fp8 weights (docs/memory-calibration.md,
      "Partly offloaded end to end"), within the eager reservation.
    * "cast": their weights are cast to the compute dtype at every layer call (fp8 checkpoints).  The
      allocator's holes around the casts are not smaller under compile: fully resident fp8 experts measured
      compiled per block held more than the compiled figure at 720p81 (the expert this rule was made from,
      and one it was not), and within the eager one on every expert it was not made from
      (docs/memory-calibration.md, "Compiled blocks with cast weights").
    The compiled figure itself comes from forwards with resident weights in the compute dtype."""
    if not w.compiled:
        return ""
    if ws.streamed or partial:
        return "streamed"
    return "cast" if ws.casts_to(w.dtype) else ""


def activation_bytes(dims: activation_model.WanDims, w: activation_model.Workload, ws: activation_model.WeightSetup | None = None,
                     partial: bool = False) -> dict:
    """Peak bytes of one forward with ``w.rows`` rows, split into named terms.  Compiled blocks count
    as eager where :func:`compiled_as_eager` says why ("compiled_as_eager" in the result)."""
    ws = ws or activation_model.WeightSetup()
    as_eager = compiled_as_eager(w, ws, partial)
    if as_eager:
        w = replace(w, compiled=False)
    phase, pers, top = activation_model.forward_peak(dims, w)
    base = phase + pers
    sdpa_w = replace(w, self_attn="sdpa", cross_attn="sdpa")
    sdpa_phase, sdpa_pers, _ = activation_model.forward_peak(dims, sdpa_w)
    transient = activation_model.weight_transient(dims, replace(ws, streamed=ws.streamed or partial), w.dtype)
    slack = CALIBRATED["slack_fixed"] + int(CALIBRATED["slack_rel"] * base)
    frag = fragmentation_bytes(dims, w, ws, partial)
    total = base + transient + slack + frag
    return {
        "phase_peak": phase, "dominant_phase": top, "persistent": pers,
        "sage_extra": (phase + pers) - (sdpa_phase + sdpa_pers),
        "weight_transient": transient, "slack": slack, "fragmentation": frag, "total": total,
        "compiled_as_eager": as_eager,
    }


@dataclass(frozen=True)
class EstimateRequest:
    dims: activation_model.WanDims
    width: int
    height: int
    frames: int
    batch: int = 1
    cfg: float = 1.0
    dtype: str = "bf16"
    attention: str = "sdpa"
    cc: int | None = None
    vram_bytes: int | None = None  # what the model may use: free VRAM plus evictable models
    weights_bytes: int | None = None
    weights: activation_model.WeightSetup = field(default_factory=activation_model.WeightSetup)
    img_tokens: int = 0
    vace_streams: int = 0
    per_frame_timesteps: bool = False
    margin_bytes: int = 0
    reserved_bytes: int = COMFY_EXTRA_RESERVED
    compiled: bool = False  # the model's blocks run under torch.compile
    sage_grouped: bool = False  # the Sage patch splits self-attention into its memory mode's head groups


def validate_request(r: EstimateRequest) -> None:
    """Clear errors for impossible sizes; each names the field and the allowed range."""
    for name, (lo, hi) in SIZE_LIMITS.items():
        val = getattr(r, name)
        if not isinstance(val, int) or isinstance(val, bool):
            raise ValueError(f"{name} must be an integer, got {val!r:.40}")
        if not lo <= val <= hi:
            raise ValueError(f"{name} must be between {lo} and {hi}, got {val:.3g}" if abs(val) >= 1e6 else
                             f"{name} must be between {lo} and {hi}, got {val}")
    lo, hi = CFG_LIMITS
    if isinstance(r.cfg, bool) or not isinstance(r.cfg, (int, float)) or not lo <= r.cfg <= hi:
        raise ValueError(f"cfg must be a number between {lo:g} and {hi:g}, got {r.cfg!r:.40}")
    if r.dtype not in activation_model.DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(activation_model.DTYPE_BYTES)}, got {r.dtype!r:.40}")
    if r.vram_bytes is not None and r.vram_bytes <= 0:
        raise ValueError(f"vram must be positive, got {r.vram_bytes / GiB:.2f} GiB")
    if r.margin_bytes < 0:
        raise ValueError("margin must be >= 0")


@dataclass(frozen=True)
class Estimate:
    request: dict
    latent: tuple
    tokens: int
    rows_sequential: int
    rows_batched: int
    resident: dict  # activation terms, weights fully resident, rows_sequential rows
    partial: dict  # the same with weights partly offloaded
    reservation_resident: int
    reservation_partial: int
    reservation_batched_resident: int | None  # the same for cond and uncond batched (rows_batched rows)
    reservation_batched_partial: int | None  # None when cfg 1 leaves one row per sample
    comfy_estimate: int
    weights_bytes: int | None
    vram_bytes: int | None
    verdict: str
    offload_bytes: int
    notes: tuple

    def as_dict(self) -> dict:
        d = asdict(self)
        d["latent"] = list(self.latent)
        return d


def rounding_notes(dims: activation_model.WanDims, width: int, height: int, frames: int) -> list:
    """How ComfyUI's Wan latent nodes round these pixel sizes, in words (empty when exact)."""
    notes = []
    st, sh, sw = dims.vae_stride
    if (frames - 1) % st:
        used = (frames - 1) // st * st + 1
        notes.append(f"frames {frames} is not of the form {st}n+1: the latent keeps {used} frames' worth "
                     f"((frames-1)//{st}+1 latent frames), as ComfyUI's Wan latent nodes do")
    for name, px, s in (("width", width, sw), ("height", height, sh)):
        if px % s:
            notes.append(f"{name} {px} is not a multiple of {s}: the latent covers {px // s * s} px "
                         f"(ComfyUI floors to the VAE stride)")
        elif (px // s) % 2:
            notes.append(f"{name} {px} gives an odd latent size; the DiT pads it to the 2x2 patch")
    return notes


# What a reservation with streamed weights holds, in the order of the CLI's table.
WORKING_MEMORY_PARTS = "activations, weight transients, streaming, fragmentation and allocator slack"


def verdict_for(weights: int, resident_need: int, partial_need: int, room: int, margin: int = 0) -> tuple:
    """(verdict text, bytes of weights offloaded) for a model given the VRAM ``room`` it may use.
    ``resident_need`` and ``partial_need`` are the reservations (working memory plus ``margin``)
    with every weight resident and with weights streamed."""
    if weights + resident_need <= room:
        return "fits: all weights resident", 0
    if partial_need <= room:
        off = weights - (room - partial_need)
        return f"offloads {off / GiB:.1f} GiB of weights", off
    parts = WORKING_MEMORY_PARTS + (" plus the margin" if margin else "")
    # The streamed reservation is an upper bound (its fragmentation term is set for the worst records), so
    # below it a run may still complete: the verdict says what is reserved, not what the run will need.
    return (f"cannot fit its reservation even fully offloaded: reserves {partial_need / GiB:.1f} GiB of working memory "
            f"({parts}), {max(room, 0) / GiB:.1f} GiB available; every weight streams and sampling may run out of "
            "memory"), weights


def sage_groups(dims: activation_model.WanDims, self_path: str, rows: int, tokens: int, dtype: str) -> int:
    """The head groups the Sage patch's memory mode splits a self-attention call of this forward into
    (1 for SDPA): the same rule the dispatcher applies, from attention.head_groups."""
    if self_path == "sdpa":
        return 1
    from ..attention.head_groups import head_groups
    from ..attention.kernel_bytes import AttnShape
    e = activation_model.DTYPE_BYTES[dtype]
    shape = AttnShape(rows, dims.num_heads, tokens, tokens, dims.head_dim, e, None, True)
    return head_groups(self_path, shape, "sdpa").groups


def _reservations(dims, r: EstimateRequest, w: activation_model.Workload) -> tuple:
    res = activation_bytes(dims, w, r.weights, partial=False)
    par = activation_bytes(dims, w, r.weights, partial=True)
    return res, par, res["total"] + r.margin_bytes, par["total"] + r.margin_bytes


def estimate(r: EstimateRequest) -> Estimate:
    validate_request(r)
    dims = r.dims
    latent = activation_model.latent_shape(dims, r.width, r.height, r.frames, r.batch)
    _, _C, T, H, W = latent
    L = activation_model.tokens(dims, T, H, W)
    self_p, cross_p, _kernel, attention_note = attention_plan(r.attention, r.cc)
    rows_seq = r.batch
    rows_bat = r.batch * (2 if r.cfg != 1.0 else 1)
    groups = sage_groups(dims, self_p, rows_seq, L, r.dtype) if r.sage_grouped else 1
    w = activation_model.Workload(L=L, rows=rows_seq, dtype=r.dtype, self_attn=self_p, cross_attn=cross_p,
                   img_tokens=r.img_tokens, per_frame_timesteps=T if r.per_frame_timesteps else 0,
                   vace_streams=r.vace_streams, latent_elems_per_row=activation_model.latent_elems(latent),
                   compiled=r.compiled, self_attn_groups=groups)
    res, par, res_r, par_r = _reservations(dims, r, w)
    bat_res = bat_par = None
    if rows_bat != rows_seq:
        _res, _par, bat_res, bat_par = _reservations(dims, r, activation_model.with_rows(w, rows_bat))
    comfy = comfy_estimate_bytes(dims, latent, r.dtype, vace=r.vace_streams > 0)
    verdict, offload = "unknown (no VRAM given)", 0
    if r.vram_bytes is not None and r.weights_bytes is not None:
        verdict, offload = verdict_for(r.weights_bytes, res_r, par_r, r.vram_bytes - r.reserved_bytes, r.margin_bytes)
    elif r.vram_bytes is not None:
        verdict = "fits" if par_r <= r.vram_bytes - r.reserved_bytes else "cannot fit its reservation even fully offloaded"
    notes = rounding_notes(dims, r.width, r.height, r.frames) + ([attention_note] if attention_note else [])
    eager_whys = [res["compiled_as_eager"]] + ([par["compiled_as_eager"]] if not verdict.startswith("fits") else [])
    notes += [COMPILED_AS_EAGER_NOTES[why] for why in dict.fromkeys(eager_whys) if why]
    return Estimate(
        request={"model": dims.name, "width": r.width, "height": r.height, "frames": r.frames,
                 "batch": r.batch, "cfg": r.cfg, "dtype": r.dtype, "attention": r.attention,
                 "kernel": _kernel, "cc": r.cc or DEFAULT_CC, "compiled": r.compiled,
                 "sage_head_groups": groups},
        latent=latent, tokens=L, rows_sequential=rows_seq, rows_batched=rows_bat,
        resident=res, partial=par, reservation_resident=res_r, reservation_partial=par_r,
        reservation_batched_resident=bat_res, reservation_batched_partial=bat_par,
        comfy_estimate=comfy, weights_bytes=r.weights_bytes, vram_bytes=r.vram_bytes,
        verdict=verdict, offload_bytes=max(0, offload), notes=tuple(notes))
