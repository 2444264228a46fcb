"""Render the docs pages from the records of ``bench/records/``: docs/attention.md, docs/memory-model.md
and docs/benchmarks.md, and the results table of README.md (between its ``<!-- render_docs: results -->``
and ``<!-- /render_docs: results -->`` lines, where README.md has them).

    python -m bench.render_docs          # from the repository root

Every figure of a table and of the text around it is computed from the records.  Rows are grouped by
what they say about themselves (config, env, commit, and the ``round`` of a merged record file); which
record files a rule was set from is ``bench._records.SET_FROM``."""
from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import statistics
import string
import sys
from pathlib import Path
from unittest import mock

from . import _host, plot_e2e
from ._records import (RECORDS, SET_FROM, files, held_per_step, moved_before_steps, name_of, not_set_from, path, rows,
                       run_sets, set_from)
from .measured_rows import compiled_blocks, e2e_estimate, gguf_stream_copy_gib, gguf_stream_need_gib, head_groups, predict_forward

_host.load_pack()
from wan_sage.memory import activation_model, vae_decode  # noqa: E402
from wan_sage.memory.compile_payback import compile_payback  # noqa: E402
from wan_sage.memory.estimate import CALIBRATED, COMFY_EXTRA_RESERVED, fragmentation_bytes  # noqa: E402
from wan_sage.nodes.replan import MEASURED_FLOOR, MEASURED_MARGIN  # noqa: E402

GiB = 2 ** 30
ROOT = _host.ROOT
# what each rule of bench._records.SET_FROM is called in the pages
RULE_TEXT = {"partial_frag_factor": "the partial-load term (`partial_frag_factor`)",
             "cast_frag_factor": "the fp8 cast term (`cast_frag_factor`)",
             "compiled_as_eager": "the cast rule for compiled blocks (`compiled_as_eager`)",
             "gguf_stream_copies": "the GGUF streaming term (`gguf_stream_copies`)"}
DOCS = ROOT / "docs"
R720 = (1280, 720, 81)


# --------------------------------------------------------------------------- small helpers

def link(name: str, text: str | None = None, base: str = "../bench/records/") -> str:
    """A Markdown link to a record file, from a page of docs/."""
    return f"[`{text or Path(name).name}`]({base}{name})"


def _span(values, fmt="{:.2f}", sep="–"):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else fmt.format(lo) + sep + fmt.format(hi)


def _and(parts: list) -> str:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def size_of(c: dict) -> str:
    return f"{c['width']}×{c['height']}×{c['frames']}"


def commit_of(r: dict) -> str:
    return (r.get("env") or {}).get("wan_sage_commit") or "?"


def held_above_weights(e: dict) -> float:
    """What the allocator held above an expert's resident weights at its sampling peak (GiB); where the re-plan
    moved weights between steps, at the peak of the step that held the most above the weights it then had."""
    if e.get("replan") and e.get("step_peak_reserved_gib"):
        return max(held_per_step(e, e["resident_gib"]))
    return e["peak_reserved_gib"] - e["resident_gib"]


def held_above_start(e: dict) -> float:
    """What the allocator held at an expert's sampling peak above what was allocated when its sampling
    started (GiB): its weights, and on the full card the other models that stayed loaded too."""
    return e["peak_reserved_gib"] - e["base_alloc_gib"]


def e2e_records(weights: str | None = None, paths=None) -> list[tuple[Path, dict]]:
    """(file, record) of every end-to-end run record (void files left out), optionally of one weight format."""
    out = []
    for p in (files("e2e") if paths is None else paths):
        for r in rows(p):
            if "config" in r and "prompts" not in r and (weights is None or r["config"].get("weights") == weights):
                out.append((p, r))
    return out


# --------------------------------------------------------------------------- docs/attention.md

INTO_Q_GROUPS = re.compile(r"a14b_720p81: into-q (\d+) groups")
INTO_Q_FAILED = re.compile(r"tests/gpu/test_into_q_gpu\.py:\d+: \w+")
INTO_Q_COST = re.compile(r"A14B 720p81: ungrouped ([\d.]+) ms, write-into-q ([\d.]+) ms")


INTO_Q_ROW = re.compile(r"^(\S+): into-q (\d+) groups, peak ([\d.]+) MiB \(formula ([\d.]+)\), SDPA ([\d.]+) MiB, "
                        r"ungrouped Sage formula ([\d.]+) MiB, rel L2 ([\d.]+)", re.M)


# The shapes of tests/gpu/test_into_q_gpu.py: [B, H, N, D].
INTO_Q_SHAPES = {"a14b_720p81": (1, 40, 75600, 128), "a14b_480p81": (1, 40, 32760, 128),
                 "t2v1.3b_480p81_cfg2": (2, 12, 32760, 128), "ti2v5b_704p121": (1, 24, 27280, 128),
                 "a14b_1080p49": (1, 40, 106080, 128), "a14b_7480": (1, 40, 7480, 128), "a14b_4680": (1, 40, 4680, 128),
                 "ti2v5b_9000": (1, 24, 9000, 128), "t2v1.3b_15000_cfg2": (2, 12, 15000, 128),
                 "t2v14b_3120": (1, 40, 3120, 128)}


def into_q_logs() -> dict:
    """{log name: (rows, cost)} of the gpu-tier logs that are evidence of this checkout's write-into-q path: their
    into-q tests passed, they ran no shape outside :data:`INTO_Q_SHAPES`, and every shape ran in the groups this
    checkout picks (``head_groups.into_q_groups``).  rows: {shape: (groups, peak MiB, formula MiB, SDPA MiB,
    ungrouped formula MiB, relative L2)}; cost: (ungrouped ms, write-into-q ms) at A14B 720p81, or None."""
    from wan_sage.attention import head_groups, kernel_bytes
    found = {}
    for p in sorted((RECORDS / "gpu-tier").glob("*.log")):
        text = p.read_text()
        rows = {m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4)), float(m.group(5)), float(m.group(6)),
                             float(m.group(7))) for m in INTO_Q_ROW.finditer(text)}
        if not rows or INTO_Q_FAILED.search(text) or set(rows) - set(INTO_Q_SHAPES):
            continue
        if all(head_groups.into_q_groups("sage2_sm90_into_q", kernel_bytes.AttnShape(B, H, N, N, D)).groups == rows[n][0]
               for n, (B, H, N, D) in INTO_Q_SHAPES.items() if n in rows):
            m = INTO_Q_COST.search(text)
            found[p.name] = (rows, (float(m.group(1)), float(m.group(2))) if m else None)
    return found


def into_q_measured_text() -> str:
    """What the write-into-q calls held against SDPA and against their formula in :func:`into_q_logs`."""
    found = into_q_logs()
    if not found or not all("a14b_720p81" in rows for rows, _cost in found.values()):
        return ""
    main = [rows["a14b_720p81"] for rows, _cost in found.values()]
    g, ungrouped = main[0][0], main[0][4]
    others = [x for rows, _cost in found.values() for n, x in rows.items() if n != "a14b_720p81"]
    over = max((x[1] - x[2], n) for rows, _cost in found.values() for n, x in rows.items())
    return (f"On the H200 (gpu tier, {_and([f'`{n}`' for n in found])}) an A14B 1280×720×81 call ran in {g} groups and held "
            f"{_span([x[1] for x in main], '{:.1f}')} MiB above its inputs, against {_span([x[3] for x in main], '{:.1f}')} MiB "
            f"for SDPA and {ungrouped:,.0f} MiB for the ungrouped kernel, at relative L2 {_span([x[5] for x in main], '{:.3f}')}; "
            f"A14B 480p81 and 1080p49, 1.3B 480p81 with cfg batch 2, 5B 704p121, and short calls of 3,120 to 15,000 tokens "
            f"ran in {_span(sorted({x[0] for x in others}), '{:d}')} groups and held "
            f"{_span([x[1] / x[3] for x in others])}× SDPA's bytes. The most a call held above its formula, with the output "
            f"check, was {over[0]:.1f} MiB ({over[1]}).")


def into_q_cost_text() -> str:
    """What the write-into-q call costs against the ungrouped kernel at A14B 720p81 in :func:`into_q_logs`."""
    runs = sorted((into_q / ungrouped - 1, ungrouped, into_q, name)
                  for name, (rows, cost) in into_q_logs().items() if cost for ungrouped, into_q in [cost])
    if not runs:
        return ""
    groups = into_q_logs()[runs[0][3]][0]["a14b_720p81"][0]
    costs = [100 * c for c, *_ in runs]
    each = "; ".join(f"{100 * c:+.1f} % in `{n}` ({q:.1f} against {u:.1f} ms)" for c, u, q, n in runs)
    median = f" (median {statistics.median(costs):+.1f} %)" if len(runs) > 2 else ""
    if len(runs) == 1:
        return f"Against the ungrouped kernel at 720p81 the write-into-q call in {groups} groups took {each}."
    return (f"Against the ungrouped kernel at 720p81 the write-into-q call in {groups} groups took "
            f"{_span(costs, '{:+.1f}')} %{median} over {len(runs)} gpu-tier runs: {each}.")


PACK_ONLY = "the pack's only"  # the caches column of a process that found only the pack's folder kept
BENCH_ONLY = "wan-sage bench's only"  # the first process of a configuration whose folder `wan-sage bench` filled
EXPERT_NAMES = {"high": "high-noise", "low": "low-noise"}


def _compiled_estimator_rows():
    """The whole-generation rows of compiled estimator runs, with their set's label (one machine's records)."""
    for x in whole_rows(whole_sets()):
        if x["workflow"][5] != "" and x["config"][0]:
            yield x


def kept_compile_text() -> str:
    """The first prompt's compile seconds of the compiled whole-prompt rows, caches empty against kept (and against
    the pack's own folder only), per budget, within one set of records (one machine) (" (...)" for the attention
    page; empty without such rows)."""
    by: dict = {}
    for x in _compiled_estimator_rows():
        secs = [r["prompts"][0]["compile"]["compile_s"] for r in x["recs"]
                if r["prompts"] and r["prompts"][0].get("status") == "ok" and r["prompts"][0].get("compile")]
        if secs:
            by.setdefault((x["workflow"][0], x["workflow"][1], x["budget"], x["set"]["label"]), {})[x["caches"]] = \
                statistics.median(secs)
    parts = []
    for (source, size, b, _label), v in by.items():
        # a saved workflow's rows carry "weights:workflow name"; the harness's own workflow is the A14B's
        model = f"the template {source.split(':', 1)[1]}, " if ":" in source else "A14B "
        # a first process whose pack folder held only wan-sage bench's timings compiled from nothing, as one
        # with every folder empty
        empty = v.get("empty", v.get(BENCH_ONLY))
        for kept, words in (("kept", "kept"), (PACK_ONLY, "with only the pack's folder kept")):
            if empty is not None and kept in v:
                parts.append(f"{empty:.1f} s empty against {v[kept]:.1f} s {words} ({model}{_size_text(size)}, "
                             f"{_budget_text(b)})")
    if not parts:
        return ""
    return (f" ([benchmarks](benchmarks.md#{anchor('Whole generation')}); compiling on the first prompt, "
            f"blocks compiled one by one: {'; '.join(parts)})")


def pack_expert_text() -> str:
    """Per expert, the first prompt's compile seconds with every cache empty against only the pack's folder
    kept, within one set of records (" (...)"; empty without such a pair)."""
    found: dict = {}
    for x in _compiled_estimator_rows():
        if x["caches"] not in ("empty", BENCH_ONLY, PACK_ONLY):
            continue
        for r in x["recs"]:
            p = r["prompts"][0] if r["prompts"] else {}
            by = (p.get("compile") or {}).get("by_expert") or {}
            streamed = {e: (v.get("resident_frac") or 1.0) < 1.0 for e, v in (p.get("experts") or {}).items()}
            if p.get("status") == "ok" and by:
                # wan-sage bench's timings only: nothing compiled yet, as with every folder empty
                caches = "empty" if x["caches"] == BENCH_ONLY else x["caches"]
                found.setdefault((x["set"]["label"], x["budget"]), {})[caches] = (by, streamed)
    parts = []
    for (_label, _b), v in found.items():
        if {"empty", PACK_ONLY} <= set(v):
            (empty, streamed), (pack, _s) = v["empty"], v[PACK_ONLY]
            for e in ("high", "low"):
                if e in empty and e in pack and (empty[e]["compile_s"] or pack[e]["compile_s"]):
                    # (an expert that compiled nothing ran the other expert's graph: said of that one)
                    how = "its weights streamed" if streamed.get(e) else "every weight resident"
                    parts.append(f"the {EXPERT_NAMES.get(e, e)} expert, {how}, {pack[e]['compile_s']:.1f} s against "
                                 f"{empty[e]['compile_s']:.1f} s")
    return f" ({'; '.join(parts)})" if parts else ""


def attention_doc() -> str:
    a = rows("attention/kernels.jsonl")
    ab = rows("attention/auto-interleaved.jsonl")
    s1 = rows("attention/kernels-sageattention-1.jsonl")
    o = ["# Attention kernels against SDPA on Wan shapes (H200)\n",
         "How each attention kernel compares with PyTorch's SDPA on the shapes ComfyUI's Wan models call, what the",
         "Sage patch's `auto` override does with them end to end, and the patch under torch.compile. Measured on one",
         "NVIDIA H200 (sm90) with torch 2.11.0+cu130 and triton 3.6.0. SageAttention 2.x was built from",
         "thu-ml/SageAttention main `d1a57a5` for sm90; the packaged 1.0.6 and comfy-kitchen 0.2.40 were measured too.",
         "All runs are bf16, with q/k/v laid out the way ComfyUI's Wan model passes them. The records are in",
         "[`bench/records/attention/`](../bench/records/attention/), the commands that wrote them in",
         "[`bench/records/LOG.md`](../bench/records/LOG.md).\n",
         "```bash",
         "wan-sage bench --dtype bf16 --kernels all --iters 5 --json kernels.jsonl   # SageAttention 2.x + comfy-kitchen installed",
         "wan-sage bench --dtype bf16 --kernels sage1 --shapes a14b_720p81_self,a14b_480p81_self,a14b_720p81_cross --iters 3",
         "wan-sage bench --dtype bf16 --kernels sage2_sm90 --no-accuracy --shapes ...   # auto vs SDPA, interleaved A/B",
         "python -m pytest tests/gpu -q -rs    # the gpu tier",
         "```\n",
         "## Every kernel on every Wan shape\n",
         f"From {link('attention/kernels.jsonl')} and, for SageAttention 1.0.6, {link('attention/kernels-sageattention-1.jsonl')}.",
         "The ms column is the median of 5. The extra column is `max_memory_allocated` above the inputs, for the same",
         "call the dispatcher makes. The formula column comes from `attention/kernel_bytes.py`. rel-L2 is against an fp32",
         "reference on the first 1024 queries.\n",
         "| shape | backend | ms | × SDPA | extra MB | formula MB | error | rel-L2 |",
         "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in a + [x for x in s1 if x["backend"] == "sage1"]:
        if r["backend"] == "auto" or "ms" not in r:
            continue
        err = f"{100 * r['formula_err']:+.2f} %" if "formula_err" in r else ""
        o.append(f"| {r['shape']} | {r['backend']} | {r['ms']:.2f} | {r['ratio']:.3f} | {r['extra_bytes'] / 1e6:.1f} | "
                 f"{r['formula_bytes'] / 1e6:.1f} | {err} | {r.get('rel_l2', 0):.4f} |")
    o += ["\n## The `auto` override end to end\n",
          "The override is called exactly as ComfyUI calls it, with the timing cache already filled. Each call",
          "includes the decision, the memory check, the kernel and the NaN/Inf check. Its batches are interleaved",
          f"with plain SDPA batches (A/B, 7 rounds), so clock drift affects both sides equally ({link('attention/auto-interleaved.jsonl')}).\n",
          "| shape | chosen | × SDPA | × SDPA, no finite check | decision (CPU) |", "|---|---|---:|---:|---:|"]
    for r in ab:
        if r["backend"] == "auto":
            o.append(f"| {r['shape']} | {r['chosen']} | {r['ratio']:.3f} | {r['ratio_no_finite_check']:.3f} | "
                     f"{r['decision_us']:.1f} µs |")
    o += attention_reading(a, ab, s1)
    o += compile_section()
    return "\n".join(o) + "\n"


def attention_reading(a, ab, s1) -> list:
    """The reading under the kernel tables: every figure is taken from the records."""
    def ratios(rs, backends, cross):
        return [r["ratio"] for r in rs if r["backend"] in backends and "ratio" in r
                and ("cross" in r["shape"]) == cross]
    sm90_ab = {r["shape"]: r["ratio"] for r in ab if r["backend"] == "sage2_sm90"}
    others = [x for sh, x in sm90_ab.items() if "self" in sh and sh != "a14b_720p81_self"]
    at720 = {r["backend"]: r["ratio"] for r in a + s1 if r["shape"] == "a14b_720p81_self" and "ratio" in r}
    fp16pv = [at720[n] for n in ("sage2_fp16_triton", "sage2_fp16_cuda", "sage1")]
    quant = [b for b in {r["backend"] for r in a + s1} if b not in ("sdpa", "auto")]
    auto_cross = [(r["ratio"], r["shape"]) for r in ab if r["backend"] == "auto" and "cross" in r["shape"]]
    worst = min(auto_cross)
    errs = [r["formula_err"] for r in a + s1 if "formula_err" in r]
    checks = [(r["ratio_no_finite_check"] / r["ratio"] - 1, r) for r in ab if r["backend"] == "auto"
              and "self" in r["shape"]]
    cost, at = max(checks, key=lambda x: x[0])
    sage1_auto = [r for r in s1 if r["backend"] == "auto"]
    return [f"""
## Memory: a handed-over q takes the output

ComfyUI 0.38 and newer hand Wan's q, k and v to the patch in attention containers. ComfyUI 0.3.64's Wan
self-attention keeps them, so there the patch sets, on the model it returns, its own forward of each block's
self-attention (an object patch, `nodes/handover.py`; only over a forward that reads 0.3.64's names and that
no other node patched): it computes q, k and v as 0.3.64 does and hands them over in the same way. When
nothing else holds q (no other reference, no
other tensor on its memory, not recording autograd), the call runs on the kernel's write-into-q path, head
group by head group: K's mean over tokens is taken once for the call, by one matrix-vector product (torch's
`k.mean` over the token axis stages partial sums in up to about 130 MiB, more than the rest of a short call);
then each group's V is quantised to FP8 from its own heads (copied out with its zero padding only where
SageAttention's padding to 64 tokens falls short of the kernel's 128), its q and k are quantised to INT8, and
the kernel writes the group's output into its own heads of q. No output buffer is allocated, and V's BF16
transients are gone before K's copy and the INT8 q and k exist, so a group peaks at the larger of the two steps
(`attention.kernel_bytes`, `sage2_sm90_into_q`). The group count is the fewest whose peak is at or below SDPA's
extra bytes for the same call with 16 MiB to spare for the allocator, which serves a request from a cached
block up to 1 MiB larger than asked, and for the output check's probe (`attention.head_groups.into_q_groups`).
{into_q_measured_text()} {into_q_cost_text()}

Under `torch.compile` the patch's own forward on 0.3.64 hands the tensors to a second custom op,
`wan_sage::attention_into_q`, which mutates q (`SageAttentionOverride.dead_q_call`, `attention/op.py`): inductor
reinplaces the mutation on q's own buffer, so the compiled call allocates no output either. A compiled A14B
block at 480p81 on the H200 peaked 1,504.0 MiB above its inputs with it, against 1,599.9 MiB for compiled SDPA
and 1,784.8 MiB for the ordinary op, at relative L2 5.2e-4 against the ordinary op (`e9eec03.log`,
`e97e33e.log`; `tests/gpu/test_compile_gpu.py`). 0.38's own container call sites take the same op under compile
where the call site hands q over and keeps no copy of it (`SageAttentionOverride._compiled_q_is_dead`: Wan's
self-attention without `attn1_patch` patches, in the op's layout, with no other option); a graph has no reference
count, so 0.38's call-site contract stands in for it. Cross-attention and calls with patches keep the ordinary op.
Tested on the CPU with fake kernels (`tests/unit/test_current_comfy_attention.py`); on the H200 a compiled A14B
block at 480p81 whose self-attention calls hand over containers like 0.38's (`nodes.handover.Container`) peaked
1,504.0 MiB above its inputs as well (`8fed20d.log`, `c83b7ae.log`; ComfyUI 0.38 itself has not run on the GPU).

The estimator node plans the write-into-q path and groups where it finds q handed over in eager mode; compiled
plans keep the ordinary path's bytes, which are more (the op was measured on a compiled block, not yet on a
whole compiled forward). The route and `wan-sage plan` plan the ordinary path. The sm90 kernel has this path;
other kernels and a q held elsewhere take the ordinary path and its memory mode.

Since q is overwritten, a call that is due an output check runs the same path first on a copy of 256 query
rows with all of k and v, and compares those rows with SDPA's: a failure settles the shape on SDPA with q
intact. A kernel that raises or runs out of memory in a group leaves that group's heads of q unwritten, and
SDPA finishes them and the heads after them.

## Reading

- On Hopper only the sm90 kernel of SageAttention 2.x beats cuDNN SDPA: {sm90_ab["a14b_720p81_self"]:.2f}× on A14B 720p81
  self-attention and {_span(others)}× on the other self-attention shapes.
- These all lose to SDPA on Hopper (A14B 720p81 self-attention unless a range is given):
  - the FP16-PV kernels: 2.x Triton, 2.x fp16_cuda, and 1.0.6 at {_span(fp16pv)}×;
  - the sm89 FP8 kernel, at {at720["sage2_fp8_cuda"]:.2f}×;
  - comfy-kitchen's int8 attention, at {_span(ratios(a, ("ck_int8",), False))}× over the self-attention shapes.

  `auto` therefore keeps SDPA wherever one of them would be the only option. With only 1.0.6 installed it
  chose SDPA for {sum(r["chosen"].startswith("sdpa") for r in sage1_auto)} of the {len(sage1_auto)} shapes measured.
- Every quantised kernel loses on cross-attention ({_span(ratios(a + s1, quant, True))}×), so `auto` keeps SDPA there
  (`cross_slower`). The worst `auto` shape is {worst[1]}, at {worst[0]:.3f}× SDPA.
- The measured extra bytes match the formulas within {100 * max(errs):+.2f} % for every kernel and shape.
- The per-call NaN/Inf check costs one host sync. At 720p that is invisible. On shorter self-attention shapes
  it costs up to {100 * cost:.1f} % ({at["ratio"]:.3f}× against {at["ratio_no_finite_check"]:.3f}× on {at["shape"]}).
"""]


FIRST_CALL_BEFORE = "first-call/sage2-sm90-44b7f5b.jsonl"  # python -m bench.first_call: a shape timed in extra runs
FIRST_CALL = "first-call/sage2-sm90-4e251ea.jsonl"  # the same, a shape timed on its own first calls


def first_call_lines() -> list:
    """What the first Sage calls of a process cost, part by part, from :data:`FIRST_CALL` (and the
    shape's timing before, from :data:`FIRST_CALL_BEFORE`)."""
    by_caches = {r["caches"]: r for r in rows(FIRST_CALL)}
    before = {r["caches"]: r["parts"] for r in rows(FIRST_CALL_BEFORE)}
    empty, kept = by_caches["empty"]["parts"], by_caches["kept"]["parts"]
    big, small = "a14b_720p81_self", "a14b_480p81_self"

    def old_extra(parts, shape):
        return parts[shape + ".patch_first"] - parts[shape + ".patch_again"]
    return [
        f"The first Sage call of a process pays for loading the kernel. In `python -m bench.first_call` (record "
        f"[`{FIRST_CALL}`](../bench/records/{FIRST_CALL}), {by_caches['empty']['gpu']}) the patch's self-test, which is the "
        f"kernel's first launch and the first compile of SageAttention's Triton quantisation kernels, took "
        f"{empty['self_test']:.1f} s with empty caches and {kept['self_test']:.1f} s with Triton's cache kept from an "
        f"earlier process; importing SageAttention took {empty['import']:.2f} s and its build identity "
        f"{empty['build_identity']:.2f} s. PyTorch SDPA's own first call took {empty[small + '.sdpa_first']:.2f} s in the "
        f"first process of the machine and {kept[small + '.sdpa_first']:.2f} s in the next (cuDNN's libraries read from "
        f"disk once; stock ComfyUI pays it too).",
        "",
        f"A new shape is timed on its own first calls: each runs the kernel or SDPA for its own output, so the timing "
        f"runs nothing extra. A 720p81 self-attention shape was timed on {empty[big + '.patch_timing_calls']} calls, which "
        f"took {empty[big + '.patch_timing_extra']:.2f} s more than as many settled calls with empty caches and "
        f"{kept[big + '.patch_timing_extra']:.2f} s with the caches kept (a shape timed once is timed again by the next "
        f"process); a 480p81 one {empty[small + '.patch_timing_extra']:.2f} / {kept[small + '.patch_timing_extra']:.2f} s. "
        f"When the shape's first call timed it in extra runs ([`{FIRST_CALL_BEFORE}`](../bench/records/{FIRST_CALL_BEFORE})) "
        f"that cost {old_extra(before['empty'], big):.2f} / {old_extra(before['kept'], big):.2f} s at 720p81 and "
        f"{old_extra(before['empty'], small):.2f} / {old_extra(before['kept'], small):.2f} s at 480p81.",
        "",
        "The patch starts the import, build identity and self-test in a background thread when it is applied, so they "
        "overlap the text encode and the model loads that come before the first step. The column *first prompt's first "
        "step* of the whole-generation table shows it: GGUF 480p81 at 16 GiB, the high-noise expert's first step before "
        "(the set without a round) and after (round `b`). A passed self-test is kept in the timing cache file (per GPU, "
        "kernel build, torch/CUDA/cuDNN and dtype), so that at the next start the estimator, which plans the model's "
        "load before this background test ends, knows the kernel passed; the test still runs and decides the calls.",
        "",
    ]


SWITCH_ROUND = ("whole-prompt/gguf-480p81-4steps-16gib-eager.jsonl", "c")  # the first steps as fast as stock's


def expert_switch_lines() -> list:
    """Where the pack still loses at GGUF 480p81 16 GiB: the expert switch of a partly loaded model, from the
    records of :data:`SWITCH_ROUND`."""
    path, rnd = SWITCH_ROUND
    got = {r["run"].split("@")[0]: r for r in rows(path) if r.get("round") == rnd and r.get("status") == "ok"}
    est, comfy = got["est+sage"], got["comfy+sdpa"]
    high = est["prompts"][0]["experts"]["high"]
    first = {k: r["prompts"][0]["experts"]["high"]["step_s"][0] for k, r in got.items()}
    later = [s for p in est["prompts"] for x in p["experts"].values() for s in x["step_s"][1:]]
    stock = [s for p in comfy["prompts"] for x in p["experts"].values() for s in x["step_s"][1:]]
    return [
        f"With the shape timed on its own calls (round `{rnd}` of [`{path}`](../bench/records/{path}), `{est['commit']}`), "
        f"the high-noise expert's first step took {first['est+sage']:.2f} s against {first['comfy+sdpa']:.2f} s for "
        f"ComfyUI alone, and the later steps {min(later):.2f}–{max(later):.2f} s against {min(stock):.2f}–{max(stock):.2f} s. "
        f"The prompt was still slower at this budget, in the switch between experts: the estimator reserved "
        f"{high['predicted_working_gib']:.2f} GiB where ComfyUI reserves {high['comfy_estimate_gib']:.2f} GiB (the "
        f"sampling held {high['working_gib']:.2f} GiB above the weights), so {100 * (1 - high['resident_frac']):.1f} % of "
        f"the weights stayed streamed, and unloading that partly loaded expert at a switch took "
        f"{min(switch_unloads(est)):.1f}–{max(switch_unloads(est)):.1f} s against {min(switch_unloads(comfy)):.1f}–{max(switch_unloads(comfy)):.1f} s "
        f"for the fully loaded one of ComfyUI alone. From `2e41b0a` the decode's room no longer streams weights "
        f"([memory model](memory-model.md#{anchor('The VAE decode after the sampling')})): the later rounds of that "
        f"file in the table above are after it.",
        "",
        *unload_sentence(),
    ]


def unload_sentence() -> list:
    path, before, after = UNLOAD_ROUNDS[0]
    ours, stock = expert_unloads(path, after, "est+sage"), expert_unloads(path, after, "comfy+sdpa")
    old = expert_unloads(path, before, "est+sage")
    if not (ours and stock and old):
        return []
    return [f"Unloading an expert at a switch took {min(old):.1f}–{max(old):.1f} s in round `{before}`. From round "
            f"`{after}` the estimator's clone gives its weights their host tensors back instead of copying them "
            f"([memory model](memory-model.md#{anchor('Unloading a model at an expert switch')})): "
            f"{min(ours):.2f}–{max(ours):.2f} s a switch, against {min(stock):.1f}–{max(stock):.1f} s for ComfyUI alone.",
            ""]


GPU_TIER_PRINTS = (("extra", "A14B 720p81 self-attention extra bytes: "), ("groups", "A14B 480p81: "),
                   ("decision", "decision cost of a settled shape: "), ("calibrating", "A14B 720p81, sage2_sm90: "))


def gpu_tier_logs() -> list[dict]:
    """Every gpu-tier log of bench/records/gpu-tier/ (one per wan-sage commit or SageAttention build): its
    summary line and what it printed (``-s``), by number of tests, then name."""
    out = []
    for p in (RECORDS / "gpu-tier").glob("*.log"):
        lines = p.read_text().splitlines()
        # with -v (bash bench/e2e_h200.sh gpu-tier) pytest frames its last line in "="
        summary = [x for x in lines if " passed" in x and " in " in x][-1].strip().strip("=").strip()
        printed = {k: next((x.strip()[len(pre):] for x in lines if x.strip().startswith(pre)), "") for k, pre in GPU_TIER_PRINTS}
        out.append(dict(name=p.stem, file=name_of(p), summary=summary, **printed))
    return sorted(out, key=lambda x: (int(x["summary"].split()[0]), x["name"]))


def gpu_tier_table() -> list:
    o = ["| log | result | A14B 720p81 self-attention extra bytes | A14B 480p81 head groups | decision cost | calibrating call (A14B 720p81) |",
         "|---|---|---|---|---|---|"]
    for g in gpu_tier_logs():
        result = g["summary"]
        if "error" in result:
            result += (" (the errors: `ModuleNotFoundError: No module named 'av'` where the compile tests boot ComfyUI; the"
                       " fixture stubs PyAV as the harness does since)")
        o.append(f"| {link(g['file'])} | {result} | {g['extra'] or '—'} | {g['groups'] or '—'} | {g['decision'] or '—'} | "
                 f"{g['calibrating'] or '—'} |")
    return o


def calibrating_peaks() -> tuple:
    """((lowest, highest) calibrating call, (lowest, highest) settled call, one output) in GiB over the
    gpu-tier logs that print the line, and those logs."""
    found = {}
    for g in gpu_tier_logs():
        m = re.search(r"calibrating call ([0-9.]+) GiB, settled call ([0-9.]+) GiB above the inputs \(one output ([0-9.]+) GiB\)",
                      g["calibrating"])
        if m:
            found[g["file"]] = tuple(float(x) for x in m.groups())
    if not found:
        raise SystemExit("render_docs: no gpu-tier log prints the calibrating call's peak")
    cal, settled, out = zip(*found.values())
    if len(set(out)) != 1:
        raise SystemExit(f"render_docs: the gpu-tier logs print different output sizes: {found}")
    return ((min(cal), max(cal)), (min(settled), max(settled)), out[0]), sorted(found)


def _gib_range(lo_hi) -> str:
    lo, hi = lo_hi
    return f"{lo:.3f}" if lo == hi else f"{lo:.3f}–{hi:.3f}"


def compile_section() -> list:
    """torch.compile and the patch, from the compile-table records."""
    t = rows("compile/table.jsonl")
    forced = rows("compile/table-grouping-forced.jsonl")
    env = t[0]["env"]
    base = next(r for r in t if r["config"] == "eager-sdpa")["s_per_forward"]
    o = ["\n## torch.compile\n",
         f"A14B at 1280×720×81 on one {env['device']} with torch {env['torch']}, triton {env['triton']},",
         f"{env['allocator']}, ComfyUI {env['comfyui']} and SageAttention {env['sageattention']} (commit",
         f"`{env['sageattention_commit']}`); wan-sage `{env['wan_sage_commit']}`. A real ComfyUI `WanModel` at A14B dims with random",
         "bf16 weights, fully resident; `comfy.sample.sample` with 2 steps run twice, the second reported.",
         "Compile is per transformer block through ComfyUI's `set_torch_compile_wrapper` (inductor). The peak",
         "is `max_memory_allocated` during the forward minus the allocation before it "
         f"({link('compile/table.jsonl')}, {link('compile/table-grouping-forced.jsonl')}).\n",
         "```bash",
         "COMFYUI_PATH=... python -m bench.compile_table --size 1280x720x81 --configs eager-sdpa,compile-sdpa,"
         "compile-sage-grouped,eager-sage-grouped,compile-sage-ungrouped,eager-sage-ungrouped,compile-sage-grouped-fullgraph",
         "```\n",
         "| configuration | s/forward | × eager SDPA | activation peak | graph breaks | Sage calls | head-split calls |",
         "|---|---:|---:|---:|---:|---:|---:|"]

    def line(r, label=None, ratio_base=base):
        sg = r.get("sage") or {}
        return (f"| {label or r['config']} | {r['s_per_forward']:.3f} | {ratio_base / r['s_per_forward']:.3f} | "
                f"{r['peak_gib']:.3f} GiB | {r['dynamo']['graph_breaks']} | {sg.get('sage_calls', '')} | "
                f"{sg.get('head_split_calls', '')} |")
    for r in t:
        o.append(line(r))
    for r in forced:
        o.append(line(r, r["config"] + ", grouping forced on"))
    grouped = {r["config"]: r for r in forced}
    plain = {r["config"]: r for r in t}
    cost = {k: grouped[k]["s_per_forward"] / plain[k.replace("grouped", "ungrouped")]["s_per_forward"] - 1
            for k in grouped}
    o.append(f"""
- **Graph breaks: none.** The patch is one custom op (`wan_sage::attention`) in the compiled graph; the
  decision, the memory check, the head split, the kernel and every fallback run inside it. `fullgraph=True`
  compiles ({plain["compile-sage-grouped-fullgraph"]["s_per_forward"]:.3f} s/forward).
- **Speed.** Compile + Sage runs at {base / plain["compile-sage-ungrouped"]["s_per_forward"]:.3f}× eager SDPA, eager + Sage at
  {base / plain["eager-sage-ungrouped"]["s_per_forward"]:.3f}×; compile alone gives {base / plain["compile-sdpa"]["s_per_forward"]:.3f}×.
- **The memory mode by default** runs a shape grouped only where the dispatcher's timing measures the split at
  most 2 % slower per call. In the table's own rows it measured more, so they ran ungrouped (head-split calls 0)
  and both `grouped` rows equal the ungrouped ones. The per-shape cost is in *The memory mode's cost per Wan
  shape* below; at A14B 720p81 it lies near the 2 % line, so a process can settle either way (the end-to-end
  runs of [benchmarks.md](benchmarks.md) settled it grouped in some processes and ungrouped in others).
- **The memory mode forced on** (the 2 % check off for that run, 80 of 80 Sage calls split): the compiled peak
  falls to {grouped["compile-sage-grouped"]["peak_gib"]:.3f} GiB, equal to the compiled SDPA peak ({plain["compile-sdpa"]["peak_gib"]:.3f} GiB: the phase
  that decides it is then one the patch does not touch), and the eager peak to {grouped["eager-sage-grouped"]["peak_gib"]:.3f} GiB,
  eager SDPA's ({plain["eager-sdpa"]["peak_gib"]:.3f} GiB). It costs {100 * cost["compile-sage-grouped"]:.1f} % per forward compiled
  and {100 * cost["eager-sage-grouped"]:.1f} % eager ({base / grouped["compile-sage-grouped"]["s_per_forward"]:.3f}× and
  {base / grouped["eager-sage-grouped"]["s_per_forward"]:.3f}× eager SDPA). The forced rows are a second process on the same machine.
- **End to end** through real ComfyUI, with both A14B experts, a LoRA and compile per block or of the whole
  model: [benchmarks.md, "torch.compile end to end"](benchmarks.md#{anchor("torch.compile end to end")}).
- **Whether compile pays back for a prompt.** A fresh process pays the compile before the first step, and a
  step saves only what inductor fuses between the matrix multiplies and the attention (0.8 s per A14B 720p81
  forward, with SDPA and with Sage alike).
  - *What the pack tells the user.* After each sampling of a compiled model, the Sage patch's log and panel give
    the compile cost of a fresh process, the steps per model after which it pays back, the verdict for the run's
    own steps (`run eager` or `compile pays back`) and, where one prompt does not pay it back, the prompt of a
    process by which it does (`memory/compile_payback.py`). The costs it counts: about 20 s for blocks compiled
    one by one (one graph, shared by Wan 2.2 A14B's two experts while their weights are resident), about 5 s for
    that graph where the pack keeps the run's compile file (next item), up to one graph per block with streamed
    weights, about 9 s per block for a whole-model compile; the saving scales with rows × tokens × width × blocks.
    `bench/tests/test_compile_payback_records.py` checks the two block-graph costs on whole-prompt first steps
    they were not set from.
  - *The templates run eager.* By the payback model, compiling from empty caches lengthens the first prompt of
    each: the 4-step A14B ones and the 20-step 5B and I2V ones (measured for the 5B: 62.4 s against 53.0 s eager;
    for the I2V: 137.7 s against 135.3 s; below). Each template's note gives the seconds a compiled step saves at
    its size and the prompt by which compiling pays back (`bench/make_workflows.py`, `compile_line`, which refuses
    a template whose first prompt it would pay back).
  - *Compile's start runs beside the loads.* The first `torch.compile` call of a process imports TorchInductor
    and Triton. Wan Compile Blocks starts those imports on a worker thread when it runs, makes each block's
    compiled callable at the block's first call, and hot-loads the pack's compile file on the same worker, so
    both run beside the text encoder's and the model's loads (`nodes/compile_import.py`). On an H100 (rounds `c`
    and `d` of `h100-ti2v5b-704p121-20steps-24gib-template.jsonl`, one machine) the node takes 0.002–0.003 s, and
    the nodes before the sampler 3.7–3.9 s against the eager template's 4.0 s.
  - *The 5B template compiled.* After a restart with the pack's compile file it took 49.5–49.7 s for its first
    prompt against the eager template's 53.0 s and stock ComfyUI's 64.3 s, and 41.5–41.6 s for the repeat
    against 47.3 s and 51.4 s: it pays back within that first prompt, as the model says. With every cache empty
    it took 62.4 s. Each of those first prompts compiled one graph and nothing again. At 24 GiB ComfyUI runs the
    first step's cond and uncond apart and batches them from the second, where every block would compile again
    for two rows (8.50 s on an H100); Wan Compile Blocks holds the cond/uncond batching to the rows its blocks
    have run compiled (`nodes/cond_rows.py`).
  - *Several prompts of one process.* GGUF 720p81 at 16 GiB, a process with the pack's compile file took 59.8 s
    for its first prompt and 45.2 s for the next (round `l` of the compiled file), where eager estimator + Sage
    took 64.8–70.7 s and 50.0–52.2 s (rounds `e` to `h` of the 16 GiB eager file, other machines;
    [benchmarks](benchmarks.md#whole-generation)). Compiling the blocks is ahead from the first prompt after a
    restart; the model, with its 0.8 s per forward and 5 s for the kept graph, says so by the second.
- **Wan Compile Blocks** (`nodes/compile_blocks.py`). The pack's compile node compiles the blocks one by one,
  as the records above do. A block whose weights are all on the input's device runs the block graph. A streamed
  block traced as it is would make a graph of its own (its weights' device, ComfyUI's cast flag and a streamed
  GGUF weight's LoRA patch list are guarded on: 5 graphs and 4–5 recompiles per prompt at 12 GiB in the rows
  above), and ComfyUI's lowvram load takes the largest modules of every block first, so a partial load streams
  part of every block, and leaves every block's own `modulation` on the host. So a streamed block is made to look
  resident for its compiled call (`nodes/staged_blocks.py`). A streamed module with no per-call patch function is
  *lifted*: its tensors copied onto the GPU as its resident self holds them (a ComfyUI-GGUF weight with its LoRA
  riding on it) and ComfyUI's marks of a streamed module taken off; where every streamed Linear can be lifted, the
  block runs the resident block's graph. Otherwise (a LoRA that ComfyUI patches into a streamed bf16 Linear at each
  call) every Linear stands behind one stand-in class holding its weight and bias cast onto the GPU by the layer's
  own cast, LoRA included, and the graph sees plain weights in the compute dtype (*staged*). A model compiles at
  most two graphs, the resident block's and the staged block's, shared by both experts; a GGUF model one. A block
  that cannot be lifted or staged runs eagerly (an fp8 Linear with a per-call LoRA, a Linear of a kind not known,
  another streamed module with a patch function), and so does one whose copy fails; the first layer of each kind in
  a process is run both ways, and a difference in any bit keeps that kind eager. When a sampling ends the node logs
  how its blocks ran (resident, lifted, staged or eagerly, with the reason of each eager call: "Wan Compile Blocks:
  40 of 40 blocks ran compiled (12 resident, 28 streamed, lifted into the resident block's graph)"), the Sage
  patch's panel adds that line to its compile line, and the payback counts the blocks as they ran. Until the
  model's streamed blocks have run, the estimator plans a streamed load for the larger of the eager forward and the
  compiled one plus a block's staged weights (0.65 GiB at A14B in bf16; at 480p81 and 720p81 the eager forward is the
  larger): a block the node cannot lift or stage runs eagerly. Once their Linears have run compiled with no call
  eager and no sampling failed (the node's count since it made its stand-ins), it plans the compiled forward plus
  the one block's weights its path holds: as stored where lifted (0.20 GiB for a Q4_K_M A14B block), in the compute
  dtype where staged; a VACE model keeps the eager floor, since its VACE blocks are not compiled. The path a
  sampling showed is kept in the pack's cache folder (`compile/streamed-blocks.json`, `nodes/streamed_record.py`),
  under the torch build and GPU, the versions of the pack and ComfyUI, the model's dims and compute dtype, the
  weights its LoRA changes, and the kinds of its blocks' weighted modules; a block run eagerly or a failed sampling
  marks that key eager, and nothing compiled overwrites it. A model whose own blocks have not streamed compiled
  yet plans from it: the first prompt after a restart, and Wan 2.2's low-noise expert after the
  high-noise one (the two are of one kind), and the estimator's report says so. Only the first streamed sampling of
  a model kind starts on the eager floor, and only its first step runs on it.
  {replan_text()}. On an H100 (`h100-gguf-720p81-4steps-16gib-compiled-blocks.jsonl` round `c`
  and `h100-gguf-720p81-4steps-12gib-compiled-blocks.jsonl`, `7c19018`, one machine): at 16 GiB the first prompt
  after a restart planned the high-noise expert at 7.33 GiB against 8.27, kept 87 % of its weights resident against
  77 %, and left 0.71 GiB of the budget unused beyond what ComfyUI keeps free, against 1.77 GiB in the process
  before it; at 12 GiB from empty caches the low-noise expert's first sampling planned 5.50 GiB against 7.90, kept
  64 % resident against 38 %, and left 0.65 GiB unused; 0 out-of-memory errors, 0 allocator retries. On the 12 GiB
  seed records (`gguf-720p81-4steps-compiled-blocks.jsonl`, rounds `i` and `j`) that plan is 5.46 GiB where every
  streamed expert held 5.00-5.09 GiB above its base, against the 7.89 GiB of the eager floor: 2.4 GiB more of a 12
  GiB budget left to the weights from the repeat prompt on. On the H200 at a size and budget it was not first
  checked on (the 20-step A14B 832×480×81 at 12 GiB, `whole-prompt/void-compiled-streamed-plan-h200-588f023.jsonl`)
  the repeat prompt planned 3.17 GiB where the experts held 2.56-2.59 GiB, against 4.14-4.30 GiB by the eager floor
  on the first prompt, and 89 % of the weights stayed resident against 77-78 %; 0 out-of-memory errors. Over every
  streamed expert of these records the plan covers what it held and runs 0.35-0.60 GiB over: 1.05-1.10× at
  720p81, 1.18-1.22× at 832×480×81 (`bench/tests/test_compiled_streamed_records.py`). At 960×544×81, a size no
  record had before, 20 steps at 12 GiB on an H100
  (`whole-prompt/h100-gguf-544p81-20steps-12gib-compiled-blocks.jsonl`, `77613cb`), it covered all four expert
  samplings at 1.12-1.14×, 0.40-0.50 GiB over; from the re-plan on, 66-84 % of the weights stayed resident and each
  sampling's peak left 0.48-0.67 GiB of the budget unused. The excess is the weight transient, planned as the eager
  chain's 12 bytes per element of the largest Linear (a ComfyUI-GGUF dequantisation in two bf16 copies, the LoRA's
  two fp32 ones): 0.79 GiB at A14B. Compiled, inductor fuses the chain and keeps 6
  (the fp32 `up @ down` product, the bf16 weight; `python -m bench.compiled_weight_chain`,
  `bench/records/compile/compiled-weight-chain-cpu.jsonl`), and the resident compiled experts of the same records
  held 0.32-0.46 GiB above the forward's other terms, the streamed ones 0.19-0.45 GiB above those and the block's
  weights. A 6-byte term covers the allocated peaks, but the pool held 0.05-0.27 GiB above them in those rows, and
  the plan has no term for that, so the transient stays at the eager chain's figure: planned with 6 bytes, 15 of
  the 63 streamed experts above would have held up to 0.05 GiB more than their plan.
  Compiling a streamed block with its Linear layers left out of the
  graph (each behind a `torch.compiler.disable`d stand-in) was measured and not adopted: each graph break passes
  the values live at it on to the next compiled piece, which holds them until the block returns. One A14B block at
  1280×720×81 with its Linears streamed held 7.50 GiB above its input that way, against 5.77 GiB eagerly and
  3.61 GiB compiled with its weights resident (`python -m bench.streamed_block_peak`,
  `bench/records/compile/streamed-block-peak-422b0cb.jsonl`), and a 12 GiB seed prompt planned as eager ran out
  of memory in its first step (`whole-prompt/void-compile-streamed-layers-b4d6a7a.jsonl`). A staged block
  instead, each mode compiled afresh (`python -m bench.streamed_block_peak`): on the CPU the staged block held
  the compiled resident one's 0.115 GiB plus its weights when they are copied (0.202 GiB; 0.244 GiB around eager
  layers, 0.200 GiB eagerly; dims 1536×8960 at 512×512×17, `streamed-block-peak-cpu.jsonl`); on the H200
  (`streamed-block-peak-a8a25da.jsonl`) the streamed block staged or lifted through the node's own stand-in held
  4.26 GiB above its input (the compiled resident block's 3.61 GiB plus its 0.65 GiB of bf16 weights; eagerly
  5.77 GiB), and from page-locked memory its call took 0.281 s against 0.277 s compiled resident and 0.305 s
  eagerly. The host tier
  checks the node on tiny real Wan models on the CPU (`tests/host/test_host_compile.py`: one staged graph for
  two partly streamed experts with a LoRA, no recompile, eager's latent within bf16's rounding; one graph for both
  experts when resident; `tests/host/test_host_gguf_cast.py`: a streamed ComfyUI-GGUF block after a resident one,
  lifted into the resident block's graph with no recompile, eager's output bit for bit, and a ComfyUI-GGUF expert
  with its LoRA that ComfyUI's own lowvram load streams part of every block: every block lifted, one graph over two
  steps, eager's latent bit for bit). On a ComfyUI with dynamic VRAM the node compiles a clone without it, as
  ComfyUI's own compile node does ([compatibility](compatibility.md)). On the H200 (GGUF 832×480×81, 20
  steps, 24 GiB, every weight resident) the node compiled one graph for both experts on the first prompt, and the
  steps ran at 2.75–2.83 s against ComfyUI alone's 3.73–3.78 s. Every repeat prompt then compiled 3 more graphs
  (13.2–15.9 s): loading the other expert had unloaded part of this one, and ComfyUI's reload puts its cast flag
  back as an attribute of each module it had moved, which dynamo guards on. The node drops that attribute
  where it equals the class's value for each compiled call and puts it back after (`settle_cast_flags`; the
  host tier's repeat after a partial unload and reload compiled 2 graphs before, none now). On the H200 since
  that change the repeat prompt compiles nothing: 59.1 s against ComfyUI alone's 89.2 s (1.51×, round `c` of the
  compiled file), and 59.7 s against 93.4 s (1.56×) with the text encoder host copy
  (`gguf-480p81-20steps-24gib-te-copy`). The node as it is now, with the host copy, on one H200 (round `f` of that
  file, `d57c9d4`): ComfyUI alone 93.4 s for the first prompt and 87.7 s for the repeat; the node 77.4 s and 58.6 s
  from empty caches (1.21× / 1.50×), and 68.5 s (1.36×) for the first prompt after a restart that kept only the
  pack's compile file, where eager estimator + Sage with the host copy took 78.4–80.8 s (1.23–1.31×) on other
  machines. So over 20 steps compiling wins every prompt but the very first after installing, where it is about even
  with eager and still ahead of ComfyUI alone. The 20-step
  templates run other models with CFG (Wan 2.1 image to video, Wan 2.2 5B) and run eager: the 5B one compiled
  pays back within the first prompt after a restart but not from empty caches (above), and the payback model says
  the same of the I2V one, whose first prompt after a restart has not run compiled. On an H100 from empty caches
  (`h100-i2v14b-480p81-20steps-24gib-template.jsonl`, round `b`, `77613cb`) it took 137.7 s compiled for its first
  prompt, one graph and 14.6 s compiling, against the eager template's 135.3 s (round `a`, another machine) and
  ComfyUI alone's 157.7 s, and 102.9 s for the repeat against 117.3 s and 135.6 s. A 20-step A14B GGUF prompt at 960×544×81 and 12 GiB, a size the payback model was not set from, took 119.9 s compiled from
  empty caches against ComfyUI alone's 167.9 s on the same H100 (1.40×), and 87.4 s against 143.7 s for the repeat
  (1.64×; `h100-gguf-544p81-20steps-12gib-compiled-blocks.jsonl`).
  ComfyUI-GGUF holds each quantized weight as a tensor subclass, and traced as it is, dynamo interprets the
  subclass's `__torch_function__`, `.to` and `.shape` for each op of the dequantization: 7.1 s of a first
  prompt's 8.2 s in dynamo on the H200 (round `c` of the host copy file, `2852b60`). The node gives the layers of
  a block it runs compiled ComfyUI-GGUF's own cast with the dequantization on a plain view of each weight's bytes
  (`nodes/gguf_cast.py`; for that call only, taken away in `finally`; the first layer of each ComfyUI-GGUF is cast
  both ways once per process, and a difference in any bit keeps ComfyUI-GGUF's own cast), the same weights bit for
  bit (`tests/host/test_host_gguf_cast.py`: every Q4_K, Q6_K, F32 and BF16 layer of the miniature A14B with its
  LoRA, no FX node traced through the subclass, and one graph for two chained blocks, the output handed on as a
  plain tensor as eagerly). The tracing then took 2.45 s on the H200 (round `d`, a process
  that compiled the changed graph afresh), one graph for both experts, no recompile, steps 2.79 s; with the compile
  file kept, 2.3 s (round `f`). For the call the cast also gives each layer's tensors a copy of their LoRA list:
  ComfyUI-GGUF's loader gives every tensor one default list and a move to the GPU gives the moved tensor a copy, so
  a block never moved shares one list across its layers where a resident one does not, and dynamo would guard on
  that: at 16 GiB the resident low-noise expert compiles nothing after the partly streamed high-noise one has
  traced the graph (0 graphs, 0 recompiles on an H100, rounds `b` to `e` of
  `h100-gguf-720p81-4steps-16gib-compiled-blocks.jsonl`; without the copies it recompiled once, 1.0–1.6 s).
- **Compile caches across ComfyUI starts.** Inductor keeps what it compiled in a temporary folder that a
  reboot empties. Around each sampling run of a compiled model the Sage patch hot-loads, once per process,
  the files of this torch build and GPU from `compile/` beside the kernel timing cache
  (`ComfyUI/user/wan_sage/`, or `$WAN_SAGE_CACHE_DIR`), and after the run writes what the run compiled or
  found to the file of its size and compile scope (`torch.compiler.save_cache_artifacts`,
  `nodes/compile_cache.py`). Measured on the first prompt, with inductor's and Triton's own folders kept and
  with only the pack's folder kept (theirs empty, as after a reboot){kept_compile_text()}. On the CPU
  (`tests/unit/test_compile_cache.py`) a fresh process with empty inductor folders finds every graph of the
  files. On the H200 the files gave back the graph of resident weights but not one traced with weights
  streamed on the CPU{pack_expert_text()}, so they save most where every weight is resident.
  What a file gives back, one A14B block at 1280×720×81 compiled in four fresh processes on the H200
  (`python -m bench.compile_cache_probe`, `bench/records/compile/compile-cache-probe-588f023.jsonl` and
  `compile-cache-probe-kernels-588f023.jsonl`): the first call took 12.6-13.1 s with inductor's and Triton's folders
  empty, 3.6 s with only the pack's file, and 3.1-3.9 s with both folders kept, so the file restores what kept
  folders do (the graph, its 280 Triton kernels, and the autotuning of 5 kernels). Two reduction kernels (the layer
  norms fused with the modulation) are benchmarked again in every process, kept folders included: about 1 s a
  graph. Their saved choice is in their cache file, under the hash of their list of configurations, but is none of
  the configurations in that list, and torch reads a saved choice back only where it is one of them. Inductor adds
  configurations with a smaller R0_BLOCK to a reduction that uses many registers after the list is hashed
  (`dynamic_scale_rblock`). Wan Compile Blocks compiles with it off: then, on an H100, a process that hot-loaded the
  file found every kernel's choice in the autotune cache (7 of 7, no autotuning; with it on, 2 of 8 were benchmarked
  again, 0.7 s) and the block's settled call took the same time, 0.27 s either way (bench/records/LOG.md, the probe
  with `TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0` and with torch's default on one machine). The probe keeps process 1's
  folder, where those choices were read (next item): what a cache path that stays the same across starts gives.
- **The path of torch's cache folder.** A graph found in inductor's cache brings its Triton kernels ready to launch,
  each with the absolute file name it was compiled under, and torch looks for a kernel's saved choice beside that
  name (`CachingAutotuner.recheck_autotune_cache`), not in the folder the file's choices were written into. Torch's
  default folder keeps its path across restarts and reboots (`<temp>/torchinductor_<user>`), so the file's choices
  are found there; a `TORCHINDUCTOR_CACHE_DIR` that changes from one start to the next loses them, and every kernel
  with a choice is benchmarked again. On an H100, the 20-step GGUF A14B prompt of a process that had hot-loaded the
  file benchmarked all 17 such kernels of its graph, 1.4-1.9 s, where each process had a folder of a new name
  (`whole-prompt/void-rblock-off-h100-39bd122.jsonl`, `void-autotune-missed-h100-16e0afb.jsonl`); with one path
  emptied at each start, as a reboot leaves it, none, and the prompt took 68.0 s to the frames against 72.5 s
  (`whole-prompt/h100-gguf-480p81-20steps-24gib-compiled-blocks.jsonl`); on the H200 68.5 s, its first step 2.9 s
  longer than the next (round `f` of `whole-prompt/gguf-480p81-20steps-24gib-te-copy.jsonl`).
- **fp8 matmuls: measured, not adopted.** ComfyUI 0.3.64's `fp8_e4m3fn_fast` runs no fp8 matmul for Wan (the model
  stays in training mode, docs/compatibility.md), and where it runs it casts each input to fp8 unscaled. The pack
  tried the Linears of the compiled blocks as `torch._scaled_mm` in float8_e4m3fn with a scale per input row and
  per output channel, the weight and the input quantised at each call (Wan Compile Blocks at `ff75279`, taken out
  after). On an H100 one A14B block at 1280×720×81 took 268.4 ms a call against 278.7 ms in bf16 (1.04×), its
  update (output less input) 0.057 from bf16's in relative L2, and peaked 5.15 GiB above its input against 3.60
  GiB (`bench/records/compile/void-fp8-matmuls-block-h100-ff75279.log`). The seed on the full card, Sage + Wan
  Compile Blocks + fp8, took 9.32-9.51 s a step and 42.5-42.9 s for the repeat prompt to the frames, against 56.8 s
  for ComfyUI alone on the same machine (1.32-1.34×), what the H200 gave without fp8 (1.33×); its first prompt
  69.2-72.4 s against 62.8 s (`whole-prompt/void-fp8-matmuls-h100-ff75279.jsonl`). The Linears are 28 % of a 720p81
  block's multiply-adds, and the per-call quantisation takes back most of what fp8 saves on them: not worth 1.5 GiB
  and the error.
- **The full card's repeat prompt.** With every weight resident, the seed's repeat prompt is its four steps and the
  decode. On the H200 (round `k` of `whole-prompt/gguf-720p81-4steps-compiled-blocks.jsonl`) Sage with Wan Compile
  Blocks took 9.30-9.40 s a step against ComfyUI alone's 12.80-12.91 s (1.36-1.39×), and both decoded in 4.5-4.6 s:
  1.33× for the prompt. A step is as much faster than SDPA's as the self-attention kernel is: SageAttention 2's sm90
  kernel serves A14B's largest self-attention shape in the dispatch table at 1.39× SDPA on the H200, its other shapes
  at 1.25-1.44× (`bench/records/gpu-tier/d14fa3b-dispatch-table.jsonl`). A 1.40× prompt at this size needs about
  1.46× a step, more than the kernel gives while the Linears run in bf16 (fp8 matmuls, above, gave 1.04× a block)
  and the decode is ComfyUI's.
""")
    o += replan_table()
    o.append(f"""### The gpu tier on the H200

`python -m pytest tests/gpu -q -rs -s`. Its compile tests build one real A14B block through ComfyUI at 480p81:
`torch._dynamo.explain` finds 0 graph breaks and one graph holding the `wan_sage::attention` op, `fullgraph=True`
with inductor compiles and runs it, the compiled output matches eager, and grouped and ungrouped calls agree
compiled and eager (bit-identical eager). Its dispatch tests force the failure paths on the real kernel: an error
charged to the kernel that raised it, a real out-of-memory error remembered until free memory grows, a NaN that
appears later caught within one sampling interval. One log per wan-sage commit it ran at (`sageattention-1` and
`sageattention-2`: the first runs, with each SageAttention build), with what each printed:
""")
    o += gpu_tier_table()
    o += dispatch_table_section()
    o += grouping_cost_section()
    return o


def dispatch_table_section() -> list:
    """The gpu tier's dispatch table of held-out shapes (``attention/dispatch-table.jsonl``): the rows of the
    newest commit in it."""
    table = [r for r in rows("attention/dispatch-table.jsonl") if r.get("commit")]
    if not table:
        return []
    newest = table[-1]["commit"]
    rs = [r for r in table if r["commit"] == newest]
    o = ["", "### The dispatch table of held-out shapes\n",
         f"The gpu tier's `tests/gpu/test_dispatch_table_gpu.py` at `{newest}` "
         f"({link('attention/dispatch-table.jsonl', 'dispatch-table.jsonl')}): the `auto` patch on shapes no other test "
         "names, calibrated on the real kernels, then the settled call against plain SDPA. × SDPA: SDPA's time over the "
         "patched call's; peak: above the inputs, against SDPA's for the same call; relative L2 and cosine against SDPA "
         "in the call's dtype (first 1,024 query rows of every head). Decision: what a declined call adds over plain SDPA, "
         "through `override(func, ...)` (0.3.64) and through `container_function` (0.38), as ComfyUI's `wrap_attn` calls "
         "them (this thread's CPU time, the least of 15 rounds of 2,000 calls in each of two passes: as the row runs and "
         "after the whole table). SDPA, both the baseline and the patch's own, is PyTorch's called in the backend order "
         "ComfyUI sets around every Wan call (comfy/ops.py: cuDNN, flash, efficient, math), as a user's stock ComfyUI "
         "runs it. Rows measured before that (without `sdpa_baseline` in the record) used PyTorch's plain call, whose "
         "backend depended on what ran before in the process: in the whole tier, after ComfyUI's own calls, it ran "
         "these shapes with a log-sum-exp beside the output (97.5 MiB against 96.0 at 1.3B 480p81) and 1.3–1.7× as long "
         "(`3366bb5.log` against `84ac0d6-dispatch-table.log`), so those served ratios read 2.1–2.3× where the pinned "
         "order gives 1.2–1.5×. The served calls here keep their q (the "
         "caller holds it), so they run the ordinary path, ungrouped; where q is handed over the output goes into q "
         f"and the call holds less than SDPA (*{'Memory: a handed-over q takes the output'}* above).\n",
         "| shape | dtype | runs on | × SDPA | peak MiB | SDPA MiB | rel L2 | cosine | decision µs (0.3.64 / 0.38) |",
         "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rs:
        runs = (r["served"] + (f" ×{r['groups']}" if r.get("groups") and r["groups"] > 1 else "")) if r["served"] \
            else f"SDPA ({r['reason']})"
        dec = (f"{r['decision_us']:.2f} / {r['decision_containers_us']:.2f}" if "decision_containers_us" in r
               else "—")
        o.append(f"| {r['shape']} | {r['dtype']} | {runs} | {r['ratio']:.3f} | {r['peak'] / 2**20:.1f} | "
                 f"{r['sdpa_peak'] / 2**20:.1f} | {r['rel_l2']:.4f} | {r['cos']:.5f} | {dec} |")
    return o


def grouping_cost_section() -> list:
    """Each Wan shape's head-group cost against ungrouped, from ``wan-sage bench --shapes wan``."""
    b = rows("attention/wan-shapes-grouping.jsonl")
    o = ["\n### The memory mode's cost per Wan shape\n",
         "`wan-sage bench --dtype bf16 --shapes wan --kernels auto --iters 5` on the H200, in the call of the gpu tier's",
         f"`3c344d4` log ({link('attention/wan-shapes-grouping.jsonl')}). Each self-attention shape runs ungrouped and in the",
         "memory mode's head groups; the extra bytes are measured. The decision is the CPU time per call of a settled",
         "shape (the static checks, the timing-cache lookup and the free-memory check).\n",
         "| shape | groups | ms ungrouped | ms grouped | cost | extra MB ungrouped | extra MB grouped | SDPA extra MB | default | decision |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    by = {}
    for r in b:
        by.setdefault(r["shape"], []).append(r)
    costs = []
    for shape, rs in by.items():
        g = next((r for r in rs if r.get("grouping_cost") is not None), None)
        if g is None:
            continue
        one = next(r for r in rs if r["backend"] == g["backend"] and r.get("groups") == 1 and "ms" in r)
        sdpa = next(r for r in rs if r["backend"] == "sdpa")
        auto = next(r for r in rs if r["backend"] == "auto")
        costs.append(g["grouping_cost"])
        default = f"{g['groups']} groups" if g["grouping_cost"] <= 0.02 else "ungrouped (over 2 %)"
        o.append(f"| {shape} | {g['groups']} | {one['ms']:.2f} | {g['ms']:.2f} | {100 * g['grouping_cost']:+.1f} % | "
                 f"{one['extra_bytes'] / 1e6:.0f} | {g['extra_bytes'] / 1e6:.0f} | {sdpa['extra_bytes'] / 1e6:.0f} | {default} | "
                 f"{auto['decision_us']:.1f} µs |")
    decisions = [r["decision_us"] for r in b if r["backend"] == "auto" and r.get("decision_us")]
    o.append("")
    o.append(f"Grouping costs {100 * min(costs):+.1f} % to {100 * max(costs):+.1f} % per call here, so by default every shape ran")
    o.append("ungrouped in this process; the split is bit-identical (gpu tier) and brings the call to within SDPA's")
    o.append(f"extra bytes + 0.5 GiB. The decision took {min(decisions):.1f}–{max(decisions):.1f} µs per call over the shapes (one")
    o.append("loop of 2,000 calls each; the self-attention shapes share one code path, so the spread is the CPU's noise;")
    o.append("`wan-sage bench` reports the median of 7 loops).")
    return o


# --------------------------------------------------------------------------- docs/memory-model.md

FORWARD_ROWS = (("Eager, fit", "forward-peaks/fit.jsonl"), ("Eager, held out", "forward-peaks/held-out.jsonl"),
                ("Compiled, fit", "forward-peaks/compiled.jsonl"), ("Compiled, held out", "forward-peaks/compiled-held-out.jsonl"),
                ("Compiled Sage, check", "forward-peaks/compiled-sage.jsonl"),
                ("Compiled Sage, held out", "forward-peaks/compiled-sage-held-out.jsonl"))


def _attention_label(r) -> str:
    if r["attn"] == "sdpa":
        return "sdpa"
    g = head_groups(r)
    return "sage" + (f", {g} head groups" if g > 1 else (", memory mode fastest" if r.get("memory_mode") == "fastest" else ""))


def _forward_table(rs) -> tuple:
    """(Markdown lines, predicted totals) of measured rows against the memory model."""
    o = ["| model | dtype | attention | size | tokens | measured GiB | wan-sage GiB | error | ComfyUI GiB | ComfyUI ÷ measured | phase |",
         "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    totals = []
    for r in rs:
        t = predict_forward(r)
        p, m = t["total"], r["measured"]
        totals.append(p)
        o.append(f"| {r['model']} | {r['dtype']} | {_attention_label(r)} | {r['width']}×{r['height']}×{r['frames']} | "
                 f"{r['tokens']:,} | {m / GiB:.3f} | {p / GiB:.3f} | {100 * (p / m - 1):+.1f} % | {r['comfy'] / GiB:.2f} | "
                 f"{r['comfy'] / m:.2f}× | {t['dominant_phase']} |")
    return o, totals


def _error_span(rs, totals) -> str:
    """The lowest and highest error of predicted ``totals`` against the rows' measured peaks."""
    errors = [p / r["measured"] - 1 for r, p in zip(rs, totals)]
    return f"{100 * min(errors):+.1f} % to {100 * max(errors):+.1f} %"


def _over_peaks(rs, totals) -> list:
    """The measured peaks of the rows predicted more than 10 % over."""
    return [r["measured"] for r, p in zip(rs, totals) if p > 1.10 * r["measured"]]


def _ceil2(x: float) -> float:
    """``x`` rounded up to two decimals (a bound stays a bound when printed)."""
    return math.ceil(x * 100 - 1e-9) / 100


def _band(rs, totals) -> str:
    """How the rows sit against the band (``totals``: their predicted peaks): never under, at most 10 %
    over plus the fixed workspace term."""
    over = _over_peaks(rs, totals)
    under = [r for r, p in zip(rs, totals) if p < r["measured"]]
    fixed = CALIBRATED["slack_fixed"] / 2 ** 20
    return (f"{len(rs) - len(over) - len(under)} of {len(rs)} rows within [0, +10 %]"
            + (f"; {len(over)} more than 10 % over, all with peaks under "
               f"{_ceil2(max(over) / GiB):.2f} GiB, within +10 % plus the fixed {fixed:.0f} MiB "
               f"workspace term" if over else "")
            + (f"; {len(under)} under" if under else ""))


def forward_summary() -> list:
    """(title, record file, rows, table lines, predicted totals) of each forward-peak record file."""
    out = []
    for title, name in FORWARD_ROWS:
        rs = rows(name)
        lines, totals = _forward_table(rs)
        out.append((title, name, rs, lines, totals))
    return out


def memory_doc(summary) -> str:
    by = {title: rs for title, _n, rs, _l, _t in summary}
    csheld = by["Compiled Sage, held out"]
    o = ["# The working-memory model against measured peaks (H200)\n",
         "How the estimator's working-memory model compares with the real activation peak of ComfyUI's Wan forward,",
         "and how its reservations hold end to end: with weights partly offloaded, compiled, and with fp8 weights cast",
         "at every call. Measured on one NVIDIA H200 with torch 2.11.0+cu130 and ComfyUI 0.3.64 (`a125cd84`; the",
         "compiled Sage rows at the held-out sizes on `63722199`, see below). The allocator was cudaMallocAsync, which",
         "ComfyUI's `main.py` selects through `cuda_malloc`. The records are in",
         "[`bench/records/`](../bench/records/README.md), the commands that wrote them in",
         "[`bench/records/LOG.md`](../bench/records/LOG.md).\n",
         "Each forward-peak row is one real sampling step (`comfy.sample.sample`, euler, cfg 1.0, cond only). The model",
         "is a real ComfyUI `WanModel` at real dims, built through ComfyUI's own model config, with random weights",
         "resident on the GPU. The peak is `torch.cuda.max_memory_allocated()` minus the allocation before the forward,",
         "taken in a `DIFFUSION_MODEL` wrapper. In the sage rows, self-attention runs on `sage2_sm90` (ungrouped unless the",
         "attention column names head groups) and cross-attention on SDPA. Compiled rows compile each transformer block",
         "with inductor through ComfyUI's `set_torch_compile_wrapper`; the measured forward is the second.\n",
         "```bash",
         "COMFYUI_PATH=... python -m bench.forward_peaks --allocator async --out bench/records/forward-peaks/fit.jsonl",
         "COMFYUI_PATH=... python -m bench.forward_peaks --sizeset heldout --attn sdpa,sage --memory-modes fastest --dtypes bf16",
         "COMFYUI_PATH=... python -m bench.forward_peaks --compile --attn sdpa --dtypes bf16 [--sizeset heldout]",
         "COMFYUI_PATH=... python -m bench.forward_peaks --compile --attn sage --memory-modes sdpa,fastest --dtypes bf16 [--sizeset heldout]",
         "```\n",
         "## Fit, held-out and check rows\n",
         f"The model's terms and constants were set from the *fit* rows: {link('forward-peaks/fit.jsonl')} (eager) and",
         f"{link('forward-peaks/compiled.jsonl')} (compiled), plus the compile table's A14B 720p81 Sage rows for the compiled",
         "attention op ([attention.md](attention.md#torchcompile)). The *held-out* rows use sizes the fit never saw: other aspect",
         "ratios (1024×576, 960×960), portrait (480×832, 720×1280, 704×1280), longer clips (121 and 161 frames) and",
         "other frame counts (25, 65, 97), for each model. The band every row must meet",
         "(`bench/tests/test_forward_peaks_band.py`): never under the measured peak, and at most 10 % over it plus the",
         f"fixed {CALIBRATED['slack_fixed'] / 2 ** 20:.0f} MiB term for the cuBLAS workspace a process's first forward allocates.\n"]
    o += ["| rows | records | count | error | band |", "|---|---|---:|---|---|"]
    for title, name, rs, _lines, totals in summary:
        o.append(f"| {title} | {link(name)} | {len(rs)} | {_error_span(rs, totals)} | {_band(rs, totals)} |")
    o.append("")
    o.append("One held-out compiled row, TI2V-5B 832×480×161, was seen before the fixed workspace term was set (it")
    o.append("allocated 37 MiB in a later forward); it is counted above but is not held out for that constant.\n")
    o.append(f"The *check* rows ({link('forward-peaks/compiled-sage.jsonl')}) are the compiled forward with the Sage patch at")
    o.append("the fit sizes, measured after every term and constant was set, so they set none of them. Each size ran")
    o.append("in the patch's memory mode `fastest` (ungrouped) and, where the head-group formula splits the call, in")
    o.append("the mode `sdpa` (every Sage call split: the record's head-split calls equal its Sage calls); a size the")
    o.append("formula leaves whole in `sdpa` mode is the same run as `fastest`. The compiled attention-op term")
    o.append("(`COMPILED[\"op_d_buffers\"]` in `memory/activation_model.py`) was set from the compile table's A14B")
    o.append("1280×720×81 Sage rows (grouped and ungrouped); these rows check it on every model and size.")
    o.append(f"The compiled Sage rows at the held-out sizes ({link('forward-peaks/compiled-sage-held-out.jsonl')}, the same two")
    o.append(f"memory modes, measured with wan-sage `{csheld[0]['predicted_by']['wan_sage_commit']}`) check it on sizes the fit never saw. They ran")
    o.append("on ComfyUI `63722199` (the commit that set the version to 0.3.64), whose differences from `a125cd84` touch")
    o.append("AMD settings, the VAE dtype on AMD and LoRA patches of scaled fp8 weights, none of them on this path.\n")
    for title, _name, _rs, lines, _totals in summary:
        o += [f"### {title}\n"] + lines + [""]
    o.append("ComfyUI's own figure is " + "; ".join(f"{_span(v)}× the measured eager peak for {m}"
                                                    for m, v in comfy_ratios(summary).items()) + ".\n")
    o += partial_load_section()
    o += e2e_streamed_section()
    o += e2e_streamed_fp8_section()
    o += e2e_compiled_resident_section()
    o += e2e_compiled_cast_section()
    o += decode_room_section()
    o += unload_section()
    return "\n".join(o) + "\n"


def decode_room_rows() -> list[dict]:
    """The VAE decodes of the whole-prompt records that say what was loaded around them: per process, its set,
    configuration, commit, the diffusion model's GiB resident as the decode began, what the decode evicted, the
    device's free GiB as it began (records that read the allocator) and its seconds, first and repeat prompt."""
    out = []
    for st in whole_sets():
        for r in st["runs"]:
            ph = [p["phases"]["decode"] for p in r["prompts"] if p.get("status") == "ok" and "decode" in p.get("phases", {})]
            if not ph or any(not d.get("loaded_gib_before") for d in ph):
                continue
            before = [sum(v for k, v in d["loaded_gib_before"].items() if k != "WanVAE") for d in ph]
            after = [sum(v for k, v in d["loaded_gib_after"].items() if k != "WanVAE") for d in ph]
            free = [(d.get("pool_before") or {}).get("free_gib") for d in ph]
            c = r["config"]
            name = WHOLE_CONFIG_NAMES.get(whole_config(c), r["run"])
            name += " (no trim after the sampling)" if c.get("trim_after_sampling") is False else ""
            name += (f" (+{c['decode_room_extra_gib']:g} GiB for the decode)" if c.get("decode_room_extra_gib")
                     else "")
            out.append(dict(set=st, run=r, config=name,
                            resident=before, evicted=[b - a for b, a in zip(before, after)], free=free,
                            seconds=[d["s"] for d in ph]))
    return out


# (records, round before, round after) of the whole prompts around the host-copy unload (nodes/host_copy.py)
UNLOAD_ROUNDS = (("whole-prompt/gguf-480p81-4steps-16gib-eager.jsonl", "e", "f"),
                 ("whole-prompt/gguf-720p81-4steps-24gib-eager.jsonl", "b", "c"))


def _phases_seconds(pr: dict, key: str, expert_before: bool | None = None):
    """(expert, ``comfy_memory_s[key]``) of the high and low phases of one prompt record; ``expert_before``: only the
    phases that began with a Wan expert loaded (True) or without one (False)."""
    for e in ("high", "low"):
        ph = (pr.get("phases") or {}).get(e) or {}
        if expert_before is not None and ("WAN21" in (ph.get("loaded_gib_before") or {})) != expert_before:
            continue
        v = (ph.get("comfy_memory_s") or {}).get(key)
        if v is not None:
            yield e, v


def switch_unloads(r: dict) -> list:
    """The seconds ComfyUI spent unloading the other expert at each switch of one whole-prompt record (the
    first prompt's high-noise expert unloads the text encoder instead, and is left out)."""
    return [v for pr in r["prompts"] for e, v in _phases_seconds(pr, "model_unload", expert_before=True)
            if (pr["prompt"], e) != ("first", "high")]


def _round_runs(path: str, rnd: str, run: str) -> list:
    """The records of one round and configuration (``est+sage``, ``comfy+sdpa``) that ran."""
    return [r for r in rows(path) if r.get("round") == rnd and r.get("status") == "ok" and r["run"].split("@")[0] == run]


def expert_unloads(path: str, rnd: str, run: str) -> list:
    """:func:`switch_unloads` over the processes of one round and configuration."""
    return [s_ for r in _round_runs(path, rnd, run) for s_ in switch_unloads(r)]


def _commit_of_round(path: str, rnd: str):
    return next((commit_of(r) for r in rows(path) if r.get("round") == rnd and r.get("status") == "ok"), None)


def unload_section() -> list:
    """Unloading an expert at a switch, before and after the estimator's clone kept its host copies."""
    o = ["\n## Unloading a model at an expert switch\n",
         "When ComfyUI loads the next Wan 2.2 expert it unloads the one before: `ModelPatcher.unpatch_model` moves",
         "every weight back to the host with `model.to(offload_device)`, a pageable copy into newly allocated host",
         "memory. The estimator's clone keeps, while it is loaded, the host tensors its weights were loaded from",
         "(`nodes/host_copy.py`): its `load` notes each weight on the host before ComfyUI's load and keeps those now on",
         "the GPU unchanged in size and dtype after it; when ComfyUI unloads the model its `unpatch_model` puts them back",
         "in place, so the copy finds them there and copies nothing. A weight ComfyUI backed up (a LoRA patched into full-precision weights:",
         "the backup already lies on the host) or a model with hook patches is left to ComfyUI's copy. The host memory",
         "kept is that of the loaded weights while they are loaded: never more than the model held before its first",
         "load. Not on dynamic VRAM, where ComfyUI manages the weights' residency itself.",
         "Where ComfyUI frees only part of the model for the next one (`partially_unload`, smallest modules first:",
         "both experts do not fit, yet the first was not unloaded for the decode), each module it moves gets its",
         "weights' host tensors back the same way, through an instance `to` set on the module for that call only. A",
         "weight whose loaded object carries more than its host one is left to ComfyUI's copy: ComfyUI-GGUF keeps a",
         "LoRA on the loaded quantized tensor (`patches`), which a module left streamed must keep.",
         *partial_unload_lines(), "",
         "Seconds ComfyUI spent unloading the other expert at each switch (`model_unload`; the first prompt's",
         "high-noise expert unloads the text encoder and is left out), GGUF Q4_K_M A14B, whole prompts on the H200:\n",
         "| records | before: estimator + Sage | before: ComfyUI alone | after: estimator + Sage | after: ComfyUI alone |",
         "|---|---|---|---|---|"]
    span = lambda xs: f"{min(xs):.2f}–{max(xs):.2f} s ({len(xs)})" if xs else "—"  # noqa: E731
    for path, before, after in UNLOAD_ROUNDS:
        commits = {rnd: _commit_of_round(path, rnd) for rnd in (before, after)}
        name = Path(path).stem
        o.append(f"| [`{name}`](../bench/records/{path}) rounds `{before}` (`{commits[before]}`) / `{after}` "
                 f"(`{commits[after]}`) | {span(expert_unloads(path, before, 'est+sage'))} | "
                 f"{span(expert_unloads(path, before, 'comfy+sdpa'))} | {span(expert_unloads(path, after, 'est+sage'))} | "
                 f"{span(expert_unloads(path, after, 'comfy+sdpa'))} |")
    return o + [""] + unmapping_lines() + [""]


# (records, round before, round after) around the partial unload that gives host tensors back
PARTIAL_UNLOAD_ROUNDS = ("whole-prompt/gguf-480p81-20steps-24gib-eager.jsonl", "b", "c")
# (records, round before, round after) around the streamed GGUF weights left on the file's map (skip_unmapping)
UNMAP_ROUNDS = (("whole-prompt/gguf-720p81-4steps-12gib-eager.jsonl", "c", "d", "12 GiB"),
                ("whole-prompt/gguf-720p81-4steps-16gib-eager.jsonl", "e", "f", "16 GiB"))


def _expert_phase_seconds(path: str, rnd: str, run: str, prompt: str, key: str,
                          expert_before: bool | None = None) -> list:
    """:func:`_phases_seconds` of ``prompt`` over the processes of one round and configuration."""
    return [v for r in _round_runs(path, rnd, run) for pr in r["prompts"] if pr["prompt"] == prompt
            for _e, v in _phases_seconds(pr, key, expert_before)]


def _secs(xs, sep: str = " + ") -> str:
    return sep.join(f"{x:.2f}" for x in xs) + " s" if xs else "—"


def _per_expert(xs) -> str:
    """Seconds per expert, high / low."""
    return _secs(xs, " / ")


def partial_unload_lines() -> list:
    """The partial unloads of the other expert before and after the estimator's clone gave host tensors back there."""
    path, before, after = PARTIAL_UNLOAD_ROUNDS
    got = {(rnd, pr): _expert_phase_seconds(path, rnd, "est+sage", pr, "partially_unload", True)
           for rnd in (before, after) for pr in ("first", "repeat")}
    te = [v for rnd in (before, after)  # the text encoder's: no expert loaded before the phase
          for v in _expert_phase_seconds(path, rnd, "est+sage", "first", "partially_unload", False)]
    return [f"In the 20-step 480p81 prompts at 24 GiB (GGUF with its LoRA, {link(path)}), ComfyUI's partial unloads of",
            f"the other expert took {_secs(got[(before, 'first')])} (first prompt) and {_secs(got[(before, 'repeat')])} "
            f"(repeat) at `{_commit_of_round(path, before)}` (round `{before}`), when it copied every module, and",
            f"{_secs(got[(after, 'first')])} and {_secs(got[(after, 'repeat')])} at `{_commit_of_round(path, after)}` "
            f"(round `{after}`): the weights with the LoRA on them, most of",
            "the bytes it frees, were still copied. The clone now gives those back too, as twins on their host storage",
            "that carry the LoRA (`host_copy._host_twin`; host tier: `tests/host/test_host_unload.py`); not yet",
            "measured on the H200."
            + (f" The first prompt's other partial unload, of the text encoder ({min(te):.2f}–{max(te):.2f} s), is not "
               "the clone's." if te else "")]


def unmapping_lines() -> list:
    """ComfyUI-GGUF's first partial load, before and after the estimator's clone left streamed modules on the map."""
    o = ["ComfyUI-GGUF's first partial load moves each module left streaming to the GPU and back, to take it off the",
         "file's memory map. The estimator's clone keeps its loaded weights' host tensors, which lie on that map, so on",
         "the clone that copy frees nothing: the clone skips it (`host_copy.skip_unmapping`; below, it copies the",
         "streamed modules into page-locked memory instead), except where ComfyUI pins streamed weights (ComfyUI-GGUF",
         "copies a weight off the map before ComfyUI pins it). Seconds of the first prompt's partial loads (`partially_load`, high / low",
         "expert), estimator + Sage, GGUF Q4_K_M A14B 720p81:", ""]
    for path, before, after, budget in UNMAP_ROUNDS:
        b = _expert_phase_seconds(path, before, "est+sage", "first", "partially_load")
        a = _expert_phase_seconds(path, after, "est+sage", "first", "partially_load")
        o.append(f"- {budget}: {_per_expert(b)} at `{_commit_of_round(path, before)}` (round `{before}`), {_per_expert(a)} at "
                 f"`{_commit_of_round(path, after)}` (round `{after}`; {link(path)}).")
    return (o + [""] + pinned_lines() + [""] + pin_throughput_lines() + [""] + kept_pin_lines() + [""]
            + te_copy_lines())


# (records, round before, round after) around the page-locked streamed weights (nodes/pinned_host.py), and the probe
PIN_ROUNDS = ("whole-prompt/gguf-720p81-4steps-12gib-eager.jsonl", "g", "h")
PIN_PROBE = "compile/streamed-block-peak-2916b3e.jsonl"
# python -m bench.pin_throughput on the H200 (rounds: sources in memory, sources on a file map), and the fp8 12 GiB
# whole prompts before and after the page-locked buffers asked for huge pages
PIN_THROUGHPUT = "pinning/throughput.jsonl"
PIN_HUGE_ROUNDS = ("whole-prompt/fp8-720p81-4steps-12gib-eager.jsonl", None, "b")
PIN_PRIVATE_ROUND = "c"  # the same file's first round with the pack's private maps (pinned_host.new_map)
PIN_METHOD_WORDS = {"copy": "a new private map per weight with 4 KiB pages",
                    "copy-thp": "the same with huge pages asked for, the pack's way now",
                    "copy-populate": "the map's pages faulted in when it is made",
                    "alloc-pinned": "torch's page-locked allocator",
                    "in-place": "the source registered where it lies, no copy"}


def pin_throughput_lines() -> list:
    """How fast the page-locking runs per method (the tool's rows), and what huge pages changed in a whole prompt."""
    recs = rows(PIN_THROUGHPUT)
    o = [f"How fast weights are page-locked ({link(PIN_THROUGHPUT)}, `python -m bench.pin_throughput`: "
         f"{recs[0]['gb']:.1f} GB in {recs[0]['weights']} weights, copy and `cudaHostRegister` together, each pass):", ""]
    for source in ("memory", "file"):
        got = [r for r in recs if r.get("source", "memory") == source]
        if not got:
            continue
        where = "from memory already faulted in" if source == "memory" else "from a file map in the page cache"
        parts = []
        for m in dict.fromkeys(r["method"] for r in got):
            if m == "alloc-pinned":
                continue  # its second pass reuses the first pass's blocks (torch's host allocator caches them)
            secs = [r["total_s"] for r in got if r["method"] == m]
            parts.append(f"`{m}` {_span(secs)} s" + (f" ({PIN_METHOD_WORDS[m]})" if m in PIN_METHOD_WORDS else ""))
        o.append(f"- {where}: " + "; ".join(parts) + ".")
    first = [r["total_s"] for r in recs if r["method"] == "alloc-pinned"][:1]
    if first:
        o.append(f"- torch's page-locked allocator took {first[0]:.2f} s on its first pass (its later passes reuse "
                 "the blocks it keeps, so they do not measure a first load).")
    path, before, after = PIN_HUGE_ROUNDS
    b = _expert_phase_seconds(path, before, "est+sage", "first", "partially_load")
    a = _expert_phase_seconds(path, after, "est+sage", "first", "partially_load")
    c = _expert_phase_seconds(path, PIN_PRIVATE_ROUND, "est+sage", "first", "partially_load")
    private = (f": with them (round `{PIN_PRIVATE_ROUND}`, `{_commit_of_round(path, PIN_PRIVATE_ROUND)}`, another "
               f"machine) the first prompt's partial loads took {_per_expert(c)}." if c else ", and no whole prompt "
               "has run with them.")
    o += ["", f"In the fp8 12 GiB prompts ({link(path)}) the first prompt's partial loads took {_per_expert(b)} at "
          f"`{_commit_of_round(path, before)}` (the file's first set) and {_per_expert(a)} at "
          f"`{_commit_of_round(path, after)}` (round `{after}`): about 13 GiB page-locked per expert, several times "
          "slower than the tool's rate. Both pack commits mapped each buffer as shared anonymous memory (Python's "
          "default), which the tool did not measure and which the kernel's default setting gives no huge pages, so "
          f"round `{after}`'s request for them changed nothing; the pack's maps are private now, as the tool's are "
          "(`pinned_host.new_map`, which the tool calls)" + private]
    return o


def pinned_lines() -> list:
    """The streamed weights in page-locked host memory: the one-block probe, and the 12 GiB whole prompts before and
    after the estimator's clone page-locked them."""
    probe = {r["mode"]: r["s"] for r in rows(PIN_PROBE)}
    path, before, after = PIN_ROUNDS

    def later_steps(rnd):
        return [s_ for r in _round_runs(path, rnd, "est+sage") for pr in r["prompts"] for x in pr["experts"].values()
                for s_ in x["step_s"][1:]]

    def frames(rnd, prompt):
        return [pr["to_frames_s"] for r in _round_runs(path, rnd, "est+sage") for pr in r["prompts"]
                if pr["prompt"] == prompt]
    loads = {rnd: _expert_phase_seconds(path, rnd, "est+sage", "first", "partially_load") for rnd in (before, after)}
    return [
        "ComfyUI 0.3.64 streams the weights a partial load leaves on the host from pageable memory, through the",
        "driver's staging buffer. After each load the estimator's clone copies the weights of every module left",
        "streaming into one page-locked buffer per module (`nodes/pinned_host.py`, `cudaHostRegister`), within 40 % of",
        "the machine's RAM and never below 4 GiB of available host memory; newer ComfyUI pins streamed weights itself,",
        "and there the clone does not. One A14B block at 1280×720×81 with its Linears streamed "
        f"({link(PIN_PROBE)}): {probe.get('eager, streamed', float('nan')):.3f} s from pageable memory, "
        f"{probe.get('eager, streamed from pinned memory', float('nan')):.3f} s from page-locked memory, "
        f"{probe.get('eager, resident', float('nan')):.3f} s resident.",
        f"In the 12 GiB seed prompts ({link(path)}, estimator + Sage + text encoder host copy) the first prompt's",
        f"partial loads took {_per_expert(loads[before])} at `{_commit_of_round(path, before)}` (round `{before}`) and "
        f"{_per_expert(loads[after])} at `{_commit_of_round(path, after)}` (round `{after}`, the copies into page-locked",
        f"memory); the later steps {_span(later_steps(before))} s and {_span(later_steps(after))} s; the prompt "
        f"{_per_expert(frames(before, 'first'))} and {_per_expert(frames(after, 'first'))} first, {_per_expert(frames(before, 'repeat'))} and "
        f"{_per_expert(frames(after, 'repeat'))} repeated (two machines; the ratios to ComfyUI alone on each are in "
        "[benchmarks](benchmarks.md#whole-generation))."]


# the 5B template's whole prompts on one H100 before and after the kept host copies were page-locked
KEPT_PIN_ROUNDS = ("whole-prompt/h100-ti2v5b-704p121-20steps-24gib-template.jsonl", "d", "e")


def kept_pin_lines() -> list:
    """The host copies kept for the loaded weights, page-locked beside the sampling: the reload in the repeat
    prompt's first step before and after, from the 5B template's records."""
    path, before, after = KEPT_PIN_ROUNDS
    rate = [r for r in rows(PIN_THROUGHPUT) if r["method"] != "in-place"]  # in-place: the source itself locked

    def prompts(rnd, variant, prompt):
        return [pr for r in rows(path) if r.get("round") == rnd and r.get("status") == "ok"
                and r["config"].get("variant") == variant for pr in r["prompts"]
                if pr["prompt"] == prompt and pr["status"] == "ok"]

    def reload(rnd, variant):  # the repeat prompt's first step over its later steps' median
        return [steps[0] - statistics.median(steps[1:]) for pr in prompts(rnd, variant, "repeat")
                for steps in pr["step_s_by_node"].values()]

    def frames(rnd, variant, prompt):
        return [pr["to_frames_s"] for pr in prompts(rnd, variant, prompt)]
    return [
        "Where the model is loaded again (the repeat prompt after the decode's unload, the expert switch of a repeat",
        "prompt, the text encoder for a new text) ComfyUI copies the kept host copies onto the GPU: "
        f"{_span([r['h2d_pageable_gb_s'] for r in rate])} GB/s from pageable memory,",
        f"{_span([r['h2d_locked_gb_s'] for r in rate])} GB/s from page-locked memory on the H200 host "
        f"({link(PIN_THROUGHPUT)}). After each load the estimator's",
        "clone (and the text encoder's) gives its kept host copies to one worker thread, which copies each module's into",
        "one page-locked buffer while the model samples (one thread, within the same ceiling) and points the kept",
        "entries at it (`host_copy.pin_kept`); a module unloaded meanwhile keeps its pageable copy. Where the ceiling",
        "is reached, streamed weights, read at every step, take the room of kept copies, read once a load: a kept",
        "copy's buffer is unregistered and stays where it is, pageable (`pinned_host.make_room`; on a host of 32 GB",
        "the ceiling is 12.8 GB, and the text encoder's 10.58 GiB of kept copies, page-locked while it encodes, would",
        "otherwise leave all but 1.3 GiB of the diffusion model's streamed weights pageable).",
        f"The 5B template at 24 GiB on an H100 ({link(path)}): the repeat prompt's first step took",
        f"{_span(reload(before, 'template'))} s more than its later steps at `{_commit_of_round(path, before)}` "
        f"(round `{before}`; 9.31 GiB reloaded after the decode's",
        f"unload) and {_span(reload(after, 'template'))} s at `{_commit_of_round(path, after)}` (round `{after}`; "
        f"stock ComfyUI {_span(reload(after, 'comfy'))} s); the repeat prompt to the frames",
        f"{_span(frames(before, 'template', 'repeat'))} s and {_span(frames(after, 'template', 'repeat'))} s, stock "
        f"ComfyUI {_span(frames(after, 'comfy', 'repeat'))} s. The worker page-locked the text encoder's 10.58 GiB in",
        "4.1–6.3 s and the model's 9.31 GiB in 4.8–4.9 s (round `e`'s log) while they sampled; the first prompts took",
        f"{_span(frames(after, 'template', 'first'))} s (round `{after}`) against "
        f"{_span(frames(before, 'template', 'first'))} s (round `{before}`; the first of round `{after}`'s two "
        "processes ran in the call that wrote the model files)."]


# the whole prompts with Wan Text Encoder Host Copy and ComfyUI alone on one machine (nodes/text_encoder.py)
TE_COPY_RECORDS = "whole-prompt/gguf-480p81-20steps-24gib-te-copy.jsonl"


def te_copy_lines() -> list:
    """The text encoder's unload for the first expert, ComfyUI alone against the rows with the host copy node."""
    recs = [r for r in rows(TE_COPY_RECORDS) if r.get("status") == "ok" and r.get("prompts")]

    def unload(r):  # the first prompt's high-noise phase: ComfyUI frees the text encoder for the expert
        return sum(v for e, v in _phases_seconds(r["prompts"][0], "model_unload") if e == "high")
    stock = [unload(r) for r in recs if not r["config"].get("estimator")]
    mine = [(unload(r), r) for r in recs if r["config"].get("te_host_copy")]
    o = ["The text encoder is unloaded the same way for the first expert of every prompt whose text changed",
         "(10.6 GiB of umt5-xxl in bf16 in these records): in ComfyUI alone that copy back is part of the first prompt.",
         "*Wan Text Encoder Host Copy* (`nodes/text_encoder.py`, CLIP → CLIP) puts the same host copy on a clone of the",
         "text encoder's patcher."]
    if stock and mine:
        commit = commit_of(mine[0][1])
        o[-1] += (f" GGUF A14B 832×480×81 at 24 GiB on one machine ({link(TE_COPY_RECORDS)}, `{commit}`): ComfyUI"
                  f" alone spent {_span(stock, '{:.2f}')} s unloading it for the high-noise expert, the rows with the"
                  f" node {_span([x for x, _r in mine], '{:.2f}')} s.")
    return o


def decode_room_section() -> list:
    """How the VAE decode after the sampling ran against the weights the sampling left resident."""
    rows = decode_room_rows()
    if not rows:
        return []
    fig = comfy_wan_vae_decode_gib(1280, 720)
    total = comfy_frees_gib(1280, 720)
    vae = total - fig
    o = ["\n## The VAE decode after the sampling\n",
         "ComfyUI's `VAE.decode` (comfy/sd.py) loads the VAE with its own figure for the decode as the memory required,",
         f"and `load_models_gpu` frees that figure plus 1.1× the VAE's weights first: for the Wan 2.1 VAE at 1280×720 in bf16,",
         f"{fig:.2f} + {vae:.2f} = {fig + vae:.2f} GiB above what it always keeps free (`memory/vae_decode.py`). Weights the sampling kept",
         "resident beyond that are evicted there, smallest modules first, and the decode runs among the holes they leave.",
         "Whole prompts on the H200, and on an H100 in the `h100-` files (the decode of each prompt, first / repeat;",
         "*resident*: the diffusion model's GiB on",
         "the GPU as the decode began; *free*: the device's free GiB then, where the record read it):\n",
         "| record | configuration | wan-sage | resident GiB | evicted GiB | free GiB | decode s |",
         "|---|---|---|---:|---:|---:|---:|"]
    for x in rows:
        free = " / ".join("—" if f is None else f"{f:.2f}" for f in x["free"])
        o.append(f"| {_record_link(x['set']['file'], x['set']['label'])} | {x['config']} | `{commit_of(x['run'])}` | "
                 f"{' / '.join(f'{v:.2f}' for v in x['resident'])} | {' / '.join(f'{v:.2f}' for v in x['evicted'])} | "
                 f"{free} | {' / '.join(f'{v:.1f}' for v in x['seconds'])} |")
    o += ["",
          "From `1f8f94f` the Sage patch empties the allocator cache when its sampling ends (`comfy_bridge.trim_allocator`),",
          "so the decode does not start among the sampling's cached blocks. The room the decode takes is what ComfyUI",
          "frees for it and the workspace of the decoder's largest convolution's fast cuDNN engine, taken as that",
          f"convolution's input plus its output ({conv_workspace_gib(1280, 720):.2f} GiB at 1280×720, "
          f"{conv_workspace_gib(832, 480):.2f} GiB at 832×480; below) (`memory/vae_decode.py`).",
          "",
          "The estimator's clone makes that room when its sampling ends: where it is not free then (with what ComfyUI",
          "keeps free), its `OUTER_SAMPLE` wrapper unloads the model whole through ComfyUI's `free_memory`, keeping every",
          "other loaded model (`nodes/decode_room.py`). Its weights keep their host copies (below), so the unload copies",
          "nothing, and the reservation in force while it samples keeps none of the decode's room",
          "(`memory.estimate.decode_unload`): the weights use it. A second sampling of the same model loads it again.",
          "Where the model's unload would copy its weights back (load and offload on one device, where no host copies are",
          "kept), the reservation in force is at least the decode's room, where that fits in the budget",
          "(`memory.estimate.decode_floor`), capped where that room and every weight do not fit together at the larger",
          "of what fits beside every weight (less 0.25 GiB, `PLACEMENT_SLACK`) and ComfyUI's own reservation for the",
          "forward, the room its decodes have after ComfyUI alone's sampling. Records up to `6716f0e` kept that room",
          "while sampling, and records from `087d8a9` to `32a669a` kept what ComfyUI frees alone.",
          "Where the decode needs more than the budget, ComfyUI unloads the model whole for it in any case.",
          "The cond / uncond batching test and dynamic VRAM plan no room and no unload; `wan-sage plan --no-decode` and",
          "the route's `no_decode` plan a sampling with no decode after it."]
    o += decode_profile_lines()
    o += decode_conv_lines()
    # the experts whose reservation was the decode's room (their records give it to the GiB's hundredth)
    kept = [e for st in whole_sets() for r in st["runs"] if r["config"].get("estimator")
            for p in r["prompts"] for e in p.get("experts", {}).values()
            if any(abs(e.get("predicted_working_gib", 0) - g) < 0.01
                   for g in decode_rooms_gib(r["config"]["width"], r["config"]["height"]))]
    if kept:
        o.append(f"While the experts sample, that room is more than they use: in the records where it was in force they "
                 f"held {_span([e['working_gib'] for e in kept])} GiB above their weights against "
                 f"{_span([e['predicted_working_gib'] for e in kept])} GiB reserved. The budget the sampling leaves "
                 f"unused is the decode's, the next node's ([benchmarks](benchmarks.md#{anchor('Whole generation')})).")
    return o + [""]


DECODE_PROFILE = "whole-prompt/void-decode-profile-7b4d74a.jsonl"
DECODE_ALONE = "decode-room/720p81-16gib.jsonl"
FALLBACK_CONV = "implicit_convolveNd_sgemm"  # cuDNN's convolution engine that needs no workspace


def fallback_calls(decode: dict) -> tuple:
    """A profiled decode's calls of :data:`FALLBACK_CONV` among its top kernels, and their device seconds."""
    hit = [t for t in decode["profile"]["top"] if FALLBACK_CONV in t["name"]]
    return sum(t["calls"] for t in hit), sum(t["ms"] for t in hit) / 1e3


def decode_profile_lines() -> list:
    """Where the decode's time went after the estimator + Sage sampling against after ComfyUI alone's (the void
    file: torch.profiler ran around each decode, so its seconds are not the user's), and the same latent decoded
    alone in fresh processes with the memory around it arranged (``bench.decode_room``)."""
    try:
        prof = [r for r in rows(DECODE_PROFILE) if r.get("status") == "ok"]
        alone = [r for r in rows(DECODE_ALONE) if r.get("status") == "ok"]
    except FileNotFoundError:
        return []
    by = {r["config"]["estimator"]: r for r in prof}
    if set(by) != {False, True} or not alone:
        return []

    def decodes(r):
        return [p["phases"]["decode"] for p in r["prompts"]]

    def dev_s(ds):
        return [d["profile"]["device_s"] for d in ds]

    est, stock = decodes(by[True]), decodes(by[False])
    fb = [fallback_calls(d) for d in est]
    stock_fb = [fallback_calls(d) for d in stock]
    alone_s = [d["s"] for r in alone for d in r["decodes"]]
    scen = _and([f"`{r['scenario']}`" for r in alone])
    budget = by[True]["config"]["budget_gib"]
    return [
        "",
        f"What ComfyUI frees alone was not enough at {budget:g} GiB with GGUF experts: there the decode after the estimator + Sage "
        f"sampling evicted nothing and began with {_span([d['pool_before']['free_gib'] for d in est])} GiB free, and "
        f"still took longer than after ComfyUI alone's. Profiled ({link(DECODE_PROFILE, DECODE_PROFILE.split('/')[-1])}, "
        f"`{commit_of(by[True])}`, torch.profiler around each decode, first / repeat prompt; the profiler's own cost is "
        f"in its seconds, so they are not the user's), the decode's kernels ran "
        f"{' / '.join(f'{x:.2f}' for x in dev_s(est))} s on the device against "
        f"{' / '.join(f'{x:.2f}' for x in dev_s(stock))} s after ComfyUI alone's sampling. The difference "
        f"is cuDNN's convolution engine that needs no workspace, `{FALLBACK_CONV}`: "
        f"{' / '.join(f'{n} calls, {t:.2f} s' for n, t in fb)} after the estimator + Sage sampling, "
        f"{' / '.join(f'{n} calls' for n, _t in stock_fb)} after ComfyUI alone's, which ran those convolutions on "
        "workspace engines. PyTorch keeps the engine cuDNN settled on for a convolution's shape for the rest of the "
        "process, and chooses among the engines whose workspace it can allocate at that moment; the decode's own pool "
        "reached "
        f"{_span([d['peak_reserved_gib'] for d in est])} GiB of the {budget:g} there. Decoded alone "
        f"({link(DECODE_ALONE, DECODE_ALONE.split('/')[-1])}, `python -m bench.decode_room`: the same 1280×720×81 latent "
        f"in fresh processes at {alone[0]['budget_gib']:g} GiB with {scen}), every decode took {_span(alone_s, '{:.1f}')} s: "
        "free memory, holes in the pool, a trim before it or a first decode at 11 GiB do not by themselves make cuDNN "
        "settle on that engine.",
        "",
    ]


DECODE_PROBE = "whole-prompt/void-decode-probe-1c7065e.jsonl"
CONV_SWEEP = "decode-room/conv-workspace-9c19405.jsonl"
DECODE_PLAN = "whole-prompt/void-decode-plan-68a53a8.jsonl"


def _shape(xs) -> str:
    return "×".join(str(x) for x in xs)


def sweep_lines(sweep: list) -> dict:
    """Per input shape of ``bench.conv_workspace`` rows: the most GiB free before the first call that left the
    convolution on a slow engine (over twice its fastest ms), the least that gave a fast one, and both ms."""
    out: dict = {}
    for r in sweep:
        out.setdefault(tuple(r["input"]), []).append(r)
    lines = {}
    for shape, rs in out.items():
        best = min(r["ms"] for r in rs)
        slow = [r for r in rs if r["ms"] > 2 * best]
        fast = [r for r in rs if r["ms"] <= 2 * best and (not slow or r["free_gib"] > max(x["free_gib"] for x in slow))]
        if slow and fast:
            lines[shape] = dict(slow_gib=max(r["free_gib"] for r in slow), fast_gib=min(r["free_gib"] for r in fast),
                                slow_ms=_span([r["ms"] for r in slow], "{:.1f}"),
                                fast_ms=_span([r["ms"] for r in fast], "{:.1f}"))
    return lines


def decode_conv_lines() -> list:
    """Which convolution the decode's time went to, the memory it was first run with (the decode profile's
    convolution table), that convolution alone by the memory free before its first call (``bench.conv_workspace``),
    and the step tried against it."""
    try:
        probe = [r for r in rows(DECODE_PROBE) if r.get("status") == "ok"]
        sweep = [r for r in rows(CONV_SWEEP) if r.get("ms")]
        tried_all = [r for r in rows(DECODE_PLAN) if r.get("status") == "ok"]
        tried = [r for r in tried_all if r["config"].get("estimator")]
        stock = [r for r in tried_all if not r["config"].get("estimator") and r["config"].get("attention") == "sdpa"]
    except FileNotFoundError:
        return []
    convs = [(r, p["phases"]["decode"]) for r in probe for p in r["prompts"]]
    if not convs or not sweep or not all(d.get("profile", {}).get("convs") for _r, d in convs):
        return []

    def per_call(c):
        return c["device_ms"] / c["calls"] if c.get("device_ms") and c["calls"] else 0.0
    worst = [max(d["profile"]["convs"], key=lambda c: c.get("device_ms") or 0) for _r, d in convs]
    shape = tuple(worst[0]["input"])
    if any(tuple(w["input"]) != shape for w in worst):
        return []
    others = [per_call(c) for _r, d in convs for c in d["profile"]["convs"] if tuple(c["input"]) != shape]
    began = [d["profile"]["convs"][0]["first"]["free_gib"] for _r, d in convs]
    lines = sweep_lines(sweep)
    line = lines.get(shape)
    if line is None:
        return []
    rest = [(k, v) for k, v in lines.items() if k != shape]
    rest_text = _and([f"{k[-1] - 2}×{k[-2] - 2}" for k, _v in rest])
    rest_span = (f"{_span([v['slow_gib'] for _k, v in rest], '{:.1f}')} and "
                 f"{_span([v['fast_gib'] for _k, v in rest], '{:.1f}')} GiB") if rest else ""
    trims = _and(sorted({"without" if r["config"].get("trim_after_sampling") is False else "with" for r, _d in convs}))
    trims_order = "; ".join(
        " and ".join(str(fallback_calls(p["phases"]["decode"])[0]) for p in r["prompts"])
        + (" without it" if r["config"].get("trim_after_sampling") is False else " with the trim") for r in probe)
    o = ["",
         f"One convolution takes that time ({link(DECODE_PROBE, DECODE_PROBE.split('/')[-1])}, `{commit_of(probe[0])}`, "
         "the decode profile naming each convolution shape, its calls, its device time and the device's free memory "
         f"when the decode first ran it; {trims} the Sage patch's trim when its sampling ends): the decoder's last "
         f"{shape[1]}-channel 3-D convolution at full resolution, input {_shape(shape)}, "
         f"{_span([w['calls'] for w in worst], '{:d}')} calls and "
         f"{_span([w['device_ms'] / 1e3 for w in worst], '{:.2f}')} s of device time a decode "
         f"({_span([per_call(w) for w in worst], '{:.0f}')} ms a call; no other shape took more than "
         f"{max(others):.1f} ms a call). The decode first runs it with its second latent frame, when its own pool has "
         f"grown: {_span([w['first']['free_gib'] for w in worst])} GiB were free on the device then, against "
         f"{_span(began)} GiB as the decode began, with the trim or without it. Alone in a fresh process "
         f"({link(CONV_SWEEP, CONV_SWEEP.split('/')[-1])}, `python -m bench.conv_workspace`, bf16, cudaMallocAsync), "
         f"the same convolution runs at {line['fast_ms']} ms a call when {line['fast_gib']:g} GiB or more are free "
         f"before its first call and at {line['slow_ms']} ms with {line['slow_gib']:g} GiB or less"
         + (f"; at {rest_text} the line lies between {rest_span}" if rest else "") + ". "
         "So the decode's first call of it had room for a workspace engine, and took one: of its "
         f"{_span([w['calls'] for w in worst], '{:d}')} calls, {trims_order} ran on `{FALLBACK_CONV}` (first and "
         "repeat decode). The first decode changed engines part-way, "
         "which PyTorch does when the workspace of the engine it kept cannot be allocated at a later call: it picks "
         "again among what fits then and keeps that for the rest of the process, so the repeat decode runs the slow "
         "one from its first call. The decode's pool grows to the budget's edge "
         f"({_span([d['peak_reserved_gib'] for _r, d in convs])} GiB of {probe[0]['config']['budget_gib']:g}), and "
         "PyTorch's cudaMallocAsync backend does not hand the pool's cached blocks back and retry when an "
         "allocation fails."]
    if tried:
        ds = [p["phases"]["decode"]["s"] for p in tried[0]["prompts"]]
        o.append(f"Running the convolutions the decode first runs with its second frame once, on empty tensors of "
                 f"their shapes, right after the sampling did not change it ({link(DECODE_PLAN, DECODE_PLAN.split('/')[-1])}, "
                 f"`{commit_of(tried[0])}`: {' / '.join(f'{x:.1f}' for x in ds)} s, first / repeat); the pack does "
                 "not do it.")
        if stock:
            frames = lambda r: [p["to_frames_s"] for p in r["prompts"]]  # noqa: E731
            mine, base = frames(tried[0]), frames(stock[0])
            base_dec = [p["phases"]["decode"]["s"] for p in stock[0]["prompts"]]
            o.append(f"On that machine ComfyUI alone + SDPA took {' / '.join(f'{x:.1f}' for x in base)} s to the frames "
                     f"(decode {' / '.join(f'{x:.1f}' for x in base_dec)} s), "
                     f"the estimator + Sage with that step {' / '.join(f'{x:.1f}' for x in mine)} s: "
                     f"{' / '.join(f'{b / m:.2f}×' for b, m in zip(base, mine))} on the user's clock, the decode "
                     "being the difference.")
    o += workspace_room_lines()
    return o + [""]


WORKSPACE_ROOM = ("whole-prompt/gguf-720p81-4steps-16gib-eager.jsonl", "c")  # the set with the workspace in the room


def workspace_room_lines() -> list:
    """The whole prompt with the decode's room keeping its largest convolution's workspace, against ComfyUI alone
    on the same machine."""
    path, rnd = WORKSPACE_ROOM
    try:
        got = [r for r in rows(path) if r.get("round") == rnd and r.get("status") == "ok"]
    except FileNotFoundError:
        return []
    by = {r["config"]["estimator"]: r for r in got}
    if set(by) != {False, True}:
        return []
    mine, base = by[True], by[False]
    dec = [p["phases"]["decode"] for p in mine["prompts"]]
    dec_s = " / ".join(f"{d['s']:.1f}" for d in dec)
    frames = lambda r: [p["to_frames_s"] for p in r["prompts"]]  # noqa: E731
    room = comfy_frees_gib(mine["config"]["width"], mine["config"]["height"]) + conv_workspace_gib(
        mine["config"]["width"], mine["config"]["height"])
    return [f"With the workspace in the room ({room:.2f} GiB; {link(path, path.split('/')[-1] + f' ({rnd})')}, "
            f"`{commit_of(mine)}`), the decode after the estimator + Sage sampling began with "
            f"{_span([d['pool_before']['free_gib'] for d in dec])} GiB free and took "
            f"{dec_s} s (first / repeat); ComfyUI alone + SDPA on that machine "
            f"took {' / '.join(f'{x:.1f}' for x in frames(base))} s to the frames, the estimator + Sage "
            f"{' / '.join(f'{x:.1f}' for x in frames(mine))} s: "
            f"{' / '.join(f'{b / m:.2f}×' for b, m in zip(frames(base), frames(mine)))}."]


def comfy_ratios(summary) -> dict:
    """Per model, ComfyUI's own figure over the measured eager peak (fit and held-out rows)."""
    by = {title: rs for title, _n, rs, _l, _t in summary}
    eager = by["Eager, fit"] + by["Eager, held out"]
    return {m: [r["comfy"] / r["measured"] for r in eager if r["model"] == m] for m in _host.presets()}


# ----------------------------------------------------------------- partial loading (bench/records/partial-load)

def partial_files() -> list[Path]:
    """The partial-load benchmark's record files: one per machine and case (the reference run apart)."""
    return [p for p in files("partial-load") if p.resolve() not in {x.resolve() for x in set_from("partial_frag_factor")}]


def partial_case(p: Path) -> tuple:
    """(size, weights, LoRA rank, label) of a partial-load record file, from its name:
    ``{720p81|480p81}-{bf16|fp8}[-lora{R}][-...].jsonl`` (its rows do not say)."""
    parts = p.stem.split("-")
    res, weights = parts[0], parts[1]
    rank = int(parts[2][4:]) if len(parts) > 2 and parts[2].startswith("lora") else 0
    size = {"720p81": (1280, 720, 81), "480p81": (832, 480, 81)}[res]
    return size, weights, rank, f"{res} {weights}" + (f" + LoRA r{rank}" if rank else "")


def partial_ratios():
    """(file, label, attention, ComfyUI s/step, wan-sage s/step, ratio, runs each) per record file (one
    machine each): the median over its runs of each configuration, ComfyUI's reservation against wan-sage's."""
    out = []
    for p in partial_files():
        rs = [r for r in rows(p) if r["status"] == "ok"]
        for att, suffix in (("SDPA", ""), ("Sage", "+sage")):
            c = [r["median_2_4_s"] for r in rs if r["config"] == "comfy" + suffix]
            w = [r["median_2_4_s"] for r in rs if r["config"] == "ours" + suffix]
            if c and w:
                mc, mw = statistics.median(c), statistics.median(w)
                out.append((p, partial_case(p)[3], att, mc, mw, mc / mw, min(len(c), len(w))))
    return out


def _runs(label=None, config=None):
    """(file, record) of the partial-load records, filtered by case label and configuration."""
    return [(p, r) for p in partial_files() if label is None or partial_case(p)[3] == label
            for r in rows(p) if config is None or r["config"] == config]


PARTIAL_COMMANDS = {  # the command that wrote each partial-load record file
    "720p81-bf16.jsonl": "--res 1280x720x81 --configs comfy,ours,comfy+sage,ours+sage",
    "720p81-bf16-sdpa-interleaved.jsonl": "--res 1280x720x81 --configs comfy,ours,ours,comfy,comfy+sage,ours+sage",
    "720p81-fp8.jsonl": "--res 1280x720x81 --weights fp8 --configs comfy,ours,comfy+sage,ours+sage",
    "480p81-bf16-lora64.jsonl": "--res 832x480x81 --lora-rank 64 --configs ours+sage,comfy+sage",
    "480p81-fp8-lora64.jsonl": "--res 832x480x81 --weights fp8 --lora-rank 64 --configs ours+sage,comfy+sage",
    "720p81-bf16-sage-interleaved.jsonl": "--res 1280x720x81 --configs ours+sage,comfy+sage,comfy+sage,ours+sage",
}


def partial_load_section() -> list:
    before = ("720p81-bf16.jsonl", "480p81-bf16-lora64.jsonl", "720p81-bf16-sdpa-interleaved.jsonl", "720p81-fp8.jsonl")
    o = ["## Partial loading on a simulated 24 GB card\n",
         "A14B weights at real size (bf16: 26.6 GiB; fp8 e4m3: 13.3 GiB) are loaded through",
         "`comfy.sd.load_diffusion_model_state_dict`. A ballast allocation makes `get_free_memory()` read 24.0 GiB.",
         "Each run samples 4 steps (euler, cfg 1.0) with cudaMallocAsync. Each record file of",
         "[`bench/records/partial-load/`](../bench/records/partial-load/) holds the runs of one machine; a ratio is only",
         "taken between runs of one file. The harness runs `comfy.sample.sample` under `torch.inference_mode()`, as",
         "ComfyUI's executor runs every node; the rows of " + _and([f"`{n}`" for n in before]) + " were measured with",
         "autograd enabled around model loading (the sampler itself is `no_grad`, so the forward and its memory are the",
         "same). ComfyUI's fp8 LoRA patching refuses autograd (`clamp(): functions with out=... arguments don't support",
         "automatic differentiation`), so the 480p81 fp8 + LoRA rows are all under inference mode. In",
         "`720p81-bf16-sdpa-interleaved.jsonl` the SDPA runs, and in `720p81-bf16-sage-interleaved.jsonl` the Sage runs,",
         "were ordered ComfyUI, wan-sage, wan-sage, ComfyUI (wan-sage first for Sage), so that drift over the machine's",
         "time cancels.\n",
         "```bash"]
    for p in partial_files():
        o.append(f"COMFYUI_PATH=... python -m bench.partial_load --budget-gb 24 {PARTIAL_COMMANDS[p.name]} --steps 4 --out {p.name}")
    o += ["```\n",
          "| records | run | reservation / row | weights resident | s/step (median of 2–4) | peak allocated | peak reserved | headroom | result | Sage / SDPA calls |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for p in partial_files():
        lab = partial_case(p)[3]
        for r in rows(p):
            sg = r.get("sage")
            calls = f"{sg['sage_calls']} / {sg['sdpa_calls']}" if sg and sg.get("sage_calls") else ("n/a" if "+sage" in r["config"] else "")
            o.append(f"| {link(name_of(p))} | {lab} {r['config']} | {r['reservation_gib_per_row']:.2f} GiB | {r['weights_resident_gib']:.2f} GiB | "
                     f"{r['median_2_4_s']:.3f} s | {r['peak_alloc_gib']:.2f} GiB | {r['peak_reserved_gib']:.2f} GiB | "
                     f"{24.0 - r['peak_reserved_gib']:.2f} GiB | {r['status']} | {calls} |")
    o += ["\n`headroom` is the budget minus the peak reserved by the allocator (ComfyUI's 400 MiB extra reserve",
          "included). `n/a`: the harness of `720p81-bf16.jsonl` and `480p81-bf16-lora64.jsonl` read the Sage counts after",
          "the patch had closed its window (it reads them inside it since; in the other files each forward (40 blocks)",
          "made 40 Sage self-attention and 40 SDPA cross-attention calls, the cross ones declined with reason",
          "`cross_slower`).\n",
          "Speed per step, ComfyUI's own reservation against wan-sage's (median of each configuration's runs",
          "within one file):\n",
          "| records | case | attention | ComfyUI s/step | wan-sage s/step | × | runs each |",
          "|---|---|---|---:|---:|---:|---:|"]
    for p, lab, att, mc, mw, ratio, n in partial_ratios():
        o.append(f"| {link(name_of(p))} | {lab} | {att} | {mc:.3f} | {mw:.3f} | {ratio:.3f}× | {n} |")
    o += partial_reading()
    return o


def partial_reading() -> list:
    """The reading under the partial-load tables: every figure is taken from the records."""
    ref = rows(set_from("partial_frag_factor")[0])
    edge_ok = min(r["reservation_gib_per_row"] for r in ref if r["status"] == "ok" and r["policy"] == "fixed")
    edge_oom = max(r["reservation_gib_per_row"] for r in ref if r["status"] == "oom")
    rep = {r["policy"]: r["median_2_4_s"] for r in ref if r["source"] == "reference run repeat"}
    ref_ratios = [c / w for c in rep["comfy"] for w in rep["fixed"]]
    bf16 = [r for _p, r in _runs("720p81 bf16") if r["status"] == "ok"]
    fp8 = [r for _p, r in _runs("720p81 fp8") if r["status"] == "ok"]
    ours_sdpa = [r for r in bf16 if r["config"] == "ours"]
    ours_sage = [r for r in bf16 if r["config"] == "ours+sage"]
    comfy_bf16 = [r for r in bf16 if r["config"].startswith("comfy")]
    comfy_fp8 = [r for r in fp8 if r["config"].startswith("comfy")]
    res_sdpa = statistics.median(r["reservation_gib_per_row"] for r in ours_sdpa)
    res_sage = statistics.median(r["reservation_gib_per_row"] for r in ours_sage)
    top = max(ours_sdpa, key=lambda r: r["peak_reserved_gib"])
    bf16_ratios = [x for x in partial_ratios() if x[1] == "720p81 bf16"]
    repeats = {att: x for x in bf16_ratios for att in (x[2],) if x[6] > 1}       # interleaved repeats, per attention
    singles = [x for x in bf16_ratios if x[6] == 1]
    streamed = [r2["weights_resident_gib"] - r1["weights_resident_gib"] for r1 in comfy_bf16 + comfy_fp8
                for r2 in bf16 + fp8 if r2["config"].startswith("ours") and r2["weights_total_gib"] == r1["weights_total_gib"]
                and r2["config"].endswith("+sage") == r1["config"].endswith("+sage")]
    saved = [mc - mw for _p, _lab, _att, mc, mw, _x, _n in bf16_ratios]
    fix = [e for r in cast_term_runs() for e in r["experts"].values()]
    b, c = repeats["SDPA"], repeats["Sage"]
    # the file with both attentions under wan-sage's reservation and the most runs: Sage against SDPA there
    both = max((p for p in partial_files() if partial_case(p)[3] == "720p81 bf16"
                and {"ours", "ours+sage"} <= {r["config"] for r in rows(p)}),
               key=lambda p: sum(r["config"] == "ours" for r in rows(p)))
    both_rows = [r for r in rows(both) if r["status"] == "ok"]
    fp8_ours = {r["config"]: r["median_2_4_s"] for r in fp8 if r["config"].startswith("ours")}
    fp8_ratio = {att: x for _p, lab, att, _mc, _mw, x, _n in partial_ratios() if lab == "720p81 fp8"}
    sdpa_b = statistics.median(r["median_2_4_s"] for r in both_rows if r["config"] == "ours")
    sage_b_s = statistics.median(r["median_2_4_s"] for r in both_rows if r["config"] == "ours+sage")
    single_text = "; ".join(f"{att} {x:.3f}× (`{p.name}`)" for p, _lab, att, _mc, _mw, x, _n in singles)
    return [f"""
- **Never out of memory.** No wan-sage run ran out of memory: bf16 and fp8, 720p81 and 480p81 with a
  rank-64 LoRA, SDPA and Sage. The reference run ({link(SET_FROM["partial_frag_factor"][0])}, PyTorch's native
  allocator) put the edge between {edge_oom:.1f} GiB per row (out of memory) and {edge_ok:.1f} GiB (safe); wan-sage reserves
  {res_sdpa:.2f} GiB (SDPA) and {res_sage:.2f} GiB (Sage) there, and its SDPA runs peak at {top["peak_reserved_gib"]:.2f} of the 24 GiB
  reserved by the allocator: it sits {24.0 - top["peak_reserved_gib"]:.2f} GiB inside the edge.
- **Weights resident.** At 720p81 bf16 wan-sage keeps {_span([r["weights_resident_gib"] for r in ours_sdpa])} GiB (SDPA) and {_span([r["weights_resident_gib"] for r in ours_sage])} GiB (Sage) of the {bf16[0]["weights_total_gib"]:.1f} GiB
  resident, where ComfyUI keeps {_span([r["weights_resident_gib"] for r in comfy_bf16])} GiB. With fp8 weights it kept {_span([r["weights_resident_gib"] for r in fp8 if r["config"].startswith("ours")])} GiB resident (all of them), where ComfyUI
  keeps {_span([r["weights_resident_gib"] for r in comfy_fp8])} GiB and streams the rest at every step. That was too close: the same fp8 configuration
  with the Sage patch ran out of memory end to end (allocator holes around the per-call fp8 casts,
  [benchmarks.md](benchmarks.md#{anchor("Out of memory")})). The estimate reserves room for those holes with fp8 weights
  (`cast_frag_factor`), and the end-to-end run with that reservation kept {_span([e["resident_gib"] for e in fix], "{:.1f}")} of the {fix[0]["weights_gib"]:.2f} GiB
  resident; the fp8 rows above are from before the cast term.
- **Speed.** The gain is what the extra resident gigabytes save in streaming: {_span(streamed, "{:.1f}")} GiB less copied per
  step, about {_span(saved, "{:.2f}")} s of a {_span([r["median_2_4_s"] for r in bf16], "{:.1f}")} s step, so the ratios sit near the size of the run-to-run
  spread (the reference run measured {_span(ref_ratios, "{:.2f}")}× between repeats). Each attention mode was therefore settled by
  interleaved repeats on one machine: SDPA {b[5]:.3f}× (`{b[0].name}`, {b[6]} runs each, {b[3]:.3f} against {b[4]:.3f} s),
  Sage {c[5]:.3f}× (`{c[0].name}`, {c[6]} runs each, {c[3]:.3f} against {c[4]:.3f} s). Single pairs: {single_text}; fp8
  {fp8_ratio["SDPA"]:.3f}× (SDPA), {fp8_ratio["Sage"]:.3f}× (Sage).
- **Sage against SDPA under wan-sage at the 24 GB budget:** {sdpa_b:.3f} / {sage_b_s:.3f} = {sdpa_b / sage_b_s:.2f}× per step in `{both.name}`
  (bf16), {fp8_ours["ours"]:.3f} / {fp8_ours["ours+sage"]:.3f} = {fp8_ours["ours"] / fp8_ours["ours+sage"]:.2f}× with fp8 weights.
"""]


def cast_term_runs() -> list[dict]:
    """The completed estimator runs with fp8 weights, eager, at 24 GiB and 720p81 in the end-to-end record
    files the cast term was not set from: the configuration that ran out of memory before it."""
    return [r for p in not_set_from("cast_frag_factor", "e2e") for r in rows(p)
            if r.get("status") == "ok" and (c := r.get("config") or {}).get("weights") == "fp8" and c.get("budget_gib") == 24.0
            and c["estimator"] and not c.get("compile") and (c["width"], c["height"], c["frames"]) == R720]


# ----------------------------------------------------------------- the memory model end to end (bench/records/e2e)

def _streamed_rows(paths) -> tuple:
    """Table lines of the experts sampled with weights partly offloaded in ``paths``, and per kind (eager,
    compiled) what the allocator held: (held above resident weights, held above the allocated peak,
    reservation); and for compiled-per-block experts, (held above resident weights, the compiled figure for
    resident weights)."""
    lines, held_over, compiled = [], {}, []
    for p, r in e2e_records(paths=paths):
        c = r["config"]
        if r.get("status") != "ok":
            continue
        est = e2e_estimate(c)
        for name, e in r["experts"].items():
            if e["resident_frac"] >= 0.9999:
                continue
            held_gib = held_above_weights(e)
            above = e["peak_reserved_gib"] - e["peak_alloc_gib"]
            res = est.reservation_partial / GiB
            kind = "compiled" if c.get("compile") else "eager"
            held_over.setdefault(kind, []).append((held_gib, above, res))
            if kind == "compiled" and compiled_blocks(c):
                compiled.append((held_gib, est.reservation_resident / GiB))
            lines.append(f"| `{commit_of(r)}` | {r['run'].split('@')[0]}@{c['budget_gib']:g} | {size_of(c)} | "
                         f"{name} | {e['resident_frac']:.0%} | {e['working_gib']:.2f} | {above:.2f} | "
                         f"{held_gib:.2f} | {res:.2f} | {held_gib / res:.2f} |")
    return lines, held_over, compiled


def _streamed_table(lines: list, held_over: dict) -> list:
    """The table of :func:`_streamed_rows`' lines, then per kind what the allocator held."""
    o = ["| wan-sage | run | size | expert | resident | working GiB | held above it | held above resident weights | reservation | held / reservation |",
         "|---|---|---|---|---:|---:|---:|---:|---:|---:|"] + lines + [""]
    for kind, vals in held_over.items():
        o.append(f"- {kind.capitalize()}: the allocator held {_span([a for _h, a, _r in vals])} GiB above the allocated peak, "
                 f"{_span([h for h, _a, _r in vals])} GiB above the resident weights in all, "
                 f"{_span([h / r for h, _a, r in vals])} of the reservation.")
    return o


def streamed_files(weights: str, not_from: tuple) -> list[Path]:
    """The end-to-end record files of ``weights`` with an expert sampled with weights partly offloaded,
    leaving out the files the rules ``not_from`` were set from."""
    source = {p.resolve() for rule in not_from for p in set_from(rule)}
    return [p for p in files("e2e") if p.resolve() not in source
            and any(r.get("status") == "ok" and any(e["resident_frac"] < 0.9999 for e in r["experts"].values())
                    for _p, r in e2e_records(weights, [p]))]


def _describe_files(paths) -> str:
    """Each file with the budgets and sizes of its runs with weights partly offloaded."""
    out = []
    for p in paths:
        cs = [r["config"] for _p, r in e2e_records(paths=[p]) if r.get("status") == "ok"
              and any(e["resident_frac"] < 0.9999 for e in r["experts"].values())]
        by_size = {}
        for c in cs:
            by_size.setdefault(size_of(c), set()).add(c["budget_gib"])
        out.append(f"{link(name_of(p))} (" + "; ".join(f"{s} at {_and([format(b, 'g') for b in sorted(bs, reverse=True)])} GiB"
                                                       for s, bs in by_size.items()) + ")")
    return _and(out)


def _oom_runs(weights: str) -> list[tuple[Path, dict]]:
    return [(p, r) for p, r in e2e_records(weights) if r.get("status") == "oom"]


def e2e_streamed_section() -> list:
    """The experts sampled end to end with weights partly offloaded (GGUF A14B), against the reservation
    the estimate makes for them; then the GGUF streaming term set from their eager rows, and its check on the
    whole-prompt records."""
    paths = streamed_files("gguf", ("partial_frag_factor",))
    lines, held_over, _compiled = _streamed_rows(paths)
    ooms = [(p, r) for p, r in _oom_runs("gguf") if not r["config"].get("budget_gib") is None]
    o = ["\n## Partly offloaded end to end (GGUF A14B, H200)\n",
         "The end-to-end runs with weights partly offloaded: " + _describe_files(paths) + ".",
         "Q4_K_M experts with a rank-64 LoRA, part of each expert's weights streamed at every step, eager and",
         "compiled per block. Per expert: the allocated working memory, what the allocator held above it at the",
         "sampling peak (peak reserved − peak allocated), what it held above the resident weights in all, and the",
         "reservation the estimate makes for that configuration with weights partly offloaded (compiled blocks",
         "with streamed weights are reserved as eager, with the partial-load term; eager ones with the GGUF streaming",
         "term below). The compiled rows check `partial_frag_factor`, which was set from other records (the reference",
         "budget run; `bench/tests/test_constants_held_out.py`); the eager rows set the GGUF streaming term. Completed runs",
         "only: " + _and([f"{r['run']} ({commit_of(r)})" for _p, r in ooms]) + " ran out of memory",
         f"([benchmarks.md](benchmarks.md#{anchor('Out of memory')})).\n",
         ] + _streamed_table(lines, held_over)
    o += gguf_stream_term_lines()
    o.append("")
    return o


def gguf_stream_term_lines() -> list:
    """How the GGUF streaming term (``CALIBRATED["gguf_stream_copies"]``) was set from the eager experts of its
    files, and what the whole-prompt experts, which it was not set from, held against the reservation the node
    makes now."""
    copy = gguf_stream_copy_gib()
    copies = CALIBRATED["gguf_stream_copies"]
    need = gguf_stream_need_gib()
    check = []
    for p in files("whole-prompt"):
        for r in rows(p):
            c = r["config"]
            if r.get("status") != "ok" or c.get("weights") != "gguf" or c.get("compile"):
                continue
            est = e2e_estimate(c, q_handed_over=c["attention"] == "sage")
            check += [(held_above_weights(e), est.reservation_partial / GiB) for pr in r["prompts"] if pr["status"] == "ok"
                      for e in pr["experts"].values() if e["resident_frac"] < 0.9999]
    if not need:
        return []
    o = [f"- **The GGUF streaming term.** Eager blocks that stream GGUF weights are reserved for the resident working memory, "
         f"the streamed weight transient and `gguf_stream_copies` = {copies} dequantised copies of the largest Linear "
         f"({copies * copy:.2f} GiB at A14B in bf16), not the partial-load term. It was set from the {len(need)} eager experts above: "
         f"the most any held above the reservation without it was {max(need):+.2f} GiB ({max(need) / copy:.2f} copies), rounded up "
         f"to whole copies. Compiled blocks that stream keep the partial-load term."]
    if check:
        o.append(f"- Checked on the {len(check)} streamed GGUF experts of the whole-prompt records (first and repeat prompts), "
                 f"which it was not set from: they held {_span([h for h, _r in check])} GiB above the resident weights, "
                 f"{_span([h / r for h, r in check])} of the reservation the node makes now "
                 f"(`bench/tests/test_constants_held_out.py`); the reservation was {_span([r / h for h, r in check], '{:.2f}')}× what they held.")
    return o


def e2e_streamed_fp8_section() -> list:
    """The fp8 experts sampled with weights partly offloaded, eager and compiled per block, against the
    reservation the estimate makes for them; the files the cast term was set from left out."""
    paths = streamed_files("fp8", ("partial_frag_factor", "cast_frag_factor"))
    lines, held_over, compiled = _streamed_rows(paths)
    if not lines:
        return []
    streamed = [r["config"] for _p, r in e2e_records("fp8", paths) if r.get("status") == "ok"
                and any(e["resident_frac"] < 0.9999 for e in r["experts"].values())]
    budgets = sorted({c["budget_gib"] for c in streamed}, reverse=True)
    sizes = sorted({(c["width"], c["height"], c["frames"]) for c in streamed})
    o = ["\n## Partly offloaded end to end (fp8 A14B, H200)\n",
         f"fp8 e4m3 experts with a rank-64 LoRA at {_and([format(b, 'g') for b in budgets])} GiB, "
         f"{_and([f'{w}×{h}×{f}' for w, h, f in sizes])}, eager",
         f"and compiled per block ({_and([link(name_of(p)) for p in paths])}). None of these records set a constant,",
         "so they check `partial_frag_factor` and `cast_frag_factor` (`bench/tests/test_constants_held_out.py`).",
         "Columns as in the GGUF table above.\n",
         ] + _streamed_table(lines, held_over)
    if compiled:
        o.append(f"- Compiled per block with streamed weights, the estimate reserves the eager figure with the partial-load term "
                 f"(`COMPILED_STREAMED_NOTE`); what these {len(compiled)} experts held, {_span([h for h, _f in compiled])} GiB above the "
                 f"resident weights, is in the compiled line above. fp8 weights are cast at every call, so with every weight resident "
                 f"their compiled blocks are reserved for as eager ones too (\"Compiled blocks with cast weights\", below).")
    o.append("")
    return o + fp8_hole_lines()


# the fp8 records whose eager estimator samplings show the allocator's holes (held above allocated at the peak)
FP8_HOLE_FILES = ("e2e/fp8-24gib-full-card.jsonl", "e2e/fp8-budgets-16-12gib.jsonl",
                  "whole-prompt/fp8-720p81-4steps-24gib-eager.jsonl", "whole-prompt/fp8-720p81-4steps-16gib-eager.jsonl",
                  "whole-prompt/fp8-720p81-4steps-12gib-eager.jsonl")


def fp8_hole_lines() -> list:
    """What the allocator held above what was allocated at the peak of each eager fp8 expert sampling (estimator
    runs, 1280x720x81), resident and streamed, and the one that ran out of memory: why the cast term is not cut to
    what most runs hold."""
    holes = {True: [], False: []}
    by_config: dict = {}  # (file, run, round) -> holes of its streamed samplings
    expandable: dict = {}  # budget -> holes of the streamed samplings on PyTorch's allocator with expandable segments
    oom = []
    for name in FP8_HOLE_FILES:
        for r in rows(name):
            c = r.get("config") or {}
            if not c.get("estimator") or c.get("compile") or (c.get("width"), c.get("height")) != (1280, 720):
                continue
            for pr in (r.get("prompts") or [r]):
                for e in (pr.get("experts") or {}).values():
                    if e.get("peak_reserved_gib") is None or e.get("peak_alloc_gib") is None:
                        continue
                    hole = e["peak_reserved_gib"] - e["peak_alloc_gib"]
                    if r.get("status") == "oom":
                        oom.append(hole)
                    elif r.get("status") == "ok" and e.get("lowvram") is not None:
                        if "expandable_segments:True" in str((r.get("env") or {}).get("alloc_conf") or ""):
                            if e["lowvram"]:  # another allocator than ComfyUI selects: told apart
                                expandable.setdefault(c.get("budget_gib"), []).append(hole)
                            continue
                        holes[bool(e["lowvram"])].append(hole)
                        if e["lowvram"]:
                            by_config.setdefault((name, r["run"], r.get("round")), []).append(hole)
    if not holes[True] or not holes[False]:
        return []
    spread = [max(v) - min(v) for v in by_config.values() if len(v) > 1]
    frag = fragmentation_bytes(activation_model.PRESETS["wan2.2-a14b"],
                               activation_model.Workload(L=21 * 45 * 80, rows=1, dtype="fp16"),
                               activation_model.WeightSetup(weight_dtype="fp8", streamed=True), True) / GiB
    return ["The allocator's holes around the casts vary more than the 1 GiB the streamed reservation may leave unused.",
            "What cudaMallocAsync held above what was allocated, at the peak of each eager estimator sampling of fp8 A14B at",
            f"1280×720×81 ({_and([link(n) for n in FP8_HOLE_FILES])}): {_span(holes[False])} GiB over "
            f"{len(holes[False])} samplings with every weight resident, {_span(holes[True])} GiB over {len(holes[True])} "
            "with weights streamed"
            + (f"; the sampling that ran out of memory held {max(oom):.2f} GiB above what it had allocated" if oom else "")
            + f". One configuration's streamed samplings spread by up to {max(spread):.2f} GiB, so a cast term cut to what "
            "most runs hold would run out of memory in the runs with the largest holes. It stays above the largest "
            f"measured ({frag:.2f} GiB with the fixed part at this size). It places the weights for the first model "
            "call of a setup's first sampling; from the second call on, the re-plan places them for what the calls "
            "held, holes included, and a later sampling of the same setup starts from what the latest one held "
            f"([the re-plan](attention.md#{anchor('The re-plan between model calls')})). " + measured_plan_text()
            + " " + kept_figure_text()
            + (" On PyTorch's own allocator with expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, "
               "ComfyUI started with `--disable-cuda-malloc`; those runs are left out of the tables) the streamed "
               "samplings held " + "; ".join(f"{_span(v)} GiB at {b:g} GiB" for b, v in sorted(expandable.items()))
               + ": the holes shrink where almost every weight streams, but where part of the weights is resident "
               "they stay of the size the cast term covers, so the cast term does not depend on the allocator." if len(expandable) > 1 else "")
            + cast_buffer_text(), ""]


CAST_BUFFER_RECORDS = "partial-load/void-cast-buffer-h100-9f16f7a.jsonl"


def cast_buffer_text() -> str:
    """The casts written into one reused buffer (bench/cast_buffer.py) against ComfyUI's, from the probe's records:
    the holes of a process's later runs and of its first, at 1280x720x81."""
    ok = [r for r in rows(CAST_BUFFER_RECORDS) if r["status"] == "ok" and r["res"] == "1280x720x81"]
    # the two cast paths as the pack runs them: with Sage, no probe extra (+trim, +warm) and not SDPA
    rs = [r for r in ok if r["lora_rank"] == 64 and _probe_extras(r) == {"sage"}]
    if not rs:
        return ""

    def holes(path, first):
        return [_probe_holes(r) for r in rs
                if r["cast_path"] == path and (r["order_in_process"] == 1) == first]

    def step_gap():  # the largest difference of a buffer run's s/step from a ComfyUI-cast run's of its process
        return max(abs(b["median_2_4_s"] / c["median_2_4_s"] - 1) for b in rs for c in rs
                   if (b["cast_path"], c["cast_path"]) == ("buffer", "comfy") and b["round"] == c["round"])
    buf_gib = max(r.get("cast_buffer_gib", 0) for r in rs)
    return (" Written into one reused buffer instead (ComfyUI's cast step for step, the same values; `bench/cast_buffer.py`, "
            f"`python -m bench.partial_load` with `+castbuf`, fp8 A14B with a rank-64 LoRA on an H100, {link(CAST_BUFFER_RECORDS)}), "
            f"the casts left {_span(holes('buffer', False))} GiB of holes in the runs after a process's first, against "
            f"{_span(holes('comfy', False))} GiB with ComfyUI's casts, with the buffer's own {buf_gib:.2f} GiB allocated "
            f"and a step's seconds within {100 * step_gap():.1f} % of ComfyUI's casts' in each process. But a process's first "
            f"run, the user's first prompt, held {_span(holes('buffer', True))} GiB with the buffer against "
            f"{_span(holes('comfy', True))} GiB with ComfyUI's casts, so the buffer does not let the cast term shrink, and "
            "the pack keeps ComfyUI's casts." + _cast_buffer_steps_text(ok) + _first_run_probes_text(ok))


def _probe_holes(r) -> float:
    """What a probe row's allocator held in holes: its peak reserved less its peak allocated, GiB."""
    return r["peak_reserved_gib"] - r["peak_alloc_gib"]


def _probe_extras(r) -> set:
    """A probe row's extras (``+sage``, ``+trim``, ``+warm``; the cast path is ``cast_path``)."""
    return set(r["config"].split("+")[1:]) - {"castbuf"}


def _first_run_probes_text(ok) -> str:
    """What the load, an emptied cache before the first forward (+trim), a warm-up sampling (+warm) and SDPA in
    place of Sage do to the holes, at 16 GiB with a rank-64 LoRA: the rows with the load's slack read apart."""
    rs = [r for r in ok if r["lora_rank"] == 64 and r["budget_gib"] == 16 and r.get("load_end_slack_gib") is not None]
    if not rs:
        return ""

    def holes(path, extras, first=None):
        return [_probe_holes(r) for r in rs
                if r["cast_path"] == path and _probe_extras(r) == extras
                and (first is None or (r["order_in_process"] == 1) == first)]
    trim, warm = holes("buffer", {"sage", "trim"}, True), holes("buffer", {"sage", "warm"}, True)
    cold = [_probe_holes(r) for r in ok if r["lora_rank"] == 64 and r["budget_gib"] == 16
            and r["cast_path"] == "buffer" and _probe_extras(r) in ({"sage"}, {"sage", "trim"})
            and r["order_in_process"] == 1]
    text = (f" Read apart ({len(rs)} runs at 16 GiB), the load ended with {_span([r['load_end_slack_gib'] for r in rs])} GiB "
            "reserved above what it had allocated, so the holes form in the first forward")
    if trim:
        text += (f"; emptying the allocator's cache between the two (`+trim`) left a first run with the buffer at "
                 f"{_span(trim)} GiB, and the first runs with the buffer and Sage held {_span(cold)} GiB in each of "
                 f"{len(cold)} processes: at one size, budget and process state the holes are the same from run to run")
    if warm:
        later = holes("buffer", {"sage"}, False)
        from .partial_load import WARM_RES
        text += (f"; one step at {'×'.join(map(str, WARM_RES))} under the same budget first (`+warm`: the weights' "
                 f"first load and every layer's first call made before the measured run) left {_span(warm)} GiB"
                 + (f", less, but not a later run's {_span(later)} GiB" if later else ""))
    sdpa_buf, sdpa_comfy = holes("buffer", set()), holes("comfy", set())
    if sdpa_buf and sdpa_comfy:
        text += (f". With SDPA in place of Sage the buffer's runs held {_span(sdpa_buf)} GiB, a process's first run and "
                 f"its second alike, and ComfyUI's casts {_span(sdpa_comfy)} GiB: the buffer's smaller holes after a "
                 "first run come only with Sage's calls, so they depend on how the whole run lays out the pool, not on "
                 "the buffer alone")
    return text + "."


def _cast_buffer_steps_text(ok) -> str:
    """Where the holes of the probe's runs form, from the runs with each step's peaks."""
    stepped = [r for r in ok if r.get("step_peak_reserved_gib")]
    if not stepped:
        return ""
    def by_first_step(r):  # reserved by the end of the first step: the load (where read apart) and its forward
        return max(v for v in (r.get("load_peak_reserved_gib"), r["step_peak_reserved_gib"][0]) if v is not None)
    grown = max(max(r["step_peak_reserved_gib"]) - by_first_step(r) for r in stepped)
    bare = [_probe_holes(r) for r in stepped
            if r["lora_rank"] == 0 and r["cast_path"] == "buffer" and r["order_in_process"] == 1]
    text = (f" With each step's peaks recorded ({len(stepped)} runs), the pool reached its peak reserved in the first "
            f"step, the weights' load and the first forward, and grew by at most {grown:.2f} GiB in the steps after it")
    if bare:
        text += (f"; a process's first run with the buffer and no LoRA held {_span(bare)} GiB, so the LoRA patched into "
                 "the weights as they load is not what makes a first run's holes")
    return text + "."


# the re-plan between model calls (nodes/replan.py): (records, round) of streamed samplings from empty caches
REPLAN_ROUNDS = (("whole-prompt/h100-gguf-720p81-4steps-16gib-compiled-blocks.jsonl", "d"),
                 ("whole-prompt/void-replan-h100-9258b09.jsonl", "a"),
                 ("whole-prompt/h100-gguf-720p81-4steps-12gib-compiled-blocks.jsonl", "b"),
                 ("whole-prompt/h100-gguf-720p81-4steps-12gib-compiled-blocks.jsonl", "c"),
                 ("whole-prompt/void-replan-h100-9258b09.jsonl", "b"),
                 ("whole-prompt/void-replan-h100-9258b09.jsonl", "c"),
                 ("whole-prompt/h100-gguf-720p81-4steps-16gib-compiled-blocks.jsonl", "e"),
                 ("whole-prompt/void-replan-h100-76fdb57.jsonl", "a"),
                 ("whole-prompt/h100-gguf-720p81-4steps-12gib-compiled-blocks.jsonl", "d"),
                 ("whole-prompt/h100-gguf-720p81-4steps-12gib-compiled-blocks.jsonl", "e"))
# the rounds whose re-plan took the lesser of the plan and what the calls held (``replan.measured_reservation``)
MEASURED_PLAN_ROUNDS = (("whole-prompt/h100-fp8-720p81-4steps-16gib-eager.jsonl", "a"),
                        ("whole-prompt/void-measured-plan-h100-3bf14f2.jsonl", "a"))
REPLAN_ROUNDS += MEASURED_PLAN_ROUNDS
# the rounds in which a sampling of a setup seen before started from what the latest one held (nodes/held_record.py)
KEPT_FIGURE_ROUNDS = (("whole-prompt/h100-gguf-720p81-4steps-12gib-eager.jsonl", "a"),
                      ("whole-prompt/h100-fp8-480p81-20steps-16gib-eager.jsonl", "a"),
                      ("whole-prompt/void-kept-figure-h100-68da9e9.jsonl", "a"))
REPLAN_ROUNDS += KEPT_FIGURE_ROUNDS


def _replan_samplings(rounds=None):
    """(file, record, expert record, GiB ComfyUI's free plus the device's outside the pool) of every estimator
    sampling of ``rounds`` (:data:`REPLAN_ROUNDS`)."""
    for name, rnd in REPLAN_ROUNDS if rounds is None else rounds:
        if not path(name).exists():
            continue
        for r in rows(name):
            if r.get("round") != rnd or r.get("status") != "ok" or not r["config"].get("estimator"):
                continue
            for pr in r["prompts"]:
                for ex, e in (pr.get("experts") or {}).items():
                    if pr.get("status") == "ok":
                        out = _outside_pool_gib(r["config"]["budget_gib"], (pr.get("phases") or {}).get(ex)) or 0.0
                        yield name, r, e, COMFY_EXTRA_RESERVED / GiB + out


def _replan_completed() -> str:
    """Whether every prompt of :data:`REPLAN_ROUNDS` completed."""
    prompts = [pr.get("status") for name, rnd in REPLAN_ROUNDS if path(name).exists() for r in rows(name)
               if r.get("round") == rnd for pr in r.get("prompts") or [{"status": r.get("status")}]]
    bad = [x for x in prompts if x != "ok"]
    return (f"All {len(prompts)} prompts of those rounds completed, none out of memory" if not bad else
            f"{len(bad)} of {len(prompts)} prompts of those rounds did not complete ({', '.join(sorted(set(map(str, bad))))})")


def _replan_moves(rounds=None) -> tuple[list, list]:
    """([(file, record, expert record, moves, unused GiB per step)] of the streamed samplings of ``rounds``
    (:data:`REPLAN_ROUNDS`) that moved weights, [(file, record, expert record, least unused GiB)] of the fp8 ones
    sampled eagerly with weights streamed, which moved none)."""
    moved, still = [], []
    for name, r, e, kept in _replan_samplings(rounds):
        b = r["config"]["budget_gib"]
        unused = [b - kept - x for x in e["step_peak_reserved_gib"]]
        if e.get("replan"):  # several moves as one: from the first one's plan to the last one's, the GiB summed
            ms = e["replan"]
            m = dict(ms[0], to_gib=ms[-1]["to_gib"], moved_gib=sum(x["moved_gib"] for x in ms))
            moved.append((name, r, e, m, unused))
        elif r["config"].get("weights") == "fp8" and e["resident_frac"] < 0.9999:
            still.append((name, r, e, min(unused)))
    return moved, still


def measured_plan_summary() -> dict | None:
    """What the re-plan from what the calls held (:data:`MEASURED_PLAN_ROUNDS`) left unused and how the call after
    its move compared with it: samplings, the unused GiB in the first step and at the later steps' peak, each
    move's held-after-the-move less the reservation it placed for (above 0: the call held more), prompts."""
    moved, _ = _replan_moves(MEASURED_PLAN_ROUNDS)
    if not moved:
        return None
    over = []
    for _, r, e, m, _u in moved:
        after = e["step_peak_reserved_gib"][m["call"] - 1] - (e["base_alloc_gib"] + m["moved_gib"])
        over.append(after - m["to_gib"])
    prompts = [pr for name, rnd in MEASURED_PLAN_ROUNDS if path(name).exists() for r in rows(name)
               if r.get("round") == rnd and r["config"].get("estimator") for pr in r.get("prompts") or []]
    return dict(samplings=len(moved), first=[u[0] for *_, u in moved],
                later=[min(u[m["call"] - 1:]) for *_, m, u in moved], over=over,
                sizes=sorted({(r["config"]["width"], r["config"]["height"], r["config"]["frames"],
                               r["config"]["budget_gib"]) for _, r, *_ in moved}),
                prompts=len(prompts), ok=sum(1 for pr in prompts if pr.get("status") == "ok"),
                retries=sum(int(pr.get("alloc_retries") or 0) for pr in prompts))


def measured_plan_text() -> str:
    """One sentence on the re-plan from what the calls held, from :func:`measured_plan_summary`."""
    m = measured_plan_summary()
    if m is None:
        return "The re-plan from what the calls held is not measured yet."
    over = [x for x in m["over"] if x > 0.005]
    where = _and([f"{w}×{h}×{f} at {b:g} GiB" for w, h, f, b in m["sizes"]])
    return (f"Placed for what the calls held (fp8 A14B with a rank-64 LoRA, estimator + Sage + host copy, eager, "
            f"{where}; {_and([link(n) for n, _ in MEASURED_PLAN_ROUNDS])}), {m['samplings']} expert samplings left "
            f"{_span(m['first'])} GiB of the budget unused in the first step (the plan) and {_span(m['later'])} GiB "
            "at the later steps' peak; "
            + (f"in {len(over)} of them the call after the move held up to {max(over):.2f} GiB more than the figure "
               "it was placed for (the holes formed again larger than in the first call), which came out of what "
               "ComfyUI keeps free" if over else "no call after a move held more than the figure it was placed for")
            + f"; {m['ok']} of {m['prompts']} prompts completed, with {m['retries']} allocator retries.")


def started_on_plan(e: dict) -> bool:
    """Whether an expert sampling placed its weights for its plan: the reservation ComfyUI's load read
    (``predicted_working_gib``) is the estimate's (``estimator.reservation_gb``).  Below it, the sampling started
    from what an earlier one of its setup held (the log says so for each: bench/tests/test_kept_figure_records.py)."""
    return abs(e["predicted_working_gib"] - e["estimator"]["reservation_gb"]) < 0.005


def kept_figure_summary() -> dict | None:
    """What the samplings of :data:`KEPT_FIGURE_ROUNDS` left unused: per sampling the unused GiB of each step, those
    that started on the plan apart from those that started from the kept figure; the prompts and their retries."""
    plan, kept, sizes = [], [], set()
    for _, r, e, k in _replan_samplings(KEPT_FIGURE_ROUNDS):
        c = r["config"]
        (plan if started_on_plan(e) else kept).append([c["budget_gib"] - k - x for x in e["step_peak_reserved_gib"]])
        sizes.add((c.get("weights"), c["width"], c["height"], c["frames"], c.get("steps", 4), c["budget_gib"]))
    if not kept:
        return None
    prompts = [pr for name, rnd in KEPT_FIGURE_ROUNDS if path(name).exists() for r in rows(name)
               if r.get("round") == rnd and r["config"].get("estimator") for pr in r.get("prompts") or []]
    return dict(plan=plan, kept=kept, sizes=sorted(sizes), prompts=len(prompts),
                ok=sum(1 for pr in prompts if pr.get("status") == "ok"),
                retries=sum(int(pr.get("alloc_retries") or 0) for pr in prompts))


def kept_figure_text() -> str:
    """One sentence on the samplings that started from what the latest sampling of their setup held."""
    m = kept_figure_summary()
    if m is None:
        return "A sampling that starts from what the latest one of its setup held is not measured yet."
    where = _and([f"{_weights_text(w)} {_size_text((wd, h, f))} {n} steps at {b:g} GiB"
                  for w, wd, h, f, n, b in m["sizes"]])
    return (f"A sampling of a setup seen before starts from what the latest one held, with the same margin "
            f"(`nodes/held_record.py`; on an H100, estimator + Sage + host copy, eager, {where}; "
            f"{_and([link(n) for n, _ in KEPT_FIGURE_ROUNDS])}): the {len(m['kept'])} samplings that did left "
            f"{_span([u[0] for u in m['kept']])} GiB of the budget unused in their first step and at most "
            f"{max(max(u) for u in m['kept']):.2f} GiB in any step; the {len(m['plan'])} that ran their first step on "
            "the plan (the first sampling of a setup in a process with no figure kept for it: the high-noise expert's "
            "first calls time new shapes ungrouped, so the low-noise one's setup, grouped, differed) left "
            f"{_span([u[0] for u in m['plan']])} GiB in it; {m['ok']} of {m['prompts']} prompts completed, with "
            f"{m['retries']} allocator retries. From `c4834ff` on, a grouped setup with no figure of its own starts "
            "from the ungrouped one's, which holds more (not yet measured on a GPU).")


def replan_text() -> str:
    """The re-plan between model calls: what it does, and the span of what it left unused where it ran (the rows
    are in :func:`replan_table`)."""
    moved, still = _replan_moves(tuple(x for x in REPLAN_ROUNDS
                                       if x not in MEASURED_PLAN_ROUNDS and x not in KEPT_FIGURE_ROUNDS))
    text = ("Before each model call after the first the estimator plans the sampling again from what the calls "
            "showed, and where the plan fell by at least ComfyUI's smallest partial load (128 MiB) it loads the "
            "weights the freed room holds through ComfyUI's own `partially_load`, sized as `load_models_gpu` sizes "
            "one, with a budget at which ComfyUI's greedy load keeps every module on the device where it is (a "
            "larger one can set a module that filled a gap to stream where it lies, its merged LoRA applied again "
            "at each call); where it rose it unloads to it (`nodes/replan.py`; only where ComfyUI places a model in "
            "part, and not under ComfyUI's whole-model compile, whose one "
            "graph would compile again for moved weights). The reservation is the lesser of that plan and what the "
            "calls held, holes included (the pool's reserved bytes as the next call begins less what was allocated "
            f"as the call began), with {100 * MEASURED_MARGIN:g} % on top and at least {MEASURED_FLOOR >> 20} MiB; a "
            "call whose allocation was retried or that ran out of memory is not read, and a call that runs out of "
            "memory with the weights placed below the plan runs again once they stand for the plan. ")
    if not moved:
        text += "That is not measured yet"
    else:
        def spans(rows_, compiled):
            first = [u[0] for *_, u in rows_]
            streamed = [min(u[m["call"] - 1:]) for _, _, e, m, u in rows_ if e["resident_end_gib"] < e["weights_gib"] - 1e-3]
            return (f"{_span(first)} GiB unused in the first step" + (", still on the eager floor" if compiled else "")
                    + (f", and {_span(streamed)} GiB at the later steps' peak where weights still streamed" if streamed
                       else ", every weight resident after it"))
        kinds = {}
        for row in moved:
            kinds.setdefault(row[1]["config"].get("weights"), []).append(row)
        said = [f"{_weights_text(k)}: {spans(v, k == 'gguf')}" for k, v in kinds.items()]
        text += (f"Measured on the high-noise expert's first sampling of {len(moved)} first prompts (table: "
                 f"[The re-plan between model calls](#{anchor('The re-plan between model calls')})): "
                 + "; ".join(said) + ". " + _replan_completed())
    text += ". " + measured_plan_text() + " " + kept_figure_text()[:-1]
    if still:
        name, r, e, u = still[0]
        text += (f". An fp8 expert sampled eagerly ({link(name)} round `{r.get('round')}`, {r['config']['budget_gib']:g} "
                 f"GiB) showed nothing that changed its plan and moved nothing: {_span([x[3] for x in still])} GiB "
                 "unused, the allocator's holes around the casts (below)")
    import textwrap  # continued on the bullet's indented lines
    return textwrap.fill(text, width=116, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False,
                         break_long_words=False)[2:]


def replan_table() -> list:
    """The re-plan as it ran: per streamed sampling that moved weights, the plan before and after, the weights
    loaded, and the budget left unused in its first step and at its later steps' peak."""
    moved, _ = _replan_moves()
    if not moved:
        return []
    import textwrap
    o = ["### The re-plan between model calls", "",
         *textwrap.wrap("Each expert sampling that moved weights, caches empty, on H100s. Before the reservation "
                        "took what the calls held (wan-sage before `3bf14f2`): the high-noise expert's first sampling "
                        "of a first prompt, with Wan Compile Blocks (GGUF: its streamed blocks lifted into the "
                        "resident block's graph; fp8 with a LoRA: every block eager). From `3bf14f2` on: every "
                        "sampling of fp8 estimator + Sage + host copy, eager, first and repeat prompts; from `68da9e9` on, GGUF "
                        "too, and a sampling that started from what the latest one of its setup held and moved "
                        "nothing has no row. *Unused*: the "
                        "budget less what ComfyUI keeps free, what the "
                        "device held outside PyTorch's pool and the pool's peak; *later steps*: the least over the "
                        "steps after the move (`bench.render_docs.REPLAN_ROUNDS` lists the rounds).", width=116,
                        break_on_hyphens=False), "",
         "| weights | size | budget | plan before → after the first call | loaded | resident before → after | unused, "
         "first step | unused, later steps | record | wan-sage |",
         "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, r, e, m, unused in sorted(moved, key=lambda x: (x[1]["config"].get("weights") != "gguf",
                                                               -x[1]["config"]["width"] * x[1]["config"]["height"],
                                                               -x[1]["config"]["budget_gib"])):
        c = r["config"]
        size = f"{c['width']}×{c['height']}×{c['frames']}, {c.get('steps', 4)} steps"
        after = 100 * e["resident_end_gib"] / e["weights_gib"]
        label = Path(name).stem + (f" ({r['round']})" if r.get("round") else "")
        o.append(f"| {_weights_text(c.get('weights'))} | {size} | {c['budget_gib']:g} GiB | {m['from_gib']:.2f} → {m['to_gib']:.2f} GiB | "
                 f"{m['moved_gib']:.2f} GiB | {100 * e['resident_frac']:.0f} → {after:.0f} % | {unused[0]:.2f} GiB | "
                 f"{min(unused[m['call'] - 1:]):.2f} GiB | {link(name, label)} | `{commit_of(r)}` |")
    return o + [""]


def e2e_compiled_resident_section() -> list:
    """The compiled end-to-end experts with every weight resident, against the reservation the estimate
    makes for them: per-block compile gets the compiled figure, a whole-model compile the eager one."""
    lines, under, fp8_files = [], [], []
    for p, r in e2e_records():
        c = r["config"]
        if r.get("status") != "ok" or not c.get("compile"):
            continue
        est = e2e_estimate(c)
        for name, e in r["experts"].items():
            if e["resident_frac"] < 0.9999:
                continue
            if c.get("weights") == "fp8" and p not in fp8_files:
                fp8_files.append(p)
            res = est.reservation_resident / GiB
            att = (e.get("attention") or {})
            split = att.get("head_split_calls", 0) if c["attention"] == "sage" else None
            calib = att.get("calibration_ms") if c["attention"] == "sage" else None
            lines.append(f"| `{commit_of(r)}` | {c.get('weights')} | {r['run'].split('@')[0]}@{'full' if c['budget_gib'] is None else format(c['budget_gib'], 'g')} | "
                         f"{size_of(c)} | {'blocks' if compiled_blocks(c) else 'whole model'} | {name} | "
                         f"{'—' if split is None else split} | {'—' if calib is None else format(calib / 1000, '.1f')} | "
                         f"{e['working_gib']:.2f} | {res:.2f} | {e['working_gib'] / res:.2f} |")
            if e["working_gib"] > res:
                under.append((r, name, e["working_gib"], res, calib))
    o = ["\n## Compiled end to end, weights resident (A14B, H200)\n",
         "The compiled end-to-end runs with every weight resident (GGUF, and fp8 in "
         f"{_and([link(name_of(p)) for p in fp8_files])}), against the reservation the estimate",
         "makes for them. Blocks compiled one by one get the compiled figure; ComfyUI's `TorchCompileModel` compiles",
         "the whole model as one graph, whose peak the compiled forward rows (all per block) do not cover, so it is",
         "planned as eager. Working GiB is the sampling peak allocated above what was allocated when sampling started",
         "(GGUF dequantisation and the LoRA included); head-split calls are the Sage calls the memory mode ran grouped;",
         "timing s is the time the dispatcher spent timing kernels on new shapes during that expert's sampling.\n",
         "| wan-sage | weights | run | size | compiled | expert | head-split calls | timing s | working GiB | reservation | working / reservation |",
         "|---|---|---|---|---|---|---:|---:|---:|---:|---:|"] + lines + [""]
    if under:
        o.append("Above the reservation: " + "; ".join(
            f"wan-sage `{commit_of(r)}` {r['run'].split(':')[0]}, {name} expert, {w:.2f} against {res:.2f} GiB"
            for r, name, w, res, _c in under) + ".")
        if all(calib for *_rest, calib in under):
            (cal, settled, out), logs = calibrating_peaks()
            o.append("Each is an expert whose sampling timed kernels on a new shape with a wan-sage from before 67359ad,")
            o.append("whose dispatcher kept one attention output (SDPA's or a faster kernel's) while it timed another, so")
            o.append("that step held one output more than a settled step, which the estimate does not count; ComfyUI's own")
            o.append("extra reserve (400 MiB by default) covered it. Later the dispatcher dropped each output when its timing")
            o.append("run ended and ran the winner once more for the call's output: on the H200 such a call at A14B 720p81")
            o.append(f"held {_gib_range(cal)} GiB above its inputs and a settled call {_gib_range(settled)} GiB (one output: {out:.3f} GiB;")
            o.append(f"gpu tier, {_and([link(x) for x in logs])}, `tests/gpu/test_execution_gpu.py`). Now a new shape is timed on")
            o.append("its own first calls, each running one kernel variant or SDPA for its own output, so none holds more than")
            o.append("a settled call.")
        o.append("")
    return o


def without_cast_rule(config: dict) -> float:
    """The resident reservation (GiB) the estimate would make for an e2e configuration if compiled blocks
    with cast weights kept the compiled figure (``compiled_as_eager`` never answering "cast")."""
    estimate_module = sys.modules["wan_sage.memory.estimate"]  # the module; the package exports a function of that name
    rule = estimate_module.compiled_as_eager

    def streamed_only(w, ws, partial):
        why = rule(w, ws, partial)
        return "" if why == "cast" else why

    with mock.patch.object(estimate_module, "compiled_as_eager", streamed_only):
        return e2e_estimate(config).reservation_resident / GiB


def e2e_compiled_cast_section() -> list:
    """The fp8 experts compiled per block with every weight resident, against what fully resident fp8
    experts held in eager mode and against the reservation made then and today's; the file the cast rule
    was made from apart from the files that check it."""
    source = {p.resolve() for p in set_from("compiled_as_eager")}
    compiled, eager, eager_files = [], [], []
    for p, r in e2e_records("fp8"):
        c = r["config"]
        if r.get("status") != "ok":
            continue
        if compiled_blocks(c):
            today = e2e_estimate(c).reservation_resident / GiB
            compiled += [(p, r, name, e, today) for name, e in r["experts"].items() if e["resident_frac"] >= 0.9999]
        elif not c.get("compile"):
            full = [e for e in r["experts"].values() if e.get("resident_frac", 0) >= 0.9999 and e.get("peak_reserved_gib")]
            eager += full
            if full and p not in eager_files:
                eager_files.append(p)
    if not compiled:
        return []
    o = ["\n## Compiled blocks with cast weights (fp8 A14B, H200)\n",
         "fp8 weights are cast to the compute dtype at every layer call, and the allocator keeps holes around those casts",
         f"(the cast term, `cast_frag_factor`). Fully resident fp8 experts in eager mode at 720p81 ({len(eager)} experts of",
         f"{_and([link(name_of(p)) for p in eager_files])}, under a budget and on the full card) held "
         f"{_span([held_above_start(e) for e in eager])} GiB above what was",
         f"allocated when their sampling started, with {_span([e['working_gib'] for e in eager])} GiB of it allocated. "
         "Compiled per block with every weight resident (held: the same",
         "measure; on the full card the other expert and the text encoder stay loaded, so the weights alone would not do;",
         "reserved then is the estimator's figure in its runs and ComfyUI's own in ComfyUI's; reservation today is what",
         "the estimator of this checkout reserves for the run's configuration):\n",
         "| wan-sage | run | size | expert | working GiB | held above the start | peak reserved / budget GiB | reserved then | reservation today |",
         "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for _p, r, name, e, today in compiled:
        c = r["config"]
        budget = "full" if c["budget_gib"] is None else format(c["budget_gib"], "g")
        o.append(f"| `{commit_of(r)}` | {r['run'].split(':')[0]} | {size_of(c)} | {name} | {e['working_gib']:.2f} | "
                 f"{held_above_start(e):.2f} | {e['peak_reserved_gib']:.2f} / {budget} | {e['predicted_working_gib']:.2f}"
                 f"{' (ComfyUI)' if e.get('reservation_source') == 'comfyui' else ''} | {today:.2f} |")
    made = [x for x in compiled if x[0].resolve() in source]
    checks = [x for x in compiled if x[0].resolve() not in source]
    mp, r, _n, e, _t = max(made, key=lambda x: held_above_start(x[3]))
    o += ["",
          f"In {link(name_of(mp))} (wan-sage `{commit_of(r)}`): under compile the allocated working memory was smaller "
          f"({e['working_gib']:.2f} GiB) but the memory held",
          f"was not ({held_above_start(e):.2f} GiB), and it reached the budget ({e['peak_reserved_gib']:.2f} of {r['config']['budget_gib']:g} GiB) without",
          f"running out. The reservation made then, the compiled figure ({e['predicted_working_gib']:.2f} GiB), was below what was held. So",
          "compiled blocks whose weights are cast at every call are reserved for as eager ones (`COMPILED_CAST_NOTE`,",
          "`memory/estimate.compiled_as_eager`): the right-hand column. No constant changed. That rule was made after seeing",
          "this expert, so its row does not validate it."]
    if checks:
        over = [x for x in checks if held_above_start(x[3]) > x[4]]
        over_names = [f"`{commit_of(x[1])}` {x[1]['run']} {x[2]}" for x in over]
        margin = min(checks, key=lambda x: x[4] - held_above_start(x[3]))
        sizes = sorted({(x[1]["config"]["width"], x[1]["config"]["height"], x[1]["config"]["frames"]) for x in checks})
        check_files = list(dict.fromkeys(x[0] for x in checks))
        short = [(x, without_cast_rule(x[1]["config"])) for x in checks]
        short = [(x, f) for x, f in short if held_above_start(x[3]) > f]
        o += ["",
              f"The check, on the {len(checks)} experts of {_and([link(name_of(p)) for p in check_files])} "
              f"(runs the rule was not made from; {_and([f'{w_}×{h_}×{f_}' for w_, h_, f_ in sizes])}; "
              f"{sum(x[1]['config']['budget_gib'] is None for x in checks)} of them on the full card): they held "
              f"{_span([held_above_start(x[3]) for x in checks])} GiB against today's reservation of "
              f"{_span([x[4] for x in checks])} GiB, "
              + (f"none above it (the closest: {margin[1]['run'].split(':')[0]}'s {margin[2]} expert at "
                 f"{size_of(margin[1]['config'])}, "
                 f"{held_above_start(margin[3]):.2f} against {margin[4]:.2f} GiB)." if not over else
                 f"**{len(over)} above it** ({_and(over_names)}).")]
        o.append("Without the rule, the estimate would reserve the compiled figure for them, and "
                 + ("every one of them would still have fit in it: these runs do not show the rule is needed." if not short else
                    _and([f"{x[1]['run'].split(':')[0]}'s {x[2]} expert at {size_of(x[1]['config'])} "
                          f"({held_above_start(x[3]):.2f} GiB held) would not have fit in it ({f:.2f} GiB)" for x, f in short])
                    + f": {'a run' if len(short) == 1 else 'runs'} the rule was not made from where it was needed."))
    o += ["GGUF weights are dequantised rather than cast, and their compiled resident experts held within the compiled",
          "figure (the table above).", ""]
    return o


# --------------------------------------------------------------------------- docs/benchmarks.md: whole generation

WHOLE_HEADING = "Whole generation"
TE_COPY = "text encoder host copy"  # the Wan Text Encoder Host Copy node on the CLIP (config.te_host_copy)
WHOLE_CONFIGS = ((False, "sdpa"), (False, "sage"), (True, "sdpa"), (True, "sage"), (True, "sage", TE_COPY))
# The weight formats of the README's whole-prompt lines: those the templates load.  fp8 loaded as
# fp8_e4m3fn_fast is measured in docs/benchmarks.md, not recommended.
WHOLE_HEADLINE_WEIGHTS = ("gguf", "fp8")
WHOLE_CONFIG_NAMES = {(False, "sdpa"): "ComfyUI alone + SDPA", (False, "sage"): "ComfyUI alone + Sage",
                      (True, "sdpa"): "estimator + SDPA", (True, "sage"): "estimator + Sage",
                      (True, "sage", TE_COPY): "estimator + Sage + text encoder host copy"}


# A saved workflow's variants (bench.workflow_variants) as the built-in graph's configurations: stock ComfyUI runs
# SDPA; the pack's templates chain the estimator, the Sage patch and the text encoder host copy.
WORKFLOW_VARIANT_CONFIGS = {"comfy": (False, "sdpa"), "template": (True, "sage", TE_COPY),
                            "compilenode": (True, "sage", TE_COPY)}


def whole_config(c: dict) -> tuple:
    """A whole-prompt record's configuration: (estimator, attention), and the text encoder host copy where the
    graph had it; a saved workflow's variant as the configuration its nodes make."""
    if c.get("variant") is not None:
        return WORKFLOW_VARIANT_CONFIGS[c["variant"]]
    return (bool(c.get("estimator")), c.get("attention")) + ((TE_COPY,) if c.get("te_host_copy") else ())


def whole_prompt_files() -> list[Path]:
    """The record files whole-prompt records are read from: ``bench/records/whole-prompt/``, and ``e2e/``
    should such a record be merged into a file there."""
    return files("whole-prompt") + files("e2e")


def whole_sets(paths=None) -> list[dict]:
    """The sets of whole-prompt records (those with ``prompts``), one per machine: per file, or per
    ``round`` of a file that merges several; each with its file, a label and its faithful records."""
    sets = run_sets(whole_prompt_files() if paths is None else paths)
    per_file: dict = {}
    for p, rnd, _rs in sets:
        per_file.setdefault(p, []).append(rnd)
    out = []
    for p, rnd, rs in sets:
        # the tables compare setups on the allocator ComfyUI selects (cudaMallocAsync); a run on another one (an
        # allocator experiment: PyTorch's own with expandable segments) is left out of them and told in the log
        recs = [r for r in rs if r.get("prompts") and r.get("config") and plot_e2e.faithful(r)
                and (r.get("env") or {}).get("allocator") in (None, "cudaMallocAsync")]
        if recs:
            rounds = per_file[p]
            label = p.stem + (f" ({string.ascii_lowercase[rounds.index(rnd)]})" if len(rounds) > 1 else "")
            out.append(dict(file=p, label=label, runs=recs))
    return out


def _whole_workflow(c: dict) -> tuple:
    """What makes two whole-prompt records the same workflow: weights (with a saved workflow's name: its model is
    its own), size, steps, cfg, LoRA, setup, decode (a saved workflow decodes)."""
    weights = c.get("weights") if c.get("workflow") is None else f"{c.get('weights')}:{Path(c['workflow']).stem}"
    return (weights, (c["width"], c["height"], c["frames"]), c.get("steps"), c.get("cfg", 1.0),
            c.get("lora_rank") is not None, _setup(c), bool(c.get("decode")) or c.get("workflow") is not None)


def _weights_text(weights) -> str:
    if ":" in str(weights):  # a saved workflow's: "fp16:Wan 2.2 5B text to video 704p"
        fmt, name = str(weights).split(":", 1)
        return f"the template {name} ({fmt})"
    return {"gguf": "GGUF Q4_K_M", "fp8": "fp8", "fp8_fast": "fp8 as fp8_e4m3fn_fast"}.get(weights, str(weights))


def _whole_workflow_text(wf: tuple) -> str:
    weights, size, steps, cfg, lora, setup, decode = wf
    parts = [_weights_text(weights), _size_text(size), f"{steps} steps"]
    parts += ([f"cfg {cfg:g}"] if cfg != 1.0 else []) + ([] if lora else ["no LoRA"]) + [SETUP_NAMES[setup]]
    return ", ".join(parts) + ("" if decode else ", no decode")


def whole_caches(r: dict) -> str:
    """The caches a process started with: ``kept`` when its folders held files (an earlier process filled
    them), ``the pack's only`` when only the pack's folder was kept and held files (``--caches pack``), else
    ``empty`` (``--caches none``, or the process that filled a kept set); ``wan-sage bench's only`` for the first
    process of a configuration whose pack folder ``wan-sage bench`` filled just before (``--bench-first``)."""
    if r.get("bench_first") and (r.get("process") or {}).get("index") == 1:
        return BENCH_ONLY
    c = r.get("caches") or {}
    if not c.get("filled_at_start"):
        return "empty"
    return PACK_ONLY if c.get("mode") == "pack" else "kept"


def _prompt_median(recs, i: int, key: str, expert: str | None = None):
    vals = []
    for r in recs:
        ps = r.get("prompts") or []
        if len(ps) > i and ps[i].get("status") == "ok":
            v = ps[i].get(key) if expert is None else (ps[i].get(key) or {}).get(expert)
            if v is not None:
                vals.append(v)
    return statistics.median(vals) if vals else None


def _seconds(v, base) -> str:
    """``v`` seconds, and ComfyUI alone's seconds over them when there is a baseline."""
    if v is None:
        return "—"
    return f"{v:.1f} s" + ("" if base is None else f" ({base / v:.2f}×)")


def _record_link(p: Path, label: str) -> str:
    try:
        return link(name_of(p), label)
    except ValueError:       # a file outside bench/records/ (the tests' records)
        return f"`{label}`"


def switched_off_default(c: dict) -> bool:
    """A run with one of the harness's A/B switches off the Sage node's defaults (no NaN/Inf check, a named memory
    mode, no trim after the sampling, more room kept for the decode): measured for what the switch does, left out of
    the tables of the pack."""
    return (c.get("check_finite") is False or bool(c.get("memory_mode")) or c.get("trim_after_sampling") is False
            or bool(c.get("decode_room_extra_gib")))


def _stock_stand_in(by: dict, wf: tuple, budget, caches: str) -> tuple:
    """ComfyUI alone + SDPA of the same set for a row whose own workflow and caches it did not run, where its
    seconds stand for that run, and the words that say so; else (None, None).

    - Caches kept: eager ComfyUI alone + SDPA reads none of the three folders (no timing cache, nothing compiled),
      so its process with them empty is its process with them kept.
    - fp8 loaded as ``fp8_e4m3fn_fast``: stock ComfyUI loads the same fp8 files with the default weight dtype, so
      that is the user's stock run of the workflow.
    - A compiled row: stock ComfyUI runs the same workflow eagerly (the baseline of every whole-prompt target),
      and eager it reads none of the cache folders."""
    stock = (False, "sdpa")
    stock_wf, notes = wf, []
    if wf[0] == "fp8_fast":
        stock_wf = ("fp8", *wf[1:])
        notes.append("the fp8 files loaded with the default weight dtype")
    if wf[5] != "":
        stock_wf = (*stock_wf[:5], "", *stock_wf[6:])
        notes.append("eager")
    for c in (caches, "empty") if caches != "empty" and stock_wf[5] == "" else (caches,):
        if (stock_wf, budget, c, stock) in by and (stock_wf, c) != (wf, caches):
            if c != caches:
                notes.append("caches empty: eager, it reads none of them")
            return by[(stock_wf, budget, c, stock)], "; ".join(notes)
    return None, None


def whole_rows(sets) -> list[dict]:
    """Per set, workflow, budget and caches at the start: each configuration's medians over its processes,
    with ComfyUI alone + SDPA of the same set, workflow, budget and caches as the baseline."""
    out = []
    stock_of_file: dict = {}  # (file, workflow, budget, caches) -> [(set index, set label, records)] of sets with one
    groups = []
    for n, s in enumerate(sets):
        by: dict = {}
        for r in s["runs"]:
            c = r["config"]
            if switched_off_default(c):
                continue
            by.setdefault((_whole_workflow(c), c.get("budget_gib"), whole_caches(r),
                           whole_config(c)), []).append(r)
        for (wf, budget, caches, cfg), recs in by.items():
            if cfg == (False, "sdpa"):
                stock_of_file.setdefault((s["file"], wf, budget, caches), []).append((n, s["label"], recs))
        groups.append((s, by))
    for n, (s, by) in enumerate(groups):
        for (wf, budget, caches, cfg), recs in by.items():
            base, base_set, base_note = by.get((wf, budget, caches, (False, "sdpa"))), None, None
            if base is None and cfg != (False, "sdpa"):
                base, base_note = _stock_stand_in(by, wf, budget, caches)
            if base is None and cfg != (False, "sdpa") and (s["file"], wf, budget, caches) in stock_of_file:
                # a set without ComfyUI alone is compared with the same file's (same workflow, budget and
                # caches; another machine): the last set before it that has one, else the first after it; and says so
                stocks = stock_of_file[(s["file"], wf, budget, caches)]
                _, base_set, base = ([x for x in stocks if x[0] < n] or stocks)[-1 if any(x[0] < n for x in stocks)
                                                                                 else 0]
            figures = {}
            for name, i in (("first", 0), ("repeat", 1)):
                for key in ("to_latent_s", "to_frames_s"):
                    v = _prompt_median(recs, i, key)
                    b = _prompt_median(base, i, key) if base and cfg != (False, "sdpa") else None
                    figures[f"{name}_{key}"] = (v, b)
            starts = [r["process_start_s"] for r in recs if r.get("process_start_s") is not None]
            out.append(dict(set=s, workflow=wf, budget=budget, caches=caches, config=cfg, recs=recs, figures=figures,
                            base_set=base_set, base_note=base_note,
                            first_steps=tuple(_prompt_median(recs, 0, "first_step_s", e) for e in ("high", "low")),
                            start=statistics.median(starts) if starts else None))
    order = lambda x: (x["workflow"][0], -x["workflow"][1][0] * x["workflow"][1][1], x["workflow"][2],  # noqa: E731
                       SETUPS.index(x["workflow"][5]), not x["workflow"][6], x["budget"] is not None, -(x["budget"] or 0),
                       x["caches"] != "empty", WHOLE_CONFIGS.index(x["config"]) if x["config"] in WHOLE_CONFIGS else 9,
                       x["set"]["label"])
    return sorted(out, key=order)


COMPILE_NODE = "Wan Compile Blocks"


def headline_setup(wf: tuple) -> str:
    """The setup the README gives for a whole-prompt workflow (A14B, both experts sharing the schedule): Wan Compile
    Blocks where the payback model the Sage patch's panel reports from (``memory/compile_payback.py``) says that
    compiling, with the pack's compile file kept from an earlier start, pays back within the workflow's steps,
    else eager."""
    weights, size, steps, cfg, *_rest = wf
    dims = activation_model.PRESETS["wan2.2-a14b"]
    tokens = activation_model.tokens(dims, *activation_model.latent_shape(dims, *size)[2:])
    payback = compile_payback(dims, tokens, 1 if cfg == 1.0 else 2, max(1, int(steps or 0) // 2), shared_by=2, kept=True)
    return COMPILE_NODE if payback.pays_back else ""


def headline_rows(ws: list) -> list:
    """The whole-generation rows the README's lines are made of: the estimator + Sage rows of the weight formats
    the templates load, on the H200, against ComfyUI alone.  Per workflow and budget, those of
    :func:`headline_setup` where that setup was measured from empty caches, else the eager ones; a compiled setup's
    rows from empty caches, and the first prompt of a process that started with the pack's folder only where its
    inductor folder kept its path (``bench.e2e.kept_path``: the restart a user makes)."""
    from . import e2e
    cands = [w for w in ws if w["config"][:2] == (True, "sage") and w["workflow"][0] in WHOLE_HEADLINE_WEIGHTS
             and w["workflow"][5] in ("", COMPILE_NODE) and not _h100(w) and w["figures"]["first_to_frames_s"][1]
             and (w["caches"] == "empty" or (w["caches"] == PACK_ONLY and w["workflow"][5]
                                             and all(e2e.kept_path(r.get("caches") or {}) for r in w["recs"])))]
    key = lambda w: (w["workflow"][:5] + w["workflow"][6:], w["budget"])  # noqa: E731  the workflow but its setup
    from_empty: dict = {}
    for w in cands:
        if w["caches"] == "empty":
            from_empty.setdefault(key(w), set()).add(w["workflow"][5])
    out = []
    for w in cands:
        want = headline_setup(w["workflow"])
        if w["workflow"][5] == (want if want in from_empty.get(key(w), ()) else ""):
            out.append(w)
    return out


def whole_headlines(ws: list) -> list:
    """The README's results rows of the whole-generation rows, one per workflow apart from its size (three lines
    for the three workflows; a workflow measured at several sizes names each size in its line): per size and
    budget the prompt to the frames, first and repeat, against ComfyUI alone + SDPA, from empty caches; and where
    a process started with the pack's folder only was measured (a compiled setup), its first prompt too."""
    by = {}
    for w in ws:
        weights, _size, *rest = w["workflow"]
        by.setdefault((weights, *rest), []).append(w)
    out = []
    for group in by.values():
        sizes = list(dict.fromkeys(w["workflow"][1] for w in group))
        per_budget: dict = {}
        restart: dict = {}
        for w in group:  # a budget measured in several sets (machines): the last set of its file, the code as it is
            key = (w["workflow"][1], _budget_text(w["budget"]))
            if w["caches"] == PACK_ONLY:
                restart[key] = w
            else:
                per_budget[key] = w
        parts = []
        for (size, budget), w in per_budget.items():
            (f1, b1), (f2, b2) = w["figures"]["first_to_frames_s"], w["figures"]["repeat_to_frames_s"]
            where = f"{_size_text(size)} {budget}" if len(sizes) > 1 else budget
            later = restart.get((size, budget))
            after = ""
            if later and later["figures"]["first_to_frames_s"][1]:
                f3, b3 = later["figures"]["first_to_frames_s"]
                after = f", after a restart **{b3 / f3:.2f}×**"
            parts.append(f"{where} **{b1 / f1:.2f}× / {b2 / f2:.2f}×**{after}")
        text = _whole_workflow_text(group[0]["workflow"])
        if len(sizes) > 1:
            text = text.replace(f"{_size_text(sizes[0])}, ", "", 1)
        out.append((f"whole prompt: {text}", "; ".join(parts),
                    f"[benchmarks](docs/benchmarks.md#{anchor('Whole generation')})"))
    return out


def whole_headline_table(rows_: list) -> list:
    """The section's headline: the rows the README's results lines are made of (:func:`headline_rows`), one per
    workflow, budget and caches at start (a budget measured in several sets: the last set of its file), to the
    frames, against ComfyUI alone + SDPA."""
    last: dict = {}
    for w in headline_rows(rows_):
        last[(w["workflow"], w["budget"], w["caches"])] = w
    if not last:
        return []
    o = ["The headline, on the H200: per workflow and budget the setup the pack recommends for it (the README's "
         "figures), to the",
         "decoded frames, against ComfyUI alone + SDPA on the same machine; the newest round of each.\n",
         "| workflow | budget | caches at start | first prompt | repeat prompt | ComfyUI alone, first / repeat | record |",
         "|---|---|---|---:|---:|---:|---|"]
    for w in last.values():
        (f1, b1), (f2, b2) = w["figures"]["first_to_frames_s"], w["figures"]["repeat_to_frames_s"]
        stock = "—" if not (b1 and b2) else f"{b1:.1f} / {b2:.1f} s"
        o.append(f"| {_whole_workflow_text(w['workflow'])} | {_budget_text(w['budget'])} | {w['caches']} | "
                 f"{_seconds(f1, b1)} | {_seconds(f2, b2)} | {stock} | {_record_link(w['set']['file'], w['set']['label'])} |")
    return o + [""]


def whole_generation_section(paths=None) -> list:
    """The section of docs/benchmarks.md on the whole prompt as the user waits for it; empty when no record
    has ``prompts``."""
    sets = whole_sets(paths)
    rows_ = whole_rows(sets)
    if not rows_:
        return []
    envs = [r.get("env") or {} for s in sets for r in s["runs"]]
    vals = lambda k: _and(sorted({str(e.get(k)) for e in envs if e.get(k)}))  # noqa: E731
    o = [f"## {WHOLE_HEADING}\n",
         "The time a user waits for a prompt, from pressing Run to the video: from the prompt's first node (text encode,",
         "model loads, both experts' sampling) to the latent, and to the decoded frames. *First prompt*: the first prompt",
         "of a freshly started ComfyUI process, with no warm-up; *repeat prompt*: the next one in the same process with a",
         "new seed, as ComfyUI runs it (the nodes whose inputs did not change are served from its cache, the models stay",
         "loaded). *Caches at start*: the pack's timing cache, TorchInductor's and Triton's folders were *empty* (the first",
         "prompt after installing) or *kept* from an earlier process (the first prompt after a restart); *the pack's only*:",
         "the pack's folder kept, TorchInductor's and Triton's empty (the first prompt after a reboot); *wan-sage bench's",
         "only*: only what `wan-sage bench` wrote just before (its timings and self-test pass). × is ComfyUI",
         "alone + SDPA's seconds over the row's (above 1: faster), same workflow, budget, caches and machine round;",
         "medians where several processes ran. The process's own start (interpreter, ComfyUI's import) is apart, under",
         "*start-up*. `python -m bench.whole_prompt` (bench/README.md) wrote the records, on",
         f"{vals('device')} with torch {vals('torch')} and ComfyUI {vals('comfyui')}; the graph is that of *The case* below.",
         "A record file named `h100-...` was written on the H100, the others on the H200; a row's × is always against",
         "ComfyUI alone on its own machine.\n",
         *whole_headline_table(rows_),
         "Every round:\n",
         "| workflow | budget | caches at start | configuration | first prompt: to the latent | first prompt: to the "
         "frames | repeat prompt: to the latent | repeat prompt: to the frames | first prompt's first step, high / low "
         "| start-up | processes | records | wan-sage |",
         "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for x in rows_:
        f = x["figures"]
        hi, lo = x["first_steps"]
        steps = "—" if hi is None else f"{hi:.1f} / " + ("—" if lo is None else f"{lo:.1f}") + " s"
        start = "—" if x["start"] is None else f"{x['start']:.0f} s"
        against = f" (× against ComfyUI alone + SDPA of ({x['base_set'][-2]}))" if x.get("base_set") else \
            f" (× against ComfyUI alone + SDPA, {x['base_note']})" if x.get("base_note") else ""
        o.append(f"| {_whole_workflow_text(x['workflow'])} | {_budget_text(x['budget'])} | {x['caches']} | "
                 f"{WHOLE_CONFIG_NAMES.get(x['config'], str(x['config']))}{against} | "
                 + " | ".join(_seconds(*f[k]) for k in ("first_to_latent_s", "first_to_frames_s", "repeat_to_latent_s",
                                                         "repeat_to_frames_s"))
                 + f" | {steps} | {start} | "
                 f"{len(x['recs'])} | {_record_link(x['set']['file'], x['set']['label'])} | "
                 f"{', '.join(dict.fromkeys(f'`{commit_of(r)}`' for r in x['recs']))} |")
    return o + [""] + whole_decode_lines(rows_) + whole_compile_lines(rows_) + whole_streamed_budget_lines(rows_) + [""]


def _guard_kind(cause: str) -> str:
    """What a dynamo guard failure of a compiled block was about, in words."""
    if "dispatch key set mismatch" in cause:
        return "a parameter's device (streamed on the CPU, or resident)"
    if "comfy_cast_weights" in cause:
        return "ComfyUI's cast flag of a streamed layer"
    if ".patches is " in cause:
        return "the LoRA patch list on a GGUF parameter"
    return "other guards"


def _count(values, word: str) -> str:
    text = _span(values, "{:d}")
    return f"{text} {word}" + ("" if text == "1" else "s")


def whole_compile_lines(rows_) -> list:
    """Per compiled row: the graphs, recompiles and compile seconds of each prompt, and what the recompiles
    were about."""
    o = []
    for x in rows_:
        if x["workflow"][5] == "":
            continue
        per_prompt, kinds = [], {}
        for name, i in (("first", 0), ("repeat", 1)):
            cs = [r["prompts"][i].get("compile") for r in x["recs"] if len(r["prompts"]) > i
                  and r["prompts"][i].get("status") == "ok" and r["prompts"][i].get("compile")]
            if not cs:
                continue
            per_prompt.append(f"{name} prompt {_count([c.get('unique_graphs', 0) for c in cs], 'graph')}, "
                              f"{_count([c.get('recompiles', 0) for c in cs], 'recompile')}, "
                              f"{_span([c.get('compile_s', 0.0) for c in cs], '{:.1f}')} s compiling")
            for c in cs:
                for e in (c.get("by_expert") or {}).values():
                    for cause, n in (e.get("guard_causes") or {}).items():
                        kinds[_guard_kind(cause)] = kinds.get(_guard_kind(cause), 0) + n
        if per_prompt:
            why = f"; guards that failed: {_and([f'{k} ({n}×)' for k, n in kinds.items()])}" if kinds else ""
            o.append(f"- {_whole_workflow_text(x['workflow'])}, {_budget_text(x['budget'])}, caches {x['caches']}, "
                     f"{WHOLE_CONFIG_NAMES.get(x['config'], str(x['config']))}: {'; '.join(per_prompt)}{why}.")
    if not o:
        return []
    return ["", "What dynamo did in the compiled rows above (both experts of a prompt together):", ""] + o


def _outside_pool_gib(budget: float, phase: dict | None) -> float | None:
    """What the device held outside PyTorch's pool when an expert's sampling began (GiB): the simulated budget
    less the device's free memory and the pool's reservation above the ballast (the CUDA libraries' and the
    kernels' own memory, loaded after the budget was set, as on a real card); None where not recorded."""
    pool = (phase or {}).get("pool_before") or {}
    if "free_gib" not in pool or "reserved_gib" not in pool:
        return None
    return max(0.0, budget - pool["free_gib"] - pool["reserved_gib"])


def _h100(x: dict) -> bool:
    """Whether a whole-generation row's set was measured on the H100 (an ``h100-`` record file)."""
    return x["set"]["file"].name.startswith("h100-")


def whole_streamed_budget_lines(rows_) -> list:
    """Per estimator row whose experts streamed weights: the budget its sampling left unused at its peak beyond
    what ComfyUI keeps free and what the device held outside PyTorch's pool, and its reservation over what the
    allocator held above the resident weights."""
    kept_free = COMFY_EXTRA_RESERVED / GiB
    newest = {}  # the newest set of each workflow, budget, caches and configuration: the code as it is; an H100
    for x in rows_:  # set (an `h100-` file) only where the H200 has none
        if x["config"][0] and x["budget"] is not None:
            key = (x["workflow"], x["budget"], x["caches"], x["config"])
            if key in newest and _h100(x) and not _h100(newest[key]):
                continue
            newest[key] = x
    o = []
    for x in newest.values():
        es = [(e, _outside_pool_gib(x["budget"], (pr.get("phases") or {}).get(name)))
              for r in x["recs"] for pr in r["prompts"] if pr.get("status") == "ok"
              for name, e in (pr.get("experts") or {}).items() if e.get("resident_frac", 1.0) < 0.9999]
        if not es:
            continue
        outside = [v for _e, v in es if v is not None]
        unused = [x["budget"] - kept_free - e["peak_reserved_gib"] - (v or 0.0) for e, v in es]
        over = [e["predicted_working_gib"] / held_above_weights(e) for e, _v in es]
        beside = (f", and the {_span(outside)} GiB the device held outside PyTorch's pool (CUDA libraries and kernels)"
                  if len(outside) == len(es) else "")
        o.append(f"- {_whole_workflow_text(x['workflow'])}, {_budget_text(x['budget'])}, caches {x['caches']}, "
                 f"{WHOLE_CONFIG_NAMES.get(x['config'], str(x['config']))} ({_record_link(x['set']['file'], x['set']['label'])}, "
                 f"{', '.join(dict.fromkeys(f'`{commit_of(r)}`' for r in x['recs']))}): "
                 f"{_span([100 * e['resident_frac'] for e, _v in es], '{:.0f}')} % of the weights resident; at the sampling "
                 f"peak {_span(unused)} GiB of the budget unused beyond the {kept_free:.2f} GiB ComfyUI keeps free{beside}; "
                 f"the reservation {_span(over)}× what the allocator held above the resident weights ({len(es)} expert "
                 f"sampling{'s' if len(es) > 1 else ''}).")
    if not o:
        return []
    return ["", "Where the weights streamed, what the sampling left of the budget, in the newest set of each estimator row above:", ""] + o


def _decode_phases(recs) -> list:
    """(seconds, GiB loaded before, GiB loaded after) of each completed prompt's VAE decode in ``recs``."""
    return [(p["phases"]["decode"]["s"], p["phases"]["decode"].get("loaded_gib_before"),
             p["phases"]["decode"].get("loaded_gib_after")) for r in recs for p in r["prompts"]
            if p.get("status") == "ok" and "decode" in p.get("phases", {})]


def whole_decode_lines(rows_) -> list:
    """The VAE decode after the estimator's sampling, where it took longer than after ComfyUI alone's in the same
    set: its seconds, and the GiB of the diffusion model it evicted (records that say what was loaded)."""
    out = []
    for x in rows_:
        if x["config"] == (False, "sdpa"):
            continue
        base = next((b for b in rows_ if b["set"] is x["set"] and b["workflow"] == x["workflow"]
                     and b["budget"] == x["budget"] and b["caches"] == x["caches"] and b["config"] == (False, "sdpa")), None)
        if base is None:
            continue
        mine, theirs = _decode_phases(x["recs"]), _decode_phases(base["recs"])
        if not mine or not theirs or min(s for s, _b, _a in mine) <= 1.5 * max(s for s, _b, _a in theirs):
            continue
        evicted = [sum(b.values()) - sum(v for k, v in a.items() if k in b) for _s, b, a in mine if b and a]
        out.append(f"- {_whole_workflow_text(x['workflow'])}, {_budget_text(x['budget'])} "
                   f"({x['set']['label']}): the VAE decode after {WHOLE_CONFIG_NAMES.get(x['config'], str(x['config']))}'s "
                   f"sampling took {' / '.join(f'{s:.1f}' for s, _b, _a in mine)} s (first / repeat prompt), after ComfyUI "
                   f"alone's {' / '.join(f'{s:.1f}' for s, _b, _a in theirs)} s"
                   + (f"; it evicted {_span(evicted)} GiB of the diffusion model, which the estimator's reservation had kept "
                      "resident" if evicted else "")
                   + f". ComfyUI frees its own figure for the Wan VAE decode ({comfy_wan_vae_decode_gib(*x['workflow'][1][:2]):.1f} "
                     "GiB here) before decoding, so weights kept resident past the sampling are evicted there "
                     f"([memory model](memory-model.md#{anchor('The VAE decode after the sampling')})).")
    return out


def _wan21_latent(width: int, height: int) -> tuple:
    return (1, 16, 1, height // 8, width // 8)


def comfy_wan_vae_decode_gib(width: int, height: int) -> float:
    """ComfyUI 0.3.64's memory figure for a Wan 2.1 VAE decode in bf16 (comfy/sd.py, ``memory_used_decode``;
    ``memory.vae_decode``), which it frees before decoding; frames do not enter it."""
    return vae_decode.comfy_figure_bytes(_wan21_latent(width, height)) / GiB


def comfy_frees_gib(width: int, height: int) -> float:
    """What ComfyUI frees for that decode: the figure plus 1.1x the VAE's bf16 weights (``memory.vae_decode``)."""
    return vae_decode.comfy_frees_bytes(_wan21_latent(width, height)) / GiB


def conv_workspace_gib(width: int, height: int) -> float:
    """The workspace the estimator keeps beyond that for the decoder's largest convolution (``memory.vae_decode``)."""
    return vae_decode.conv_workspace_bytes(_wan21_latent(width, height)) / GiB


def decode_rooms_gib(width: int, height: int) -> tuple:
    """The rooms the estimator has kept for that decode: what ComfyUI frees, and that plus the workspace."""
    return comfy_frees_gib(width, height), vae_decode.decode_bytes(_wan21_latent(width, height)) / GiB


# --------------------------------------------------------------------------- docs/benchmarks.md

SETUPS = ("", "compile per block", "Wan Compile Blocks", "compile")  # plot_e2e.compile_kind: eager, per block, node, whole
SETUP_NAMES = {"": "eager", "compile per block": "compiled per block", "compile": "compiled whole (TorchCompileModel)",
               "Wan Compile Blocks": "Wan Compile Blocks"}


def e2e_sets() -> list[dict]:
    """The sets of end-to-end run records, one per machine: per record file, or per ``round`` of a file
    that merges several.  Each has its file, a label for tables (the file's stem, with a letter where the
    file holds several sets) and its faithful records, tagged ``_set`` with the label (for bench.plot_e2e)."""
    out = []
    sets = run_sets(files("e2e"))
    per_file = {}
    for p, rnd, _rs in sets:
        per_file.setdefault(p, []).append(rnd)
    for p, rnd, rs in sets:
        rounds = per_file[p]
        label = p.stem + (f" ({string.ascii_lowercase[rounds.index(rnd)]})" if len(rounds) > 1 else "")
        runs = []
        for r in rs:
            if r.get("schema") == plot_e2e.SCHEMA and "config" in r and plot_e2e.faithful(r):
                runs.append(dict(r, _set=label))
        out.append(dict(file=p, label=label, runs=runs))
    return out


def _setup(c: dict) -> str:
    return plot_e2e.compile_kind(c) if c.get("compile") else ""


def _cfg(r: dict) -> tuple:
    c = r["config"]
    return (c.get("weights"), c.get("budget_gib"), (c["width"], c["height"], c["frames"]), _setup(c))


def _median_steps(recs, skip_first=True):
    vals = [plot_e2e._steps_s(r, skip_first) for r in recs if r.get("status") == "ok"]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def _budget_text(b) -> str:
    return "full card" if b is None else f"{b:g} GiB"


def _percent(fr) -> str:
    return ", ".join(f"{f:.0%}" for f in fr)


def _size_text(size) -> str:
    return {(1280, 720, 81): "720p81", (832, 480, 81): "480p81"}.get(tuple(size), "{}×{}×{}".format(*size))


def e2e_pairs(candidate: tuple, baseline: tuple) -> list[dict]:
    """Per set, per configuration (weights, budget, size, setup): the ``candidate`` (estimator, attention)
    against the ``baseline`` (estimator, attention) of the same set, both completed; medians of repeats."""
    out = []
    for s in e2e_sets():
        by = {}
        for r in s["runs"]:
            c = r["config"]
            if switched_off_default(c):
                continue
            by.setdefault((_cfg(r), c["estimator"], c["attention"]), []).append(r)
        for (cfg, est, att), recs in by.items():
            if (est, att) != candidate:
                continue
            base = by.get((cfg, *baseline))
            a, b = _median_steps(base or []), _median_steps(recs)
            if a is None or b is None:
                continue
            out.append(dict(set=s, cfg=cfg, base=base, cand=recs, base_s=a, cand_s=b, ratio=a / b,
                            ratio_all=_median_steps(base, False) / _median_steps(recs, False)))
    return sorted(out, key=_pair_order)


def _pair_order(x: dict) -> tuple:
    """By weights, the full card first and then larger budgets, larger sizes, setup, reservation, set."""
    w, b, size, setup = x["cfg"]
    return (w, b is not None, -(b or 0), -size[0] * size[1], SETUPS.index(setup), x["cand"][0]["config"]["estimator"],
            x["set"]["label"])


def rule_source(p: Path) -> str | None:
    """The rule of the pack a record file was set from, if any (``SET_FROM``): its runs were measured
    before that rule."""
    for rule, names in SET_FROM.items():
        if any(p.resolve() == path(n).resolve() for n in names):
            return rule
    return None


def _resident(recs) -> str:
    fr = [e.get("resident_frac") for r in recs for e in (r.get("experts") or {}).values() if e.get("resident_frac") is not None]
    return _span([100 * f for f in fr], "{:.0f}") + " %" if fr else "—"


def _pair_table(pairs, base_name: str, cand_name: str, reservation: bool = False) -> list:
    o = [f"| weights | budget | size | setup | {'reservation | ' if reservation else ''}{base_name} s/step | {cand_name} s/step | "
         "× after the first step | × all steps | resident (baseline; candidate) | records | wan-sage |",
         "|---|---|---|---|" + ("---|" if reservation else "") + "---:|---:|---:|---:|---|---|---|"]
    for x in pairs:
        w, b, size, setup = x["cfg"]
        src = rule_source(x["set"]["file"])
        res = ("the estimator's | " if x["cand"][0]["config"]["estimator"] else "ComfyUI's | ") if reservation else ""
        o.append(f"| {w} | {_budget_text(b)} | {_size_text(size)} | {SETUP_NAMES[setup]} | {res}{x['base_s']:.3f} | {x['cand_s']:.3f} | "
                 f"**{x['ratio']:.3f}×** | {x['ratio_all']:.3f}× | {_resident(x['base'])}; {_resident(x['cand'])} | "
                 f"{link(name_of(x['set']['file']), x['set']['label'])}{'¹' if src else ''} | "
                 f"{', '.join(dict.fromkeys(f'`{commit_of(r)}`' for r in x['cand']))} |")
    return o


def benchmarks_doc() -> str:
    sets = e2e_sets()
    runs = [r for s in sets for r in s["runs"]]
    envs = [r.get("env") or {} for r in runs]
    vals = lambda k: _and(sorted({str(e.get(k)) for e in envs if e.get(k)}))  # noqa: E731
    est_pairs = e2e_pairs((True, "sage"), (False, "sdpa"))
    o = ["# End-to-end benchmarks: Wan 2.2 A14B in ComfyUI on an H200\n",
         "What the pack does to a whole Wan 2.2 A14B generation in ComfyUI: seconds per step, the weights kept",
         "resident, the memory held and whether a run runs out of memory, by weights (GGUF Q4_K_M, fp8), budget (a",
         "simulated card of 8 to 24 GiB, or the whole H200), size and setup (eager, compiled per block, compiled",
         "whole). Every table is rendered from the run records of [`bench/records/e2e/`](../bench/records/e2e/);",
         "[`bench/records/LOG.md`](../bench/records/LOG.md) has the commands that wrote them.\n",
         f"Measured on one {vals('device')} with torch {vals('torch')} (CUDA {vals('cuda')}), Python {vals('python')}, the",
         f"{vals('allocator')} allocator (what ComfyUI's `main.py` selects), ComfyUI {vals('comfyui')}, ComfyUI-GGUF",
         f"{vals('comfyui_gguf')} and SageAttention built from source for sm90 (thu-ml/SageAttention main at commit",
         f"{vals('sageattention_commit')}; the first records read a build installed without package metadata as version",
         "`unknown`). Every record carries these fields in its `env`.\n"] + whole_generation_section() + [
         "## The case\n",
         "Wan 2.2 T2V A14B, both experts, a rank-64 LoRA on each (standing in for the 4-step Lightning LoRAs), 4 steps",
         "(high-noise expert steps 0–2, low-noise 2–4), euler / simple, cfg 1.0, seed 0, UMT5-XXL encoder loaded and used",
         "first, 1280×720×81 (75,600 tokens; `720p81`) unless a row names another size. Experts as **GGUF Q4_K_M** (9.29",
         "GiB each, through ComfyUI-GGUF's `UnetLoaderGGUF`) and as **fp8 e4m3** (13.31 GiB each, through `UNETLoader`).",
         "*ComfyUI alone* is stock ComfyUI with PyTorch's attention (SDPA) and its own memory reservation; the",
         "*estimator* is the Working-Memory Estimator node, *Sage* the Sage Attention Patch with its defaults.\n",
         "![seconds per step and peak VRAM per configuration](e2e-h200.png)\n",
         "The plot shows the runs of `gguf-24gib-full-card.jsonl`, `fp8-24gib-full-card.jsonl` and",
         "`fp8-24gib-cast-term.jsonl` (`python -m bench.plot_e2e`, bench/README.md).\n",
         "## Per step against stock ComfyUI\n",
         "Estimator + Sage against ComfyUI alone with SDPA, both on one machine (a set of runs: ratios are never taken",
         "across machines), the same weights, budget, size and setup. s/step is the sampler's step callback,",
         "CUDA-synchronised, over both experts; \"after the first step\" leaves out the run's first step, and in a",
         "compiled run each expert's first step, which carries the compile (see *The first step* below); the median",
         "where a set repeats a configuration. ¹: a set a rule of the estimate was set from, so measured before it",
         "(`bench._records.SET_FROM`: the fp8 cast term, the cast rule for compiled blocks).\n"] + _pair_table(est_pairs, "ComfyUI alone + SDPA", "estimator + Sage")
    o += ["\n## Sage against SDPA with the same reservation\n",
          "The Sage patch alone: the same reservation (ComfyUI's own, or the estimator's) with and without the patch.\n"]
    o += _pair_table(sorted(e2e_pairs((False, "sage"), (False, "sdpa")) + e2e_pairs((True, "sage"), (True, "sdpa")), key=_pair_order),
                     "SDPA", "Sage patch", reservation=True)
    o += [""] + residency_section(sets) + oom_section(sets) + compile_e2e_section(sets) + method_section(runs)
    o += all_runs_section(sets)
    return "\n".join(o) + "\n"


def residency_section(sets) -> list:
    o = ["## Residency and headroom under a budget\n",
         "Every completed estimator run under a budget: the share of each expert's weights kept resident (ComfyUI",
         "alone's at the same setting on the same machine beside it, where it ran), the working memory the estimator",
         "reserved against the one measured (the sampling peak allocated above what was allocated when sampling",
         "started; high-noise expert; low-noise expert), and the headroom: the budget minus the highest peak reserved",
         "while an expert sampled. The headroom is *met* when every weight stays resident or less than 1.5 GiB of the",
         f"budget is left, *at the budget* under {plot_e2e.AT_THE_BUDGET_GIB:g} GiB.\n",
         "| weights | budget | size | setup | attention | resident | ComfyUI alone resident | working GiB reserved / measured | headroom GiB | verdict | records |",
         "|---|---|---|---|---|---|---|---|---:|---|---|"]
    lines = []
    for s in sets:
        comfy = {}
        for r in s["runs"]:
            if not r["config"]["estimator"]:
                comfy.setdefault(_cfg(r), []).append(r)
        for r in s["runs"]:
            c = r["config"]
            if not c["estimator"] or r.get("status") != "ok" or c.get("budget_gib") is None:
                continue
            ex = r.get("experts") or {}
            fr = [e.get("resident_frac") for e in ex.values() if e.get("resident_frac") is not None]
            peak = plot_e2e.sampling_peak_reserved(r)
            head = c["budget_gib"] - peak
            full = all(f >= 0.9999 for f in fr)
            verdict = "at the budget" if head < plot_e2e.AT_THE_BUDGET_GIB else ("met" if full or head < 1.5 else "missed")
            pm = "; ".join(f"{plot_e2e._f(e.get('predicted_working_gib'))} / {plot_e2e._f(e.get('working_gib'))}" for e in ex.values())
            alone = comfy.get(_cfg(r))
            w, b, size, setup = _cfg(r)
            lines.append(((w, -b, -size[0] * size[1], SETUPS.index(setup), s["label"]),
                          f"| {w} | {_budget_text(b)} | {_size_text(size)} | {SETUP_NAMES[setup]} | {c['attention']} | "
                          f"{_percent(fr)} | {_percent([e['resident_frac'] for x in alone for e in x['experts'].values() if e.get('resident_frac') is not None]) if alone else '—'} | {pm} | {head:.2f} | "
                          f"{verdict if verdict == 'met' else f'**{verdict}**'} | {link(name_of(s['file']), s['label'])} |"))
    o += [x for _k, x in sorted(lines, key=lambda t: t[0])]
    return o + [""]


def oom_section(sets) -> list:
    est = [(s, r) for s in sets for r in s["runs"] if r["config"]["estimator"]]
    ooms = [(s, r) for s in sets for r in s["runs"] if r.get("status") == "oom"]
    o = ["## Out of memory\n",
         f"**{sum(r.get('status') == 'oom' for _s, r in est)} of {len(est)} estimator runs ran out of memory**; every run",
         "that did, with what ComfyUI alone did at the same setting (any machine):\n",
         "| run | weights | budget | size | setup | failed in | ComfyUI alone at that setting | records | wan-sage | note |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in ooms:
        w, b, size, setup = _cfg(r)
        alone = [x for s2 in sets for x in s2["runs"] if not x["config"]["estimator"] and _cfg(x) == _cfg(r)]
        alone_text = _and(sorted({x.get("status") for x in alone})) if alone else "not run"
        src = rule_source(s["file"])
        o.append(f"| {r['run']} | {w} | {_budget_text(b)} | {_size_text(size)} | {SETUP_NAMES[setup]} | {r.get('failed_phase')} | "
                 f"{alone_text} | {link(name_of(s['file']), s['label'])} | `{commit_of(r)}` | "
                 + (f"{RULE_TEXT[src]} was set from this file's runs |" if src else "|"))
    o += ["",
          "- fp8 with every weight resident at 24 GiB: cudaMallocAsync held about 3.5 GiB of holes around the per-call fp8",
          "  weight casts above the allocated peak, which the estimate then had no room for. The estimate reserves room",
          "  for them since (`cast_frag_factor`, set from that file's runs), and the same configuration completed with it",
          "  (the residency table above).",
          "- Compiled per block at 8 GiB with 1 % of each expert resident: the estimator's report said the run cannot fit",
          "  even fully offloaded, and ComfyUI alone with compiled SDPA ran out of memory there too (inside a compiled",
          "  block; `oom_where`, `oom_memory` and `oom_figures` in its record): compiled streaming at 720p81 needs more",
          "  than 8 GiB with or without the estimator.",
          ""]
    return o


def _e2e_key(r) -> str:
    c = r["config"]
    return (("est" if c["estimator"] else "comfy") + "+" + c["attention"] + ("+" + plot_e2e.compile_kind(c) if c.get("compile") else "")
            + ("@full" if c.get("budget_gib") is None else f"@{c['budget_gib']:g}")
            + ("" if (c["width"], c["height"], c["frames"]) == R720 else f" {c['width']}x{c['height']}x{c['frames']}"))


def _log_lines(p: Path) -> list:
    return gzip.open(p, "rt").read().splitlines() if p.is_file() else []


def log_env(lines: list) -> dict:
    """The ``e2e env`` record of a bench.e2e log."""
    return next((json.loads(x.split(": ", 1)[1]) for x in lines if x.startswith("e2e env: ")), {})


def log_runs(lines: list) -> dict:
    """run -> [(expert, seconds)] of each ``e2e step`` line a bench.e2e log has after its ``e2e run`` line."""
    out, run = {}, None
    for line in lines:
        if line.startswith("e2e run "):
            run = line.split(": ", 1)[1] if ": " in line else None
        elif run and line.startswith("e2e step "):
            expert, rest = line[len("e2e step "):].split(" ", 1)
            out.setdefault(run, []).append((expert, float(rest.split(": ", 1)[1].split(" s", 1)[0])))
    return out


def unrecorded_runs() -> list:
    """(log, env, run, steps) of each run an e2e log shows steps of but no record file holds: a call killed
    at its time limit after the steps and before the run's record was written."""
    recorded = {r["run"] for _p, r in e2e_records()}
    out = []
    for p in sorted((RECORDS / "e2e").glob("*.log.gz")):
        lines = _log_lines(p)
        env = log_env(lines)
        for run, steps in log_runs(lines).items():
            if run not in recorded and steps:
                out.append((p, env, run, steps))
    return out


def compile_e2e_section(sets) -> list:
    """The end-to-end runs of each set with a compiled run: s/step against eager SDPA at the same budget in
    the same set, working memory, compile time, graph breaks, recompiles, head-split calls."""
    def after_first(r):
        return plot_e2e._steps_s(r, skip_first=True)

    def working(r, e):
        return r["experts"][e]["working_gib"]

    o = ["## torch.compile end to end\n",
         "Both experts compiled through ComfyUI: `compile per block` compiles each transformer block on its own",
         "(`set_torch_compile_wrapper` with the keys `diffusion_model.blocks.N`, as per-block compile nodes do),",
         "`compile` is ComfyUI's own `TorchCompileModel` node (the whole diffusion model as one graph), each applied",
         "after the Sage patch so that the compiled model carries it. Each compiled run starts from",
         "`torch._dynamo.reset()`. s/step leaves out each expert's first step, which carries the compile; × eager SDPA",
         "is against ComfyUI alone with eager SDPA at the same budget and size in the same set. Working GiB is the",
         "sampling peak above what was allocated when sampling started, high-noise expert; low-noise expert. Runs",
         "that ran out of memory are in *Out of memory* above. One table per set with a compiled run:"]
    by_set = []
    for s in sets:
        rs = [r for r in s["runs"] if r.get("status") == "ok"]
        if not any(r["config"].get("compile") for r in rs):
            continue
        by = {_e2e_key(r) + f" {r['config']['weights']}": r for r in rs}
        by_set.append((s, by))
        commits = list(dict.fromkeys(commit_of(r) for r in rs))
        o += ["", f"{link(name_of(s['file']), s['label'])} (wan-sage {_and([f'`{x}`' for x in commits])}):\n",
              "| run | weights | resident | s/step | × eager SDPA | working GiB | compile s | graph breaks | recompiles | head-split calls (high; low) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for k, r in by.items():
            c = r.get("compile") or {}
            att = [(r["experts"][e].get("attention") or {}) for e in ("high", "low")]
            split = "; ".join(str(a.get("head_split_calls", "—")) for a in att) if r["config"]["attention"] == "sage" else "—"
            base = by.get("comfy+sdpa@" + k.split("@", 1)[1])  # same budget, size and weights
            ratio = f"{after_first(base) / after_first(r):.3f}" if base else "—"
            res = min(e.get("resident_frac", 1.0) for e in r["experts"].values())
            o.append(f"| {k.rsplit(' ', 1)[0]} | {r['config']['weights']} | {res:.0%} | {after_first(r):.3f} | {ratio} | "
                     f"{working(r, 'high'):.2f}; {working(r, 'low'):.2f} | "
                     f"{format(c['compile_s'], '.1f') if c else '—'} | {c.get('graph_breaks', '—')} | {c.get('recompiles', '—')} | {split} |")
    o.append("")
    # the configurations the reading below compares, found in whichever sets hold them
    for s, by in by_set:
        g = {k.rsplit(" ", 1)[0]: r for k, r in by.items() if k.endswith(" gguf")}
        base, sage_b, sdpa_b = g.get("comfy+sdpa@full"), g.get("comfy+sage+compile per block@full"), g.get("comfy+sdpa+compile per block@full")
        if base and sage_b and sdpa_b:
            o.append(f"- GGUF, full card ({s['label']}): per-block compile + Sage runs at {after_first(base) / after_first(sage_b):.3f}× eager SDPA and "
                     f"{after_first(sdpa_b) / after_first(sage_b):.3f}× per-block compile with SDPA. Its settled expert's working memory equals "
                     f"compiled SDPA's ({working(sage_b, 'low'):.2f} against {working(sdpa_b, 'low'):.2f} GiB): the memory mode ran every Sage call grouped.")
            o.append(f"  The first expert's {working(sage_b, 'high'):.2f} GiB is the step that timed the new shape (ungrouped,")
            o.append("  grouped and SDPA on the real tensors, each only after the memory check for it passed); the estimator")
            o.append("  reserves the ungrouped call until a shape has settled grouped, or until the timing and the self-test")
            o.append("  pass kept from earlier starts say that its first call will settle it grouped.")
        sage24, sdpa24, eager24 = (g.get(k) for k in ("comfy+sage+compile per block@24", "comfy+sdpa+compile per block@24", "comfy+sdpa@24"))
        if sage24 and sdpa24 and eager24:
            split = (sage24["experts"]["low"].get("attention") or {}).get("head_split_calls", 0)
            o.append(f"- GGUF, 24 GiB ({s['label']}): per-block compile + Sage {after_first(eager24) / after_first(sage24):.3f}× eager SDPA and "
                     f"{after_first(sdpa24) / after_first(sage24):.3f}× compiled SDPA, with "
                     + ("every Sage call ungrouped: the process measured the split more than 2 % slower when it timed the shape, so"
                        " the memory mode left it whole," if not split else "the shape settled grouped,")
                     + f" and the working memory is {working(sage24, 'low'):.2f} GiB settled against compiled SDPA's {working(sdpa24, 'low'):.2f}.")
    again = [(s, by[k]) for s, by in by_set for k in by if k == "comfy+sage+compile per block@24 gguf"]
    if len(again) > 1:
        o.append("- The second expert under compile, GGUF per-block compile + Sage at 24 GiB in "
                 + _and([f"{s['label']} (wan-sage `{commit_of(r)}`: {r['compile']['unique_graphs']} graph{'s' * (r['compile']['unique_graphs'] != 1)}, "
                         f"{r['compile']['recompiles']} recompile{'s' * (r['compile']['recompiles'] != 1)}, the low-noise expert's first step "
                         f"{r['experts']['low']['step_s'][0]:.1f} s, {after_first(r):.3f} s/step after it)" for s, r in again])
                 + ". A compiled call names the patch by its settings since 57e0002, so the second expert reuses the first"
                   " expert's graph; a graph that named the patch id recompiled once for it.")
    for s, by in by_set:
        whole = by.get("comfy+sdpa+compile@full gguf")
        if whole:
            o.append(f"- ComfyUI's `TorchCompileModel` compiles the whole diffusion model as one graph: {whole['compile']['compile_s']:.0f} s for the first")
            o.append(f"  expert on the H200 (the second reused the graph: {whole['compile']['unique_graphs']} graph, {whole['compile']['recompiles']} recompiles), "
                     f"{after_first(whole):.3f} s/step after it, working {working(whole, 'low'):.2f} GiB ({s['label']}).")
    for p, env, run, steps in unrecorded_runs():
        first, rest = steps[0][1], [x for _e, x in steps[1:]]
        low_first = next(x for e, x in steps if e == "low")
        o.append(f"- {run} (wan-sage `{env.get('wan_sage_commit')}`): the first step, which compiled the")
        o.append(f"  whole model, took {first:.1f} s, the next {len(rest)} {_span(rest, '{:.2f}')} s; the low-noise expert's first step took {low_first:.2f} s,")
        o.append("  so it ran the graph the high-noise expert compiled. The call was killed at its time limit after its")
        o.append(f"  {len(steps)} steps, before the run's record was written: these figures are the `e2e step` lines of its log,")
        o.append(f"  {link(name_of(p))} (no memory or dynamo counts).")
    o.append("")
    return o


def method_section(runs) -> list:
    inherited = [(r.get("budget") or {}).get("inherited_alloc_gib") for r in runs]
    inherited = [x for x in inherited if x is not None]
    retries = [r.get("alloc_retries") for r in runs if r.get("alloc_retries") is not None]
    ballast = [(r.get("budget") or {}).get("ballast_gib") for r in runs if (r.get("budget") or {}).get("ballast_gib")]
    return ["## How it is measured\n",
            "The harness is `python -m bench.e2e`: real ComfyUI in-process, its own loader, encode, LoRA,",
            "`ModelSamplingSD3`, `KSamplerAdvanced` and `VAEDecode` nodes, under `torch.inference_mode()` as ComfyUI's",
            "executor runs them, the pack's two nodes applied through their own wiring with default settings. The model",
            "files are random weights at real sizes and real key names (random weights exercise the same memory and",
            "compute; `bench/e2e_models.py`, `bench/kquants.py`). On the device, `bench/e2e_h200.sh` installs the carried",
            "wheels and the Sage build, writes the model files and runs a list of run specs, starting no run that could",
            "end after the call's 10 minutes (bench/README.md). A run spec is",
            "`{est|comfy}+{sdpa|sage}[+compile|+compileblocks]@{GB|full}:{res}`: `est` with the Working-Memory Estimator,",
            "`comfy` ComfyUI alone; `sage` with the Sage Attention Patch; `@24` a simulated 24 GB card, `@full` the whole",
            "H200.\n",
            "### The simulated budget\n",
            "`--vram-budget 24` holds a ballast allocation" + (f" ({_span(ballast, '{:.1f}')} GiB here)" if ballast else "")
            + " so that ComfyUI's `get_free_memory()`",
            "reads the budget, checked to within 1 MiB. What ComfyUI decides (which weights stay resident, what it evicts,",
            "how it batches) reads that figure, so the decisions are those of a card of that size. What differs:\n",
            "- **Compute and the host link are the H200's.** An H200 computes several times faster than a 24 GB consumer",
            "  card, and its link to host memory is not a desktop's, so the balance between compute and streamed weights",
            "  differs. Compare ratios within one configuration, not absolute seconds, and expect the estimator's gain from",
            "  keeping weights resident to be larger on a real card.",
            "- **The CUDA context is outside the budget**, as it is outside a real card's free memory; a real 24 GB card",
            "  has about 22.5–23.2 GiB free after its context and desktop, so `@24` is about 1 GiB kinder than a real",
            "  card. The estimator reads the real free memory, so on a real card it keeps fewer weights resident rather",
            "  than running out.",
            "- **One allocator pool.** With cudaMallocAsync the ballast lives in the same pool as everything else;",
            "  fragmentation near the limit can differ slightly from a card that is really that small.",
            "- **Running out is an exception here, as on Linux.** Windows' NVIDIA \"sysmem fallback\" spills to shared",
            "  system memory and carries on many times slower. That cannot be reproduced on Linux: where this harness",
            "  reports out of memory, such a Windows card runs slowly instead.",
            f"- **Nothing was inherited.** Every run started with at most {max(inherited):.3f} GiB still allocated after the previous",
            "  run's models were unloaded (`budget.inherited_alloc_gib`; a run above 0.25 GiB is marked `faithful: false`,",
            "  run again and left out of every table), and "
            + (f"no allocation needed the allocator to free its cache first (`alloc_retries: 0` in all {len(retries)} runs that count them)."
               if not any(retries) else f"{sum(1 for x in retries if x)} of {len(retries)} runs had an allocation that needed the allocator to free its cache first."),
            "",
            "### The first step\n",
            *first_call_lines(),
            *expert_switch_lines(),
            "The harness's warm-up run makes the first Sage calls itself, and the per-step tables give both the all-steps",
            "and the after-the-first ratios: a long-running ComfyUI server pays these once.\n",
            "### What is not measured\n",
            "- A real 24, 16 or 12 GB card, and GPUs other than the H200 and the H100: the budget is simulated (above).",
            "- Trained weights: the random weights have the real shapes, dtypes, quantisation types and LoRA ranks, so",
            "  memory and compute match, but images are noise.",
            "- fp8 with the estimator at 24 GiB, eager, interleaved with ComfyUI alone on one machine with the cast term in",
            "  force: the same-machine ratio of that case is from before the cast term (¹ above).",
            "- Forward-peak rows of a whole-model compile: a whole-model `TorchCompileModel` is planned as eager.",
            "- ComfyUI's own fp8 matmuls (`fp8_e4m3fn_fast`) with Sage. ComfyUI 0.3.64's `fp8_ops` runs its fp8 matmul",
            "  only for a layer in eval mode and leaves the Wan model in training mode (docs/compatibility.md), so the",
            "  fp8_e4m3fn_fast whole-prompt row (estimator + Sage, 480p81, 20 steps) ran the ordinary fp8 path, and its",
            "  gain is Sage's. Row-scaled fp8 matmuls in the compiled blocks were measured and not adopted",
            "  (docs/attention.md, \"fp8 matmuls: measured, not adopted\").",
            "- ComfyUI alone + SDPA with its caches kept: eager, it reads none of the three folders, so the rows with the",
            "  caches kept are compared with its run with them empty on the same machine (and say so).",
            "- A whole prompt of eager estimator + Sage on the full card (the compiled one is in round `h`).",
            ""]


def all_runs_section(sets) -> list:
    o = ["## Every run\n",
         "Every faithful run record, one table per set (one machine). \"Working GiB\" is what the run reserved for one",
         "row (`memory_required`: the estimator's figure with `est`, ComfyUI's own without) against the peak allocated",
         "during sampling minus what was allocated when sampling started. Peaks are for the whole run, above the",
         "ballast."]
    for s in sets:
        if not s["runs"]:
            continue
        o += ["", f"### {s['label']}\n", f"{link(name_of(s['file']))}, wan-sage "
              + _and(list(dict.fromkeys(f"`{commit_of(r)}`" for r in s["runs"]))) + ":\n"]
        o.append(plot_e2e.markdown(s["runs"]).rstrip("\n"))
    o += ["", "### The targets\n",
          "The targets the benchmark was built to, over every set (`bench.plot_e2e.targets`): Sage ≥ 1.20× SDPA with the",
          "estimator at 24 GiB, estimator + Sage ≥ 1.25× ComfyUI alone with SDPA at 24 GiB, Sage ≥ 1.25× SDPA on the full",
          "card (each within one set), never out of memory where ComfyUI alone completes (over all sets), and the",
          "headroom of each estimator run under a budget. \"Met after the first step\" means the target is met only when",
          "each run's first step, which pays the once-per-machine costs, is left out.\n",
          plot_e2e.targets_markdown([r for s in sets for r in s["runs"]]).rstrip("\n")]
    return o + [""]


# --------------------------------------------------------------------------- README.md's results table

README_BLOCK = "results"


def readme_results(summary) -> str:
    """The README's results table: headline figures only, each linking to its docs section."""
    ab = rows("attention/auto-interleaved.jsonl")
    auto720 = next(r for r in ab if r["backend"] == "auto" and r["shape"] == "a14b_720p81_self")
    by = {title: (rs, tot) for title, _n, rs, _l, tot in summary}
    held = [(title, by[title]) for title in ("Eager, held out", "Compiled, held out", "Compiled Sage, held out")]
    n_held = sum(len(rs) for _t, (rs, _tot) in held)
    errs = [p / r["measured"] - 1 for _t, (rs, tot) in held for r, p in zip(rs, tot)]
    under = sum(1 for e in errs if e < 0)
    over = [m for _t, (rs, tot) in held for m in _over_peaks(rs, tot)]
    sets = e2e_sets()
    est = [r for s in sets for r in s["runs"] if r["config"]["estimator"]]
    ooms = [(s, r) for s in sets for r in s["runs"] if r["config"]["estimator"] and r.get("status") == "oom"]

    oom_why = []
    for s, r in ooms:
        alone = [x for s2 in sets for x in s2["runs"] if not x["config"]["estimator"] and _cfg(x) == _cfg(r)]
        w, b, _size, setup = _cfg(r)
        where = f"{w} {SETUP_NAMES[setup].split(' (')[0]} at {_budget_text(b)}"
        if alone and all(x.get("status") == "oom" for x in alone):
            oom_why.append(f"{where}, where ComfyUI alone ran out too")
        elif rule_source(s["file"]):
            oom_why.append(f"{where}, before {RULE_TEXT[rule_source(s['file'])]} set from it")
        else:
            oom_why.append(f"{where}, where ComfyUI alone completed")
    rows_ = whole_headlines(headline_rows(whole_rows(whole_sets())))
    rows_ += [
        ("A14B 720p81 self-attention, `auto` against SDPA", f"**{auto720['ratio']:.2f}×** ({auto720['chosen']})",
         f"[attention](docs/attention.md#{anchor('The `auto` override end to end')})"),
        (f"working-memory model on {n_held} held-out forward peaks", f"**{100 * min(errs):+.1f} % to {100 * max(errs):+.1f} %**"
         + (", never under" if not under else f", {under} under")
         + (f"; above +10 % only peaks under {_ceil2(max(over) / GiB):.2f} GiB" if over else ""),
         f"[memory model](docs/memory-model.md#{anchor('Fit, held-out and check rows')})"),
        ("estimator runs out of memory", f"**{len(ooms)} of {len(est)}**" + (f" ({'; '.join(oom_why)})" if ooms else ""),
         f"[benchmarks](docs/benchmarks.md#{anchor('Out of memory')})"),
    ]
    out = ["| measured on the H200 | result | details |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows_]
    return "\n".join(out)


def replace_block(p: Path, name: str, text: str) -> bool:
    """Put ``text`` between the ``<!-- render_docs: NAME -->`` and ``<!-- /render_docs: NAME -->`` lines
    of ``p`` when both are there, once each; return whether they were."""
    start, end = f"<!-- render_docs: {name} -->", f"<!-- /render_docs: {name} -->"
    lines = p.read_text().split("\n")
    if lines.count(start) != 1 or lines.count(end) != 1:
        return False
    i, j = lines.index(start), lines.index(end)
    p.write_text("\n".join(lines[:i + 1] + text.rstrip("\n").split("\n") + lines[j:]))
    return True


# --------------------------------------------------------------------------- main

def render() -> dict:
    """The rendered pages: path -> text, and the README's results table under ``README_BLOCK``."""
    summary = forward_summary()
    return {"docs/attention.md": attention_doc(), "docs/memory-model.md": memory_doc(summary),
            "docs/benchmarks.md": benchmarks_doc(), README_BLOCK: readme_results(summary)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.render_docs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--print-results", action="store_true", help="print the README's results table too")
    a = ap.parse_args(argv)
    pages = render()
    for rel, text in pages.items():
        if rel != README_BLOCK:
            (ROOT / rel).write_text(text)
            print(rel)
    if replace_block(ROOT / "README.md", README_BLOCK, pages[README_BLOCK]):
        print(f"README.md (the {README_BLOCK} table)")
    else:
        print(f"README.md has no <!-- render_docs: {README_BLOCK} --> block: left as it is")
    if a.print_results:
        print(pages[README_BLOCK])
    return 0


if __name__ == "__main__":
    sys.exit(main())
