"""The working-memory estimate of a Wan denoise: :func:`plan` is its one entry point.

The node (from the loaded model and the real latent), the server route (from a JSON body) and
``wan-sage plan`` (from its flags) each build a :class:`Setup` and call :func:`plan` once; it returns
an :class:`Estimate`: the activation peak by term, with weights resident and with weights streamed,
the reservation ComfyUI is told under the chosen policy, ComfyUI's own figure, the verdict for the
VRAM the model may use, and the notes and problems to show.  :mod:`.report` words it, once for all
three.  Constants set from measurements live in :data:`CALIBRATED`, each naming its record file.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from . import activation_model, parallel, vae_decode
from .activation_model import WanDims, WeightSetup
from .parallel import Parallel
from ..attention import registry

__all__ = ["Setup", "AttentionPlan", "Estimate", "plan", "attention_plan", "activation_bytes", "comfy_figure",
           "fragmentation_bytes", "compiled_as_eager", "sage_groups", "rounding_notes", "latent_problems",
           "verdict_for", "sage_mode_advice", "CALIBRATED", "COMFY_EXTRA_RESERVED", "DEFAULT_CC", "POLICIES", "GiB", "MiB"]

GiB = 1 << 30
MiB = 1 << 20

# Constants set from H200 records (ComfyUI 0.3.64), each with the records it was set from and the ones
# that check it: the allocator/cuBLAS slack on top of the phase model, and the fragmentation terms
# (streamed layers and per-call weight casts under memory pressure) as multiples of the largest single
# activation block.  docs/memory-model.md renders the checks.
CALIBRATED = {
    # The cuBLAS workspace a process's first forward allocates (and a forward of a newly compiled
    # graph may allocate again), plus 1 % of the activations.  Set from the fit table
    # (bench/records/forward-peaks/fit.jsonl): its first row, the process's first forward, measured
    # 33.9 MiB above the phase model where the other rows measured 0.14 %.  Checked on the held-out
    # rows, except one that was seen before this value was set and so is not held out for it: TI2V-5B
    # compiled 832x480x161, which allocated 37 MiB in a later forward (docs/memory-model.md).
    "slack_fixed": 34 * MiB,
    # A margin, not a fit: the fit table's rows after the first measured about 0.14 % above the phase
    # model; 1 % covers that with room.  Checked on the held-out and compiled rows
    # (bench/tests/test_forward_peaks_band.py).
    "slack_rel": 0.01,
    # Weights partly offloaded: set with partial_fixed from the reference budget run
    # (bench/records/partial-load/reference-budget.jsonl, PyTorch's native allocator: the reservation
    # per row between out of memory and safe).  Checked on records it was not set from, the
    # partial-load benchmark and the GGUF end-to-end runs with streamed weights
    # (bench/tests/test_constants_held_out.py).
    "partial_frag_factor": 1.5,
    # Weights stored in another dtype than the compute dtype (fp8 checkpoints, cast per Linear call),
    # even when all are resident: the casts interleave with the activations and cudaMallocAsync's pool
    # keeps holes.  Set from bench/records/e2e/fp8-24gib-full-card.jsonl (fp8 A14B + rank-64 LoRA,
    # 1280x720x81, weights resident): peak reserved minus (weights + predicted working memory) was
    # 1.13-3.12 GiB over 16 completed expert samplings, and one sampling at a 24 GiB budget ran out of
    # memory holding 3.47 GiB of it (a lower bound).  The largest block there is 1.95 GiB, so the factor
    # is at least 1.78.  GGUF's dequantisation transient already covers its 0.4-0.7 GiB.  Weights in
    # the compute dtype (bf16 resident) make no casts and were not measured for it.
    "cast_frag_factor": 2.0,
    # Added to either fragmentation term; set and checked with partial_frag_factor above.
    "partial_fixed": 256 * MiB,
    # GGUF weights partly offloaded, blocks run eagerly: what the allocator holds for the streamed layers
    # above the reservation with the streamed weight transient, in dequantised copies (compute dtype) of the
    # largest Linear.  ComfyUI-GGUF dequantises a streamed layer where it runs, so the partial-load term (set
    # for bf16 layers copied whole, PyTorch's native allocator) over-reserves it.  Set from the 20 eager
    # streamed experts of bench/records/e2e/gguf-budgets-*.jsonl (A14B Q4_K_M, 1280x720x81, 832x480x81 and
    # 832x1472x49 at 16 to 8 GiB): the most any held above that reservation was 0.31 GiB, 2.38 copies of
    # A14B's 0.132 GiB FFN, rounded up to whole copies.  Checked on the streamed experts of the whole-prompt
    # records, which it was not set from (bench/tests/test_constants_held_out.py).  Compiled blocks that
    # stream keep the partial-load term: they held up to 1.8 GiB more than eager ones in the same files.
    "gguf_stream_copies": 3,
}

# ComfyUI keeps this much free on top of a model's reservation (EXTRA_RESERVED_VRAM, Linux).
COMFY_EXTRA_RESERVED = 400 * MiB

# The GPU assumed when none is given or found.
DEFAULT_CC = 90

# Where the decode's room is capped at what fits beside every weight, this much stays between the two: ComfyUI
# places the weights against its free memory when it loads them, after the estimate, and what the sampling
# allocates in between (latent, noise, conditioning: tens of MiB for Wan 2.x at 1280x720x81) must not tip the
# last modules into streaming, which makes every load and unload of the model a partial one.
PLACEMENT_SLACK = 256 * MiB

# What ComfyUI is told to reserve per forward: wan-sage's estimate (plus the margin), the larger of it and
# ComfyUI's own figure, or a fixed amount per row.
POLICIES = ("wan-sage estimate", "max(wan-sage, ComfyUI)", "fixed GiB per row")


@dataclass(frozen=True)
class AttentionPlan:
    """The kernel_bytes formulas a forward's attention calls run on (:mod:`attention.kernel_bytes`),
    the self-attention kernel (None: SDPA), and a note when Sage was asked for but stays off."""

    self_path: str = "sdpa"
    cross_path: str = "sdpa"
    kernel: str | None = None
    note: str | None = None
    self_by: str | None = None  # another node runs self-attention (e.g. KJNodes' Mem Eff Sage), in words


def attention_plan(attention: str, cc: int | None = None, tokens: int | None = None,
                   installed: tuple | None = None, head_dim: int | None = None) -> AttentionPlan:
    """The attention of a forward for an ``attention`` choice (``sdpa``, ``sage-auto``/``auto`` or a
    registry kernel) on compute capability ``cc`` (None: sm90), before any shape is timed.

    The candidates are the registry's :func:`~attention.registry.planned_candidates` (the arch's auto
    order for ``sage-auto``; the named kernel where it runs), and the paths the registry's
    :func:`~attention.registry.unmeasured_paths` over them: cross-attention on SDPA, self-attention on
    the first candidate, as the dispatcher runs a shape it has not timed.  ``tokens`` (the self-attention
    length) leaves out the kernels whose registry token limit that length exceeds on ``cc``.
    ``installed``: for ``sage-auto``, the kernels installed on this GPU in its auto order (the node reads
    them), which take the place of the arch's whole order where any of them serves the call.  ``head_dim``
    leaves out the kernels that do not run the model's head dim (the dispatcher runs those calls on SDPA)."""
    arch = cc or DEFAULT_CC
    if attention == "sdpa":
        return AttentionPlan()
    if attention in ("sage-auto", "auto", "sage"):
        kernel = "auto"
    elif attention in registry.KERNELS:
        kernel = attention
    else:
        raise ValueError(f"attention must be sdpa, sage-auto or one of {', '.join(registry.KERNELS)}")
    names, why = registry.planned_candidates(kernel, arch, tokens)
    if kernel == "auto" and installed is not None:
        names = registry.within_limits(installed, arch, tokens) or names
    if head_dim is not None and names:
        runs = tuple(n for n in names if registry.KERNELS[n].head_dim_ok(head_dim))
        if not runs:
            why = f"{', '.join(names)} do{'es' if len(names) == 1 else ''} not run head dim {head_dim}"
        names = runs
    self_path, cross_path, name = registry.unmeasured_paths(names, arch, tokens)
    return AttentionPlan(self_path, cross_path, name,
                         f"{why}: attention stays on SDPA" if why is not None and not names else None)


def comfy_figure(dims: WanDims, latent: tuple, dtype: str = "bf16", flash: bool = True) -> int:
    """ComfyUI's own working-memory figure for a Wan latent ``[B, C, T, H, W]`` (``BaseModel.memory_required``):
    ``B*T*H*W`` x ``0.01 x dtype bytes`` MiB with PyTorch's flash attention (or xformers; ``flash``), else
    ``x 0.15`` MiB, times Wan's ``memory_usage_factor`` (dim / 2222, x 1.2 for VACE)."""
    B, _C, T, H, W = (int(x) for x in latent[:5])
    factor = dims.dim / 2222 * (1.2 if dims.vace_layers else 1.0)
    per_elem = activation_model.DTYPE_BYTES[dtype] * 0.01 if flash else 0.15
    return int(B * T * H * W * per_elem * factor * MiB)


def fragmentation_bytes(dims: activation_model.WanDims, w: activation_model.Workload, ws: activation_model.WeightSetup,
                        partial: bool, compiled: bool = False) -> int:
    """What the allocator holds above the allocated peak: streamed layers under partial loading
    (``partial_frag_factor``), per-call weight casts (``cast_frag_factor``), the larger of the two,
    as a multiple of the largest activation block plus a fixed part; 0 for resident weights in the
    compute dtype and for resident GGUF.  GGUF layers streamed by eager blocks get ``gguf_stream_copies``
    dequantised copies of the largest Linear instead; ``compiled``: the model runs under some
    torch.compile (per block, the whole model, or a scope not known), where streamed GGUF keeps the
    partial-load term."""
    if partial and ws.gguf and not compiled:
        return int(CALIBRATED["gguf_stream_copies"] * activation_model.DTYPE_BYTES[w.dtype] * dims.dim * dims.ffn_dim)
    factor = max(CALIBRATED["partial_frag_factor"] if partial else 0.0,
                 CALIBRATED["cast_frag_factor"] if ws.casts_to(w.dtype) else 0.0)
    return int(factor * activation_model.largest_block(dims, w)) + CALIBRATED["partial_fixed"] if factor else 0


COMPILED_STREAMED_NOTE = ("weights partly offloaded: compiled blocks are reserved for as eager ones (streaming "
                          "under compile leaves the allocator holding more above the compiled peak; measured with "
                          "GGUF and fp8 weights)")


COMPILED_CAST_NOTE = ("weights cast at every layer call (fp8): compiled blocks are reserved for as eager ones (the "
                      "allocator's holes around the casts stay under compile; docs/memory-model.md, "
                      "\"Compiled blocks with cast weights\")")
COMPILED_AS_EAGER_NOTES = {"streamed": COMPILED_STREAMED_NOTE, "cast": COMPILED_CAST_NOTE}


def compiled_as_eager(w: activation_model.Workload, ws: activation_model.WeightSetup, partial: bool) -> str:
    """Why compiled blocks are reserved for as eager ones ("" where the compiled figure stands):

    * "streamed": their weights stream (partial loading), and ComfyUI casts each streamed weight inside
      the compiled graph.  Measured end to end with GGUF and fp8 weights (docs/memory-model.md,
      "Partly offloaded end to end"), within the eager reservation.
    * "cast": their weights are cast to the compute dtype at every layer call (fp8 checkpoints).  The
      allocator's holes around the casts are not smaller under compile: fully resident fp8 experts measured
      compiled per block held more than the compiled figure at 720p81 (the expert this rule was made from,
      and one it was not), and within the eager one on every expert it was not made from
      (docs/memory-model.md, "Compiled blocks with cast weights"; made from
      bench/records/e2e/fp8-compiled-24gib.jsonl, checked on fp8-compiled-cast-rule-check.jsonl).
    The compiled figure itself comes from forwards with resident weights in the compute dtype."""
    if not w.compiled:
        return ""
    if ws.streamed or partial:
        return "streamed"
    return "cast" if ws.casts_to(w.dtype) else ""


def activation_bytes(dims: activation_model.WanDims, w: activation_model.Workload, ws: activation_model.WeightSetup | None = None,
                     partial: bool = False, other_compile: bool = False) -> dict:
    """Peak bytes of one forward with ``w.rows`` rows, split into named terms.  Compiled blocks count
    as eager where :func:`compiled_as_eager` says why ("compiled_as_eager" in the result).
    ``other_compile``: a compile other than per block runs the model (planned as eager; see
    :func:`fragmentation_bytes`)."""
    ws = ws or activation_model.WeightSetup()
    compiled = w.compiled or other_compile
    as_eager = compiled_as_eager(w, ws, partial)
    if as_eager:
        w = replace(w, compiled=False)
    phase, pers, top = activation_model.forward_peak(dims, w)
    base = phase + pers
    sdpa_w = replace(w, self_attn="sdpa", cross_attn="sdpa")
    sdpa_phase, sdpa_pers, _ = activation_model.forward_peak(dims, sdpa_w)
    transient = activation_model.weight_transient(dims, replace(ws, streamed=ws.streamed or partial), w.dtype,
                                                  tokens=w.rows * w.L)
    slack = CALIBRATED["slack_fixed"] + int(CALIBRATED["slack_rel"] * base)
    frag = fragmentation_bytes(dims, w, ws, partial, compiled)
    total = base + transient + slack + frag
    return {
        "phase_peak": phase, "dominant_phase": top, "persistent": pers,
        "sage_extra": (phase + pers) - (sdpa_phase + sdpa_pers),
        "weight_transient": transient, "slack": slack, "fragmentation": frag, "total": total,
        "compiled_as_eager": as_eager,
    }


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


def latent_problems(dims: WanDims, latent: tuple) -> list:
    """What makes this latent wrong for this model, in words (empty when it fits): its channel count."""
    channels = int(latent[1])
    if channels == dims.latent_channels:
        return []
    fix = ("a 48-channel latent node (Wan22ImageToVideoLatent) or a 16-channel model"
           if dims.latent_channels == 48 else
           "a 16-channel latent node (EmptyHunyuanLatentVideo) or a 48-channel model (Wan 2.2 TI2V-5B)")
    return [f"the latent has {channels} channels but {dims.name} takes {dims.latent_channels}: use {fix}"]


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


@dataclass(frozen=True)
class Setup:
    """Everything one estimate depends on, built by an adapter (the node, the route, the CLI)."""

    dims: WanDims
    latent: tuple  # [B, C, T, H, W] of the latent the sampler gets
    dtype: str = "bf16"  # compute dtype
    cfg: float = 1.0  # not 1: an uncond pass, batched with cond (2B rows) when ComfyUI finds room
    attention: AttentionPlan = AttentionPlan()
    sage_grouped: bool = False  # the Sage patch runs self-attention in its memory mode's head groups
    compiled: bool = False  # the transformer blocks run under torch.compile, each its own graph
    weights: WeightSetup = field(default_factory=WeightSetup)
    weights_bytes: int | None = None
    vram_bytes: int | None = None  # VRAM the model may use: free plus evictable models, or the card
    kept_free: int = COMFY_EXTRA_RESERVED  # what ComfyUI keeps free on top of the reservation
    margin_bytes: int = 0  # added to wan-sage's estimate per forward
    policy: str = POLICIES[0]
    fixed_bytes: int = 10 * GiB  # per row, for the fixed policy
    streamed: bool | None = None  # weights streamed; None: as the verdict for vram_bytes finds
    img_tokens: int = 0
    per_frame_timesteps: bool = False
    vace_streams: int = 0
    comfy_flash: bool = True  # ComfyUI's own figure with PyTorch's flash attention (its CUDA default)
    dynamic_vram: bool = False  # ComfyUI manages this model's residency itself (dynamic VRAM)
    kernel_set: str = activation_model.KERNEL_SETS[0]  # Wan's elementwise kernels (activation_model.KERNEL_SETS)
    # Wan's self-attention hands q over to the Sage patch (ComfyUI's attention containers, or the patch's own
    # forward where ComfyUI has none: nodes/handover.py) and the kernel's write-into-q pieces are installed, so
    # an eager Sage call writes its output into q.  The node sets it from what it finds; the route and the CLI
    # plan without it (the ordinary path holds more, so their plan never falls short).
    q_handed_over: bool = False
    # A compile other than per block runs the model (ComfyUI's TorchCompileModel on the whole model, or a
    # compile whose scope wan-sage cannot read): planned as eager, but streamed GGUF weights keep the
    # partial-load term (fragmentation_bytes).
    other_compile: bool = False
    # The pack's Wan Compile Blocks node runs the model: a block whose weights stream runs compiled with its
    # Linears' weights cast onto the GPU first (nodes/staged_blocks.py), or eagerly where it cannot be staged.
    # Where the weights stream, the forward is planned as the larger of the eager one (streamed GGUF included,
    # fragmentation_bytes) and the compiled one holding a block's staged weights (staged_block_bytes).
    streamed_blocks_staged: bool = False
    # How Wan Compile Blocks has run this model's streamed blocks (the node's count in this process, else what an
    # earlier sampling of the model's kind kept in the pack's cache folder, nodes/streamed_record.py):
    # "" none yet, or one ran eagerly: planned as above; "lifted": every streamed call ran in the resident block's
    # graph, with the block's weights copied onto the GPU as stored (lifted_block_bytes); "staged": some ran the
    # staged graph, with the block's weights in the compute dtype (staged_block_bytes).  Either of those two: the
    # compiled forward plus that one block's weights, with no eager floor (no block of the model runs eagerly).
    streamed_blocks_ran: str = ""
    legacy_reason: str | None = None  # why the reservation places the weights (the legacy path), when known
    # A Wan VAE decode of this latent follows the sampling, in a dtype of this many bytes: on the legacy path the
    # reservation in force keeps the room the decode takes (memory.vae_decode), so the decode evicts none of the
    # weights kept resident.  None: not planned (the cond/uncond batching test, a caller that says so).
    decode_dtype_size: int | None = None
    # The model is unloaded when its sampling ends wherever the decode's room is not free then, and that unload
    # copies nothing back (the node keeps the weights' host copies, nodes/host_copy.py): the reservation in force
    # keeps no room for the decode, and the weights use it while the model samples.
    decode_by_unload: bool = False
    sage_memory_mode: str | None = None  # the Sage patch's memory mode ("sdpa", "fastest"); None: not known
    pixels: tuple | None = None  # (width, height, frames) the latent was made from, for rounding notes
    source: str = ""  # where the model's dims came from, in words
    notes: tuple = ()  # the adapter's facts to show (weights, compile, the model file)
    parallel: Parallel = Parallel()  # multi-GPU degrees (Raylight's Ulysses, ring, FSDP, CFG parallel)

    def with_latent(self, latent) -> "Setup":
        """The same setup for another latent shape (ComfyUI asks per batch of rows)."""
        return replace(self, latent=tuple(int(x) for x in latent[:5]), pixels=None)


@dataclass(frozen=True)
class Estimate:
    setup: Setup
    tokens: int  # per row
    rows_sequential: int  # rows per forward when cond and uncond run one after the other
    rows_batched: int  # rows when ComfyUI batches them
    resident: dict  # activation_bytes with every weight resident
    partial: dict  # the same with weights streamed
    reservation_resident: int  # ComfyUI's reservation per forward under the policy, weights resident
    reservation_partial: int
    reservation_batched_resident: int | None  # the same for cond and uncond batched; None at cfg 1
    reservation_batched_partial: int | None
    comfy_estimate: int  # ComfyUI's own figure for the same forward
    streamed: bool  # the reservation in force is the one with weights streamed
    verdict: str
    level: str  # "fits", "offloads", "cannot" or "unknown"
    offload_bytes: int
    sage_head_groups: int
    notes: tuple
    problems: tuple  # what makes the setup wrong (e.g. a latent of another channel count)
    sage_advice: str | None = None  # the Sage memory mode that avoids running out of memory, when it matters
    decode_floor: int = 0  # the room kept for the VAE decode after the sampling (memory.vae_decode); 0: none
    # The room the VAE decode takes where the model is unloaded for it when its sampling ends
    # (Setup.decode_by_unload, with the weights kept resident not leaving it free); 0: no unload planned
    decode_unload: int = 0
    per_rank: dict | None = None  # one rank's figures under s.parallel (memory.parallel.per_rank); None: one GPU

    @property
    def terms(self) -> dict:
        """The activation terms of the reservation in force."""
        return self.partial if self.streamed else self.resident

    @property
    def reservation(self) -> int:
        """What ComfyUI is told to keep free per forward of ``rows_sequential`` rows: the working memory of the
        forward, or the room the VAE decode after the sampling takes where that is more (:attr:`decode_floor`)."""
        return max(self.reservation_partial if self.streamed else self.reservation_resident, self.decode_floor)

    @property
    def activation_peak(self) -> int:
        """The predicted activation peak of one forward: its largest phase plus what persists across blocks."""
        return self.terms["phase_peak"] + self.terms["persistent"]

    @property
    def sage_extra(self) -> int:
        """What Sage adds to the peak over SDPA (0 where it needs no more, e.g. grouped under compile)."""
        return max(0, self.terms["sage_extra"])

    @property
    def room_for_weights(self) -> int | None:
        """VRAM left for weights once ComfyUI's kept-free memory and the reservation are taken."""
        if self.setup.vram_bytes is None:
            return None
        return max(0, self.setup.vram_bytes - self.setup.kept_free - self.reservation)

    def as_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "setup"}
        s = self.setup
        d["request"] = {"model": s.dims.name, "latent": list(s.latent), "cfg": s.cfg, "dtype": s.dtype,
                        "kernel": s.attention.kernel, "self_attention": s.attention.self_path,
                        "cross_attention": s.attention.cross_path, "compiled": s.compiled,
                        "sage_head_groups": self.sage_head_groups, "policy": s.policy,
                        "weights_bytes": s.weights_bytes, "vram_bytes": s.vram_bytes, "kept_free": s.kept_free,
                        "margin_bytes": s.margin_bytes, "dynamic_vram": s.dynamic_vram,
                        "kernel_set": s.kernel_set, "ulysses": s.parallel.ulysses, "ring": s.parallel.ring,
                        "fsdp": s.parallel.fsdp, "cfg_parallel": s.parallel.cfg_parallel}
        d["reservation"] = self.reservation
        return d


def _policy_need(s: Setup, ours: int, comfy: int, rows: int) -> int:
    if s.policy == POLICIES[2]:
        return s.fixed_bytes * rows
    if s.policy == POLICIES[1]:
        return max(ours, comfy)
    return ours


def staged_block_bytes(dims: activation_model.WanDims, dtype: str) -> int:
    """One transformer block's Linear weights and biases in the compute dtype: what a streamed block that Wan
    Compile Blocks runs compiled holds for its call (nodes/staged_blocks.py)."""
    d, f = dims.dim, dims.ffn_dim
    params = 8 * d * d + 2 * d * f + 9 * d + f
    if dims.has_img_emb:
        params += 2 * d * d + 2 * d
    return activation_model.DTYPE_BYTES[dtype] * params


def lifted_block_bytes(dims: activation_model.WanDims, ws: activation_model.WeightSetup, dtype: str) -> int:
    """One transformer block's Linear weights and biases as stored (GGUF's quantized bytes): what a streamed block
    that Wan Compile Blocks lifts into the resident block's graph copies onto the GPU for its call."""
    per_param = (ws.gguf_bytes_per_param if ws.gguf
                 else activation_model.DTYPE_BYTES[ws.weight_dtype or dtype])
    return int(staged_block_bytes(dims, dtype) / activation_model.DTYPE_BYTES[dtype] * per_param)


STREAMED_PATHS = ("lifted", "staged")  # Setup.streamed_blocks_ran: the compiled ways a streamed block runs


def _with_staged(s: Setup, w: activation_model.Workload, par: dict) -> dict:
    """The streamed terms under Wan Compile Blocks.  Until the model's streamed blocks have run compiled and none
    eagerly (``Setup.streamed_blocks_ran``): the eager streamed forward's, raised to the compiled forward with a
    block's staged weights where that holds more (the ``staged_block`` term).  After: the compiled forward plus the
    one block's weights its path holds (``streamed_compiled``), except for a VACE model, whose VACE blocks the node
    does not compile: they stream and run eagerly whatever the main blocks did.  Weights cast at every call (fp8)
    keep the eager figure: their blocks run eagerly where ComfyUI patches a LoRA in at each call, and lifted where
    not, with the casts in the resident block's graph, which compiled resident fp8 blocks are planned as eager for
    (``COMPILED_CAST_NOTE``)."""
    par = dict(par, staged_block=0, streamed_compiled=False)
    if not w.compiled or s.weights.casts_to(w.dtype):
        return par
    staged = activation_bytes(s.dims, w, replace(s.weights, streamed=False), partial=False,
                              other_compile=s.other_compile)
    if staged["compiled_as_eager"]:
        return par
    if s.streamed_blocks_ran in STREAMED_PATHS and not s.dims.vace_layers:
        held = (lifted_block_bytes(s.dims, s.weights, w.dtype) if s.streamed_blocks_ran == "lifted"
                else staged_block_bytes(s.dims, w.dtype))
        return dict(staged, staged_block=held, streamed_compiled=True, total=staged["total"] + held)
    more = staged["total"] + staged_block_bytes(s.dims, w.dtype) - par["total"]
    if more > 0:
        par["staged_block"], par["total"] = more, par["total"] + more
    return par


def _needs(s: Setup, w: activation_model.Workload) -> tuple:
    """(resident terms, streamed terms, resident reservation, streamed reservation) under the policy."""
    res = activation_bytes(s.dims, w, s.weights, partial=False, other_compile=s.other_compile)
    par = activation_bytes(s.dims, replace(w, compiled=False) if s.streamed_blocks_staged else w, s.weights,
                           partial=True, other_compile=s.other_compile)
    if s.streamed_blocks_staged:
        par = _with_staged(s, w, par)
    comfy = comfy_figure(s.dims, (w.rows,) + tuple(s.latent[1:]), s.dtype, s.comfy_flash)
    return (res, par, _policy_need(s, res["total"] + s.margin_bytes, comfy, w.rows),
            _policy_need(s, par["total"] + s.margin_bytes, comfy, w.rows))


DYNAMIC_VERDICTS = {
    "fits": "fits: all weights resident",
    "offloads": "fits with about {off:.1f} GiB of weights evicted on demand (dynamic VRAM)",
    "cannot": ("cannot fit its activations even with every weight evicted: {need:.1f} GiB of working memory, "
               "{room:.1f} GiB on the card after ComfyUI's kept-free memory; sampling may run out of memory"),
}


QUANT_NOTE = ("{fmt} weights (ComfyUI's QuantizedTensor): their per-layer transient is not measured; modelled as the "
              "larger of a dequantised copy of the largest Linear and the quantised copy of its input, with the "
              "fragmentation of fp8 casts")


DECODE_NOTE = ("the reservation in force is the room the {vae} decode after the sampling takes ({gib:.2f} GiB: what "
               "ComfyUI frees for it and the workspace of its largest convolution), more than the sampling's own: "
               "with less, the decode evicts weights kept resident and its convolutions fall back to cuDNN's "
               "engine without a workspace, about 10x slower at 1280x720")

DECODE_CAPPED_NOTE = ("the reservation in force keeps {gib:.2f} GiB for the {vae} decode after the sampling, of the "
                      "{full:.2f} GiB it takes (what ComfyUI frees for it and the workspace of its largest "
                      "convolution): the rest would stream weights, so the room is capped at {why}")

DECODE_UNLOAD_NOTE = ("the {vae} decode after the sampling takes {gib:.2f} GiB (what ComfyUI frees for it and the "
                      "workspace of its largest convolution), more than the resident weights leave free: the model is "
                      "unloaded when its sampling ends, which copies nothing back (its weights keep their host "
                      "copies), so the reservation in force keeps none of that room and the weights use it while "
                      "sampling")

FP8_MATMUL_NOTE = ("fp8 weights multiply in fp8 (fp8_e4m3fn_fast): each layer call copies its input to fp8 instead "
                   "of casting the weight; that copy is modelled, not measured")


def sage_mode_advice(s: Setup, w: activation_model.Workload, need: int, room: int | None) -> str | None:
    """Which Sage memory mode avoids running out of memory, where the ungrouped Sage call does not fit in
    ``room`` with every weight streamed (``need``) but the call split into head groups of about SDPA's memory
    (attention.head_groups, as the patch's "within SDPA's memory" mode splits it) does; None otherwise."""
    if room is None or w.self_attn == "sdpa" or w.self_attn_groups > 1 or need <= room:
        return None
    groups = sage_groups(s.dims, w.self_attn, w.rows, w.L, s.dtype)
    if groups <= 1:
        return None
    grouped = _needs(s, replace(w, self_attn_groups=groups))[3]
    if grouped > room:
        return None
    head = (f"Sage memory mode: ungrouped Sage self-attention does not fit ({need / GiB:.1f} GiB of working memory, "
            f"{max(room, 0) / GiB:.1f} GiB available); split into {groups} head groups it does ({grouped / GiB:.1f} GiB)")
    if s.sage_memory_mode == "sdpa":
        return head + ": the patch's memory_mode \"within SDPA's memory\" runs it grouped, keep it"
    return head + ": set the Sage patch's memory_mode to \"within SDPA's memory\""


def into_q_plan(s: Setup, att: AttentionPlan, rows: int, tokens: int) -> tuple | None:
    """(path, head groups) of the Sage self-attention call when it writes its output into q, else None.
    Where Wan's self-attention hands q over (``s.q_handed_over``: ComfyUI 0.38's attention containers, or the
    patch's own forward on 0.3.64), an eager call runs on the kernel's write-into-q path in the fewest head
    groups within SDPA's bytes, whatever the memory mode (the dispatcher's rule,
    attention.head_groups.into_q_groups).  Compiled calls write into q as well (attention/op.py's
    write-into-q op), but its peak is measured on one compiled block (gpu tier), not on a whole compiled
    forward, so a compiled plan keeps the ordinary path's bytes, which are more: the reservation never falls
    short.  Self-attention run by another node runs the ordinary path."""
    if not s.q_handed_over or s.compiled or att.kernel is None or att.self_by is not None:
        return None
    path = registry.KERNELS[att.kernel].into_q_path(None, s.dims.head_dim)
    if not path:
        return None
    from ..attention.head_groups import into_q_groups
    from ..attention.kernel_bytes import AttnShape
    found = into_q_groups(path, AttnShape(rows, s.dims.num_heads, tokens, tokens, s.dims.head_dim,
                                          activation_model.DTYPE_BYTES[s.dtype], None, True))
    return None if found is None else (path, found.groups)


def _decode_need(s: Setup, latent: tuple, room: int | None) -> int | None:
    """What the VAE decode after the sampling takes (:func:`.vae_decode.decode_bytes`) where the plan makes room
    for it: a decode follows, on the legacy path, and it fits in ``room``.  None otherwise (no decode, dynamic
    VRAM, no VRAM given, a latent no Wan VAE decodes, or more than ``room``: ComfyUI then unloads the model
    whole for it)."""
    if s.decode_dtype_size is None or s.dynamic_vram or room is None:
        return None
    need = vae_decode.decode_bytes(latent, s.decode_dtype_size)
    return None if need is None or need > room else need


def decode_floor(s: Setup, latent: tuple, room: int | None, comfy: int) -> int:
    """The room the reservation in force keeps for the VAE decode after the sampling: what the decode takes
    (:func:`.vae_decode.decode_bytes`: what ComfyUI frees for it and the workspace of its largest convolution),
    on the legacy path where that fits in ``room``; else 0.  With less, the decode evicts weights kept resident,
    and its pool reaches the budget's edge, where a convolution's workspace fails to allocate and PyTorch falls
    back for the rest of the process to cuDNN's engine without one (memory.vae_decode).  Where the decode needs
    more than ``room``, ComfyUI unloads this model whole for it, and keeping room for it would only stream
    weights.  Dynamic VRAM evicts on demand and is left to ComfyUI; the fixed policy's reservation is the
    user's own.  Where the model is unloaded for the decode when its sampling ends (``s.decode_by_unload``:
    :func:`decode_unload`), no room is kept.

    Where that room and every weight do not fit in ``room`` together, with :data:`PLACEMENT_SLACK` to spare,
    the room kept is capped at the larger of what fits beside every weight (less that slack) and ComfyUI's
    own reservation for the forward (``comfy``: :func:`comfy_figure` for ``latent``, the room its decodes have
    after ComfyUI alone's sampling): the decode's room then streams no weight that ComfyUI alone keeps resident, and the decode
    never starts with less room than after ComfyUI alone's."""
    need = None if s.policy == POLICIES[2] or s.decode_by_unload else _decode_need(s, latent, room)
    if need is None:
        return 0
    if s.weights_bytes is not None and s.weights_bytes + need + PLACEMENT_SLACK > room:
        beside = room - s.weights_bytes - PLACEMENT_SLACK
        need = min(need, max(beside, comfy))
    return need


def decode_unload(s: Setup, latent: tuple, room: int | None, offload: int) -> int:
    """The room the VAE decode after the sampling takes (:func:`.vae_decode.decode_bytes`) where the model is
    unloaded for it when its sampling ends: ``s.decode_by_unload`` on the legacy path, and the weights kept
    resident (every weight but ``offload`` bytes) leave less than that free in ``room``.  0 otherwise: no
    decode planned, the room is free beside the weights, or the decode needs more than ``room`` (ComfyUI then
    unloads the model for it in any case)."""
    need = _decode_need(s, latent, room) if s.decode_by_unload else None
    if need is None:
        return 0
    resident = max(0, (s.weights_bytes or 0) - offload)
    return need if resident + need > room else 0


def plan(s: Setup) -> Estimate:
    """The estimate for ``s``: see the module's docstring."""
    dims, latent = s.dims, tuple(int(x) for x in s.latent[:5])
    if s.kernel_set not in activation_model.KERNEL_SETS:
        raise ValueError(f"kernel_set must be one of {', '.join(activation_model.KERNEL_SETS)}")
    B, _C, T, H, W = latent
    L = activation_model.tokens(dims, T, H, W)
    att = s.attention
    rows_seq, rows_bat = B, B * (2 if activation_model.runs_uncond(s.cfg) else 1)
    groups = sage_groups(dims, att.self_path, rows_seq, L, s.dtype) if s.sage_grouped else 1
    self_path = att.self_path
    into_q = into_q_plan(s, att, rows_seq, L)
    if into_q is not None:
        self_path, groups = into_q
    w = activation_model.Workload(L=L, rows=rows_seq, dtype=s.dtype, self_attn=self_path, cross_attn=att.cross_path,
                                  img_tokens=s.img_tokens, per_frame_timesteps=T if s.per_frame_timesteps else 0,
                                  vace_streams=s.vace_streams, latent_elems_per_row=activation_model.latent_elems(latent),
                                  compiled=s.compiled, self_attn_groups=groups, kernels=s.kernel_set,
                                  int8_ffn=(s.weights.quant_format if s.weights.quant_format in activation_model.INT8_FFN_FORMATS
                                            else None))
    res, par, res_need, par_need = _needs(s, w)
    bat_res = bat_par = None
    if rows_bat != rows_seq:
        _r, _p, bat_res, bat_par = _needs(s, activation_model.with_rows(w, rows_bat))
    verdict, offload = "unknown (no VRAM given)", 0
    room = None if s.vram_bytes is None else s.vram_bytes - s.kept_free
    comfy = comfy_figure(dims, latent, s.dtype, s.comfy_flash)
    floor = decode_floor(s, latent, room, comfy)
    if room is not None and s.weights_bytes is not None:
        verdict, offload = verdict_for(s.weights_bytes, max(res_need, floor), max(par_need, floor), room,
                                       s.margin_bytes)
    elif room is not None:
        verdict = "fits" if max(par_need, floor) <= room else "cannot fit its reservation even fully offloaded"
    level = next((lv for lv in ("fits", "offloads", "cannot") if verdict.startswith(lv)), "unknown")
    if s.dynamic_vram and level in DYNAMIC_VERDICTS:
        verdict = DYNAMIC_VERDICTS[level].format(off=offload / GiB, need=par_need / GiB, room=max(room or 0, 0) / GiB)
    streamed = s.streamed if s.streamed is not None else level != "fits"
    notes = list(rounding_notes(dims, *s.pixels) if s.pixels else []) + ([att.note] if att.note else [])
    eager_whys = [res["compiled_as_eager"]] + ([par["compiled_as_eager"]] if streamed else [])
    notes += [COMPILED_AS_EAGER_NOTES[why] for why in dict.fromkeys(eager_whys) if why]
    if s.weights.quant_format is not None:
        notes.append(QUANT_NOTE.format(fmt=s.weights.quant_format))
    if s.weights.fp8_matmul:
        notes.append(FP8_MATMUL_NOTE)
    if floor > (par_need if streamed else res_need):
        full = vae_decode.decode_bytes(latent, s.decode_dtype_size)
        if floor < full:
            why = ("ComfyUI's own reservation, the room its decodes have after ComfyUI alone's sampling"
                   if floor == comfy else "what fits beside every weight")
            notes.append(DECODE_CAPPED_NOTE.format(vae=vae_decode.vae_name(latent), gib=floor / GiB, full=full / GiB,
                                                   why=why))
        else:
            notes.append(DECODE_NOTE.format(vae=vae_decode.vae_name(latent), gib=floor / GiB))
    unload = decode_unload(s, latent, room, max(0, offload))
    if unload:
        notes.append(DECODE_UNLOAD_NOTE.format(vae=vae_decode.vae_name(latent), gib=unload / GiB))
    per = None
    if s.parallel.active:
        def local_totals(local: int) -> tuple:
            """(resident, streamed) activation totals of one forward of the rank's slice, as one GPU's."""
            r, p, _rn, _pn = _needs(s, replace(w, L=local))
            return r["total"], p["total"]
        per = parallel.per_rank(s.parallel, dims, L, rows_seq, activation_model.DTYPE_BYTES[s.dtype], att.self_path,
                                s.weights_bytes, local_totals, uncond=activation_model.runs_uncond(s.cfg))
        if room is not None and per["weights_bytes"] is not None and not s.dynamic_vram:
            # each rank is a GPU of its own: its weights against its working memory, resident and streamed, as for
            # one GPU
            per["verdict"], off = verdict_for(per["weights_bytes"], per["working_bytes"] + s.margin_bytes,
                                              per["streamed_working_bytes"] + s.margin_bytes, room, s.margin_bytes)
            per["offload_bytes"] = max(0, off)
    return Estimate(
        setup=s, tokens=L, rows_sequential=rows_seq, rows_batched=rows_bat, resident=res, partial=par,
        reservation_resident=res_need, reservation_partial=par_need, reservation_batched_resident=bat_res,
        reservation_batched_partial=bat_par, comfy_estimate=comfy,
        streamed=streamed, verdict=verdict, level=level, offload_bytes=max(0, offload), sage_head_groups=groups,
        notes=tuple(s.notes) + tuple(notes), problems=tuple(latent_problems(dims, latent)),
        sage_advice=sage_mode_advice(s, w, par_need, room), per_rank=per, decode_floor=floor, decode_unload=unload)
