"""The estimate per rank (memory.parallel through memory.estimate.plan) against numbers derived by hand, and
``wan-sage plan``'s and the route's multi-GPU fields and their one-line errors."""
import json

import pytest

from wan_sage import cli
from wan_sage.memory import request
from wan_sage.memory.errors import RequestError
from wan_sage.memory.estimate import plan
from wan_sage.memory.parallel import Parallel

A14B_720P81 = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "vram_gib": 80,
               "dtype": "bf16"}


def estimate(**fields):
    return plan(request.build(dict(A14B_720P81, **fields)).setup)


def test_ulysses_2_per_rank_by_hand():
    est = estimate(ulysses=2)
    r = est.per_rank
    # Wan 2.2 A14B at 1280x720x81: latent 16 x 21 x 90 x 160; 1x2x2 patches -> 21 * 45 * 80 = 75,600 tokens.
    assert r["tokens"] == 75_600
    # Ulysses 2 splits the 40 heads of 128: 20 heads per rank, attending over all 75,600 tokens;
    # outside attention each rank holds 75,600 / 2 = 37,800 tokens.
    assert (r["heads_per_rank"], r["attention_tokens"], r["tokens_per_rank"]) == (20, 75_600, 37_800)
    assert (r["world_size"], r["rows_per_rank"], r["forwards_per_step"]) == (2, 1, 1)
    # One block (a gathered q, k, v or output) in bf16: 1 row x 75,600 x 20 x 128 x 2 B = 387,072,000 B
    # (369.1 MiB), the same as the rank's own slice 37,800 x 40 x 128 x 2 B.
    assert r["block_bytes"] == 387_072_000 == 37_800 * 40 * 128 * 2
    # All-to-all buffers: gathered q, k, v + the staging copy + the output's receive buffer = 5 blocks
    # = 1,935,360,000 B (1.80 GiB).
    assert r["all_to_all_bytes"] == 1_935_360_000
    # The rank's attention call on SDPA: gathered q, k, v (3 blocks) + SDPA's output (1 block; kernel_bytes
    # "sdpa") = 1,548,288,000 B (1.44 GiB).
    assert r["attention_bytes"] == 1_548_288_000
    # No FSDP: every rank holds all weights; working memory = the slice's activations + the all-to-all buffers.
    assert r["weights_bytes"] == est.setup.weights_bytes
    assert r["working_bytes"] == r["activation_bytes"] + 1_935_360_000
    assert r["total_bytes"] == r["weights_bytes"] + r["working_bytes"]
    # The slice's activations are those of one GPU at 37,800 tokens: less than the single-GPU 75,600-token figure.
    assert r["activation_bytes"] < est.resident["total"]


def test_sage_attention_bytes_come_from_kernel_bytes():
    from wan_sage.attention.kernel_bytes import AttnShape, extra_bytes
    r = estimate(ulysses=2, attention="sage2_sm90", arch="sm90").per_rank
    assert r["attention_bytes"] == 3 * 387_072_000 + extra_bytes("sage2_sm90", AttnShape(1, 20, 75_600, 75_600, 128, 2))


def test_ring_fsdp_and_cfg_parallel_by_hand():
    est = estimate(ulysses=2, ring=2, fsdp=True, cfg=5.0, cfg_parallel=True)
    r = est.per_rank
    # 2 x 2 x 2 = 8 ranks; ring 2 halves the attention's tokens (37,800), Ulysses 2 the heads (20);
    # outside attention 75,600 / 4 = 18,900 tokens per rank.
    assert (r["world_size"], r["attention_tokens"], r["heads_per_rank"], r["tokens_per_rank"]) == (8, 37_800, 20, 18_900)
    # CFG parallel: the 2 cond/uncond rows over 2 ranks, 1 row per rank in one forward per step.
    assert (r["rows_per_rank"], r["forwards_per_step"]) == (1, 1)
    assert r["block_bytes"] == 37_800 * 20 * 128 * 2
    # FSDP: weights / 8 ranks plus one of the 40 blocks gathered (weights / 40), each rounded up.
    w = est.setup.weights_bytes
    assert r["weights_bytes"] == -(-w // 8) + -(-w // 40)


def test_without_cfg_parallel_a_rank_runs_cond_and_uncond():
    assert estimate(ulysses=2, cfg=5.0).per_rank["forwards_per_step"] == 2


def test_one_gpu_has_no_per_rank_figures():
    assert estimate().per_rank is None
    assert Parallel().active is False and Parallel(fsdp=True).active is True


@pytest.mark.parametrize("fields, field, needle", [
    ({"ulysses": 3}, "ulysses", "must divide the model's 40 heads"),
    ({"ulysses": 0}, "ulysses", "between 1 and 64"),
    ({"ring": 1.5}, "ring", "integer"),
    ({"fsdp": "yes"}, "fsdp", "true or false"),
    ({"cfg_parallel": True}, "cfg_parallel", "needs a cfg other than 1"),
    ({"cfg_parallel": True, "cfg": 1.0000000001}, "cfg_parallel", "needs a cfg other than 1"),
])
def test_bad_degrees_name_the_field(fields, field, needle):
    with pytest.raises(RequestError) as e:
        request.build(dict(A14B_720P81, **fields))
    assert e.value.field == field and needle in str(e.value) and "\n" not in str(e.value)


def test_cli_prints_per_rank_and_rejects_bad_degrees_in_one_line(capsys):
    code = cli.main(["plan", "--preset", "wan2.2-a14b", "--vram", "80", "--dtype", "bf16", "--ulysses", "2"])
    out, _err = capsys.readouterr()
    assert code == 0
    assert "per rank (2 ranks: Ulysses 2, ring 1" in out and "all-to-all buffers 1.80 GiB" in out
    code = cli.main(["plan", "--preset", "wan2.2-a14b", "--vram", "80", "--ulysses", "3"])
    _out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "--ulysses must divide the model's 40 heads" in err
    code = cli.main(["plan", "--preset", "wan2.2-a14b", "--vram", "80", "--ulysses", "2", "--json"])
    answer = json.loads(capsys.readouterr()[0])
    assert answer["summary"]["per_rank"]["heads_per_rank"] == 20
    assert answer["estimate"]["request"]["ulysses"] == 2


def test_each_rank_gets_a_verdict_of_its_own():
    """Several GPUs: each rank holds its weights (sharded with FSDP) and its working memory in its own VRAM, so
    the headline verdict is the rank's, with one GPU's beside it."""
    est = estimate(vram_gib=24, ulysses=2)
    r, room = est.per_rank, est.setup.vram_bytes - est.setup.kept_free
    # no FSDP: all 26.6 GiB of weights on each rank, which must stream what its working memory, weights streamed,
    # leaves no room for
    assert r["weights_bytes"] + r["working_bytes"] > room > r["streamed_working_bytes"] > r["working_bytes"]
    assert r["offload_bytes"] == r["weights_bytes"] - (room - r["streamed_working_bytes"])
    assert r["verdict"] == f"offloads {r['offload_bytes'] / 2**30:.1f} GiB of weights"
    sharded = estimate(vram_gib=24, ulysses=4, ring=2, fsdp=True)
    assert sharded.per_rank["total_bytes"] <= room and sharded.per_rank["verdict"].startswith("fits")
    assert sharded.level == "offloads"  # one GPU alone would stream
    from wan_sage.memory import report
    line = next(x for x in report.report(sharded).splitlines() if x.startswith("verdict:"))
    assert line.startswith("verdict: fits: all weights resident (per rank, 8 ranks); on one GPU: offloads")
    assert estimate(ulysses=2, vram_gib=None).per_rank.get("verdict") is None  # no VRAM: no verdict


def test_a_cfg_parallel_rank_that_runs_one_gpus_forward_streams_as_one_gpu_does():
    """CFG parallel without Ulysses or ring: each rank runs one GPU's forward (one row, every token, every head)
    and holds every weight, so where the weights stream it offloads what one GPU offloads, against the streamed
    reservation (its streaming and fragmentation terms), not the resident one."""
    one = estimate(preset="wan2.1-14b", vram_gib=24, cfg=3.0)
    ranks = estimate(preset="wan2.1-14b", vram_gib=24, cfg=3.0, cfg_parallel=True)
    r = ranks.per_rank
    assert one.level == "offloads" and r["rows_per_rank"] == one.rows_sequential == 1
    assert r["working_bytes"] == one.resident["total"] < r["streamed_working_bytes"] == one.partial["total"]
    assert r["offload_bytes"] == one.offload_bytes > 0
    assert r["verdict"] == one.verdict


def test_fsdp_over_one_rank_is_refused_naming_the_field():
    with pytest.raises(RequestError) as e:
        request.build(dict(A14B_720P81, fsdp=True))
    assert e.value.field == "fsdp" and "one rank" in str(e.value)
    assert estimate(fsdp=True, cfg=5.0, cfg_parallel=True).per_rank["world_size"] == 2


def test_an_fsdp_model_on_one_rank_keeps_its_estimate_and_dynamic_vram_gets_no_rank_verdict():
    """The one-rank refusal is the request's (a user's flags); degrees read from a running model are estimated as
    they are.  Under dynamic VRAM, where ComfyUI evicts weights on demand, no rank gets an offload verdict."""
    from dataclasses import replace
    setup = request.build(dict(A14B_720P81, vram_gib=24, ulysses=2)).setup
    assert plan(replace(setup, parallel=Parallel(fsdp=True))).per_rank["world_size"] == 1
    assert plan(replace(setup, dynamic_vram=True)).per_rank.get("verdict") is None
