"""The fragmentation constants and the cast rule of memory/estimate.py on records they were not set from.

Which record files each was set from is ``bench._records.SET_FROM``: ``partial_frag_factor`` from the
reference budget run (PyTorch's native allocator), ``cast_frag_factor`` from the end-to-end fp8 runs with
every weight resident at 24 GiB and on the full card, and the cast rule of
``memory/estimate.compiled_as_eager`` from one expert of the fp8 runs compiled per block at 24 GiB.  The
partial-load benchmark's runs (cudaMallocAsync, ``python -m bench.partial_load``) were set from neither
factor: in every one of them, what the allocator held above the resident weights at its peak must fit in
the reservation the estimate makes for that configuration (weights partly offloaded, or all resident and
cast per call for fp8).  The end-to-end experts sampled with weights partly offloaded, GGUF and fp8, eager
and compiled per block, with the estimator or ComfyUI's reservation, in every end-to-end record file
neither factor was set from, are checked the same way per completed expert.  The fp8 experts compiled per
block with every weight resident in the files the cast rule was not made from check that rule.
"""
import math

import pytest

from bench import _records
from bench.measured_rows import e2e_estimate, gguf_stream_copy_gib, gguf_stream_need_gib
from wan_sage.memory import activation_model
from wan_sage.memory.estimate import CALIBRATED, GiB, Setup, attention_plan, plan
from wan_sage.memory.weights import weights_for_key

A14B = activation_model.PRESETS["wan2.2-a14b"]
RUNS = [(p.name, r) for p in _records.not_set_from("partial_frag_factor", "partial-load") for r in _records.rows(p)]


def _records_of(paths) -> list:
    """Every end-to-end run record of these record files, in order."""
    return [r for p in paths for r in _records.rows(p) if "config" in r]


def _case(name):
    """(size, weights, LoRA) of a partial-load record file, from its name (``720p81-fp8-lora64.jsonl``)."""
    size = (1280, 720, 81) if name.startswith("720p81") else (832, 480, 81)
    return size, "fp8" if "-fp8" in name else "bf16", "-lora" in name


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


# every end-to-end record file neither fragmentation factor was set from
E2E_CHECK_FILES = [p for p in _records.not_set_from("partial_frag_factor", "e2e")
                   if p in _records.not_set_from("cast_frag_factor", "e2e")]
GGUF_TERM_FILES = {p.resolve() for p in _records.set_from("gguf_stream_copies")}


def _gguf_eager(c: dict) -> bool:
    """GGUF weights streamed by eager blocks: reserved with the GGUF streaming term, not the partial-load one."""
    return c.get("weights") == "gguf" and not c.get("compile")


# Their eager GGUF experts set the GGUF streaming term, so they are left out here; the whole-prompt records check it.
E2E_STREAMED = [(f"{r['run']} {r['config']['weights']} {name} ({p.stem})", r, e)
                for p in E2E_CHECK_FILES for r in _records_of([p]) if r["status"] == "ok"
                and not (p.resolve() in GGUF_TERM_FILES and _gguf_eager(r["config"]))
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
    gguf = [r for _n, r, _e in E2E_STREAMED if r["config"]["weights"] == "gguf"]
    assert {bool(r["config"].get("compile")) for r in gguf} == {True}
    assert {r["config"]["estimator"] for r in gguf} == {False, True}
    fp8 = [r for _n, r, _e in E2E_STREAMED if r["config"]["weights"] == "fp8"]
    assert {bool(r["config"].get("compile")) for r in fp8} == {False, True}
    assert {r["config"]["estimator"] for r in fp8} == {False, True}
    for rs in (gguf, fp8):
        assert {r["config"]["budget_gib"] for r in rs} >= {16.0, 12.0}
    assert {r["config"]["budget_gib"] for _n, r, _e in E2E_STREAMED} >= {24.0, 20.0, 16.0, 12.0}
    # with the partial-load benchmark's runs, the partial-load term is checked at more than one size
    sizes = {(r["config"]["width"], r["config"]["height"], r["config"]["frames"]) for _n, r, _e in E2E_STREAMED}
    assert len(sizes | {_case(n)[0] for n, _r in RUNS}) >= 2


def test_the_compiled_fp8_expert_kept_resident_is_now_reserved_above_what_it_held():
    """Regression guard, not validation: the low-noise fp8 expert the cast rule was made from, compiled per
    block with every weight resident, held more above its weights than the compiled figure reserved for it
    then; compiled blocks with cast weights are now reserved for as eager ones
    (memory/estimate.compiled_as_eager), a rule made after seeing this row."""
    rs = _records_of(_records.set_from("compiled_as_eager"))
    resident = [(r, e) for r in rs if r["status"] == "ok" and r["config"].get("compile")
                for e in r["experts"].values() if e["resident_frac"] >= 0.9999]
    assert resident
    for r, e in resident:
        held = (e["peak_reserved_gib"] - e["resident_gib"]) * GiB
        est = e2e_estimate(r["config"])
        assert e["predicted_working_gib"] * GiB < held <= est.reservation_resident, (held / GiB, est.reservation_resident / GiB)
        assert est.resident["compiled_as_eager"] == "cast"


# The compiled fp8 runs of every record file the cast rule was not made from.
CAST_RULE_CHECK = [(f"{r['run']} {name} ({p.stem})", r, e)
                   for p in _records.not_set_from("compiled_as_eager", "e2e")
                   for r in _records_of([p]) if r["status"] == "ok" and r["config"].get("weights") == "fp8" and r["config"].get("compile")
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


# The GGUF streaming term (CALIBRATED["gguf_stream_copies"]) on the records it was not set from: every expert
# of a whole-prompt run (first and repeat prompt) that streamed GGUF weights through eager blocks.
WHOLE_GGUF_STREAMED = [(f"{r['run']} {pr['prompt']} {name} ({p.stem})", r, e)
                       for p in _records.files("whole-prompt") for r in _records.rows(p)
                       if r.get("status") == "ok" and _gguf_eager(r["config"])
                       for pr in r["prompts"] if pr["status"] == "ok"
                       for name, e in pr["experts"].items() if e["resident_frac"] < 0.9999]


@pytest.mark.parametrize("name,r,e", WHOLE_GGUF_STREAMED, ids=[x[0] for x in WHOLE_GGUF_STREAMED])
def test_whole_prompt_experts_streaming_gguf_fit_in_the_gguf_streaming_reservation(name, r, e):
    """What the allocator held above the resident weights fits in the streamed reservation the node makes
    now: for Sage, the plan with q handed over (the smaller one, as the node makes it on 0.3.64)."""
    c = r["config"]
    est = e2e_estimate(c, q_handed_over=c["attention"] == "sage")
    assert est.partial["fragmentation"] == int(CALIBRATED["gguf_stream_copies"] * 2 * A14B.dim * A14B.ffn_dim)
    held = (e["peak_reserved_gib"] - e["resident_gib"]) * GiB
    assert held <= est.reservation_partial, (held / GiB, est.reservation_partial / GiB)


def test_the_gguf_streaming_check_covers_budgets_and_both_configurations():
    assert len(WHOLE_GGUF_STREAMED) >= 8
    assert {r["config"]["budget_gib"] for _n, r, _e in WHOLE_GGUF_STREAMED} >= {16.0, 12.0}
    assert {r["config"]["estimator"] for _n, r, _e in WHOLE_GGUF_STREAMED} == {False, True}


def test_the_gguf_streaming_term_is_the_fewest_whole_copies_its_records_need():
    """The fit itself: the eager experts that streamed GGUF weights in the files the term was set from need
    at most this many dequantised copies of the largest Linear above the reservation without it, and one
    copy fewer would leave the largest of them above the reservation."""
    need = gguf_stream_need_gib()
    assert len(need) >= 20
    assert CALIBRATED["gguf_stream_copies"] == max(1, math.ceil(max(need) / gguf_stream_copy_gib()))
