"""memory/estimate.py's fragmentation term, against the end-to-end runs measured on the H200.

The fp8 runs of docs/measurements/e2e-h200-fp8*.jsonl held up to 3.47 GiB in cudaMallocAsync's pool
above the allocated peak with every weight resident, and one of them ran out of memory at a 24 GiB
budget because the estimate had no room for it.  These tests pin the term and replay those records.
"""
import json
from pathlib import Path

import pytest

from wan_sage.memory import activation_model
from wan_sage.memory.estimate import CALIBRATED, COMFY_EXTRA_RESERVED, GiB, fragmentation_bytes
from wan_sage.memory.weights import weights_for_key
from setups import estimate

A14B = activation_model.PRESETS["wan2.2-a14b"]
ROOT = Path(__file__).resolve().parents[2]
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


def _fp8_records():
    out = []
    for p in sorted((ROOT / "docs" / "measurements").glob("e2e-h200-fp8*.jsonl")):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            if "config" in r and r["config"].get("weights") == "fp8":
                out.append(r)
    return out


def _estimate(c, vram_gib=None):
    plan = weights_for_key(A14B, "fp8", True, compute="bf16")
    return estimate(A14B, c["width"], c["height"], c["frames"], attention="sage-auto" if c["attention"] == "sage"
                    else "sdpa", cc=90, weights=plan.setup, weights_bytes=plan.nbytes,
                    vram_bytes=None if vram_gib is None else int(vram_gib * GiB))


def test_fp8_resident_reservation_covers_every_measured_reserved_peak():
    n = 0
    for r in _fp8_records():
        est = _estimate(r["config"])
        for name, x in (r.get("experts") or {}).items():
            if x.get("resident_frac") != 1.0 or x.get("peak_reserved_gib") is None:
                continue
            need = x["peak_reserved_gib"] - x["base_alloc_gib"]   # for the OOM run: a lower bound
            assert est.reservation_resident / GiB >= need, (r["run"], name, r["status"])
            n += 1
    assert n >= 17  # 16 completed samplings and the one that ran out of memory


def test_the_fp8_run_that_ran_out_of_memory_now_offloads():
    oom = [r for r in _fp8_records() if r["status"] == "oom"]
    assert oom, "the out-of-memory record is the reason for the term"
    for r in oom:
        c = r["config"]
        est = _estimate(c, vram_gib=r["budget"]["free_seen_gib"])
        assert est.verdict.startswith("offloads"), est.verdict
        # what stays resident plus the reservation fits, with the measured shortfall inside it
        resident = est.setup.weights_bytes - est.offload_bytes
        assert resident + est.reservation_partial + COMFY_EXTRA_RESERVED <= c["budget_gib"] * GiB + 1
        high = r["experts"]["high"]
        assert est.reservation_partial / GiB > high["peak_reserved_gib"] - high["base_alloc_gib"]


def test_gguf_and_bf16_reservations_are_unchanged_by_the_term():
    for key in ("q4_k_m", "bf16"):
        plan = weights_for_key(A14B, key, True, compute="bf16")
        ws, wbytes = plan.setup, plan.nbytes
        est = estimate(A14B, 1280, 720, 81, attention="sdpa", weights=ws, weights_bytes=wbytes)
        assert est.resident["fragmentation"] == 0
        assert est.partial["fragmentation"] == pytest.approx(
            CALIBRATED["partial_frag_factor"] * activation_model.largest_block(A14B, W720) + CALIBRATED["partial_fixed"], abs=1)
