"""One rank of the two-process Ulysses test (tests/unit/test_inner_attention_distributed.py), run in a process
of its own by torch.multiprocessing's spawn.

It does what xFuser's long-context attention does around Raylight's inner-attention processor, with a plain
all-to-all written here on gloo (yunchang and xFuser do not run on the CPU): q, k, v arrive as this rank's
[B, N/U, H, D] slice of the sequence, an all-to-all turns them into [B, N, H/U, D] (the full sequence, this
rank's heads), the processor computes attention on that share with ``dense`` being local SDPA (the ring
function at ring degree 1), and a second all-to-all turns the output back into [B, N/U, H, D].

The kernel is a fake installed through ``fake_device.install`` (tests/fake_device.py; SDPA in fp32 on the
CPU); with ``oom_rank`` it raises torch's out-of-memory error on that rank only, so that rank falls back to
``dense`` while the other stays on the kernel.
"""
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
if "wan_sage" not in sys.modules:  # load this checkout as wan_sage, as tests/conftest.py does
    spec = importlib.util.spec_from_file_location("wan_sage", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["wan_sage"] = module
    spec.loader.exec_module(module)

sys.path.insert(0, str(ROOT / "tests"))
import fake_device  # noqa: E402

B, N, H, D = 1, 2048, 4, 64
CALLS = 2  # two attention calls: the collectives after a fallback must still line up


def inputs(call: int):
    """The full q, k, v [B, N, H, D] of call ``call`` (the same on every rank and in the parent)."""
    g = torch.Generator().manual_seed(1000 + call)
    return tuple(torch.randn(B, N, H, D, generator=g).to(torch.bfloat16) for _ in range(3))


def reference(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2)


def all_to_all(x, scatter_dim: int, gather_dim: int, world: int):
    """Split ``x`` in ``world`` chunks along ``scatter_dim``, send chunk i to rank i, and concatenate what
    arrives along ``gather_dim`` (xFuser's SeqAllToAll4D), built from gloo's all_gather."""
    chunks = [c.contiguous() for c in x.chunk(world, dim=scatter_dim)]
    rank = dist.get_rank()
    received = []
    for owner in range(world):  # every rank takes part in every gather, in the same order
        gathered = [torch.empty_like(chunks[owner]) for _ in range(world)]
        dist.all_gather(gathered, chunks[owner])
        if owner == rank:
            received = gathered
    return torch.cat(received, dim=gather_dim)


def _fake_gpu(oom: bool):
    def kernel(q, k, v, tensor_layout="HND", sm_scale=None, **kwargs):
        if oom:
            raise torch.OutOfMemoryError("fake out of memory on this rank")
        if tensor_layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=sm_scale).to(q.dtype)
        return o.transpose(1, 2) if tensor_layout == "NHD" else o
    fake_device.install({"sage2_sm90": kernel})


def dense(q, k, v, **kwargs):
    """The ring function at ring degree 1: attention on this rank's heads, returned as (out, lse, None)."""
    return reference(q, k, v).to(q.dtype), None, None


def run(rank: int, world: int, port: int, out_dir: str, oom_rank: int):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        _fake_gpu(oom=rank == oom_rank)
        from wan_sage.attention import stats
        from wan_sage.attention.config import PatchConfig
        from wan_sage.attention.inner_attention import InnerAttention
        from wan_sage.attention.override import SageAttentionOverride

        processor = InnerAttention(SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=out_dir)))
        stats.begin_run(processor.override.patch_id)
        outputs = []
        for call in range(CALLS):
            q, k, v = (t.chunk(world, dim=1)[rank] for t in inputs(call))  # this rank's sequence slice
            q, k, v = (all_to_all(t, 2, 1, world) for t in (q, k, v))  # [B, N, H/U, D]
            out = processor(dense, q, k, v, transformer_options={}, softmax_scale=None, causal=False,
                            dropout_p=0.0, window_size=(-1, -1), group=None, joint_tensor_key=None)
            outputs.append(all_to_all(out, 1, 2, world))  # back to [B, N/U, H, D]
        summary = stats.end_run(processor.override.patch_id)
        dist.barrier()
        torch.save({"outputs": outputs, "summary": summary}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
