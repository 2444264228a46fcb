"""Plot the end-to-end benchmark's JSON lines: seconds per step (each expert) and peak VRAM per configuration.

    python -m bench.plot_e2e results.jsonl [more.jsonl ...] --out docs/e2e-h200.png [--markdown table.md]
    python -m bench.plot_e2e --set A=a1.jsonl,a2.jsonl --set B=b.jsonl --out ... [--markdown ...]

Reads every line that is a ``wan-sage-e2e/1`` run record (other lines, e.g. logs, are skipped; a
repeated configuration keeps every record, shown as ``(run k)``, and the targets take the median).  Left: seconds per step of the high- and low-noise
expert; right: peak allocated and peak reserved above the ballast, the budget as a line, and the
predicted peak (weights resident at the start of sampling plus the reserved working memory, for
the expert with the higher prediction) as a marker.  Runs that ran out of memory are marked OOM.
``--markdown`` also writes the results as a Markdown table and the targets' table; given without
``--out``, it writes only the tables, which need no matplotlib.

A set is the records of one device machine in one sitting: speed ratios are only taken between runs of
one set, since machines of one kind differ by more than the gains measured.  Whether the estimator ran
out of memory where ComfyUI alone completed is checked over all sets, since that is not a ratio.  A record
that carries a ``round`` field (a merged record file holds rows of several machines) belongs to the set
named after its file's set and that field.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

from .e2e import SCHEMA, faithful  # the run record's owner


def load(paths, set_name: str = "") -> list[dict]:
    """Every faithful run record of the files, in order, tagged with its set (``_set``): ``set_name``, and
    the record's ``round`` after it where it has one.  A repeated configuration keeps all its records
    (the tables list each, the targets take the median); a line appended twice counts once."""
    runs, seen = [], set()
    for p in paths:
        for line in Path(p).read_text().splitlines():
            line = line.strip()
            if not line.startswith("{") or line in seen:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("schema") == SCHEMA and "config" in r:
                seen.add(line)
                if not faithful(r):
                    inh = (r.get("budget") or {}).get("inherited_alloc_gib")
                    print(f"plot_e2e: left out {r['run']} ({r['config'].get('weights')}): {inh} GiB was still "
                          "allocated before its ballast, so its budget was not the one named", file=sys.stderr)
                    continue
                r["_set"] = set_name if r.get("round") is None else f"{set_name}{'.' if set_name else ''}{r['round']}"
                runs.append(r)
    return runs


def sets_of(runs: list[dict]) -> list[str]:
    """The set names in order of first appearance."""
    return list(dict.fromkeys(r.get("_set", "") for r in runs))


def compile_kind(c: dict) -> str:
    """'' (eager), 'compile' (ComfyUI's TorchCompileModel: the whole model), 'compile per block' or 'Wan Compile
    Blocks' (the pack's node: per block)."""
    comp = c.get("compile")
    if not comp:
        return ""
    if comp.get("node") == "Wan Compile Blocks":
        return "Wan Compile Blocks"
    return "compile per block" if "diffusion_model.blocks.N" in (comp.get("keys") or []) else "compile"


def _attention_key(c: dict) -> str:
    """The attention part of a configuration's key: ``sdpa`` / ``sage``, with ``-nocheck`` (no NaN/Inf
    check), ``-memory-MODE`` (a named memory mode) and ``+compile`` (TorchCompileModel) or
    ``+compile per block`` where they apply."""
    return (c["attention"] + ("-nocheck" if c.get("check_finite") is False else "")
            + (f"-memory-{c['memory_mode']}" if c.get("memory_mode") else "") + ("+" + compile_kind(c) if c.get("compile") else ""))


def _key(r: dict) -> tuple:
    c = r["config"]
    return (c.get("weights"), c["estimator"], _attention_key(c), c.get("budget_gib"), (c["width"], c["height"], c["frames"]))


def labels(runs: list[dict]) -> list[str]:
    """``label`` of each run, with ``(run k)`` from the second record of a configuration in a set on,
    and the set's name in front when there are several."""
    count, out = {}, []
    several = len(sets_of(runs)) > 1
    for r in runs:
        k = (r.get("_set", ""), _key(r))
        count[k] = count.get(k, 0) + 1
        out.append((f"[{k[0]}] " if several else "") + label(r) + (f" (run {count[k]})" if count[k] > 1 else ""))
    return out


def label(r: dict) -> str:
    c = r["config"]
    res = f"{c['width']}x{c['height']}x{c['frames']}"
    res = {"1280x720x81": "720p81", "832x480x81": "480p81"}.get(res, res)
    b = "full" if c.get("budget_gib") is None else f"{c['budget_gib']:g} GB"
    nocheck = " (no finite check)" if c.get("check_finite") is False else ""
    mode = f" (memory {c['memory_mode']})" if c.get("memory_mode") else ""
    compiled = " + " + compile_kind(c) if c.get("compile") else ""
    return (f"{res} {b} {c.get('weights', '')}\n{'estimator' if c['estimator'] else 'ComfyUI'} + "
            f"{c['attention'].upper()}{nocheck}{mode}{compiled}")


def _sorted(runs: list[dict]) -> list[dict]:
    """Set by set (in order of appearance), then by configuration."""
    at = {name: i for i, name in enumerate(sets_of(runs))}
    return sorted(runs, key=lambda r: (at[r.get("_set", "")],) + _order(r))


def _order(r):
    c = r["config"]
    return (c.get("weights", ""), -(c["width"] * c["height"]), c.get("budget_gib") is None, not c["estimator"],
            compile_kind(c), c["attention"] != "sdpa")


def sage_text(env: dict) -> str:
    """'sageattention 2.x (main d1a57a5)': a source build installed without metadata reads 'unknown'."""
    v, flav, commit = env.get("sageattention"), env.get("sage_flavour"), env.get("sageattention_commit")
    if v in (None, "unknown"):
        v = {"sage2": "2.x", "sage1": "1.x"}.get(flav, "none" if not flav else "?")
    return f"sageattention {v}" + (f" (commit {commit})" if commit and commit != "unknown" else "")


def plot(runs: list[dict], out: str, title: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = _sorted(runs)
    n = len(runs)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(10, 0.75 * n + 3), 12))
    xs = list(range(n))
    w = 0.38
    colors = {"high": "#4C72B0", "low": "#55A868", "alloc": "#C44E52", "reserved": "#DD8452"}
    for i, r in enumerate(runs):
        ex = r.get("experts") or {}
        for j, e in enumerate(("high", "low")):
            v = (ex.get(e) or {}).get("s_per_step")
            if v is not None:
                ax1.bar(i + (j - 0.5) * w, v, w, color=colors[e], label=f"{e}-noise expert" if i == 0 or not ax1.get_legend_handles_labels()[1].count(f"{e}-noise expert") else None)
                ax1.text(i + (j - 0.5) * w, v, f"{v:.1f}", ha="center", va="bottom", fontsize=6)
        if r.get("status") != "ok":
            for ax in (ax1, ax2):
                ax.text(i, 0, "OOM" if r.get("status") == "oom" else r.get("status", "?").upper(), ha="center",
                        va="bottom", color="red", fontsize=9, fontweight="bold", rotation=90)
        pa, pr = r.get("peak_alloc_gib"), r.get("peak_reserved_gib")
        if pa is not None:
            ax2.bar(i - w / 2, pa, w, color=colors["alloc"], label="peak allocated" if i == 0 else None)
            ax2.text(i - w / 2, pa, f"{pa:.1f}", ha="center", va="bottom", fontsize=6)
        if pr is not None:
            ax2.bar(i + w / 2, pr, w, color=colors["reserved"], label="peak reserved" if i == 0 else None)
        b = r["config"].get("budget_gib")
        if b is not None:
            ax2.hlines(b, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                       label="budget (free VRAM seen)" if not any(l == "budget (free VRAM seen)" for l in ax2.get_legend_handles_labels()[1]) else None)
        preds = [e.get("predicted_peak_gib") for e in ex.values() if e and e.get("predicted_peak_gib") is not None]
        if preds:
            ax2.plot([i], [max(preds)], marker="D", color="black", markersize=5,
                     label="predicted peak" if not any(l == "predicted peak" for l in ax2.get_legend_handles_labels()[1]) else None)
    if not any(r.get("peak_alloc_gib") is not None for r in runs):
        ax2.text(0.5, 0.5, "no CUDA memory readings (CPU run)", transform=ax2.transAxes, ha="center")
    for ax, yl in ((ax1, "seconds per step"), (ax2, "GiB (above the ballast)")):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels(runs), rotation=60, ha="right", fontsize=8)
        ax.set_ylabel(yl)
        ax.grid(axis="y", alpha=0.3)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi * 1.25)               # room for the legend above the bars
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax1.set_title("Seconds per step, by expert")
    ax2.set_title("Peak VRAM during the run")
    env = (runs[0].get("env") or {}) if runs else {}
    fig.suptitle(title or f"Wan 2.2 A14B end to end in ComfyUI {env.get('comfyui', '')} on {env.get('device', '?')}\n"
                          f"(torch {env.get('torch', '?')}, {sage_text(env)}, {env.get('date', '')})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _f(x, fmt="{:.2f}"):
    return "—" if x is None else fmt.format(x)


def _calls(a):
    if not a:
        return "—"
    why = ", ".join(f"{k} {v}" for k, v in sorted((a.get("reasons") or {}).items(), key=lambda kv: -kv[1]))
    return f"{a.get('sage_calls', 0)} Sage / {a.get('sdpa_calls', 0)} SDPA" + (f" ({why})" if why else "")


def markdown(runs: list[dict]) -> str:
    """One row per run: result, residency, s/step, denoise time, peaks, predicted vs measured, calls."""
    rows = ["| configuration | result | resident high / low | s/step high / low | s/step after the first | denoise s "
            "| peak alloc / reserved GiB | working GiB predicted / measured (high; low) | attention calls (high) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    runs = _sorted(runs)
    for r, lab in zip(runs, labels(runs)):
        ex = r.get("experts") or {}
        hi, lo = ex.get("high") or {}, ex.get("low") or {}
        res = "ok" if r.get("status") == "ok" else f"**{r.get('status')}** ({r.get('failed_phase')})"
        pm = "; ".join(f"{_f(e.get('predicted_working_gib'))} / {_f(e.get('working_gib'))}" for e in (hi, lo) if e)
        rows.append("| " + " | ".join([
            lab.replace("\n", " · "), res,
            f"{_f(hi.get('resident_frac'), '{:.0%}')} / {_f(lo.get('resident_frac'), '{:.0%}')}",
            f"{_f(hi.get('s_per_step'))} / {_f(lo.get('s_per_step'))}",
            _f(_steps_s(r, True), "{:.3f}"),
            _f(r.get("denoise_s"), "{:.1f}"),
            f"{_f(r.get('peak_alloc_gib'))} / {_f(r.get('peak_reserved_gib'))}",
            pm or "—", _calls(hi.get("attention"))]) + " |")
    return "\n".join(rows) + "\n"


def _find(runs, weights, estimator, attention, budget, res) -> list:
    """Every record of one configuration."""
    return [r for r in runs if _key(r) == (weights, estimator, attention, budget, res)]


def _steps_s(r, skip_first: bool = False):
    """Seconds per step over both experts (the sum of the step times / the number of steps), or None.
    ``skip_first`` leaves out the run's first step (the high-noise expert's first): it pays what a process
    pays once per kernel and shape (Triton compiling SageAttention's quantisation kernels on a machine's
    first Sage call, cuDNN building a plan for a new sequence length), which a long-lived ComfyUI server
    pays once and not per run.  In a compiled run (``config.compile``) each expert compiles its own model
    in its first step, so ``skip_first`` leaves out each expert's first step."""
    if r is None or r.get("status") != "ok":
        return None
    ex = r.get("experts") or {}
    per_expert = [(ex.get(k) or {}).get("step_s") or [] for k in ("high", "low")]
    per_expert += [e.get("step_s") or [] for k, e in ex.items() if k not in ("high", "low")]
    if skip_first and (r.get("config") or {}).get("compile"):
        per_expert = [s[1:] for s in per_expert]
    steps = [t for s in per_expert for t in s]
    if skip_first and not (r.get("config") or {}).get("compile"):
        steps = steps[1:]
    return sum(steps) / len(steps) if steps else None


# Less than this left between the budget and the sampling's peak reserved: the run came within the
# allocator's rounding of running out of memory, which the headroom target must not count as met.
AT_THE_BUDGET_GIB = 0.25


def sampling_peak_reserved(r: dict):
    """The highest peak reserved while an expert sampled (GiB), or the run's peak where the record has no
    expert peaks.  The headroom is the estimator's: at a small budget the run's own peak can be the
    text encoder's, which the estimator does not reserve for."""
    peaks = [e.get("peak_reserved_gib") for e in (r.get("experts") or {}).values() if e.get("peak_reserved_gib") is not None]
    return max(peaks) if peaks else r.get("peak_reserved_gib")


def _estimator_pairs(runs: list[dict], weights: str) -> list[tuple]:
    """(ComfyUI-alone key, estimator key) for every estimator configuration of ``weights`` that ComfyUI
    alone ran at the same budget, size and compile variant: with the same attention where such a run
    exists, else with plain SDPA (ComfyUI without the pack, the baseline the device plan runs)."""
    comfy = {_key(r) for r in runs if r["config"].get("weights") == weights and not r["config"]["estimator"]}
    pairs = []
    for e in sorted({_key(r) for r in runs if r["config"].get("weights") == weights and r["config"]["estimator"]}, key=str):
        same = (e[0], False) + e[2:]
        _attention, plus, kind = e[2].partition("+")          # _attention_key: "+" only before the compile kind
        plain = (e[0], False, "sdpa" + plus + kind) + e[3:]
        if same in comfy:
            pairs.append((same, e))
        elif plain in comfy:
            pairs.append((plain, e))
    return pairs


def targets(runs: list[dict], budget: float = 24.0) -> list[tuple]:
    """The end-to-end targets from the run records: (target, measured, verdict) with verdict ``met``,
    ``met after the first step`` (only when the run's first step, see ``_steps_s``, is left out),
    ``missed`` or ``not measured``.  Speed ratios use seconds per step over both experts and are taken
    within each set; the out-of-memory check pairs configurations over all sets."""
    out = []
    R720 = (1280, 720, 81)
    names = sets_of(runs)
    labs = labels(runs)

    def per_step(recs, skip_first=False):
        return statistics.median(_steps_s(r, skip_first) for r in recs)

    def ratio(name, slow, fast, need):
        ok_s = [r for r in slow if r.get("status") == "ok"]
        ok_f = [r for r in fast if r.get("status") == "ok"]
        if not ok_s or not ok_f:
            why = "; ".join(f"{lab}: {'missing' if not recs else ', '.join(str(r.get('status')) for r in recs)}"
                            for lab, recs, ok in (("baseline", slow, ok_s), ("candidate", fast, ok_f)) if not ok)
            out.append((name, why or "—", "not measured"))
            return
        a, b = per_step(ok_s), per_step(ok_f)
        a2, b2 = per_step(ok_s, True), per_step(ok_f, True)
        verdict = "met" if a / b >= need and a2 / b2 >= need else \
            "met after the first step" if a2 / b2 >= need else "missed"
        n = f" (median of {len(ok_s)} / {len(ok_f)} runs)" if len(ok_s) > 1 or len(ok_f) > 1 else ""
        out.append((name, f"all steps {a:.2f} / {b:.2f} s = {a / b:.3f}×; after the first step "
                          f"{a2:.2f} / {b2:.2f} s = {a2 / b2:.3f}×{n}", verdict))
    for w in sorted({r["config"].get("weights") for r in runs}):
        for name in names:
            rs = [r for r in runs if r.get("_set", "") == name]
            if not any(r["config"].get("weights") == w for r in rs):
                continue
            tag = f"{w}: " + (f"set {name}, " if len(names) > 1 else "")
            ratio(tag + f"estimator, {budget:g} GB, 720p81: Sage ≥ 1.20× SDPA",
                  _find(rs, w, True, "sdpa", budget, R720), _find(rs, w, True, "sage", budget, R720), 1.20)
            ratio(tag + f"estimator + Sage ≥ 1.25× ComfyUI alone with SDPA, {budget:g} GB, 720p81",
                  _find(rs, w, False, "sdpa", budget, R720), _find(rs, w, True, "sage", budget, R720), 1.25)
            ratio(tag + "full card, 720p81: Sage ≥ 1.25× SDPA (ComfyUI's reservation)",
                  _find(rs, w, False, "sdpa", None, R720), _find(rs, w, False, "sage", None, R720), 1.25)
            ratio(tag + "full card, 720p81: estimator + Sage ≥ 1.25× SDPA (the pack's checks keep the gain)",
                  _find(rs, w, False, "sdpa", None, R720), _find(rs, w, True, "sage", None, R720), 1.25)
        tag = f"{w}: " + ("all sets, " if len(names) > 1 else "")
        pairs = _estimator_pairs(runs, w)
        failed = [r for c, e in pairs if any(x.get("status") == "ok" for x in _find(runs, *c))
                  for r in _find(runs, *e) if r.get("status") != "ok"]
        bad = list(dict.fromkeys(label(r).replace("\n", " · ") for r in failed))
        both = [r for c, e in pairs if _find(runs, *c) and all(x.get("status") == "oom" for x in _find(runs, *c))
                for r in _find(runs, *e) if r.get("status") == "oom"]
        both_labels = list(dict.fromkeys(label(r).replace("\n", " · ") for r in both))
        name = tag + "the estimator never runs out of memory where ComfyUI alone completes"
        if pairs:
            n_est = sum(len(_find(runs, *e)) for _c, e in pairs)
            out.append((name, f"{len(pairs)} pair{'s' * (len(pairs) != 1)}, {n_est} estimator run{'s' * (n_est != 1)}" +
                        (f"; out of memory in {len(failed)}: {', '.join(bad)}" if bad else "") +
                        (f"; where ComfyUI alone ran out of memory too, not counted: {', '.join(both_labels)}" if both else ""),
                        "missed" if bad else "met"))
        else:
            out.append((name, "no pair", "not measured"))
        paired = {e for _c, e in pairs}
        alone = [r for r in runs if r["config"].get("weights") == w and r["config"]["estimator"]
                 and r.get("status") == "oom" and _key(r) not in paired]
        if alone:
            out.append((tag + "estimator runs out of memory that ComfyUI alone has not run (same budget, size, compile)",
                        ", ".join(dict.fromkeys(label(r).replace("\n", " · ") for r in alone)), "not measured"))
        for r, lab in zip(runs, labs):
            c = r["config"]
            if c.get("weights") != w or not c["estimator"] or r.get("status") != "ok" or c.get("budget_gib") is None:
                continue
            fr = [e.get("resident_frac") for e in (r.get("experts") or {}).values() if e.get("resident_frac") is not None]
            peak = sampling_peak_reserved(r)
            head = c["budget_gib"] - peak if peak is not None else None
            full = all(f >= 0.9999 for f in fr) if fr else None
            if head is not None and head < AT_THE_BUDGET_GIB:
                verdict = "at the budget"            # a risk, not a saving: the allocator had nothing left
            else:
                verdict = "met" if full or (head is not None and head < 1.5) else "missed"
            out.append((f"{w}: headroom, {lab.replace(chr(10), ' · ')}",
                        f"resident {', '.join(f'{f:.0%}' for f in fr)}; budget − sampling peak reserved "
                        f"{'—' if head is None else f'{head:.2f} GiB'}", verdict))
    return out


def targets_markdown(runs: list[dict], budget: float = 24.0) -> str:
    rows = ["| target | measured | verdict |", "|---|---|---|"]
    rows += [f"| {t} | {m} | {v if v == 'met' else f'**{v}**'} |" for t, m, v in targets(runs, budget)]
    return "\n".join(rows) + "\n"


def _set_arg(text: str) -> tuple:
    name, sep, files = text.partition("=")
    if not sep or not name or not files:
        raise argparse.ArgumentTypeError(f"--set wants NAME=FILE[,FILE...], got {text!r}")
    return name, [f for f in files.split(",") if f]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.plot_e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", nargs="*", help="record files of one set")
    ap.add_argument("--set", dest="sets", type=_set_arg, action="append", default=[], metavar="NAME=FILE[,FILE...]",
                    help="the record files of one named set, one machine's runs (repeat for several; ratios stay within one)")
    ap.add_argument("--out", default=None,
                    help="the PNG to draw; needs matplotlib (default: e2e.png, none when only --markdown is given)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--markdown", default=None, help="also write the results as a Markdown table to this file")
    a = ap.parse_args(argv)
    if not a.jsonl and not a.sets:
        ap.error("give record files, or --set NAME=FILE[,FILE...]")
    runs = load(a.jsonl) if a.jsonl else []
    for name, files in a.sets:
        runs += load(files, name)
    if not runs:
        print("no wan-sage-e2e/1 run records found", file=sys.stderr)
        return 1
    out = a.out or (None if a.markdown else "e2e.png")
    if out and importlib.util.find_spec("matplotlib") is None:
        print(f"plot_e2e: drawing {out} needs matplotlib (pip install matplotlib); "
              "--markdown FILE without --out writes the tables without it", file=sys.stderr)
        return 2
    if out:
        print(plot(runs, out, a.title))
    if a.markdown:
        Path(a.markdown).write_text(markdown(runs) + "\n" + targets_markdown(runs))
        print(a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
