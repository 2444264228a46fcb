"""Q4_K and Q6_K block quantisers in ggml's exact byte layout (vectorised torch, CPU or CUDA).

ggml's reference quantisers (``quantize_row_q4_K_ref`` / ``quantize_row_q6_K_ref``) search each
sub-block's scale iteratively; these use the closed-form start of that search (Q4_K: the
sub-block's min/max; Q6_K: the signed absolute maximum maps to -32) and then follow ggml step by
step: 6-bit (Q4_K) or int8 (Q6_K) sub-block scales relative to an fp16 super-block scale, ggml's
round-half-to-even ``nearest_int``, and its packing of scales, low and high bits.  The bytes decode
with any ggml-compatible dequantiser (ComfyUI-GGUF's ``dequant.py``, ``gguf.quants``,
llama.cpp) to within the quantisation step.  Block layouts (QK_K = 256 values per block):

* ``block_q4_K`` (144 B): ``d`` fp16, ``dmin`` fp16, ``scales[12]`` (8 six-bit scales and 8
  six-bit mins), ``qs[128]`` (4-bit quants; byte ``32*j + l`` holds value ``64*j + l`` in its low
  nibble and ``64*j + 32 + l`` in its high nibble).  Value = ``d*sc[s]*q - dmin*m[s]``.
* ``block_q6_K`` (210 B): ``ql[128]`` (low 4 bits), ``qh[64]`` (high 2 bits), ``scales[16]``
  int8, ``d`` fp16.  Value = ``d*scales[s]*(q - 32)``.
"""
from __future__ import annotations

import torch

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}

__all__ = ["QK_K", "BLOCK_BYTES", "quantize", "quantize_q4_k", "quantize_q6_k", "dequantize_q4_k",
           "dequantize_q6_k", "row_bytes"]


def row_bytes(qtype: str, cols: int) -> int:
    if cols % QK_K:
        raise ValueError(f"{qtype} needs rows whose length is a multiple of {QK_K}, not {cols}")
    return cols // QK_K * BLOCK_BYTES[qtype]


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(nb, 1) float -> (nb, 2) uint8 little-endian fp16."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., n*256] -> uint8 [..., n*144] (one ``block_q4_K`` per 256 values, row-major)."""
    lead = x.shape[:-1]
    nbytes = row_bytes("Q4_K", x.shape[-1])         # checks the row length
    xb = x.reshape(-1, 8, 32).float()
    mn = xb.amin(-1).clamp(max=0.0)                 # ggml keeps min <= 0
    mx = xb.amax(-1)
    scale = (mx - mn) / 15.0                        # (nb, 8)
    mins = -mn
    max_scale = scale.amax(-1, keepdim=True)
    max_min = mins.amax(-1, keepdim=True)
    inv_scale = torch.where(max_scale > 0, 63.0 / max_scale.clamp(min=1e-30), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, 63.0 / max_min.clamp(min=1e-30), torch.zeros_like(max_min))
    ls = torch.round(inv_scale * scale).clamp(0, 63).to(torch.int32)
    lm = torch.round(inv_min * mins).clamp(0, 63).to(torch.int32)
    d16 = (max_scale / 63.0).to(torch.float16)
    dmin16 = (max_min / 63.0).to(torch.float16)
    dl = d16.float() * ls                           # effective sub-block scale
    ml = dmin16.float() * lm                        # effective sub-block min (positive)
    safe = torch.where(dl > 0, dl, torch.ones_like(dl))
    L = torch.round((xb + ml.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp(0, 15)
    L = torch.where((dl > 0).unsqueeze(-1), L, torch.zeros_like(L)).to(torch.int32)   # (nb, 8, 32)
    sc = torch.empty(xb.shape[0], 12, dtype=torch.int32, device=x.device)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    L = L.reshape(-1, 4, 2, 32)
    qs = (L[:, :, 0, :] | (L[:, :, 1, :] << 4)).reshape(-1, 128)
    out = torch.cat([_fp16_bytes(d16), _fp16_bytes(dmin16), sc.to(torch.uint8), qs.to(torch.uint8)], dim=1)
    return out.reshape(*lead, nbytes)


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., n*256] -> uint8 [..., n*210] (one ``block_q6_K`` per 256 values, row-major)."""
    lead = x.shape[:-1]
    nbytes = row_bytes("Q6_K", x.shape[-1])         # checks the row length
    xb = x.reshape(-1, 16, 16).float()
    idx = xb.abs().argmax(-1, keepdim=True)
    peak = xb.gather(-1, idx).squeeze(-1)           # signed value of largest magnitude (nb, 16)
    scale = peak / -32.0                            # make_qx_quants(nmax=32) start: peak -> -32
    j = scale.abs().argmax(-1, keepdim=True)
    max_scale = scale.gather(-1, j)                 # signed, largest |scale| (nb, 1)
    nz = max_scale != 0
    iscale = torch.where(nz, -128.0 / torch.where(nz, max_scale, torch.ones_like(max_scale)), torch.zeros_like(max_scale))
    d16 = torch.where(nz, 1.0 / torch.where(nz, iscale, torch.ones_like(iscale)), torch.zeros_like(iscale)).to(torch.float16)
    sc = torch.round(iscale * scale).clamp(-128, 127)                        # int8 scales (nb, 16)
    dl = d16.float() * sc
    safe = torch.where(dl != 0, dl, torch.ones_like(dl))
    q = torch.round(xb / safe.unsqueeze(-1)).clamp(-32, 31)
    L = (torch.where((dl != 0).unsqueeze(-1), q, torch.zeros_like(q)) + 32).to(torch.int32)
    L = L.reshape(-1, 2, 4, 32)                     # [block, half of 128, quarter, l]
    ql_lo = (L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4)
    ql_hi = (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)
    ql = torch.cat([ql_lo, ql_hi], dim=2).reshape(-1, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(-1, 64)
    out = torch.cat([ql.to(torch.uint8), qh.to(torch.uint8),
                     sc.to(torch.int8).view(torch.uint8), _fp16_bytes(d16)], dim=1)
    return out.reshape(*lead, nbytes)


def quantize(x: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype == "Q4_K":
        return quantize_q4_k(x)
    if qtype == "Q6_K":
        return quantize_q6_k(x)
    raise ValueError(f"unsupported K-quant {qtype!r}")


# --------------------------------------------------------------------------- decoders (for checks)

def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n*144] -> float32 [..., n*256], written from ggml's ``dequantize_row_q4_K``."""
    lead = b.shape[:-1]
    blk = b.reshape(-1, 144)
    d = blk[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blk[:, 2:4].contiguous().view(torch.float16).float()
    s = blk[:, 4:16].to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    qs = blk[:, 16:].to(torch.int32).reshape(-1, 4, 32)
    q = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    y = d.unsqueeze(-1) * sc.unsqueeze(-1) * q - dmin.unsqueeze(-1) * mn.unsqueeze(-1)
    return y.reshape(*lead, -1)


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n*210] -> float32 [..., n*256], written from ggml's ``dequantize_row_q6_K``."""
    lead = b.shape[:-1]
    blk = b.reshape(-1, 210)
    ql = blk[:, 0:128].to(torch.int32).reshape(-1, 2, 64)
    qh = blk[:, 128:192].to(torch.int32).reshape(-1, 2, 32)
    sc = blk[:, 192:208].contiguous().view(torch.int8).float()
    d = blk[:, 208:210].contiguous().view(torch.float16).float()
    q1 = (ql[:, :, 0:32] & 0xF) | (((qh >> 0) & 3) << 4)
    q2 = (ql[:, :, 32:64] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[:, :, 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[:, :, 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    q = torch.stack([q1, q2, q3, q4], dim=2).reshape(-1, 16, 16).float() - 32
    y = d.unsqueeze(-1) * sc.unsqueeze(-1) * q
    return y.reshape(*lead, -1)
