"""The reservation placed for what a sampling's calls held (``nodes/replan.py``, ``measured_reservation``) against
the whole-prompt records made with it (``bench.render_docs.MEASURED_PLAN_ROUNDS``): the figure each move placed the
weights for is what the first call held by the records' own step peaks, with its margin; the call after the move
stayed within that figure and what ComfyUI keeps free, so the device never held more than the budget; every prompt
completed with no allocator retry.  How much of the budget stayed unused is a benchmark figure, given in
docs/attention.md ("The re-plan between model calls"), not asserted here."""
from __future__ import annotations

import pytest

from bench import _records, render_docs
from wan_sage.memory.estimate import COMFY_EXTRA_RESERVED
from wan_sage.nodes.replan import measured_reservation

GiB = 1 << 30


def _samplings() -> list:
    out = []
    for name, rnd in render_docs.MEASURED_PLAN_ROUNDS:
        for r in _records.rows(name):
            if r.get("round") != rnd or not r["config"].get("estimator"):
                continue
            for i, pr in enumerate(r["prompts"]):
                for ex, e in pr["experts"].items():
                    out.append(pytest.param(r, pr, e, id=f"{r['run']}-{i}-{ex}"))
    return out


SAMPLINGS = _samplings()


def test_the_records_are_there():
    assert len(SAMPLINGS) >= 16


@pytest.mark.parametrize("r, pr, e", SAMPLINGS)
def test_each_sampling_moved_once_to_what_its_first_call_held(r, pr, e):
    assert pr["status"] == "ok" and pr["alloc_retries"] == 0
    (m,) = e["replan"]
    held = e["step_peak_reserved_gib"][0] - e["base_alloc_gib"]
    assert m["call"] == 2 and m["to_gib"] < m["from_gib"]
    assert m["to_gib"] == pytest.approx(measured_reservation(held * GiB) / GiB, abs=0.1)


@pytest.mark.parametrize("r, pr, e", SAMPLINGS)
def test_the_call_after_the_move_stays_within_the_figure_and_what_comfyui_keeps_free(r, pr, e):
    (m,) = e["replan"]
    after = e["step_peak_reserved_gib"][m["call"] - 1] - (e["base_alloc_gib"] + m["moved_gib"])
    assert after <= m["to_gib"] + COMFY_EXTRA_RESERVED / GiB
