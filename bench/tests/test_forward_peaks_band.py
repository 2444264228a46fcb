"""The memory model against every forward-peak record measured on the H200 (ComfyUI 0.3.64 WanModel, real
dims, random weights, cudaMallocAsync; ``python -m bench.forward_peaks`` and ``python -m bench.compile_table``).

The rows come in three roles.  *Fit* rows are the ones the model's terms and constants were set from
(bench/records/forward-peaks/fit.jsonl; for the compiled terms forward-peaks/compiled.jsonl and the
compile table).  *Check* rows were measured after the terms and constants were set and set none of
them: the compiled Sage rows at the fit sizes (forward-peaks/compiled-sage.jsonl), in both memory
modes, against the compiled attention-op term set from one compile-table row.  *Held-out* rows use sizes
the fit never saw (other aspect ratios, portrait, longer clips, other frame counts, each model):
forward-peaks/held-out.jsonl, forward-peaks/compiled-held-out.jsonl and, with the Sage patch in both
memory modes, forward-peaks/compiled-sage-held-out.jsonl.  Both must lie in the band: never under the measured peak, at
most 10 % over it plus the fixed first-forward workspace term (an absolute 34 MiB that dominates
only below about a third of a GiB).
"""
import json

import pytest

from bench._records import RECORDS
from bench.measured_rows import ROW_PRESETS as PRESET, head_groups, predict_forward
from wan_sage.memory import activation_model
from wan_sage.memory.estimate import CALIBRATED, activation_bytes

DATA = RECORDS / "forward-peaks"


def _rows(path, role):
    return [dict(json.loads(line), role=role, source=path.name) for line in path.read_text().splitlines() if line.strip()]


FIT = _rows(DATA / "fit.jsonl", "fit")
HELDOUT = _rows(DATA / "held-out.jsonl", "heldout")
COMPILED_FIT = _rows(DATA / "compiled.jsonl", "fit")
COMPILED_HELDOUT = _rows(DATA / "compiled-held-out.jsonl", "heldout")
COMPILED_SAGE = _rows(DATA / "compiled-sage.jsonl", "check")
COMPILED_SAGE_HELDOUT = _rows(DATA / "compiled-sage-held-out.jsonl", "heldout")
# Seen before CALIBRATED["slack_fixed"] was set (see its comment), so not held out for it.
NOT_HELD_OUT = {("ti2v5b", True, 832, 480, 161)}


def predict(r):
    return predict_forward(r)["total"]


def in_band(r) -> bool:
    p, m = predict(r), r["measured"]
    return m <= p <= 1.10 * m + CALIBRATED["slack_fixed"]


def _id(r):
    return f"{r['role']}-{r['model']}-{r['dtype']}-{r['attn']}-{'compiled-' if r.get('compiled') else ''}" \
           f"{r['width']}x{r['height']}x{r['frames']}"


def test_fit_table_covers_the_required_grid():
    assert len(FIT) >= 72
    for m in PRESET:
        for dt in ("bf16", "fp16"):
            for at in ("sdpa", "sage"):
                sizes = {r["tokens"] for r in FIT if (r["model"], r["dtype"], r["attn"]) == (m, dt, at)}
                assert len(sizes) >= 6, (m, dt, at)
    assert max(r["tokens"] for r in FIT if r["model"] == "a14b") == 75600


def test_held_out_sizes_are_sizes_the_fit_never_saw():
    for held, fit in ((HELDOUT, FIT), (COMPILED_HELDOUT, COMPILED_FIT), (COMPILED_SAGE_HELDOUT, COMPILED_FIT + COMPILED_SAGE)):
        seen = {(r["model"], r["width"], r["height"], r["frames"]) for r in fit}
        assert held and all((r["model"], r["width"], r["height"], r["frames"]) not in seen for r in held)
        for m in PRESET:
            mine = [r for r in held if r["model"] == m]
            assert any(r["height"] > r["width"] for r in mine), (m, "portrait")
            assert any(r["width"] == r["height"] for r in mine) or m == "ti2v5b" and any(
                r["width"] * 9 != r["height"] * 16 for r in mine), (m, "another aspect ratio")
            assert any(r["frames"] > 81 for r in mine), (m, "a longer clip")


@pytest.mark.parametrize("r", FIT + COMPILED_FIT, ids=_id)
def test_fit_rows_in_band(r):
    assert r["ok"] and r["measured"] > 0
    assert in_band(r), (predict(r) / r["measured"] - 1)


@pytest.mark.parametrize("r", HELDOUT + COMPILED_HELDOUT + COMPILED_SAGE_HELDOUT,
                         ids=lambda r: _id(r) + (f"-{r['memory_mode']}" if r.get("memory_mode") else ""))
def test_held_out_rows_in_band(r):
    assert r["ok"] and r["measured"] > 0
    assert in_band(r), (predict(r) / r["measured"] - 1)


@pytest.mark.parametrize("r", COMPILED_SAGE, ids=lambda r: _id(r) + f"-{r['memory_mode']}")
def test_compiled_sage_rows_in_band(r):
    assert r["ok"] and r["measured"] > 0 and r["compiled"] and r["sage"]["sage_calls"] > 0
    assert in_band(r), (predict(r) / r["measured"] - 1)


def test_compiled_sage_rows_cover_both_memory_modes_and_every_model():
    for m in PRESET:
        mine = [r for r in COMPILED_SAGE if r["model"] == m]
        fastest = {(r["width"], r["height"], r["frames"]) for r in mine if r["memory_mode"] == "fastest"}
        assert fastest == {(r["width"], r["height"], r["frames"]) for r in COMPILED_FIT if r["model"] == m}
        grouped = [r for r in mine if r["memory_mode"] == "sdpa"]
        assert grouped and all(r["sage"]["head_split_calls"] == r["sage"]["sage_calls"] for r in grouped)
        assert all(r["sage"]["head_split_calls"] == 0 for r in mine if r["memory_mode"] == "fastest")


def test_held_out_compiled_sage_rows_cover_both_memory_modes_and_every_model():
    """Every held-out compiled size ran with the Sage patch in mode ``fastest`` (ungrouped) and, where the
    head-group formula splits it, in mode ``sdpa`` with every Sage call split."""
    for m in PRESET:
        mine = [r for r in COMPILED_SAGE_HELDOUT if r["model"] == m and r["compiled"] and r["sage"]["sage_calls"] > 0]
        fastest = {(r["width"], r["height"], r["frames"]) for r in mine if r["memory_mode"] == "fastest"}
        assert fastest >= {(r["width"], r["height"], r["frames"]) for r in COMPILED_HELDOUT if r["model"] == m}, m
        assert all(r["sage"]["head_split_calls"] == 0 for r in mine if r["memory_mode"] == "fastest")
        grouped = [r for r in mine if r["memory_mode"] == "sdpa"]
        assert grouped and all(r["sage"]["head_split_calls"] == r["sage"]["sage_calls"] for r in grouped), m


def test_held_out_rows_are_counted_apart_from_the_rows_set_from_them():
    key = lambda r: (r["model"], bool(r.get("compiled")), r["width"], r["height"], r["frames"])  # noqa: E731
    assert {key(r) for r in COMPILED_HELDOUT} >= NOT_HELD_OUT


def _compile_table_rows():
    out = []
    for p in sorted((RECORDS / "compile").glob("table*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return out


@pytest.mark.parametrize("r", [r for r in _compile_table_rows() if r["ok"]], ids=lambda r: r["config"] + (
    "-forced" if r.get("grouping_forced") else ""))
def test_compile_table_rows_in_band(r):
    """The compile table's A14B 720p81 rows, eager and compiled, SDPA and Sage grouped or not, as the
    dispatcher ran them (head-split calls say whether the memory mode's groups were in force)."""
    d = activation_model.PRESETS["wan2.2-a14b"]
    path = "sage2_sm90" if r["attention"] == "sage" else "sdpa"
    lat = activation_model.latent_shape(d, r["width"], r["height"], r["frames"])
    w = activation_model.Workload(L=r["tokens"], dtype=r["dtype"], self_attn=path, compiled=r["compiled"],
                                  latent_elems_per_row=activation_model.latent_elems(lat),
                                  self_attn_groups=head_groups(r, d, path))
    p, m = activation_bytes(d, w)["total"], r["peak_gib"] * (1 << 30)
    assert m <= p <= 1.10 * m + CALIBRATED["slack_fixed"], p / m - 1
