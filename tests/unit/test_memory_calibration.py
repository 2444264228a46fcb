"""The memory model against every row measured on the H200 (ComfyUI 0.3.64 WanModel, real
dims, random weights, cudaMallocAsync; bench/wan_forward_calibration.py).  Never under, at most
10 % over."""
import json
from pathlib import Path

import pytest

from wan_sage.memory import activation_model
from wan_sage.memory.estimate import activation_bytes

TABLE = Path(__file__).resolve().parents[2] / "memory" / "calibration" / "h200_forward.jsonl"
PRESET = {"a14b": "wan2.2-a14b", "1.3b": "wan2.1-1.3b", "ti2v5b": "wan2.2-ti2v-5b"}
ROWS = [json.loads(line) for line in TABLE.read_text().splitlines() if line.strip()]


def predict(r):
    d = activation_model.PRESETS[PRESET[r["model"]]]
    lat = activation_model.latent_shape(d, r["width"], r["height"], r["frames"])
    assert activation_model.tokens(d, *lat[2:]) == r["tokens"]
    used_sage = r["attn"] == "sage" and (r.get("sage") or {}).get("sage_calls", 1) != 0
    w = activation_model.Workload(L=r["tokens"], dtype=r["dtype"], self_attn="sage2_sm90" if used_sage else "sdpa",
                   latent_elems_per_row=activation_model.latent_elems(lat))
    return activation_bytes(d, w)["total"]


def test_table_covers_the_required_grid():
    assert len(ROWS) >= 72
    for m in PRESET:
        for dt in ("bf16", "fp16"):
            for at in ("sdpa", "sage"):
                sizes = {r["tokens"] for r in ROWS if (r["model"], r["dtype"], r["attn"]) == (m, dt, at)}
                assert len(sizes) >= 6, (m, dt, at)
    assert max(r["tokens"] for r in ROWS if r["model"] == "a14b") == 75600


@pytest.mark.parametrize("r", ROWS, ids=lambda r: f"{r['model']}-{r['dtype']}-{r['attn']}-{r['tokens']}")
def test_prediction_within_0_to_10_percent(r):
    assert r["ok"] and r["measured"] > 0
    p = predict(r)
    assert r["measured"] <= p <= 1.10 * r["measured"], (p / r["measured"] - 1)
