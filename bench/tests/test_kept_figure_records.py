"""A sampling that starts from what the latest sampling of its setup held (``nodes/held_record.py``) against the
whole-prompt records made with it (``bench.render_docs.KEPT_FIGURE_ROUNDS``): the samplings the docs count as
started from the kept figure are those whose log says so, each placed below its plan; none held more than that
figure and what ComfyUI keeps free; every prompt completed with no allocator retry.  How much of the budget stayed
unused is a benchmark figure, given in docs/attention.md ("The re-plan between model calls"), not asserted here."""
from __future__ import annotations

import gzip

import pytest

from bench import _records, render_docs
from wan_sage.memory.estimate import COMFY_EXTRA_RESERVED

GiB = 1 << 30
STARTED = "at the start, from what an earlier sampling of this setup held"


def _samplings(name: str, rnd: str) -> list:
    return [(r, pr, e) for r in _records.rows(name) if r.get("round") == rnd and r["config"].get("estimator")
            for pr in r["prompts"] for e in pr["experts"].values()]


@pytest.mark.parametrize("name, rnd", render_docs.KEPT_FIGURE_ROUNDS)
def test_the_samplings_counted_as_started_from_the_kept_figure_are_those_the_log_says(name, rnd):
    found = _samplings(name, rnd)
    kept = [e for _, _, e in found if not render_docs.started_on_plan(e)]
    log = gzip.decompress(_records.path(name).with_suffix(".log.gz").read_bytes()).decode()
    assert len(found) >= 4 and 0 < len(kept) < len(found)
    assert log.count(STARTED) == len(kept)


@pytest.mark.parametrize("name, rnd", render_docs.KEPT_FIGURE_ROUNDS)
def test_a_sampling_started_below_its_plan_held_no_more_than_it_and_what_comfyui_keeps_free(name, rnd):
    for r, pr, e in _samplings(name, rnd):
        assert pr["status"] == "ok" and pr["alloc_retries"] == 0
        if render_docs.started_on_plan(e):
            continue
        assert e["predicted_working_gib"] < e["estimator"]["reservation_gb"]
        held = e["step_peak_reserved_gib"][0] - e["base_alloc_gib"]
        assert held <= e["predicted_working_gib"] + COMFY_EXTRA_RESERVED / GiB
