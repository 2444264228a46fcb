"""Whether torch.compile pays back for one model's sampling: what compiling costs the first prompt of a
fresh process, what each compiled step saves, and the step count at which the two meet.

The scaling is the physics of the two terms, not a fit to the runs it is checked on:

* **Compiling costs per distinct graph.**  Blocks compiled one by one share one graph (every Wan block runs
  the same code), and a second model with the same blocks (Wan 2.2 A14B's other expert) reuses it while its
  weights are resident.  With weights streamed ComfyUI's per-block lowvram state (a LoRA's patch of each
  streamed block) is guarded on, so up to one graph per block is compiled, and a second expert may compile
  them again.  A whole-model compile is one graph with every block inlined, so its cost grows with the block
  count.  The first graph of a fresh process also builds the Triton kernels; a later graph of the same block
  code reuses most of them.
* **Compiling saves what inductor fuses**: the elementwise chains between the GEMMs and the attention (RoPE,
  norms, modulation, GELU, residuals), whose traffic is tokens x channels per block and row.  The GEMMs and the
  attention (SDPA, or the Sage custom op) run the same kernels compiled or not, so the saving per forward is
  the same with SDPA and with Sage and scales with rows x tokens x dim x blocks, not with the step time.

One forward per step is counted (Euler and the other one-call samplers); a sampler that calls the model twice
per step saves twice as much per step.  Pure Python: no torch, no ComfyUI.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .activation_model import WanDims

__all__ = ["Payback", "compile_payback", "FIRST_GRAPH_S", "STREAMED_GRAPH_S", "KEPT_GRAPH_S",
           "WHOLE_MODEL_S_PER_BLOCK", "GAIN_S_PER_TOKEN_CHANNEL_BLOCK"]

# Constants set from H200 records (ComfyUI 0.3.64, torch 2.11, inductor); bench/tests/test_compile_payback_records.py
# checks them on records they were not set from.
#
# The first graph of a fresh process (inductor's caches empty): 20 s.  Set from bench/records/compile/table.jsonl:
# its first compiled configuration, A14B blocks compiled one by one, took 31.28 s for its first forward against
# 11.32 s for the next (19.96 s).
FIRST_GRAPH_S = 20.0
# Each further graph with weights streamed, up to one per block: 1.8 s.  Set from
# bench/records/e2e/fp8-compiled-24gib.jsonl: its high-noise experts that compiled one graph per block (40, weights
# streamed, a LoRA) took 55.1-110.4 s, (x - 20) / 39 = 0.9-2.3 s each.
STREAMED_GRAPH_S = 1.8
# The block graph in a fresh process that hot-loads the pack's compile file of this run (nodes/compile_cache.py),
# inductor's and Triton's own folders empty at the path they had before (as after a reboot): 5 s.  Set from
# bench/records/whole-prompt/gguf-720p81-4steps-compiled-blocks.jsonl, round l, process 2: A14B 720p81 at 16 GiB,
# its streamed blocks lifted into the block graph, its first compiled step 14.38 s against 9.29 s for the next
# (5.09 s; dynamo 3.6 s of it).  Its resident low-noise expert then recompiled once (1.56 s) on a guard on
# ComfyUI-GGUF's LoRA lists, which blocks never moved share; the node's cast no longer lets dynamo see them
# (nodes/gguf_cast.py, plain_casts; not measured on the GPU yet).  Only this graph: a graph traced with weights
# streamed and a whole-model compile were not measured with the file, so both keep their cost.  On rows it was not
# set from the cost measured 2.4-2.9 s (832x480x81 on the H200 and an H100, 1280x720x81 on the H100), so it errs
# long: the payback it gives comes no earlier than the real one.
# Processes whose inductor folder had a new path at each start (the harness before it kept one) are not evidence:
# the file's kernels look for their autotuning beside the path they were compiled under, missed it and were
# benchmarked again (docs/attention.md, "The path of torch's cache folder").
KEPT_GRAPH_S = 5.0
# The whole diffusion model as one graph (TorchCompileModel's default key), per block inlined: 9 s.  Set from
# bench/records/e2e/gguf-compile.jsonl: the whole-model compile of A14B's 40 blocks took 359.9 s.
WHOLE_MODEL_S_PER_BLOCK = 9.0
# Seconds a compiled forward saves per row, token, channel and block.  Set from bench/records/compile/table.jsonl:
# A14B 1280x720x81 (75,600 tokens, dim 5120, 40 blocks) per forward, eager against compiled, SDPA 12.114 against
# 11.322 s and Sage 9.767 against 8.928 s: about 0.8 s with either attention.
GAIN_S_PER_TOKEN_CHANNEL_BLOCK = 0.8 / (75_600 * 5120 * 40)


@dataclass(frozen=True)
class Payback:
    """Compiling one model against running it eagerly, for the first prompt of a fresh process."""

    whole_model: bool  # one graph for the whole diffusion model (else the blocks one by one)
    graphs: int  # the distinct graphs this model compiles (at most: with weights streamed, one per block)
    compile_s: float  # what compiling them costs, in seconds
    shared_by: int  # the models that compile these graphs once between them (each bears its share)
    step_gain_s: float  # what one compiled step saves, in seconds
    payback_steps: int  # the steps per model after which compiling has saved its share
    steps: int | None  # the steps this model samples (None: not known)
    kept: bool = False  # compile_s is that of a process that finds the pack's compile file of this run

    @property
    def pays_back(self) -> bool | None:
        """Whether this model's steps save its share of the compile (None when the steps are not known)."""
        return None if self.steps is None else self.steps >= self.payback_steps

    @property
    def payback_prompt(self) -> int | None:
        """The prompt of one process (1: its first) by whose end compiling has saved this model's share: a process
        compiles once, on its first prompt, and every prompt of this model's steps saves them again (None when the
        steps are not known or none)."""
        if not self.steps:
            return None
        return max(1, math.ceil(round(self.compile_s / self.shared_by / (self.step_gain_s * self.steps), 6)))


def compile_payback(dims: WanDims, tokens: int, rows: int = 1, steps: int | None = None, *,
                    whole_model: bool = False, streamed: bool = False, shared_by: int = 1,
                    kept: bool = False, compiled_blocks: int | None = None, staged_blocks: int = 0) -> Payback:
    """The payback of compiling ``dims``' model for a sampling of ``steps`` steps of ``rows`` rows (batch, times 2
    with an uncond pass) of ``tokens`` tokens.  ``streamed``: its weights are partly offloaded; ``shared_by``:
    the models of one schedule with these blocks (2 for the two experts of Wan 2.2 A14B), which share the graph
    only with resident weights; ``kept``: the pack keeps a compile file of this run, which a fresh process
    hot-loads (it shortens only the block graph of resident weights); ``compiled_blocks``: the blocks that run
    compiled where fewer than all do (Wan Compile Blocks with weights streamed: the saving of those blocks only);
    ``staged_blocks``: of those, the blocks that run the graph of a block with its weights staged (Wan Compile
    Blocks), a second graph beside the resident block's where some blocks are resident, costing a first graph's
    time (its kept file is not measured) and taken to save what a resident block saves (not measured)."""
    blocks = max(1, int(dims.num_layers))
    if whole_model:
        graphs, compile_s = 1, WHOLE_MODEL_S_PER_BLOCK * blocks
    elif streamed:
        graphs = blocks
        compile_s = FIRST_GRAPH_S + STREAMED_GRAPH_S * (blocks - 1)
    else:
        graphs, compile_s = 1, KEPT_GRAPH_S if kept else FIRST_GRAPH_S
        staged = max(0, int(staged_blocks))
        if staged and (compiled_blocks is None or staged < int(compiled_blocks)):
            graphs, compile_s = 2, compile_s + FIRST_GRAPH_S
        elif staged:
            compile_s = FIRST_GRAPH_S  # the staged graph alone
    kept = kept and not whole_model and not streamed
    shared = 1 if streamed else max(1, int(shared_by))
    runs = blocks if compiled_blocks is None else max(1, min(blocks, int(compiled_blocks)))
    gain = GAIN_S_PER_TOKEN_CHANNEL_BLOCK * max(1, int(rows)) * max(1, int(tokens)) * dims.dim * runs
    payback = max(1, math.ceil(round(compile_s / shared / gain, 6)))  # rounded: 25.0000001 is 25 steps
    return Payback(whole_model=whole_model, graphs=graphs, compile_s=compile_s, shared_by=shared, step_gain_s=gain,
                   payback_steps=payback, steps=None if steps is None else max(0, int(steps)), kept=kept)
