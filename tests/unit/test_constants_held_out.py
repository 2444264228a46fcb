"""The fragmentation constants of memory/estimate.py on records they were not set from.

``partial_frag_factor`` was set from the reference budget run (docs/measurements/2026-11-29-reference-budget.jsonl,
PyTorch's native allocator) and ``cast_frag_factor`` from the end-to-end fp8 runs of sessions 1 and 2
(docs/measurements/e2e-h200-fp8.jsonl and e2e-h200-fp8-repeat.jsonl).  The partial-load benchmark's
runs (sessions A, B and C, cudaMallocAsync, bench/partial_load.py) were set from neither: in every one
of them, what the allocator held above the resident weights at its peak must fit in the reservation
the estimate makes today for that configuration (weights partly offloaded, or all resident and cast
per call for fp8).  The end-to-end GGUF runs with weights partly offloaded (docs/measurements/e2e-h200-gguf-budgets.jsonl: 1280x720x81
at 16 and 12 GiB; e2e-h200-gguf-budgets-2.jsonl: 1280x720x81 at 12 and 8 GiB, 832x480x81 at 8 GiB,
832x1472x49 at 10 GiB; eager and compiled per block, with the estimator or ComfyUI's reservation) and the fp8
ones (e2e-h200-fp8-compile.jsonl, -2 and -3: 1280x720x81 at 24, 20, 16 and 12 GiB, eager and compiled per block)
were set from neither either, and are checked the same way per completed expert.  The fp8 experts compiled per
block with every weight resident in e2e-h200-fp8-compile-3.jsonl check the cast rule of
memory/estimate.compiled_as_eager, which was made from one expert of e2e-h200-fp8-compile-2.jsonl.
"""
import json
from pathlib import Path

import pytest

from wan_sage.memory import activation_model
from wan_sage.memory.estimate import GiB, Setup, attention_plan, plan
from wan_sage.memory.measured_rows import e2e_estimate
from wan_sage.memory.weights import weights_for_key

MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measurements"
A14B = activation_model.PRESETS["wan2.2-a14b"]
RUNS = [(p.name, json.loads(line)) for p in sorted(MEASURED.glob("2026-11-29-partial-*.jsonl"))
        for line in p.read_text().splitlines() if line.strip()]


def _records(*names: str) -> list:
    """Every record of these JSON-lines files of docs/measurements, in order."""
    return [json.loads(line) for name in names for line in (MEASURED / name).read_text().splitlines() if line.strip()]


def _case(name):
    size = (1280, 720, 81) if "720p" in name else (832, 480, 81)
    return size, "fp8" if "fp8" in name else "bf16", "lora" in name


@pytest.mark.parametrize("name,r", RUNS, ids=lambda x: x if isinstance(x, str) else x["config"])
def test_what_the_allocator_held_fits_in_the_reservation(name, r):
    (w, h, f), weights, lora = _case(name)
    weights = weights_for_key(A14B, weights, lora, compute="bf16")  # 2-byte compute: the bytes ComfyUI's fp16 choice gives too
    est = plan(Setup(dims=A14B, latent=activation_model.latent_shape(A14B, w, h, f), dtype="bf16",
                     attention=attention_plan("sage-auto" if "+sage" in r["config"] else "sdpa", 90),
                     weights=weights.setup, weights_bytes=weights.nbytes))
    assert r["status"] == "ok"
    held = (r["peak_reserved_gib"] - r["weights_resident_gib"]) * GiB
    partly_offloaded = r["weights_resident_gib"] < r["weights_total_gib"] - 0.01
    reservation = est.reservation_partial if partly_offloaded else est.reservation_resident
    assert held <= reservation, (held / GiB, reservation / GiB)


def test_the_records_cover_both_factors():
    partly = [r for n, r in RUNS if r["weights_resident_gib"] < r["weights_total_gib"] - 0.01]
    cast_resident = [r for n, r in RUNS if "fp8" in n and r["weights_resident_gib"] >= r["weights_total_gib"] - 0.01]
    assert len(partly) >= 10 and len(cast_resident) >= 4


E2E_STREAMED_FILES = ("e2e-h200-gguf-budgets.jsonl", "e2e-h200-gguf-budgets-2.jsonl", "e2e-h200-fp8-compile.jsonl",
                      "e2e-h200-fp8-compile-2.jsonl", "e2e-h200-fp8-compile-3.jsonl")
E2E_STREAMED = [(f"{r['run']} {r['config']['weights']} {name}", r, e)
                for r in _records(*E2E_STREAMED_FILES) if r["status"] == "ok"
                for name, e in r["experts"].items() if e["resident_frac"] < 0.9999]


@pytest.mark.parametrize("name,r,e", E2E_STREAMED, ids=[x[0] for x in E2E_STREAMED])
def test_experts_streamed_end_to_end_fit_in_the_partial_reservation(name, r, e):
    c = r["config"]
    est = e2e_estimate(c)
    held = (e["peak_reserved_gib"] - e["resident_gib"]) * GiB
    if c["budget_gib"] * GiB <= est.reservation_partial:
        pytest.skip("the budget is below the reservation: what the allocator held cannot exceed it, so this row checks nothing")
    assert held <= est.reservation_partial, (held / GiB, est.reservation_partial / GiB)


def test_the_end_to_end_records_stream_weights_eager_and_compiled():
    for weights in ("gguf", "fp8"):
        rs = [r for _n, r, _e in E2E_STREAMED if r["config"]["weights"] == weights]
        assert {bool(r["config"].get("compile")) for r in rs} == {False, True}, weights
        assert {r["config"]["estimator"] for r in rs} == {False, True}, weights
        assert {r["config"]["budget_gib"] for r in rs} >= {16.0, 12.0}, weights
    assert {r["config"]["budget_gib"] for _n, r, _e in E2E_STREAMED} >= {16.0, 12.0, 10.0, 8.0}
    assert len({(r["config"]["width"], r["config"]["height"], r["config"]["frames"]) for _n, r, _e in E2E_STREAMED}) >= 3


def test_the_compiled_fp8_expert_kept_resident_is_now_reserved_above_what_it_held():
    """Regression guard, not validation: session 9's low-noise fp8 expert, compiled per block with every
    weight resident, held more above its weights than the compiled figure reserved for it then; compiled
    blocks with cast weights are now reserved for as eager ones (memory/estimate.compiled_as_eager),
    a rule made after seeing this row."""
    rs = _records("e2e-h200-fp8-compile-2.jsonl")
    resident = [(r, e) for r in rs if r["status"] == "ok" and r["config"].get("compile")
                for e in r["experts"].values() if e["resident_frac"] >= 0.9999]
    assert resident
    for r, e in resident:
        held = (e["peak_reserved_gib"] - e["resident_gib"]) * GiB
        est = e2e_estimate(r["config"])
        assert e["predicted_working_gib"] * GiB < held <= est.reservation_resident, (held / GiB, est.reservation_resident / GiB)
        assert est.resident["compiled_as_eager"] == "cast"


# The compiled fp8 runs measured after the cast rule, which it was not made from (session 10).
CAST_RULE_CHECK_FILES = ("e2e-h200-fp8-compile-3.jsonl",)
CAST_RULE_CHECK = [(f"{r['run']} {name}", r, e)
                   for r in _records(*CAST_RULE_CHECK_FILES) if r["status"] == "ok" and r["config"].get("weights") == "fp8" and r["config"].get("compile")
                   for name, e in r["experts"].items() if e["resident_frac"] >= 0.9999]


@pytest.mark.parametrize("name,r,e", CAST_RULE_CHECK, ids=[x[0] for x in CAST_RULE_CHECK])
def test_compiled_fp8_experts_kept_resident_fit_in_the_reservation(name, r, e):
    """Validation of the cast rule on runs it was not made from: what the allocator held at the sampling
    peak above what was allocated when sampling started (on the full card the other models stay loaded)
    is within today's reservation for every weight resident, which reserves compiled fp8 blocks as eager."""
    est = e2e_estimate(r["config"])
    assert est.resident["compiled_as_eager"] == "cast"
    held = (e["peak_reserved_gib"] - e["base_alloc_gib"]) * GiB
    assert held <= est.reservation_resident, (held / GiB, est.reservation_resident / GiB)


def test_the_cast_rule_check_covers_sizes_budgets_and_both_configurations():
    assert len(CAST_RULE_CHECK) >= 6
    assert len({(r["config"]["width"], r["config"]["height"], r["config"]["frames"]) for _n, r, _e in CAST_RULE_CHECK}) >= 3
    assert {r["config"]["budget_gib"] for _n, r, _e in CAST_RULE_CHECK} >= {24.0, None}
    assert {r["config"]["estimator"] for _n, r, _e in CAST_RULE_CHECK} == {False, True}
