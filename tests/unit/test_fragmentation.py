"""memory/estimate.py's fragmentation term: which weights get it and how large it is.  The end-to-end
fp8 records it was set from are replayed against it in bench/tests/test_fragmentation_records.py.
"""
import pytest

from wan_sage.memory import activation_model
from wan_sage.memory.estimate import CALIBRATED, fragmentation_bytes
from wan_sage.memory.weights import weights_for_key
from setups import estimate

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


def test_a_compile_that_runs_streamed_blocks_eagerly_plans_a_streamed_load_as_eager():
    """The pack's Wan Compile Blocks: where the weights stream the blocks run eagerly, so the streamed column is
    eager's (the GGUF term, not the partial-load term of compiled streaming); the resident one stays compiled."""
    plan = weights_for_key(A14B, "q4_k_m", True, compute="bf16")
    kw = dict(attention="sdpa", weights=plan.setup, weights_bytes=plan.nbytes)
    eager = estimate(A14B, 1280, 720, 81, **kw)
    blocks = estimate(A14B, 1280, 720, 81, compiled=True, **kw)
    ours = estimate(A14B, 1280, 720, 81, compiled=True, streamed_blocks_eager=True, **kw)
    assert ours.partial == eager.partial and ours.reservation_partial == eager.reservation_partial
    assert ours.reservation_partial < blocks.reservation_partial
    assert ours.resident == blocks.resident and ours.resident["total"] < eager.resident["total"]
