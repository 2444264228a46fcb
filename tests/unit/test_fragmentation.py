"""memory/estimate.py's fragmentation term: which weights get it and how large it is.  The end-to-end
fp8 records it was set from are replayed against it in bench/tests/test_fragmentation_records.py.
"""
import pytest

from wan_sage.memory import activation_model
from wan_sage.memory.estimate import CALIBRATED, fragmentation_bytes, lifted_block_bytes, staged_block_bytes
from wan_sage.memory.report import report as format_report
from wan_sage.memory.weights import weights_for_key
from setups import estimate

GiB = 1 << 30
A14B = activation_model.PRESETS["wan2.2-a14b"]
W720 = activation_model.Workload(L=75600, self_attn="sdpa")


def _ws(key, lora=True):
    return weights_for_key(A14B, key, lora, compute="bf16").setup


def test_only_cast_weights_get_the_term_when_resident():
    largest = activation_model.largest_block(A14B, W720)
    fixed = CALIBRATED["partial_fixed"]
    assert _ws("fp8").casts_to("bf16") and not _ws("bf16").casts_to("bf16")
    assert not _ws("q4_k_m").casts_to("bf16") and not activation_model.WeightSetup().casts_to("bf16")
    assert fragmentation_bytes(A14B, W720, _ws("bf16"), False) == 0
    assert fragmentation_bytes(A14B, W720, _ws("q4_k_m"), False) == 0
    assert fragmentation_bytes(A14B, W720, _ws("fp8"), False) == int(CALIBRATED["cast_frag_factor"] * largest) + fixed
    # partial loading: the larger factor of the two, never their sum
    assert fragmentation_bytes(A14B, W720, _ws("bf16"), True) == int(CALIBRATED["partial_frag_factor"] * largest) + fixed
    assert fragmentation_bytes(A14B, W720, _ws("fp8"), True) == fragmentation_bytes(A14B, W720, _ws("fp8"), False)


def test_bf16_streamed_gets_the_partial_load_term_and_gguf_only_its_own():
    largest = activation_model.largest_block(A14B, W720)
    partial = CALIBRATED["partial_frag_factor"] * largest + CALIBRATED["partial_fixed"]
    for key, streamed in (("bf16", partial), ("q4_k_m", CALIBRATED["gguf_stream_copies"] * 2 * A14B.dim * A14B.ffn_dim)):
        plan = weights_for_key(A14B, key, True, compute="bf16")
        est = estimate(A14B, 1280, 720, 81, attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes)
        assert est.resident["fragmentation"] == 0, key
        assert est.partial["fragmentation"] == pytest.approx(streamed, abs=1), key
    # the GGUF term is the smaller: streamed GGUF reserves less than the partial-load term would
    assert CALIBRATED["gguf_stream_copies"] * 2 * A14B.dim * A14B.ffn_dim < partial


def test_streamed_gguf_under_any_compile_keeps_the_partial_load_term():
    q4 = _ws("q4_k_m")
    largest = activation_model.largest_block(A14B, W720)
    partial = int(CALIBRATED["partial_frag_factor"] * largest) + CALIBRATED["partial_fixed"]
    assert fragmentation_bytes(A14B, W720, q4, True) < partial
    assert fragmentation_bytes(A14B, W720, q4, True, compiled=True) == partial
    assert fragmentation_bytes(A14B, W720, q4, False, compiled=True) == 0
    plan = weights_for_key(A14B, "q4_k_m", True, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes)
    eager = estimate(A14B, 1280, 720, 81, **kw)
    blocks = estimate(A14B, 1280, 720, 81, compiled=True, **kw)
    whole = estimate(A14B, 1280, 720, 81, other_compile=True, **kw)
    assert blocks.partial["fragmentation"] == whole.partial["fragmentation"] == pytest.approx(partial, abs=1)
    assert eager.reservation_partial < whole.reservation_partial
    # the whole-model compile is still planned as eager: only the streaming term differs
    assert whole.resident["total"] == eager.resident["total"]


def test_wan_compile_blocks_plans_a_streamed_load_as_the_larger_of_eager_and_compiled_with_a_block_staged():
    """The pack's Wan Compile Blocks runs a streamed block compiled with its Linears' weights staged in the compute
    dtype (nodes/staged_blocks.py), or eagerly where it cannot stage it.  The streamed column is the larger of the
    eager one (the GGUF term, not the partial-load term of compiled streaming) and the compiled resident forward plus
    one block's staged weights; the resident column stays compiled."""
    plan = weights_for_key(A14B, "q4_k_m", True, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes)
    block = staged_block_bytes(A14B, "bf16")
    assert 0.65 * GiB < block < 0.66 * GiB  # A14B's 10 Linears of a block in bf16
    for size, staged_more in (((1280, 720, 81), False), ((480, 320, 33), True)):
        eager = estimate(A14B, *size, **kw)
        blocks = estimate(A14B, *size, compiled=True, **kw)
        ours = estimate(A14B, *size, compiled=True, streamed_blocks_staged=True, **kw)
        staged_total = blocks.resident["total"] + block
        assert ours.partial["total"] == max(eager.partial["total"], staged_total), size
        assert (ours.partial["staged_block"] > 0) == staged_more, size
        if not staged_more:  # eager's GGUF term is less than compiled streaming's partial-load term
            assert ours.reservation_partial < blocks.reservation_partial
        assert ours.resident == blocks.resident and ours.resident["total"] < eager.resident["total"]
        assert ("compiled with a block staged" in format_report(ours)) == staged_more


def test_weights_cast_at_every_call_are_not_staged_and_plan_eager():
    """fp8 weights: their blocks run eagerly under Wan Compile Blocks when they stream; no staged term."""
    plan = weights_for_key(A14B, "fp8", False, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes)
    eager = estimate(A14B, 480, 320, 33, **kw)
    ours = estimate(A14B, 480, 320, 33, compiled=True, streamed_blocks_staged=True, **kw)
    assert ours.partial["staged_block"] == 0 and ours.partial["total"] == eager.partial["total"]


def test_once_the_streamed_blocks_ran_compiled_the_streamed_load_is_the_compiled_forward_and_one_blocks_weights():
    """After Wan Compile Blocks has run the model's streamed blocks compiled and none eagerly, no block runs the eager
    forward: the streamed column is the compiled resident forward plus the one block's weights its path holds, as
    stored where lifted (GGUF's quantized bytes, about 0.2 GiB for a Q4_K_M A14B block) and in the compute dtype
    where staged, and it is below the eager floor the first run plans."""
    plan = weights_for_key(A14B, "q4_k_m", True, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes, compiled=True, streamed_blocks_staged=True)
    lifted = lifted_block_bytes(A14B, plan.setup, "bf16")
    assert 0.15 * GiB < lifted < 0.25 * GiB
    assert lifted_block_bytes(A14B, _ws("bf16", lora=False), "bf16") == staged_block_bytes(A14B, "bf16")
    for size in ((1280, 720, 81), (832, 480, 81), (480, 320, 33)):
        first = estimate(A14B, *size, **kw)
        resident = estimate(A14B, *size, compiled=True, attention="sdpa", weights=plan.setup,
                            weights_bytes=plan.nbytes).resident["total"]
        for ran, held in (("lifted", lifted), ("staged", staged_block_bytes(A14B, "bf16"))):
            later = estimate(A14B, *size, streamed_blocks_ran=ran, **kw)
            assert later.partial["total"] == resident + held and later.partial["staged_block"] == held, (size, ran)
            assert later.partial["streamed_compiled"] and not first.partial["streamed_compiled"]
            assert later.reservation_partial <= first.reservation_partial, (size, ran)
            assert "a streamed block's weights, compiled" in format_report(later)
        assert estimate(A14B, *size, streamed_blocks_ran="", **kw).partial == first.partial


def test_cast_weights_keep_the_eager_streamed_load_however_the_blocks_ran():
    plan = weights_for_key(A14B, "fp8", False, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes, compiled=True, streamed_blocks_staged=True)
    assert (estimate(A14B, 1280, 720, 81, streamed_blocks_ran="lifted", **kw).partial
            == estimate(A14B, 1280, 720, 81, **kw).partial)


def test_a_vace_model_keeps_the_first_runs_streamed_plan_however_its_main_blocks_ran():
    """Wan Compile Blocks compiles the main blocks only: a VACE model's VACE blocks stream and run eagerly, so a
    count of compiled main blocks does not lower its streamed column."""
    from dataclasses import replace
    vace = replace(A14B, model_type="vace", vace_layers=8)
    plan = weights_for_key(vace, "q4_k_m", True, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes, compiled=True,
              streamed_blocks_staged=True, vace_streams=1)
    first = estimate(vace, 1280, 720, 81, **kw)
    for ran in ("lifted", "staged"):
        later = estimate(vace, 1280, 720, 81, streamed_blocks_ran=ran, **kw)
        assert later.partial == first.partial and not later.partial["streamed_compiled"], ran
    # the same sizes without VACE blocks do come down, so the check above is not vacuous
    plain = dict(kw, weights=weights_for_key(A14B, "q4_k_m", True, compute="bf16").setup)
    plain.pop("vace_streams")
    assert (estimate(A14B, 1280, 720, 81, streamed_blocks_ran="lifted", **plain).reservation_partial
            < estimate(A14B, 1280, 720, 81, **plain).reservation_partial)
