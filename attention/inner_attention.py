"""The Sage patch as an inner-attention processor for multi-GPU sequence parallelism (Raylight's USP).

Raylight (komikndr/raylight) runs Wan's attention through xFuser's long-context attention: an Ulysses
all-to-all gives each rank the full sequence for its share of the heads ([B, N, H/U, D]), a "ring
function" computes attention on that share, and a second all-to-all hands the output back.  Its
inner-attention API lets a node replace the ring function: the processor object stored in
``transformer_options["raylight_inner_attention"]`` of a model clone is called as
``processor(dense, q, k, v, transformer_options=..., **kwargs)``, where ``dense`` is the ring
function it replaces and ``kwargs`` are the flash-attention options xFuser passes (``softmax_scale``,
``causal``, ``dropout_p``, ``group`` (the ring process group), the joint tensors, ...).  Raylight's
scope refuses a processor under ring degree > 1 unless it says ``supports_ring`` (komikndr/raylight
src/raylight/distributed_modules/inner_attention/dispatcher.py@55ea37bbbc1ec241c794269703e62ad937806d7a; xFuser's call:
xdit-project/xDiT xfuser/core/long_ctx_attention/hybrid/attn_layer.py@0058bb0089d06773949bf40b0867fed519562d61).

:class:`InnerAttention` is that processor for a :class:`.override.SageAttentionOverride`: each rank
runs the pack's dispatch (measured kernel choice, free-memory check, head groups, fallbacks, sampled
accuracy checks, stats) on its [B, N, H/U, D] share, and every call the dispatch would serve on SDPA
goes to ``dense`` instead, with its reason counted.  Two more reasons are decided here before the
dispatch sees the call:

=========  =========================================================================================
ring       the ring process group has more than one rank: ring attention merges partial outputs by
           their fp32 log-sum-exp, which the Sage kernels do not return, so ``supports_ring`` is False
options    xFuser asked for what the kernels do not do: causal, dropout, a window, ALiBi, attention
           probabilities, joint tensors, a KV cache, fp8 descales, or q/k/v that are not 4-D alike
=========  =========================================================================================

**No collective, so no deadlock.**  The processor runs entirely rank-local, between the two
all-to-alls that xFuser makes on every rank whatever the processor does.  A fallback (out of memory on
one rank, an error, a failed accuracy check, a shape settled on SDPA) calls ``dense`` on that rank's
own share; with ring degree 1 ``dense`` is local attention and makes no collective either.  Every rank
therefore completes the same collectives in the same order, whichever ranks fall back; decisions,
fallbacks and stats are per rank (per process), and nothing is agreed between ranks.

This module imports neither ComfyUI nor Raylight; the processor is immutable, holds no tensors,
deep-copies to itself and pickles by its arguments (Ray ships model options between processes).
"""
from __future__ import annotations

import contextvars
import sys

from . import stats
from .config import PatchConfig
from .override import SageAttentionOverride

__all__ = ["InnerAttention", "INNER_ATTENTION_KEY", "PROCESSOR_NAME", "ring_size"]

# The transformer_options key Raylight reads its processor from, and the namespaced name the pack
# registers its processor factory under in Raylight's registry (when Raylight is loaded).
INNER_ATTENTION_KEY = "raylight_inner_attention"
PROCESSOR_NAME = "wan_sage:sage_attention"

# The ring function of the call being served, for the dispatch's SDPA fallback (one per thread/task).
_DENSE = contextvars.ContextVar("wan_sage_inner_dense", default=None)

# xFuser's options whose default is the only value the Sage kernels serve.
_DEFAULT_OPTIONS = {"causal": False, "dropout_p": 0.0, "alibi_slopes": None, "return_attn_probs": False,
                    "attn_layer": None, "joint_tensor_key": None, "joint_tensor_value": None,
                    "q_descale": None, "k_descale": None, "v_descale": None}


def ring_size(group) -> int:
    """Ranks in the ring process group ``group`` (1 without torch.distributed or without a group)."""
    if group is None:
        return 1
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _options_reason(q, k, v, kwargs) -> str | None:
    for name, default in _DEFAULT_OPTIONS.items():
        value = kwargs.get(name, default)
        if (value is not None) if default is None else (value != default):
            return "options"
    window = kwargs.get("window_size")
    if window is not None and tuple(window) != (-1, -1):
        return "options"
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        return "options"
    return None


def _dense_sdpa(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                **kwargs):
    """The dispatch's SDPA for a processor call: the ring function it replaced, on [B, N, H*D] views of the
    call's [B, N, H, D] tensors (the only form :meth:`InnerAttention.__call__` hands the dispatch)."""
    dense, options = _DENSE.get()
    B, N = q.shape[0], q.shape[1]
    D = q.shape[-1] // heads
    out = dense(q.view(B, N, heads, D), k.view(k.shape[0], k.shape[1], heads, D),
                v.view(v.shape[0], v.shape[1], heads, D), **options)
    if isinstance(out, tuple):
        out = out[0]
    return out.reshape(B, N, heads * D)


class _DenseView(SageAttentionOverride):
    """The patch's override with ``dense`` as its SDPA: the same options, call keys and patch id (so its
    calls are counted in the patch's stats window), not registered as a live patch."""

    __slots__ = ()

    def __init__(self, main: SageAttentionOverride):
        for name in ("config", "free_memory", "patch_id", "config_key", "graph_key"):
            object.__setattr__(self, name, getattr(main, name))
        object.__setattr__(self, "prev", None)
        object.__setattr__(self, "sdpa", _dense_sdpa)

    def __reduce__(self):
        raise TypeError("a _DenseView is rebuilt from its InnerAttention, never pickled")


class InnerAttention:
    """``processor(dense, q, k, v, *, transformer_options=None, **kwargs)`` with q/k/v [B, N, H, D]
    (the rank's share of heads, the full sequence) returns the [B, N, H, D] output: the Sage patch's
    dispatch where it takes the call, else ``dense(q, k, v, **kwargs)``.  ``prev``: a processor that was
    in the slot before; the calls this one leaves to ``dense`` go to it instead."""

    __slots__ = ("override", "prev", "_view", "__weakref__")
    supports_ring = False

    def __init__(self, override: SageAttentionOverride, prev=None):
        if not isinstance(override, SageAttentionOverride):
            raise TypeError("InnerAttention needs the Sage patch's SageAttentionOverride")
        object.__setattr__(self, "override", override)
        object.__setattr__(self, "prev", prev)
        object.__setattr__(self, "_view", _DenseView(override))

    @classmethod
    def create(cls, **options) -> "InnerAttention":
        """A processor with its own patch of :class:`.config.PatchConfig` ``options``: the factory registered
        in Raylight's registry as :data:`PROCESSOR_NAME` (``create_inner_attention(name, **options)``)."""
        return cls(SageAttentionOverride(PatchConfig(**options)))

    def __setattr__(self, name, value):
        raise AttributeError("InnerAttention is immutable")

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def __reduce__(self):
        return (InnerAttention, (self.override, self.prev))

    def __repr__(self):
        return f"InnerAttention(patch={self.override.patch_id}, chained={self.prev is not None})"

    def _dense(self, dense, q, k, v, transformer_options, kwargs):
        if self.prev is not None:
            return self.prev(dense, q, k, v, transformer_options=transformer_options, **kwargs)
        return dense(q, k, v, **kwargs)

    def __call__(self, dense, q, k, v, *, transformer_options=None, **kwargs):
        reason = "ring" if ring_size(kwargs.get("group")) > 1 else _options_reason(q, k, v, kwargs)
        if reason is not None:
            stats.count_sdpa(self.override.patch_id, reason)
            return self._dense(dense, q, k, v, transformer_options, kwargs)
        if self.prev is not None:  # the fallback goes through the previous processor
            prev, options = self.prev, transformer_options

            def dense_or_prev(q_, k_, v_, **kw):
                return prev(dense, q_, k_, v_, transformer_options=options, **kw)
            fallback = dense_or_prev
        else:
            fallback = dense
        B, N, H, D = q.shape
        token = _DENSE.set((fallback, kwargs))
        try:
            out = self._view(None, q.reshape(B, N, H * D), k.reshape(k.shape[0], k.shape[1], H * D),
                             v.reshape(v.shape[0], v.shape[1], H * D), heads=H, scale=kwargs.get("softmax_scale"))
        finally:
            _DENSE.reset(token)
        return out.view(B, N, H, D)
