"""The accuracy bound a kernel's output must meet, and the check that measures it: a slice of the
output's query rows against PyTorch SDPA computed on the same rows of q (all of k and v), in the
call's dtype.

A shape's timing checks the first output of every candidate this way before it may serve the shape, and
the dispatcher checks the first calls of each (kernel, shape) and a sample after them
(:mod:`.execution`).  One check costs SDPA on :data:`CHECK_ROWS` query rows (every head), a
min/max reduction of the whole output for NaN/Inf, and one host sync.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["MAX_REL_L2", "MIN_COSINE", "CHECK_ROWS", "Verdict", "Reference", "reference", "check", "verdict",
           "bound_text"]

# The bound, against SDPA in the call's dtype on the same rows.  Measured on an H200 over the Wan
# shapes (relative L2 against an fp32 reference): sage2_sm90 0.036-0.039, ck_int8 0.014-0.017,
# sage2_fp16_triton 0.013, sage1 0.013, sage2_fp16_cuda 0.011, SDPA bf16 0.002.  Sage2's FP8-PV
# error of about 0.04 is the kernels' normal error; 0.10 leaves it a margin of 2.5x and still
# rejects any output that is noise (random or gray output is off by about 1 or more).  For an
# error uncorrelated with the output, cosine is about 1 - relL2^2 / 2, so 0.995 is the same bound
# on the angle; an output scaled wrong fails the relative L2 alone.  An output must pass both.
MAX_REL_L2 = 0.10
MIN_COSINE = 0.995
# Query rows compared, spread evenly over the sequence (the first and the last row included: the
# padded last tile is where kernels go wrong).  A few hundred rows of every head give a stable
# relative L2 and cost SDPA on those rows only.
CHECK_ROWS = 256


class Verdict(NamedTuple):
    """What one check found: ``failure`` None (within the bound), "nonfinite" (NaN/Inf anywhere
    in the output) or "inaccurate" (finite, beyond the bound), with the measured relative L2
    and cosine similarity on the compared rows."""

    failure: str | None
    rel_l2: float
    cosine: float


def bound_text() -> str:
    return f"relative L2 <= {MAX_REL_L2:g} and cosine >= {MIN_COSINE:g} against SDPA"


def _rows(nq: int, device) -> torch.Tensor:
    if nq <= CHECK_ROWS:
        return torch.arange(nq, device=device)
    return torch.linspace(0, nq - 1, CHECK_ROWS, device=device).round().long()


class Reference(NamedTuple):
    """SDPA's output on the compared query rows (``rows``), in the caller's output layout."""

    rows: torch.Tensor
    output: torch.Tensor
    out_layout: str


def reference(q4, k4, v4, layout: str, out_layout: str, scale) -> Reference:
    """SDPA on :data:`CHECK_ROWS` query rows of q4 and all of k4/v4 (``layout`` "NHD"
    [B, N, H, D] or "HND" [B, H, N, D]), in the caller's ``out_layout`` ("NHD": [B, rows, H*D];
    "HND": [B, H, rows, D]).  Runs on the GPU without a host sync."""
    token_dim = 1 if layout == "NHD" else 2
    rows = _rows(q4.shape[token_dim], q4.device)
    q_rows = q4.index_select(token_dim, rows)
    if layout == "NHD":
        q_rows, k4, v4 = (t.transpose(1, 2) for t in (q_rows, k4, v4))
    out = F.scaled_dot_product_attention(q_rows, k4, v4, scale=scale)  # [B, H, rows, D]
    if out_layout == "NHD":
        B, H, R, D = out.shape
        out = out.transpose(1, 2).reshape(B, R, H * D)
    return Reference(rows, out, out_layout)


def _measure(out, ref: Reference) -> torch.Tensor:
    """[min, max, |o - r|, |r|, o.r, |o|] of the output (min/max over all of it; the rest over
    the compared rows), as one fp32 tensor on the device: one host sync reads it."""
    lo, hi = torch.aminmax(out)
    o = out.index_select(1 if ref.out_layout == "NHD" else 2, ref.rows).float()
    r = ref.output.float()
    return torch.stack((lo.float(), hi.float(), torch.linalg.vector_norm(o - r), torch.linalg.vector_norm(r),
                        (o * r).sum(), torch.linalg.vector_norm(o)))


def verdict(values) -> Verdict:
    """The :class:`Verdict` of the six numbers :func:`_measure` returns."""
    lo, hi, diff, ref_norm, dot, out_norm = (float(x) for x in values)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return Verdict("nonfinite", math.inf, 0.0)
    if ref_norm > 0:
        rel = diff / ref_norm
    else:
        rel = 0.0 if diff == 0 else math.inf
    if out_norm > 0 and ref_norm > 0:
        cos = dot / (out_norm * ref_norm)
    else:
        cos = 1.0 if out_norm == ref_norm else 0.0
    ok = rel <= MAX_REL_L2 and cos >= MIN_COSINE
    return Verdict(None if ok else "inaccurate", rel, cos)


def check(out, ref: Reference) -> Verdict:
    """Is ``out`` (the whole output of the call, in the caller's layout) free of NaN/Inf and
    within the bound against ``ref`` on the compared rows?  One host sync."""
    return verdict(_measure(out, ref).tolist())
