"""gpu tier, two GPUs: the Sage patch as Raylight's inner attention under xFuser's Ulysses attention.

Run on a machine with 2 CUDA devices, one process a GPU, as
``torchrun --nproc_per_node=2 -m pytest -q -rs tests/gpu/test_raylight_usp.py`` with xFuser, yunchang,
Raylight's source and SageAttention importable (docs/multi-gpu.md, "On two GPUs").  Without torchrun, with
fewer than 2 GPUs or without one of those packages the module skips with the reason.

Each rank initialises torch.distributed (nccl) and xFuser's parallel state with Ulysses degree 2, ring
degree 1, as Raylight's actors do (``dist.init_process_group``, then xFuser's
``init_distributed_environment`` and ``initialize_model_parallel``: komikndr/raylight
src/raylight/distributed_worker/parallel_group_manager.py@c0495710d960c413443727b5c640e22d6bd9ef61).
It builds Raylight's attention function with ``make_xfuser_attention`` (xFuser's
``xFuserLongContextAttention`` with Raylight's inner-attention dispatcher on its ``ring_attn_fn``:
komikndr/raylight src/raylight/distributed_modules/attention.py@55ea37bbbc1ec241c794269703e62ad937806d7a).
Where the Raylight on the path has no inner-attention API (``raylight.distributed_modules.inner_attention``),
the test builds ``xFuserLongContextAttention`` itself and puts the same call contract on its
``ring_attn_fn`` (``processor(dense, q, k, v, transformer_options=..., **kwargs)``); the row's ``hook``
says which ran.

One A14B 720p81 self-attention call (75,600 tokens, 40 heads of 128, bf16; each rank holds
[1, 37,800, 40 x 128]) runs through it twice per rank: with Raylight's own inner attention (no processor,
``ring_attn_fn`` with ``attn_type`` Raylight's default ``TORCH_FLASH``; ``WAN_SAGE_XFUSER_ATTN`` picks
another yunchang ``AttnType``), and with the pack's processor put into ``transformer_options`` by
:func:`wan_sage.nodes.raylight_bridge.install_inner_attention`, as the patch node does.

Per rank, one row: s/call of both (medians of interleaved calls, each started after a barrier), the peak
above the inputs (``torch.cuda.max_memory_allocated`` during one call, output included) of both, the pack's
per-rank estimate for the same call (``wan-sage plan --ulysses 2``'s figures: the all-to-all buffers plus
the attention's bytes, the gathered q, k and v counted once), relative L2 and cosine of the pack's output
against the default's on the rank's whole slice, and the rank's stats window (kernel counts, reasons,
``rank``).  Rank 0 prints the rows and writes them as JSON lines to ``$WAN_SAGE_GPU_TABLE`` when set.
Asserted: both ranks finished, and every rank's output within the accuracy bound
(:mod:`wan_sage.attention.accuracy`).  Times and bytes are reported, not asserted.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time

import pytest
import torch

WORLD = 2
ULYSSES, RING = 2, 1
NEEDED = ("xfuser", "yunchang", "raylight", "sageattention")


def skip_reason() -> str | None:
    """Why this machine or launch cannot run the test (every reason found), or None."""
    why = []
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        why.append("not launched under torchrun (WORLD_SIZE unset): "
                   "torchrun --nproc_per_node=2 -m pytest -q -rs tests/gpu/test_raylight_usp.py")
    elif world != str(WORLD):
        why.append(f"WORLD_SIZE is {world}: the test runs on exactly {WORLD} ranks (Ulysses {ULYSSES}, ring {RING})")
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices < WORLD:
        why.append(f"{devices} CUDA device(s), {WORLD} needed")
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        why.append(f"not importable: {', '.join(missing)} (docs/multi-gpu.md, 'On two GPUs')")
    return "; ".join(why) or None


_WHY = skip_reason()
if _WHY:
    pytest.skip(f"two-GPU Raylight test: {_WHY}", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from wan_sage.attention import accuracy, stats  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.inner_attention import INNER_ATTENTION_KEY, InnerAttention  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride  # noqa: E402
from wan_sage.attention.state import STATE  # noqa: E402
from wan_sage.cli.bench_kernels import peak_extra  # noqa: E402
from wan_sage.memory import request  # noqa: E402
from wan_sage.memory.estimate import plan  # noqa: E402
from wan_sage.nodes import raylight_bridge  # noqa: E402

# Wan 2.2 A14B at 1280x720x81: 21 latent frames x 45 x 80 patches = 75,600 tokens; 40 heads of 128.
TOKENS, HEADS, HEAD_DIM = 75_600, 40, 128
LOCAL = TOKENS // WORLD  # 37,800 tokens on each rank outside attention
A14B_720P81 = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "dtype": "bf16"}
ITERS = 5  # timed calls of each path, interleaved
ATTN_TYPE = os.environ.get("WAN_SAGE_XFUSER_ATTN", "TORCH_FLASH")  # Raylight's XFuser_attention default
# Kept as the machine has them (docs/multi-gpu.md): NVLink multicast stays off.
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class Upstream:
    """The imported xFuser, yunchang and Raylight pieces, and what the Raylight on the path offers."""

    def __init__(self):
        # Raylight first: its package installs a minimal xFuser (only the distributed and long-context
        # attention modules, without xfuser/__init__.py's pipelines and their diffusers import) when it
        # finds xfuser (komikndr/raylight src/raylight/xfuser_compat.py@c0495710d960c413443727b5c640e22d6bd9ef61).
        try:
            self.raylight = importlib.import_module("raylight")
            self.xd = importlib.import_module("xfuser.core.distributed")
            self.lca = importlib.import_module("xfuser.core.long_ctx_attention")
            self.attn_type = importlib.import_module("yunchang.kernels").AttnType[ATTN_TYPE]
        except Exception as e:  # the same on every rank, before any collective
            pytest.skip(f"two-GPU Raylight test: xFuser's long-context attention did not import "
                        f"({type(e).__name__}: {str(e)[:300]}); see docs/multi-gpu.md, 'On two GPUs'")
        # Raylight's stand-in xfuser.envs is a module made in memory, without a file.
        self.shim = getattr(sys.modules.get("xfuser.envs"), "__file__", None) is None
        try:
            self.ra = importlib.import_module("raylight.distributed_modules.attention")
            self.ra_error = None
        except Exception as e:
            self.ra, self.ra_error = None, f"{type(e).__name__}: {str(e)[:200]}"
        try:
            self.ri = importlib.import_module("raylight.distributed_modules.inner_attention")
        except Exception:
            self.ri = None
        self.hook = ("raylight" if self.ri is not None and self.ra is not None
                     and getattr(self.ra, "InnerAttentionDispatcher", None) is not None else "test")

    def attention(self):
        """Raylight's attention function ``fn(q, k, v, heads, transformer_options=...)`` on [B, N, H*D]."""
        if self.hook == "raylight":
            return self.ra.make_xfuser_attention(ATTN_TYPE, False)  # sync_ulysses: Raylight's default
        return _test_hooked_attention(self.lca.xFuserLongContextAttention(use_sync=False, attn_type=self.attn_type))


def _test_hooked_attention(xattn):
    """xFuser's attention with Raylight's inner-attention contract on its ring function, for a Raylight that
    has no inner-attention API: the processor in ``transformer_options`` is called as
    ``processor(dense, q, k, v, transformer_options=..., **kwargs)`` with ``dense`` the ring function."""
    ring_fn, active = xattn.ring_attn_fn, {}

    def hooked(q, k, v, *args, **kwargs):
        processor = active.get("processor")
        if processor is None:
            return ring_fn(q, k, v, *args, **kwargs)

        def dense(q_, k_, v_, **options):
            return ring_fn(q_, k_, v_, *args, **options)
        return processor(dense, q, k, v, transformer_options=active["options"], **kwargs)
    xattn.ring_attn_fn = hooked

    def attention(q, k, v, heads, transformer_options=None):
        options = transformer_options if transformer_options is not None else {}
        B, D = q.shape[0], q.shape[-1] // heads
        active.update(processor=options.get(INNER_ATTENTION_KEY), options=options)
        try:
            out = xattn(None, *(t.view(B, -1, heads, D) for t in (q, k, v)))
        finally:
            active.clear()
        return out.reshape(B, -1, heads * D)
    return attention


@pytest.fixture(scope="module")
def usp():
    up = Upstream()
    for name, value in NCCL_SAFE.items():
        os.environ.setdefault(name, value)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)  # before the process groups, so NCCL binds this GPU
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
    try:
        up.xd.init_distributed_environment(rank=dist.get_rank(), world_size=dist.get_world_size(),
                                           local_rank=local_rank)
        up.xd.initialize_model_parallel(sequence_parallel_degree=ULYSSES * RING, ulysses_degree=ULYSSES,
                                        ring_degree=RING)
        yield up
    finally:
        dist.destroy_process_group()


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except Exception:
        return "?"


def _timed(call) -> float:
    dist.barrier()  # both ranks enter the all-to-alls together
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _compare(out, ref):
    """Relative L2 and cosine over the rank's whole slice, in float64 (fp32 sums over 193 million values
    shift the cosine in its fifth digit)."""
    o, r = out.double().flatten(), ref.double().flatten()
    return ((o - r).norm() / r.norm()).item(), (o @ r / (o.norm() * r.norm())).item()


def _estimate(attention: str) -> dict:
    """The pack's per-rank figures for this call (as tests/unit/test_plan_per_rank.py asks for them)."""
    major, minor = torch.cuda.get_device_capability()
    vram = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
    fields = dict(A14B_720P81, vram_gib=round(vram), ulysses=ULYSSES, ring=RING, arch=f"sm{major}{minor}",
                  attention=attention if attention in request.ATTENTION_CHOICES else "sdpa")
    r = plan(request.build(fields).setup).per_rank
    # One call: the all-to-all buffers (gathered q, k, v, a staging copy, the output's receive buffer) and
    # the attention (gathered q, k, v again, plus the kernel's extra bytes): q, k, v counted once.
    call = r["all_to_all_bytes"] + r["attention_bytes"] - 3 * r["block_bytes"]
    return {"attention": fields["attention"], "call_bytes": call, "all_to_all_bytes": r["all_to_all_bytes"],
            "attention_bytes": r["attention_bytes"], "block_bytes": r["block_bytes"],
            "tokens_per_rank": r["tokens_per_rank"], "heads_per_rank": r["heads_per_rank"]}


@torch.no_grad()  # sampling runs without autograd
def _rank_row(up) -> dict:
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    attention = up.attention()
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    q, k, v = (torch.randn(1, LOCAL, HEADS * HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
               for _ in range(3))

    override = SageAttentionOverride(PatchConfig(calibration_budget_s=600.0, label="raylight usp gpu",
                                                 cache_dir=tempfile.mkdtemp(prefix=f"wan-sage-usp-rank{rank}-")))
    options = {}
    note = raylight_bridge.install_inner_attention(options, override)
    installed = isinstance(options.get(INNER_ATTENTION_KEY), InnerAttention)
    registered = (up.ri is not None and hasattr(up.ri, "InnerAttentionRegistry")
                  and "wan_sage:sage_attention" in up.ri.InnerAttentionRegistry.available())

    def dense():
        return attention(q, k, v, HEADS, transformer_options={})

    def pack():
        return attention(q, k, v, HEADS, transformer_options=options)

    stats.begin_run(override.patch_id, "raylight usp gpu")
    dense()
    pack()  # the first calls on this shape time it on this rank (each rank runs the same steps)
    while STATE.trials:
        pack()
    ref, dense_peak = peak_extra(dense)
    out, pack_peak = peak_extra(pack)
    times = {"dense": [], "pack": []}
    for _ in range(ITERS):
        times["dense"].append(_timed(dense))
        times["pack"].append(_timed(pack))
    summary = stats.end_run(override.patch_id)
    rel, cos = _compare(out, ref)
    del out, ref

    kernel = max(summary["by_kernel"], key=summary["by_kernel"].get) if summary["by_kernel"] else "sdpa"
    est_dense, est_pack = _estimate("sdpa"), _estimate(kernel)
    dense_s, pack_s = statistics.median(times["dense"]), statistics.median(times["pack"])
    return {"test": "raylight_usp", "rank": rank, "world_size": dist.get_world_size(),
            "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "xfuser": _version("xfuser"),
            "yunchang": _version("yunchang"), "sageattention": _version("sageattention"), "hook": up.hook,
            "xfuser_shim": up.shim, "attn_type": ATTN_TYPE,
            "ulysses": up.xd.get_ulysses_parallel_world_size(), "ring": up.xd.get_ring_parallel_world_size(),
            "shape": "a14b_720p81_self", "tokens": TOKENS, "tokens_per_rank": LOCAL, "heads": HEADS,
            "heads_per_rank": HEADS // ULYSSES, "head_dim": HEAD_DIM, "dtype": "bf16",
            "installed": installed, "install_note": note, "registered": registered,
            "dense_s": dense_s, "pack_s": pack_s, "speedup": dense_s / pack_s,
            "dense_times": times["dense"], "pack_times": times["pack"],
            "dense_peak": dense_peak, "pack_peak": pack_peak, "est_dense": est_dense, "est_pack": est_pack,
            "rel_l2": rel, "cos": cos, "stats": summary, "finished": True}


def _table(rows) -> str:
    mib = 2 ** 20
    lines = [f"{'rank':>4} {'hook':<8} {'dense s':>8} {'pack s':>8} {'x':>6} {'dense MiB':>9} {'est MiB':>8} "
             f"{'pack MiB':>9} {'est MiB':>8} {'relL2':>7} {'cos':>8}  pack calls (stats rank)"]
    for r in rows:
        s = r["stats"]
        served = ", ".join(f"{k} {n}" for k, n in s["by_kernel"].items()) or "-"
        declined = ", ".join(f"{k} {n}" for k, n in s["reasons"].items())
        calls = f"sage {s['sage_calls']} ({served}), dense {s['sdpa_calls']}" + (f" ({declined})" if declined else "")
        lines.append(f"{r['rank']:>4} {r['hook']:<8} {r['dense_s']:8.4f} {r['pack_s']:8.4f} {r['speedup']:6.3f} "
                     f"{r['dense_peak'] / mib:9.1f} {r['est_dense']['call_bytes'] / mib:8.1f} "
                     f"{r['pack_peak'] / mib:9.1f} {r['est_pack']['call_bytes'] / mib:8.1f} "
                     f"{r['rel_l2']:7.4f} {r['cos']:8.5f}  {calls} (rank {s.get('rank')})")
    r = rows[0]
    lines.append(f"{r['gpu']} x{r['world_size']}, torch {r['torch']}, xfuser {r['xfuser']}, yunchang {r['yunchang']}, "
                 f"sageattention {r['sageattention']}; attn_type {r['attn_type']}; Ulysses {r['ulysses']}, ring "
                 f"{r['ring']}; [1, {r['tokens_per_rank']:,}, {r['heads']}, {r['head_dim']}] bf16 per rank; est: the "
                 f"estimate's all-to-all + attention bytes for sdpa / {r['est_pack']['attention']}")
    return "\n".join(lines)


@pytest.mark.usefixtures("fresh_state")
def test_the_pack_inside_xfuser_ulysses_on_two_gpus(usp, capsys):
    # An error on one rank stops that rank here, before the gather: the other rank is left in a collective
    # until torchrun ends it when this process exits (NCCL's timeout is 10 minutes otherwise).
    row = _rank_row(usp)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        with capsys.disabled():
            print("\n" + _table(rows))
        target = os.environ.get("WAN_SAGE_GPU_TABLE")
        if target:
            with open(target, "w") as f:
                for r in rows:
                    f.write(json.dumps(r) + "\n")
    problems = []
    for r in rows:
        if not (r and r.get("finished")):
            problems.append(f"a rank did not finish: {r}")
            continue
        if not r["installed"]:
            problems.append(f"rank {r['rank']}: the processor was not installed ({r['install_note']})")
        if not (r["rel_l2"] <= accuracy.MAX_REL_L2 and r["cos"] >= accuracy.MIN_COSINE):
            problems.append(f"rank {r['rank']}: the pack's output is beyond the bound against Raylight's own "
                            f"(rel L2 {r['rel_l2']:.4f}, cosine {r['cos']:.5f})")
    assert not problems, "\n".join(problems)
