"""Exact extra device bytes each attention kernel allocates beyond its q, k, v inputs.

One source of truth: the dispatcher's pre-call check and the memory/ estimator both call
:func:`extra_bytes`.  The formulas follow every allocation in SageAttention's wrappers
(1.0.6 and 2.x main) and in comfy-kitchen's int8_attention; they were checked against measured
peaks on an H200 by the gpu tier (tests/gpu: every installed kernel within 1 % at Wan shapes,
and the head-split path against :func:`.head_groups.split_bytes`).  The caching allocator
rounds large blocks, so :func:`with_margin` adds 4 MiB + 0.1 % before comparing with free
memory.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttnShape", "extra_bytes", "with_margin", "MEMORY_PATHS", "INTO_Q_PATHS"]


def _c(x: int, b: int) -> int:
    return -(-x // b)


@dataclass(frozen=True)
class AttnShape:
    """One attention call: batch, query heads, key/value heads, lengths, head dim, bytes/elt."""

    B: int
    Hq: int
    Nq: int
    Nk: int
    D: int
    s: int = 2  # bytes of the input dtype (2 for fp16/bf16, 4 for fp32)
    Hkv: int | None = None
    bf16: bool = True  # input is bf16 (matters for the fp16-PV paths' V copy)

    @property
    def hkv(self) -> int:
        return self.Hq if self.Hkv is None else self.Hkv

    def with_heads(self, h: int) -> "AttnShape":
        ratio = self.Hq // self.hkv
        return AttnShape(self.B, h, self.Nq, self.Nk, self.D, self.s, max(1, h // ratio), self.bf16)


def _padded_dim(D: int) -> int:
    if D <= 64:
        return 64
    if D <= 128:
        return 128
    raise ValueError(f"head dim {D} > 128 is not supported by SageAttention")


def _sdpa(a: AttnShape, flash: bool = False) -> int:
    out = a.s * a.B * a.Hq * a.Nq * a.D
    return out + (4 * a.B * a.Hq * a.Nq if flash else 0)


def _sage1(a: AttnShape) -> int:
    # 1.0.6 Triton v1: D in {64, 96, 128}, no padding.  It subtracts the K mean in place,
    # so the dispatcher hands it a private copy of k (s*Ek), alive for the whole call.
    D = a.D
    Eq, Ek = a.B * a.Hq * a.Nq * D, a.B * a.hkv * a.Nk * D
    v16 = 2 * Ek if (a.bf16 or a.s == 4) else 0
    s_out = 4 if a.s == 4 else a.s
    sc = 4 * a.B * (a.Hq * _c(a.Nq, 128) + a.hkv * _c(a.Nk, 64))
    km = a.s * a.B * a.hkv * D
    k_copy = a.s * Ek
    return k_copy + v16 + Eq + Ek + s_out * Eq + sc + km


def _common2(a: AttnShape):
    Dp = _padded_dim(a.D)
    Eq, Ek = a.B * a.Hq * a.Nq * Dp, a.B * a.hkv * a.Nk * Dp
    pad = a.s * (Eq + 2 * Ek) if a.D != Dp else 0
    km = a.s * a.B * a.hkv * Dp
    return Dp, Eq, Ek, pad, km


def _sage2_triton(a: AttnShape) -> int:
    Dp, Eq, Ek, pad, km = _common2(a)
    v16 = 2 * Ek if a.bf16 else 0
    sc = 4 * a.B * (a.Hq * _c(a.Nq, 128) + a.hkv * _c(a.Nk, 64))
    kt, o = a.s * Ek, a.s * Eq
    return pad + km + v16 + Eq + Ek + sc + max(kt, o)


def _sage2_fp16_cuda(a: AttnShape) -> int:
    # sm80 kernel, pv_accum_dtype="fp32", per_thread quantisation (Triton, K copy).
    Dp, Eq, Ek, pad, km = _common2(a)
    v16 = 2 * Ek if a.bf16 else 0
    sc = 4 * a.B * (32 * a.Hq * _c(a.Nq, 128) + 4 * a.hkv * _c(a.Nk, 64))
    kt, o = a.s * Ek, a.s * Eq
    return pad + km + Eq + Ek + sc + max(kt, o + v16)


def _sage2_fp8_cuda(a: AttnShape, per_warp: bool = False) -> int:
    # sm89 / sm120 kernel, V quantised to FP8 per channel over 64-token blocks.
    Dp, Eq, Ek, pad, km = _common2(a)
    if per_warp:
        sc = 4 * a.B * (4 * a.Hq * _c(a.Nq, 128) + a.hkv * _c(a.Nk, 64))
        kt = 0
    else:
        sc = 4 * a.B * (32 * a.Hq * _c(a.Nq, 128) + 4 * a.hkv * _c(a.Nk, 64))
        kt = a.s * Ek
    nk64 = 64 * _c(a.Nk, 64)
    vt = a.s * a.B * a.hkv * Dp * nk64
    v8 = a.B * a.hkv * Dp * nk64
    vs = 8 * a.B * a.hkv * Dp
    o = a.s * Eq
    return pad + km + Eq + Ek + sc + max(kt, o + vt + v8 + vs)


def _sage2_sm90(a: AttnShape, into_q: bool = False) -> int:
    # Hopper wgmma kernel, per_thread quantisation, V zero-padded to 128 tokens.  ``into_q``: one head group
    # of the path that writes the output into q's own memory (q is handed over by the call site, and each
    # head's q is quantised before its output is written): no output buffer; K's mean comes from a
    # matrix-vector product for the whole call (registry.sm90_key_mean: no reduction buffer); V is quantised
    # first, from its strided heads, and copied out with its padding only where SageAttention's transpose
    # (which pads to 64 tokens) falls short of 128; then K's copy and the INT8 q and k beside the FP8 V.  The
    # group's peak is the larger of the two steps.
    Dp, Eq, Ek, pad, km = _common2(a)
    sc = 4 * a.B * (32 * a.Hq * _c(a.Nq, 64) + 4 * a.hkv * _c(a.Nk, 128))
    nk128 = 128 * _c(a.Nk, 128)
    vt = a.s * a.B * a.hkv * Dp * nk128
    v8 = a.B * a.hkv * Dp * nk128
    vs = 8 * a.B * a.hkv * Dp
    kt = a.s * Ek
    if into_q:
        vc = vt if 0 < a.Nk % 128 <= 64 else 0
        return pad + max(vc + vt + v8 + vs, v8 + vs + km + Eq + Ek + sc + kt)
    vc = vt if a.Nk % 128 else 0
    return pad + km + Eq + Ek + sc + max(kt, a.s * Eq + vc + vt + v8 + vs)


def _ck_int8(a: AttnShape) -> int:
    # comfy-kitchen int8_attention (CUDA): int8 q, k and v (v padded to the key tile), fp32
    # q/k/v scales, one int32 anchor per (batch, kv head), and a [B,H,N,Dk] output.
    Dk = 64 if a.D <= 64 else 128 if a.D <= 128 else 256
    Eq, Ek = a.B * a.Hq * a.Nq * Dk, a.B * a.hkv * a.Nk * Dk
    pad = a.s * (Eq + 2 * Ek) if a.D != Dk else 0
    cta = 128 if (Dk >= 128 and a.Nk > 1024) else 64
    q_sc = 4 * a.B * a.Hq * _c(a.Nq, 128) * (64 if Dk == 256 else 32)
    k_sc = 4 * a.B * a.hkv * _c(a.Nk, cta) * 4
    v8 = a.B * a.hkv * Dk * cta * _c(a.Nk, cta)
    v_sc = 4 * a.B * a.hkv * Dk
    out = (2 if a.s == 4 else a.s) * Eq + (4 * Eq if a.s == 4 else 0)
    return pad + Eq + Ek + q_sc + k_sc + v8 + v_sc + out + 4 * a.B * a.hkv


MEMORY_PATHS = {
    "sdpa": _sdpa,
    "sdpa_flash": lambda a: _sdpa(a, flash=True),
    "sage1": _sage1,
    "sage2_fp16_triton": _sage2_triton,
    "sage2_fp16_cuda": _sage2_fp16_cuda,
    "sage2_fp8_cuda": _sage2_fp8_cuda,
    "sage2_fp8_cuda_perwarp": lambda a: _sage2_fp8_cuda(a, per_warp=True),
    "sage2_sm90": _sage2_sm90,
    "sage2_sm90_into_q": lambda a: _sage2_sm90(a, into_q=True),
    "ck_int8": _ck_int8,
}


# The paths that write the output into q's memory (no output buffer; a split allocates no full output).
INTO_Q_PATHS = frozenset({"sage2_sm90_into_q"})


def extra_bytes(path: str, shape: AttnShape) -> int:
    """Peak bytes the kernel behind ``path`` allocates beyond q, k, v (output included)."""
    try:
        fn = MEMORY_PATHS[path]
    except KeyError:
        raise ValueError(f"unknown memory path {path!r}; known: {', '.join(sorted(MEMORY_PATHS))}") from None
    return int(fn(shape))


def with_margin(nbytes: int) -> int:
    """The formula plus the caching allocator's rounding: 4 MiB + 0.1 %."""
    return int(nbytes * 1.001) + (4 << 20)
