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


def test_gguf_and_bf16_reservations_are_unchanged_by_the_term():
    for key in ("q4_k_m", "bf16"):
        plan = weights_for_key(A14B, key, True, compute="bf16")
        ws, wbytes = plan.setup, plan.nbytes
        est = estimate(A14B, 1280, 720, 81, attention="sdpa", weights=ws, weights_bytes=wbytes)
        assert est.resident["fragmentation"] == 0
        assert est.partial["fragmentation"] == pytest.approx(
            CALIBRATED["partial_frag_factor"] * activation_model.largest_block(A14B, W720) + CALIBRATED["partial_fixed"], abs=1)
