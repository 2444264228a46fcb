"""PyTorch SDPA with ComfyUI's attention-function signature: the fallback for every declined call.

ComfyUI's adapter passes its own ``attention_pytorch`` instead when it runs inside ComfyUI;
this implementation serves the CLI, the tests, and hosts whose raw function is not found.
"""
from __future__ import annotations

import torch.nn.functional as F

__all__ = ["attention_sdpa"]


def attention_sdpa(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):
    """q/k/v as ComfyUI passes them: [B, N, H*D] (k/v may be 4-D [B, N, Hk, D]) or, with
    ``skip_reshape``, [B, H, N, D].  Accepts ``scale`` and ``enable_gqa``; ignores other kwargs."""
    scale = kwargs.get("scale")
    enable_gqa = bool(kwargs.get("enable_gqa", False))
    if skip_reshape:
        b, _, _, dim_head = q.shape
        q4, k4, v4 = q, k, v
    else:
        b, _, c = q.shape
        dim_head = c // heads
        q4 = q.reshape(b, -1, heads, dim_head).transpose(1, 2)
        hk = k.shape[-1] // dim_head if k.ndim == 3 else k.shape[-2]
        k4 = k.reshape(b, -1, hk, dim_head).transpose(1, 2)
        v4 = v.reshape(b, -1, hk, dim_head).transpose(1, 2)
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    extra = {}
    if scale is not None:
        extra["scale"] = scale
    if enable_gqa or k4.shape[1] != q4.shape[1]:
        extra["enable_gqa"] = True
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, dropout_p=0.0, is_causal=False, **extra)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, q4.shape[1] * dim_head)
