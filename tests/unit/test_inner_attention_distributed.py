"""Two processes on torch.distributed (gloo, CPU) run an Ulysses all-to-all around the inner-attention
processor (tests/unit/ulysses_worker.py): the gathered output equals single-process attention, and when the
kernel runs out of memory on rank 1 only, rank 1 falls back to ``dense`` on its own heads while rank 0 stays on
the kernel, and both ranks finish (the processor makes no collective, so they stay in step).  A hang fails the
test after a deadline instead of hanging the run."""
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ulysses_worker

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD = 2
DEADLINE_S = 240  # a guard against a deadlock, not a speed target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, oom_rank: int) -> list:
    ctx = mp.start_processes(ulysses_worker.run, args=(WORLD, _free_port(), str(tmp_path), oom_rank), nprocs=WORLD,
                             join=False, start_method="spawn")
    end = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=5):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"the ranks did not finish within {DEADLINE_S} s: a collective is out of step")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def _gathered(results, call: int):
    return torch.cat([r["outputs"][call] for r in results], dim=1)  # each rank holds [B, N/U, H, D]


def _check_outputs(results):
    for call in range(ulysses_worker.CALLS):
        want = ulysses_worker.reference(*ulysses_worker.inputs(call))
        got = _gathered(results, call).float()
        assert got.shape == want.shape
        assert (got - want).norm() / want.norm() < 2e-2


def test_ulysses_output_equals_single_process_attention(tmp_path):
    results = _spawn(tmp_path, oom_rank=-1)
    _check_outputs(results)
    for rank, r in enumerate(results):
        s = r["summary"]
        assert s["rank"] == rank
        assert s["sage_calls"] == ulysses_worker.CALLS and s["sdpa_calls"] == 0


def test_out_of_memory_on_one_rank_falls_back_there_only(tmp_path):
    results = _spawn(tmp_path, oom_rank=1)
    _check_outputs(results)
    s0, s1 = results[0]["summary"], results[1]["summary"]
    assert s0["sage_calls"] == ulysses_worker.CALLS and s0["sdpa_calls"] == 0
    assert s1["sage_calls"] == 0 and s1["sdpa_calls"] == ulysses_worker.CALLS
    assert s1["fallbacks"] == {"oom": 1}  # the first call ran out; the second stayed on SDPA ("memory")
    assert s1["reasons"] == {"oom": 1, "memory": 1}
