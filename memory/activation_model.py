"""Token-based activation-memory model of one Wan DiT forward, phase by phase.

Every term is named after the code it describes (ComfyUI ``comfy/ldm/wan/model.py``).  Per
forward the peak is ``persistent + max(phase peaks) + weight transient + allocator slack``:
phases do not add up, because each block frees a phase's temporaries before the next phase
allocates its own.  Bytes below are for ``T = rows * L`` tokens, ``e`` bytes per element of
the compute dtype, ``d`` = dim, ``f`` = ffn_dim.

Phases of one ``WanAttentionBlock`` (the residual ``x`` is alive throughout, and CPython keeps a
call's argument alive until the callee returns, so each sub-module's input stays allocated):

* ``rope``: roping k.  ``x``, the self-attention input, ``q``, ``norm_k(k(x))``, the fp32
  ``x_`` and ``x_out`` of ``apply_rope1`` and its ``type_as`` result: ``5 e d T + 8 d T``.
  (18 bytes per token per dim at bf16, the A14B peak measured on an H200.)
* ``attn``: the attention call.  ``x``, input, q, k, v (``5 e d T``) plus the backend's extra
  bytes, taken from :func:`attention.kernel_bytes.extra_bytes` (SDPA: its output).
* ``cross``: the block's input (the caller still holds it), ``x``, ``norm3(x)``, ``q``, ``o``
  (+ the image branch's output for I2V): ``(5 + img) e d T`` plus the backend's extra bytes.
* ``ffn``: the block's input, ``x``, the FFN input, the first Linear's output and the GELU
  output: ``3 e d T + 2 e f T``.  (This phase dominates for 5B and 1.3B.)
* ``modulation``: with per-frame timesteps (TI2V-5B image-to-video), ``repeat_e`` materialises
  ``[B, L, d]`` shift/scale tensors around ``norm1``: ``6 e d T``.
* ``embed``: the patch embedding runs in fp32 and is cast back: ``(4 + e) d T`` plus the fp32
  copy of the latent.

Persistent across blocks: RoPE ``freqs`` (fp32, ``8 * head_dim`` bytes per token, shared by the
rows), the text/image context, and for VACE the control streams plus the un-blocked input.

The phases above are for Wan's elementwise kernels in ComfyUI 0.3.64, where every figure was measured
(:data:`KERNEL_SETS` ``comfy-0.3.64``).  Newer ComfyUI (0.38) runs them through comfy-kitchen
(``comfy-kitchen``): ``ck.apply_rope1`` for RoPE, ``ck.adaln`` for the modulation, and the FFN through
``comfy.ops.linear_input_act(down, up(x), "gelu_tanh")``.  The RoPE and modulation phases follow from what the
fused kernels allocate, measured on the H200 with comfy-kitchen 0.2.40 at four Wan sizes
(``python -m bench.kitchen_kernels``, bench/records/kitchen/kernels.jsonl): each call allocates its output and
nothing more (at most 0.2 MiB beyond it), where the eager arithmetic beside it holds the fp32 temporaries this
model gives 0.3.64's RoPE (``8 d T``, to the byte).  The FFN phase is ComfyUI 0.38 code, not comfy-kitchen's,
and is modelled from its structure, not measured, except with int8 weights (:data:`KITCHEN_UNMEASURED`):

* ``rope``: the fused kernel makes no fp32 temporaries: ``5 e d T``, as the compiled figure's RoPE.
* ``modulation``: ``adaln`` writes its output without the ``norm`` temporary: ``2 e d T`` (``4 e d T``
  with per-frame timesteps, whose shift/scale are still repeated to ``[B, L, d]``).
* ``ffn``: ``linear_input_act`` keeps the first Linear's output alive as its argument while the
  down-projection runs: ``4 e d T + 2 e f T`` with the GELU's output.  With int8 tensorwise weights
  comfy-kitchen's ``int8_linear`` quantises the GELU's output to int8 (``f T``, the weights' per-layer
  transient in :func:`weight_transient`); with convrot weights the GELU runs inside the quantiser and writes
  no output of its own: ``4 e d T + e f T``.  Both int8 paths measured on the H200 (``kitchen/kernels.jsonl``:
  ``3 f T`` and ``f T`` in bf16 beside the kept input).  With any other weights the GELU runs eagerly: modelled,
  not measured.
* ``embed``, ``attn`` and ``cross``: the same code as 0.3.64: 0.3.64's figures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["WanDims", "PRESETS", "COMPILED", "KERNEL_SETS", "KITCHEN_UNMEASURED", "INT8_FFN_FORMATS", "Workload", "latent_shape", "latent_elems", "tokens", "runs_uncond", "phase_peaks", "forward_peak",
           "largest_block", "weight_transient", "WeightSetup", "DTYPE_BYTES", "QUANT_FORMATS"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class WanDims:
    """The config of one Wan DiT, as ComfyUI detects it."""

    name: str
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    in_dim: int = 16
    out_dim: int = 16
    patch_size: tuple = (1, 2, 2)
    vae_stride: tuple = (4, 8, 8)  # (t, h, w); 16x for the Wan 2.2 VAE of TI2V-5B
    latent_channels: int = 16
    model_type: str = "t2v"  # t2v, i2v, vace, ti2v, camera, s2v, humo, animate
    text_len: int = 512
    has_img_emb: bool = False  # CLIP image tokens in cross-attention (2.1 I2V / FLF2V)
    vace_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def img_tokens(self) -> int:
        """The CLIP image tokens of cross-attention: 257 (a CLIP ViT-H/14 image's 256 patches and its class
        token) where the model has an image embedding, else none."""
        return 257 if self.has_img_emb else 0

    @property
    def per_frame_timesteps(self) -> bool:
        """Whether the model takes a timestep per latent frame: the 48-channel VAE's models (TI2V-5B)."""
        return self.latent_channels == 48

    def params(self) -> int:
        d, f, L = self.dim, self.ffn_dim, self.num_layers
        per_block = 4 * d * d + 4 * d * d + 2 * d * f + 6 * d + 10 * d + f
        if self.has_img_emb:
            per_block += 2 * d * d
        return L * per_block + 4096 * d + d * d + 256 * d + d * d + 6 * d * d + self.in_dim * 4 * d


PRESETS = {
    "wan2.1-1.3b": WanDims("Wan 2.1 T2V 1.3B", 1536, 8960, 12, 30),
    "wan2.1-14b": WanDims("Wan 2.1 T2V 14B", 5120, 13824, 40, 40),
    "wan2.1-i2v-14b": WanDims("Wan 2.1 I2V 14B", 5120, 13824, 40, 40, in_dim=36, model_type="i2v",
                              has_img_emb=True),
    "wan2.2-a14b": WanDims("Wan 2.2 T2V A14B (one expert)", 5120, 13824, 40, 40),
    "wan2.2-i2v-a14b": WanDims("Wan 2.2 I2V A14B (one expert)", 5120, 13824, 40, 40, in_dim=36),
    "wan2.2-ti2v-5b": WanDims("Wan 2.2 TI2V 5B", 3072, 14336, 24, 30, in_dim=48, out_dim=48,
                              vae_stride=(4, 16, 16), latent_channels=48, model_type="ti2v"),
}


def latent_shape(dims: WanDims, width: int, height: int, frames: int, batch: int = 1) -> tuple:
    """[B, C, T, H, W] of the empty latent ComfyUI makes for these pixel sizes.

    ComfyUI's Wan latent nodes floor: T = (frames - 1) // 4 + 1, H = height // stride,
    W = width // stride (stride 8, or 16 for the Wan 2.2 VAE).  Pixels that do not fill a
    latent cell are dropped, exactly as ComfyUI drops them.
    """
    st, sh, sw = dims.vae_stride
    return (batch, dims.latent_channels, (frames - 1) // st + 1, height // sh, width // sw)


def tokens(dims: WanDims, t_lat: int, h_lat: int, w_lat: int) -> int:
    """L = T_lat * ceil(H_lat / 2) * ceil(W_lat / 2): the DiT pads H and W to the patch size."""
    pt, ph, pw = dims.patch_size
    return math.ceil(t_lat / pt) * math.ceil(h_lat / ph) * math.ceil(w_lat / pw)


def runs_uncond(cfg: float) -> bool:
    """Whether the sampler runs an uncond pass at this cfg: ComfyUI's sampler skips it where
    ``math.isclose(cfg, 1.0)`` (comfy/samplers.py), so a cfg of 1.0000001 runs cond only too."""
    return not math.isclose(float(cfg), 1.0)


def latent_elems(latent) -> int:
    """C*T*H*W of one row of a [B, C, T, H, W] latent, H and W padded to the 2x2 patch as the DiT does."""
    _, C, T, H, W = (int(x) for x in latent[:5])
    return C * T * (H + H % 2) * (W + W % 2)


# Wan's elementwise kernels the phases are modelled for: ComfyUI 0.3.64's (measured), or comfy-kitchen's
# fused RoPE and adaln (measured) with linear_input_act's FFN (ComfyUI 0.38; measured only with int8 weights).
KERNEL_SETS = ("comfy-0.3.64", "comfy-kitchen")
# The phase of the comfy-kitchen set modelled from the code's structure rather than measured (with int8
# weights its int8 kernel is measured; with other weights the GELU is ComfyUI's eager code).
KITCHEN_UNMEASURED = ("ffn",)
# The FFN weight formats whose down-projection runs comfy-kitchen's int8 kernel (QUANT_FORMATS keys).
INT8_FFN_FORMATS = ("int8", "int8 convrot")


@dataclass(frozen=True)
class Workload:
    """One forward: tokens per row, rows, compute dtype, conditioning extras, attention backends."""

    L: int
    rows: int = 1
    dtype: str = "bf16"
    self_attn: str = "sdpa"  # a memory path of attention.kernel_bytes
    cross_attn: str = "sdpa"
    img_tokens: int = 0  # CLIP image tokens in cross-attention (257, or 514 for FLF2V)
    text_tokens: int = 512
    per_frame_timesteps: int = 0  # latent frames when TI2V's per-frame timestep is active
    vace_streams: int = 0
    latent_elems_per_row: int = 0  # C*T*H*W of the (padded) latent, for the fp32 embed copy
    compiled: bool = False  # the blocks run under torch.compile (inductor): see COMPILED
    self_attn_groups: int = 1  # head groups the self-attention kernel call runs in (attention.head_groups)
    kernels: str = KERNEL_SETS[0]  # Wan's elementwise kernels: one of KERNEL_SETS
    # int8 tensorwise FFN weights (one of INT8_FFN_FORMATS): comfy-kitchen quantises the GELU's output to int8
    # in the down-projection, fused into the quantiser with convrot weights
    int8_ffn: str | None = None


# ComfyUI names compiled modules by their key in the BaseModel; the compiled figure is for keys that are
# all transformer blocks (each block its own graph).  The whole diffusion model as one graph
# (TorchCompileModel's default) peaks above it and is planned as eager (docs/memory-model.md).
BLOCK_KEY_PREFIX = "diffusion_model.blocks."


def compiles_per_block(keys) -> bool:
    """Whether torch.compile keys (ComfyUI module keys) name transformer blocks only."""
    keys = list(keys or ())
    return bool(keys) and all(str(k).startswith(BLOCK_KEY_PREFIX) for k in keys)


# The blocks under torch.compile (inductor), per block as ComfyUI's set_torch_compile_wrapper
# compiles them.  Measured on the H200 with ComfyUI 0.3.64's WanModel (python -m bench.forward_peaks
# --compile, python -m bench.compile_table; docs/memory-model.md):
# * RoPE fuses into one pass in the compute dtype: no fp32 temporaries, so its phase is at most the
#   attention call's inputs (5 e d T).  Structural, from the fused kernels; no constant.
# * "ffn_f_buffers": the FFN holds ONE ffn_dim-wide buffer (inductor writes the GELU in place of the
#   first Linear's output) instead of eager's two.  Set from the compiled fit rows
#   (bench/records/forward-peaks/compiled.jsonl: TI2V-5B and 1.3B, where the FFN decides the peak),
#   checked on the held-out compiled rows (forward-peaks/compiled-held-out.jsonl).
# * "op_d_buffers": around the patch's opaque attention op inductor has freed the block's normed
#   input, leaving the residual and q, k, v (4 e d T) where eager keeps 5.  Set from the compile
#   table's Sage rows (bench/records/compile/table.jsonl and table-grouping-forced.jsonl: A14B 1280x720x81,
#   grouped and ungrouped); checked on the 27 compiled Sage rows measured after it was set
#   (forward-peaks/compiled-sage.jsonl: every model, the fit sizes, both memory modes).
# SDPA inside the compiled graph keeps eager's 5 e d T (the compiled SDPA rows).
COMPILED = {"ffn_f_buffers": 1, "op_d_buffers": 4}


def _attn_extra(path: str, rows: int, heads: int, nq: int, nk: int, hd: int, e: int, groups: int = 1) -> int:
    from ..attention.head_groups import split_bytes
    from ..attention.kernel_bytes import AttnShape, extra_bytes
    shape = AttnShape(rows, heads, nq, nk, hd, e, None, True)
    return split_bytes(path, shape, groups) if groups > 1 else extra_bytes(path, shape)


def phase_peaks(dims: WanDims, w: Workload) -> dict:
    """Bytes per phase of one block (without the persistent terms)."""
    e = DTYPE_BYTES[w.dtype]
    d, f, T = dims.dim, dims.ffn_dim, w.rows * w.L
    hd, H = dims.head_dim, dims.num_heads
    img = 1 if w.img_tokens else 0
    self_extra = _attn_extra(w.self_attn, w.rows, H, w.L, w.L, hd, e, w.self_attn_groups)
    phases = {
        "embed": (4 + e) * d * T + 4 * w.rows * w.latent_elems_per_row,
        "modulation": (6 if w.per_frame_timesteps else 3) * e * d * T,
        "rope": 5 * e * d * T + 8 * d * T,
        "attn": 5 * e * d * T + self_extra,
        "cross": (5 + img) * e * d * T + _attn_extra(w.cross_attn, w.rows, H, w.L, w.text_tokens, hd, e),
        "ffn": 3 * e * d * T + 2 * e * f * T,
    }
    if w.kernels == KERNEL_SETS[1]:
        phases["rope"] = 5 * e * d * T
        phases["modulation"] = (4 if w.per_frame_timesteps else 2) * e * d * T
        if w.int8_ffn not in (None,) + INT8_FFN_FORMATS:
            raise ValueError(f"int8_ffn must be one of {', '.join(INT8_FFN_FORMATS)} or None")
        # the kept input and the GELU's output, which convrot weights fuse into the int8 quantiser; the int8
        # copy itself is the quantised weights' per-layer transient (weight_transient: tokens x f)
        phases["ffn"] = 4 * e * d * T + (1 if w.int8_ffn == "int8 convrot" else 2) * e * f * T
    elif w.kernels != KERNEL_SETS[0]:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_SETS)}")
    if w.compiled:
        phases["rope"] = 5 * e * d * T
        phases["ffn"] = 3 * e * d * T + COMPILED["ffn_f_buffers"] * e * f * T
        if w.self_attn != "sdpa":
            phases["attn"] = COMPILED["op_d_buffers"] * e * d * T + self_extra
    return phases


def persistent(dims: WanDims, w: Workload) -> dict:
    e = DTYPE_BYTES[w.dtype]
    d, T = dims.dim, w.rows * w.L
    return {
        "rope_freqs": 8 * dims.head_dim * w.L,
        "context": w.rows * (w.text_tokens + w.img_tokens) * d * e,
        "vace_streams": (2 + w.vace_streams) * e * d * T if w.vace_streams else 0,
        "timestep_embeddings": w.rows * max(1, w.per_frame_timesteps) * 7 * d * 4,
    }


def largest_block(dims: WanDims, w: Workload) -> int:
    """The largest single activation allocation of a block (for fragmentation slack)."""
    e = DTYPE_BYTES[w.dtype]
    T = w.rows * w.L
    return max(4 * dims.dim * T, e * dims.ffn_dim * T, e * dims.dim * T * 2 if w.self_attn != "sdpa" else 0)


# ComfyUI's QuantizedTensor weight formats (comfy/quant_ops.py QUANT_ALGOS, ComfyUI 0.38): bytes per stored
# parameter (block scales included), and bytes per element of the quantised copy of a Linear's input that
# the quantised matmul makes (int8 weight-only formats quantise their input inside the kernel).
QUANT_FORMATS = {
    "fp8 scaled": (1.0, 1.0),           # float8_e4m3fn / float8_e5m2 (TensorCoreFP8 layouts)
    "mxfp8": (1.0 + 1 / 32, 1.0 + 1 / 32),
    "nvfp4": (0.5 + 1 / 16, 0.5 + 1 / 16),
    "int8": (1.0, 1.0),                 # int8_tensorwise
    "int8 convrot": (1.0, 1.0),         # int8_tensorwise with convrot (Hadamard-rotated) weights
    "convrot w4a4": (0.5, 0.5),
    "w4a8 int8": (0.5, 1.0),
}


@dataclass(frozen=True)
class WeightSetup:
    """How the weights reach the matmuls, which decides the per-layer transient."""

    weight_dtype: str | None = None  # None: the compute dtype; else bf16, fp16, fp32, fp8 or "gguf"
    gguf_bytes_per_param: float = 0.0  # > 0 for GGUF
    quant_format: str | None = None  # ComfyUI QuantizedTensor weights: a key of QUANT_FORMATS
    lora: bool = False  # a LoRA on the model: applied at every forward for GGUF and streamed layers (fp32
    #                     transient), merged into resident weights of other formats at load (none)
    streamed: bool = False  # lowvram: some layers are copied to the GPU per forward
    # fp8 weights multiplied in fp8 (ComfyUI's ``fp8_e4m3fn_fast`` weight dtype on a GPU with fp8 compute):
    # each Linear copies its input to fp8 instead of casting its weight
    fp8_matmul: bool = False

    @property
    def gguf(self) -> bool:
        return self.gguf_bytes_per_param > 0

    def casts_to(self, compute: str) -> bool:
        """Every Linear casts its stored weight to the compute dtype (fp8 checkpoints, QuantizedTensor
        weights); GGUF dequantises."""
        return self.quant_format is not None or (not self.gguf and self.weight_dtype not in (None, "gguf", compute))


def weight_transient(dims: WanDims, ws: WeightSetup, compute: str = "bf16", tokens: int = 0) -> int:
    """Bytes a single Linear adds while it runs, for the largest layer (the FFN, d x f; ``tokens``: rows x L).

    * resident weights in the compute dtype: none;
    * QuantizedTensor weights (ComfyUI 0.38, not measured): the larger of a dequantised copy in the compute
      dtype (a format this GPU runs emulated, or a LoRA on it) and the quantised copy of the FFN
      down-projection's input that a quantised matmul makes (``tokens x f``), plus the stored bytes when
      streamed;
    * fp8 weights multiplied in fp8 (``fp8_matmul``; ComfyUI 0.3.64 comfy/ops.py ``fp8_linear``): the weight
      as stored, and the input copied to fp8, ``tokens x f`` bytes for the FFN down-projection (not measured),
      plus the stored bytes when streamed;
    * fp8 (or other) weights cast per call, or streamed layers: a copy in the compute dtype
      (plus the raw bytes when streamed and of another dtype);
    * GGUF: the raw quantised bytes when streamed, the block-dequantisation intermediate and the
      dequantised weight, all in the compute dtype;
    * LoRA at forward time (GGUF, or lowvram ``LowVramPatch``): ``calculate_weight`` upcasts the
      weight to fp32 and builds the fp32 ``up @ down`` product, then casts back.
    """
    e = DTYPE_BYTES[compute]
    P = dims.dim * dims.ffn_dim
    t = 0
    if ws.quant_format is not None:
        stored, per_input = QUANT_FORMATS.get(ws.quant_format, (1.0, 1.0))
        t = max(e * P, int(per_input * tokens * dims.ffn_dim)) + (int(stored * P) if ws.streamed else 0)
        if ws.lora and ws.streamed:
            t += 8 * P
        return t
    if ws.gguf:
        t = 2 * e * P + (int(ws.gguf_bytes_per_param * P) if ws.streamed else 0)
    elif ws.fp8_matmul:
        t = tokens * dims.ffn_dim + (P if ws.streamed else 0)
    elif ws.casts_to(compute):
        wb = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}.get(ws.weight_dtype, 2)
        t = e * P + (wb * P if ws.streamed else 0)
    elif ws.streamed:
        t = e * P
    if ws.lora and (ws.gguf or ws.streamed):  # else merged into the weights at load
        t += 8 * P
    return t


def forward_peak(dims: WanDims, w: Workload) -> tuple:
    """(phase-peak bytes, persistent bytes, the dominating phase name)."""
    ph = phase_peaks(dims, w)
    top = max(ph, key=ph.get)
    return ph[top], sum(persistent(dims, w).values()), top


def with_rows(w: Workload, rows: int) -> Workload:
    return replace(w, rows=rows)
