"""The kernel registry: every quantised attention kernel wan-sage can use, declared once.

Each :class:`KernelSpec` states, in one place, the package and entry point it comes from, the
GPU architectures it runs on and its preference on each, the dtypes, head dims and tensor layouts
it takes, the exact extra-bytes formula (a name in :mod:`.kernel_bytes`), and how to call it (its
runner).  Everything else derives from these entries:

* the ``auto`` order of an architecture (:func:`auto_order`), including "none, so SDPA";
* which architectures wan-sage knows (:data:`KNOWN_ARCHS`, which :func:`parse_arch` checks ``--arch`` against);
* the memory formula of a kernel on an architecture (:func:`memory_path`), which the dispatcher's
  VRAM check and the working-memory estimate both use;
* the kernel a call runs on before its shape is timed (:func:`unmeasured_kernel`: SDPA for
  cross-attention), which the dispatcher's default rule and the estimate's attention paths share;
* the calls a kernel must not serve on an architecture (:meth:`KernelSpec.allows`: its token
  limits there, for paths known to return wrong output above them), which the dispatcher's
  candidates and the estimate's planned kernels both respect;
* how a call is made (:func:`KernelSpec.run`).

Adding a kernel means adding one entry here and its formula in :mod:`.kernel_bytes`.
Importing this module imports neither torch nor any kernel package: it is pure data, so
``wan-sage plan`` and the estimate work without them.  :mod:`.kernels` probes the packages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["KernelSpec", "PackageSpec", "KERNELS", "PACKAGES", "KNOWN_ARCHS", "auto_order",
           "memory_path", "unmeasured_kernel", "unmeasured_paths", "planned_candidates", "within_limits", "parse_arch",
           "arch_name", "install_hint"]

INSTALL_HINT = (
    "Install SageAttention 2.x from source (a build of thu-ml/SageAttention main at or after "
    "commit ff71e1e; `pip install --no-build-isolation .` in its checkout, with nvcc >= 12.3 for "
    "Hopper), or `pip install sageattention==1.0.6` (Triton only; slower than PyTorch SDPA on "
    "Hopper, so wan-sage will mostly keep SDPA there)."
)


def install_hint() -> str:
    return INSTALL_HINT


# Compute capabilities (major * 10 + minor) of the NVIDIA GPUs ComfyUI users run, Volta onwards.
# An architecture here with no kernel in its auto order runs everything on SDPA.
KNOWN_ARCHS = (70, 72, 75, 80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)


@dataclass(frozen=True)
class PackageSpec:
    """A package that provides kernels: how to import it and how to name its version."""

    module: str  # import name
    dists: tuple  # distribution names for importlib.metadata, first found wins
    flavours: tuple  # what the probe may find: kernel flavours this package can provide


@dataclass(frozen=True)
class KernelSpec:
    """One attention kernel and everything wan-sage needs to know about it."""

    name: str
    label: str
    package: str  # a key of PACKAGES
    flavour: str  # "sage1", "sage2" or "ck": the package generation the entry point belongs to
    entry: str  # attribute of the package module that is called
    min_cc: int  # lowest compute capability it runs on
    archs: frozenset | None  # exact archs it runs on (None: every arch >= min_cc)
    auto_rank: dict  # arch -> rank in that arch's auto order (lower runs first); absent: not auto there
    auto_rank_elsewhere: int | None = None  # rank on runnable archs that auto_rank does not list
    head_dims: tuple = (1, 128)  # (lowest, highest), or the allowed sizes when explicit_head_dims
    explicit_head_dims: bool = False
    dtypes: tuple = ("fp16", "bf16")
    layouts: tuple = ("NHD", "HND")  # layouts the entry point takes natively; others are transposed
    mutates_k: bool = False  # the entry point writes into k: the runner hands it a private copy
    memory: str = ""  # formula name in kernel_bytes (defaults to ``name``)
    memory_by_arch: dict = field(default_factory=dict)  # arch floor -> formula name, for arch-specific paths
    # arch -> the most tokens (query or key) a call may have there; absent: no limit.  For paths
    # known to return wrong output above a length; longer calls take another candidate or SDPA.
    token_limits: dict = field(default_factory=dict)
    call: Callable | None = None  # (fn, q, k, v, layout, sm_scale, cc) -> output in ``layout``
    # The path that writes the output into q's own memory, for calls whose call site hands q over
    # (ComfyUI's attention containers): the kernel_bytes formula, the package module that provides its
    # pieces, the runner of one head group, (module, q, k, v, sm_scale, h0, h1, shared) with q/k/v in
    # "NHD", writing heads h0:h1 of the output into q, and what every group of one call shares, computed
    # once per call from k: (k) -> shared (None: nothing is shared).
    into_q_memory: str = ""
    into_q_module: str = ""
    call_into_q: Callable | None = None
    into_q_shared: Callable | None = None

    def runs_on(self, cc: int) -> bool:
        if cc < self.min_cc:
            return False
        return self.archs is None or cc in self.archs

    def rank(self, cc: int) -> int | None:
        """This kernel's place in ``cc``'s auto order, or None when auto never picks it there."""
        if not self.runs_on(cc):
            return None
        return self.auto_rank.get(cc, self.auto_rank_elsewhere)

    def allows(self, cc: int | None, nq: int, nk: int) -> bool:
        """Whether a call of ``nq`` query and ``nk`` key tokens is within this kernel's token
        limit on ``cc`` (always, where it declares none)."""
        limit = self.token_limits.get(cc)
        return limit is None or max(nq, nk) <= limit

    def head_dim_ok(self, d: int) -> bool:
        if self.explicit_head_dims:
            return d in self.head_dims
        lo, hi = self.head_dims
        return lo <= d <= hi

    def dtype_ok(self, dtype_name: str) -> bool:
        return dtype_name in self.dtypes

    def memory_path(self, cc: int | None) -> str:
        """The kernel_bytes formula that describes this kernel on ``cc``."""
        path = self.memory or self.name
        for floor in sorted(self.memory_by_arch):
            if cc is not None and cc >= floor:
                path = self.memory_by_arch[floor]
        return path

    def native_layout(self, layout: str) -> str:
        """The layout the entry point computes in when handed ``layout``: ``layout`` itself when
        it takes it natively, else its first layout (the runner transposes to it and back, and the
        output's memory stays in the native layout)."""
        return layout if layout in self.layouts else self.layouts[0]

    def into_q_path(self, cc: int | None, D: int) -> str:
        """The kernel_bytes formula of the path that writes into q on ``cc`` (None: the arch the kernel was
        planned for) for head dim ``D``, or "" where there is none (the kernel has no such path, or ``D``
        would need padding)."""
        if not self.into_q_memory or (cc is not None and not self.runs_on(cc)) or D not in (64, 128):
            return ""
        return self.into_q_memory

    def run(self, fn, q, k, v, layout: str, sm_scale, cc: int):
        """Call the entry point ``fn`` on q, k, v in ``layout`` ("NHD" [B,N,H,D] or "HND"
        [B,H,N,D]); the output comes back in the same layout."""
        if self.mutates_k:
            k = k.clone()
        native = self.native_layout(layout)
        if native != layout:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return self.call(fn, q, k, v, native, sm_scale, cc).transpose(1, 2)
        return self.call(fn, q, k, v, layout, sm_scale, cc)


# ------------------------------------------------------------------ runners
# Every option is passed by keyword: ``sageattn``-style entry points silently drop unknown kwargs.

def _sage2_sm90(fn, q, k, v, layout, sm_scale, cc):
    return fn(q, k, v, tensor_layout=layout, is_causal=False, qk_quant_gran="per_thread", sm_scale=sm_scale,
              pv_accum_dtype="fp32+fp32", smooth_k=True, return_lse=False)


def _sage2_sm90_into_q(core, q, k, v, sm_scale, h0, h1, km=None):
    """The sm90 kernel on heads ``h0:h1`` of q, k, v ([B, N, H, D], D 64 or 128), its output written into
    those heads of q once they are quantised, so no output buffer is allocated.  As
    ``sageattn_qk_int8_pv_fp8_cuda_sm90`` does for a whole call: K's mean over tokens is subtracted, q and k
    are quantised to INT8 per thread, V is zero-padded to 128 tokens and quantised to FP8 per channel, and
    the kernel runs with FP32 PV accumulation.

    ``km``: K's mean over tokens for all heads, ``[B, 1, H, D]`` (:func:`sm90_key_mean`, the call's shared
    piece; computed here when None).  V goes before q and k, so its BF16 transients are gone before K's copy and the INT8 q and k exist
    (:func:`.kernel_bytes._sage2_sm90`).  SageAttention's transpose reads V's strided heads and zero-pads
    them to 64 tokens; only where that falls short of 128 tokens is V copied out with its padding first."""
    B, Nk, _H, D = k.shape
    if km is None:
        km = sm90_key_mean(k)
    vg = v[:, :, h0:h1]
    if 0 < Nk % 128 <= 64:
        padded = v.new_empty(B, Nk - Nk % 128 + 128, h1 - h0, D)
        padded[:, :Nk].copy_(vg)
        padded[:, Nk:].zero_()
        vg = padded
        del padded
    v8, v_scale, _ = core.per_channel_fp8(vg, tensor_layout="NHD", smooth_v=False)
    del vg
    qg = q[:, :, h0:h1]
    q8, q_scale, k8, k_scale = core.per_thread_int8_triton(qg, k[:, :, h0:h1], km[:, :, h0:h1], tensor_layout="NHD",
                                                          BLKQ=64, WARPQ=16, BLKK=128, WARPK=128)
    core.sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(
        q8, k8, v8, qg, q_scale, k_scale, v_scale, 0, 0, 3, float(D ** -0.5 if sm_scale is None else sm_scale), 0)


def sm90_key_mean(k):
    """K's mean over tokens, ``[B, 1, H, D]`` in k's dtype, for k ``[B, N, H, D]``: one matrix-vector
    product with FP32 accumulation.  ``k.mean(dim=1)`` is the same mean, but torch's reduction over the
    token axis stages partial sums in a buffer of up to about 130 MiB (measured on an H200: 58.5 MiB for 8
    of A14B's heads at 7,480 tokens, more than the rest of the call), where this holds only its output.
    A k whose heads cannot be viewed as one row per token takes ``k.mean``."""
    import torch
    B, Nk, H, D = k.shape
    if k.stride(3) != 1 or k.stride(2) != D:
        return k.mean(dim=1, keepdim=True)
    weights = torch.full((B, 1, Nk), 1.0 / Nk, dtype=k.dtype, device=k.device)
    return torch.matmul(weights, k.view(B, Nk, H * D)).view(B, 1, H, D)


def _sage2_fp8_cuda(fn, q, k, v, layout, sm_scale, cc):
    return fn(q, k, v, tensor_layout=layout, is_causal=False, qk_quant_gran="per_warp" if cc >= 120 else "per_thread",
              sm_scale=sm_scale, pv_accum_dtype="fp32+fp16", smooth_k=True, return_lse=False)


def _sage2_fp16_cuda(fn, q, k, v, layout, sm_scale, cc):
    return fn(q, k, v, tensor_layout=layout, is_causal=False, qk_quant_gran="per_thread", sm_scale=sm_scale,
              pv_accum_dtype="fp32", smooth_k=True, return_lse=False)


def _sage2_fp16_triton(fn, q, k, v, layout, sm_scale, cc):
    return fn(q, k, v, tensor_layout=layout, quantization_backend="triton", is_causal=False, sm_scale=sm_scale,
              smooth_k=True, return_lse=False)


def _sage1(fn, q, k, v, layout, sm_scale, cc):
    return fn(q, k, v, tensor_layout=layout, is_causal=False, sm_scale=sm_scale, smooth_k=True)


def _ck_int8(fn, q, k, v, layout, sm_scale, cc):
    return fn(q, k, v, scale=sm_scale)


PACKAGES = {
    "sageattention": PackageSpec("sageattention", ("sageattention",), ("sage1", "sage2")),
    "comfy_kitchen": PackageSpec("comfy_kitchen", ("comfy-kitchen", "comfy_kitchen"), ("ck",)),
}

# Auto ranks: on each arch the fastest measured Sage kernel first, then comfy-kitchen's int8
# kernel, then the others (on sm120/sm121 the FP16-PV kernel before it: the calls longer than the
# FP8-PV kernel's token limit fall to it).  The shape's timing, not this order, decides which available
# candidate (or SDPA) serves a shape; the order decides only when nothing has been measured.
_ALL_SAGE1 = {80: 2, 86: 2, 87: 2, 89: 3, 90: 2, 120: 3, 121: 3}
_CK_INT8 = {80: 1, 86: 1, 87: 1, 89: 1, 90: 1, 120: 2, 121: 2}

# SageAttention's INT8-QK/FP8-PV kernel returns noise, silently, above about 160k tokens on sm120
# (thu-ml/SageAttention#388, Comfy-Org/ComfyUI#15263: 151k and 154k tokens clean, 167k and more
# noise, with FP16 PV clean at the same lengths).  The cause is not known, so the cliff may move
# with the model's heads; the limit keeps a margin of 15 % below the last clean length.  Longer
# calls go to the FP16-PV kernel, ranked right after it on sm120/sm121, or to SDPA.
_FP8_PV_TOKEN_LIMIT = 131072

KERNELS: dict = {k.name: k for k in (
    KernelSpec("sage2_sm90", "SageAttention 2 INT8-QK/FP8-PV (sm90 wgmma)", "sageattention", "sage2",
               "sageattn_qk_int8_pv_fp8_cuda_sm90", 90, frozenset({90}), {90: 0}, call=_sage2_sm90,
               into_q_memory="sage2_sm90_into_q", into_q_module="sageattention.core", call_into_q=_sage2_sm90_into_q, into_q_shared=sm90_key_mean),
    KernelSpec("sage2_fp8_cuda", "SageAttention 2 INT8-QK/FP8-PV (sm89/sm120)", "sageattention", "sage2",
               "sageattn_qk_int8_pv_fp8_cuda", 89, frozenset({89, 90, 120, 121}), {89: 0, 120: 0, 121: 0},
               memory_by_arch={120: "sage2_fp8_cuda_perwarp"},
               token_limits={120: _FP8_PV_TOKEN_LIMIT, 121: _FP8_PV_TOKEN_LIMIT}, call=_sage2_fp8_cuda),
    KernelSpec("sage2_fp16_cuda", "SageAttention 2 INT8-QK/FP16-PV CUDA (sm80+)", "sageattention", "sage2",
               "sageattn_qk_int8_pv_fp16_cuda", 80, None, {80: 0, 89: 2, 120: 1, 121: 1}, call=_sage2_fp16_cuda),
    KernelSpec("sage2_fp16_triton", "SageAttention 2 INT8-QK/FP16-PV Triton", "sageattention", "sage2",
               "sageattn_qk_int8_pv_fp16_triton", 80, None, {86: 0, 87: 0}, call=_sage2_fp16_triton),
    KernelSpec("sage1", "SageAttention 1.0.6 (Triton)", "sageattention", "sage1", "sageattn", 80, None,
               _ALL_SAGE1, head_dims=(64, 96, 128), explicit_head_dims=True, mutates_k=True, call=_sage1),
    KernelSpec("ck_int8", "comfy-kitchen int8_attention", "comfy_kitchen", "ck", "int8_attention", 75, None,
               _CK_INT8, auto_rank_elsewhere=0, head_dims=(1, 256),
               layouts=("HND",), call=_ck_int8),
)}


def auto_order(cc: int | None) -> tuple:
    """The kernels ``auto`` would try on ``cc``, in order, before availability is checked.
    Empty for an architecture where no kernel runs (then everything runs on SDPA)."""
    if cc is None:
        return ()
    ranked = [(k.rank(cc), i, k.name) for i, k in enumerate(KERNELS.values()) if k.rank(cc) is not None]
    return tuple(name for _r, _i, name in sorted(ranked))


def within_limits(names, cc: int | None, tokens: int | None) -> tuple:
    """The kernels of ``names`` whose :meth:`KernelSpec.allows` a self-attention call of
    ``tokens`` tokens on ``cc`` (all of them when ``tokens`` is None), in order."""
    if tokens is None:
        return tuple(names)
    return tuple(n for n in names if KERNELS[n].allows(cc, tokens, tokens))


def planned_candidates(kernel: str, cc: int, tokens: int | None = None) -> tuple:
    """(candidate kernels in order, why there are none or None) for a patch whose kernel setting is
    ``kernel`` ("auto" or a registry name) on ``cc``, before availability is checked: the arch's
    :func:`auto_order` for "auto", else the named kernel where it runs on ``cc``; with ``tokens``
    (a self-attention call's length), only the kernels whose token limit allows it.  No candidates
    leave every call on SDPA.  The working-memory estimate plans with this; the node narrows "auto"
    to the kernels installed."""
    if kernel == "auto":
        names = within_limits(auto_order(cc), cc, tokens)
        if names:
            return names, None
        return names, (f"no kernel runs on sm{cc}" if not auto_order(cc) else
                       f"no kernel is accurate at {tokens} tokens on sm{cc}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be auto or one of {', '.join(KERNELS)}; got {kernel!r}")
    if not KERNELS[kernel].runs_on(cc):
        return (), f"{kernel} does not run on sm{cc}"
    if not within_limits((kernel,), cc, tokens):
        return (), f"{kernel} returns wrong output above {KERNELS[kernel].token_limits[cc]} tokens on sm{cc}"
    return (kernel,), None


def memory_path(name: str, cc: int | None) -> str:
    """The kernel_bytes formula of kernel ``name`` on ``cc`` ("sdpa" for SDPA)."""
    if name == "sdpa":
        return "sdpa"
    return KERNELS[name].memory_path(cc)


def unmeasured_kernel(names, cross: bool) -> str | None:
    """The kernel a call runs on while no timing of its shape exists (None: SDPA), given the
    candidate kernels ``names`` in order: SDPA for cross-attention (Wan's 512 text keys, plus 257
    image keys), where every measured Sage path has lost to SDPA; the first candidate for
    self-attention.  The dispatcher's default rule and the working-memory estimate both apply it."""
    if cross or not names:
        return None
    return names[0]


def unmeasured_paths(names, cc: int | None, tokens: int | None = None) -> tuple:
    """(self-attention path, cross-attention path, self-attention kernel or None): the kernel_bytes
    formulas a Wan forward's calls run on under :func:`unmeasured_kernel`, on ``cc``; with
    ``tokens`` (the self-attention length), of the kernels whose token limit allows that length,
    as the dispatcher's candidates are."""
    names = within_limits(names, cc, tokens)
    self_kernel, cross_kernel = unmeasured_kernel(names, False), unmeasured_kernel(names, True)
    return (memory_path(self_kernel or "sdpa", cc), memory_path(cross_kernel or "sdpa", cc), self_kernel)


def arch_name(cc: int) -> str:
    return f"sm{cc}"


def parse_arch(text) -> int:
    """``"sm90"``, ``"90"`` or ``90`` -> 90; ValueError naming the known archs otherwise."""
    known = ", ".join(arch_name(c) for c in KNOWN_ARCHS)
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise ValueError(f"arch must be a GPU architecture such as sm90 (known: {known})")
    s = str(text).strip().lower()
    digits = s[3:] if s.startswith("sm_") else s[2:] if s.startswith("sm") else s
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 3 or int(digits) not in KNOWN_ARCHS:
        shown = s if len(s) <= 12 else s[:12] + "..."
        raise ValueError(f"arch {shown!r} is not a known GPU architecture; use one of {known}")
    return int(digits)
