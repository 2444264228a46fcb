"""The record files of ``bench/records/``: where they are, how they are read, and which of them a rule
or constant of the pack was set from.

Every record file holds the rows of one kind, named by what they contain; its rows carry their own
env, commit and config fields.  A file that merges the rows of several device machines gives each row a
``round`` field (the entry of ``bench/records/LOG.md`` it was measured in), so that speed ratios are
taken between rows of one machine only.  ``bench/records/README.md`` lists every file.
"""
from __future__ import annotations

import json
from pathlib import Path

from ._host import ROOT

RECORDS = ROOT / "bench" / "records"
# A record file whose name starts with this holds records kept so that nobody reuses them as the pack's
# (a run whose budget was not the one named, or one made with a rule the pack then dropped); no table reads
# it, and a page quotes it only where it says why.
VOID_PREFIX = "void-"

# Which record files each rule or constant of the pack was set from.  The rows of these files are its
# source; the rows of the same kind in every other file were not used to set it, so they check it.
SET_FROM = {
    # memory/estimate.py CALIBRATED: the fragmentation term with weights partly offloaded
    "partial_frag_factor": ("partial-load/reference-budget.jsonl",),
    # memory/estimate.py CALIBRATED: the room for the allocator's holes around per-call weight casts (fp8)
    "cast_frag_factor": ("e2e/fp8-24gib-full-card.jsonl",),
    # memory/estimate.compiled_as_eager answering "cast": compiled blocks with weights cast at every call
    # are reserved for as eager ones
    "compiled_as_eager": ("e2e/fp8-compiled-24gib.jsonl",),
    # memory/estimate.py CALIBRATED: the streaming term of GGUF weights streamed by eager blocks
    "gguf_stream_copies": ("e2e/gguf-budgets-24-16-12gib.jsonl", "e2e/gguf-budgets-12-10-8gib.jsonl"),
}


def path(name: str) -> Path:
    """A record file by its name under ``bench/records/`` (e.g. ``e2e/gguf-compile.jsonl``)."""
    return RECORDS / name


def name_of(p: Path) -> str:
    """The name of a record file under ``bench/records/``."""
    return p.resolve().relative_to(RECORDS.resolve()).as_posix()


def rows(p) -> list[dict]:
    """Every JSON object of a JSON-lines record file, in order."""
    p = p if isinstance(p, Path) else path(p)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def files(kind: str) -> list[Path]:
    """The JSON-lines record files of one folder (``e2e``, ``partial-load``, ...), by name, without the void ones."""
    return sorted(p for p in (RECORDS / kind).glob("*.jsonl") if not p.name.startswith(VOID_PREFIX))


def set_from(rule: str) -> list[Path]:
    """The record files ``rule`` was set from (:data:`SET_FROM`)."""
    return [path(n) for n in SET_FROM[rule]]


def not_set_from(rule: str, kind: str) -> list[Path]:
    """The record files of folder ``kind`` that ``rule`` was not set from: the ones that check it."""
    source = {p.resolve() for p in set_from(rule)}
    return [p for p in files(kind) if p.resolve() not in source]


def run_sets(paths) -> list[tuple[Path, object, list[dict]]]:
    """(file, round, rows) for each set of rows measured on one machine: one per file, or one per
    ``round`` value where the file merges several, in the order the rows appear."""
    out = []
    for p in paths:
        by_round: dict = {}
        for r in rows(p):
            by_round.setdefault(r.get("round"), []).append(r)
        out += [(p, k, rs) for k, rs in by_round.items()]
    return out


def moved_before_steps(e: dict) -> list[float]:
    """GiB of weights the pack's re-plan had loaded (negative: unloaded) before each step of one expert's sampling
    (its record's ``replan``, ``nodes/replan.py``): a move before model call ``c`` comes before step ``c`` (the
    samplers of these records make one model call a step); 0 for every step where nothing moved."""
    n = len(e.get("step_peak_reserved_gib") or [])
    out = [0.0] * n
    for m in e.get("replan") or []:
        for i in range(max(0, int(m["call"]) - 1), n):
            out[i] += m["moved_gib"]
    return out


def held_per_step(e: dict, weights_gib: float) -> list[float]:
    """What the allocator held at each step's peak above ``weights_gib`` and the weights the re-plan loaded before
    that step (GiB): the working memory of each step, the weights moved between steps taken out."""
    return [r - weights_gib - m for r, m in zip(e["step_peak_reserved_gib"], moved_before_steps(e))]
