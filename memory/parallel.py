"""The estimate per rank of a multi-GPU Wan denoise (Raylight: xDiT USP, FSDP2, CFG parallel).

:class:`Parallel` holds the degrees: Ulysses ``U`` splits the heads (each rank attends over the full sequence
for ``H / U`` heads, after an all-to-all gathers the sequence), ring ``R`` splits the sequence (each rank
attends ``N / R`` queries against the keys passed round the ring); outside attention each rank holds
``N / (U * R)`` tokens.  CFG parallel puts the cond and uncond rows on different ranks, FSDP shards the
weights over every rank.  :func:`per_rank` gives the figures of one rank; :func:`..estimate.plan` calls it,
so the node, the route and ``wan-sage plan`` get the same numbers.  The terms:

* **tokens / heads per rank**: ``ceil(N / (U*R))`` tokens through the block, ``H / U`` heads in attention
  over ``ceil(N / R)`` tokens.
* **one block** ``= rows x ceil(N / R) x (H / U) x D x bytes``: one gathered q, k, v or output of a rank's
  attention call (the same size as the rank's own slice ``rows x N/(U*R) x H x D`` when ``R`` is 1).
* **all-to-all buffers** ``= 5 blocks``: the gathered q, k and v (3), the contiguous staging copy of the tensor
  being exchanged (1) and the output's receive buffer on the way back (1); the rank's own q, k, v slices stay
  alive with the caller (counted in the activations of its slice).  Modelled from xFuser's and yunchang's
  code, not measured.
* **attention per rank**: the gathered q, k, v (3 blocks) plus the kernel's extra bytes on the rank's
  [rows, H/U, N/R, N/R] call (:func:`attention.kernel_bytes.extra_bytes`, output included).
* **activations**: the single-GPU activation model run on the rank's slice of ``ceil(N / (U*R))`` tokens, with
  every weight resident (``working_bytes``) and with weights streamed (``streamed_working_bytes``: the rank's
  verdict streams weights against that one, as one GPU's does).
* **weights per rank**: with FSDP ``ceil(weights / world size)`` plus one block's weights gathered while it
  runs (``weights / layers``); without, every rank holds all weights.
* **CFG parallel**: the ``2B`` cond and uncond rows split over 2 ranks, ``B`` rows per rank in one forward
  per step (without it each rank runs cond and uncond one after the other).

Torch-free and ComfyUI-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.kernel_bytes import AttnShape, extra_bytes
from .activation_model import runs_uncond

__all__ = ["Parallel", "per_rank", "problem", "ALL_TO_ALL_BLOCKS", "DEGREE_MAX"]

ALL_TO_ALL_BLOCKS = 5
DEGREE_MAX = 64


def _c(x: int, b: int) -> int:
    return -(-x // b)


@dataclass(frozen=True)
class Parallel:
    """The degrees of a multi-GPU run (all 1 / False: one GPU)."""

    ulysses: int = 1
    ring: int = 1
    fsdp: bool = False
    cfg_parallel: bool = False

    @property
    def cfg_degree(self) -> int:
        return 2 if self.cfg_parallel else 1

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.cfg_degree

    @property
    def active(self) -> bool:
        return self.world_size > 1 or self.fsdp


def problem(par: Parallel, heads: int, cfg: float) -> tuple | None:
    """(field, what is wrong and the fix) when the degrees cannot run this model, else None."""
    if heads % par.ulysses:
        fits = [u for u in range(1, min(heads, DEGREE_MAX) + 1) if heads % u == 0]
        return "ulysses", (f"must divide the model's {heads} heads (Ulysses splits the heads over ranks), got "
                           f"{par.ulysses}: use one of {', '.join(map(str, fits))}")
    if par.cfg_parallel and not runs_uncond(cfg):
        return "cfg_parallel", "needs a cfg other than 1 (an uncond pass to put on the second rank): set cfg or drop it"
    return None


def per_rank(par: Parallel, dims, tokens: int, rows: int, dtype_bytes: int, self_path: str,
             weights_bytes: int | None, activation_totals, uncond: bool = False) -> dict:
    """The figures of one rank (see the module docstring).  ``rows``: rows per forward on one GPU (``B``);
    ``activation_totals(local_tokens)``: the activation model's totals for one forward of the rank's slice, with
    every weight resident and with weights streamed (the streaming and fragmentation terms added);
    ``uncond``: the sampler runs an uncond pass (cfg not 1)."""
    H, D = dims.num_heads, dims.head_dim
    seq_ranks = par.ulysses * par.ring
    local = _c(tokens, seq_ranks)
    attn_tokens = _c(tokens, par.ring)
    heads = H // par.ulysses
    block = rows * attn_tokens * heads * D * dtype_bytes
    a2a = ALL_TO_ALL_BLOCKS * block if par.ulysses > 1 else 0
    kernel = extra_bytes(self_path, AttnShape(rows, heads, attn_tokens, attn_tokens, D, dtype_bytes))
    activations, streamed = (int(x) for x in activation_totals(local))
    if weights_bytes is None:
        weights = None
    elif par.fsdp:
        weights = _c(weights_bytes, par.world_size) + _c(weights_bytes, dims.num_layers)
    else:
        weights = weights_bytes
    working = activations + a2a
    return {
        "ulysses": par.ulysses, "ring": par.ring, "fsdp": par.fsdp, "cfg_parallel": par.cfg_parallel,
        "world_size": par.world_size, "tokens": tokens, "tokens_per_rank": local, "attention_tokens": attn_tokens,
        "heads_per_rank": heads, "rows_per_rank": rows, "forwards_per_step": 2 if uncond and not par.cfg_parallel else 1,
        "block_bytes": block, "all_to_all_bytes": a2a, "attention_bytes": 3 * block + kernel,
        "activation_bytes": activations, "working_bytes": working, "streamed_working_bytes": streamed + a2a,
        "weights_bytes": weights,
        "total_bytes": None if weights is None else weights + working,
    }
