"""The "Whole generation" section of docs/benchmarks.md, rendered from synthetic whole-prompt records in a
temporary folder: first and repeat prompt per workflow, budget and caches, the ratio to ComfyUI alone of the
same set only, decode on and off; no section at all without such records."""
import json

import pytest

from bench import e2e, render_docs

ENV = {"device": "NVIDIA H200", "torch": "2.8.0", "comfyui": "0.3.64", "wan_sage_commit": "abc1234"}


def record(est, att, first, repeat, caches="empty", budget=24.0, decode=True, steps=4, first_step=(19.2, 11.9),
           start=33.0, **extra):
    """A whole-prompt record with the fields the section reads: ``first`` / ``repeat`` are (to the latent, to the
    frames) in seconds."""
    def prompt(name, t):
        return {"prompt": name, "status": "ok", "to_latent_s": t[0], "to_frames_s": t[1] if decode else None,
                "first_step_s": {"high": first_step[0], "low": first_step[1]}}
    return {"schema": "wan-sage-whole-prompt/1", "run": f"{'est' if est else 'comfy'}+{att}@{budget:g}:1280x720x81",
            "status": "ok", "config": {"estimator": est, "attention": att, "budget_gib": budget, "width": 1280, "height": 720,
                                       "frames": 81, "weights": "gguf", "steps": steps, "cfg": 1.0, "lora_rank": 64,
                                       "decode": decode},
            "caches": {"mode": "kept" if caches == "kept" else "none", "filled_at_start": caches == "kept"},
            "process": {"index": 2 if caches == "kept" else 1, "count": 2 if caches == "kept" else 1},
            "process_start_s": start, "prompts": [prompt("first", first), prompt("repeat", repeat)],
            "env": ENV, "commit": ENV["wan_sage_commit"], **extra}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


@pytest.fixture
def files(tmp_path):
    one = _write(tmp_path / "gguf-720p81-24gib.jsonl", [
        record(False, "sdpa", (80.0, 88.8), (64.0, 70.0)),
        record(True, "sage", (80.0, 87.2), (50.0, 56.0)),
        record(True, "sage", (82.0, 89.2), (52.0, 58.0)),                    # a second process: medians
        record(False, "sdpa", (81.0, 88.0), (64.0, 70.0), caches="kept"),
        record(True, "sage", (70.0, 76.5), (50.0, 56.0), caches="kept", first_step=(11.6, 11.5)),
        record(False, "sdpa", (80.0, None), (64.0, None), decode=False),
        record(True, "sage", (64.0, None), (40.0, None), decode=False),
        dict(record(True, "sage", (1.0, 2.0), (1.0, 2.0), budget=16.0), budget={"faithful": False}),   # left out
        {"schema": "wan-sage-e2e/1", "run": "est+sage@24:1280x720x81", "config": {"estimator": True}},   # no prompts
    ])
    # another machine: the estimator's row has no ComfyUI alone of its own set, so no ratio
    two = _write(tmp_path / "gguf-720p81-24gib-other-machine.jsonl", [record(True, "sage", (60.0, 66.0), (40.0, 45.0))])
    return [one, two]


def _rows(lines):
    """The rows of every round (below the headline table, where the section has one)."""
    if "Every round:\n" in lines:
        lines = lines[lines.index("Every round:\n"):]
    return [line for line in lines if line.startswith("| GGUF")]


def test_the_section_has_first_and_repeat_prompt_with_ratios_to_comfyui_alone_of_the_same_set(files):
    lines = render_docs.whole_generation_section(files)
    assert lines[0] == "## Whole generation\n"
    text = " ".join(lines)
    assert "on NVIDIA H200 with torch 2.8.0 and ComfyUI 0.3.64" in text
    rows = _rows(lines)
    assert len(rows) == 7, rows
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    head = [c.strip() for c in lines[lines.index(rows[0]) - 2].strip("|").split("|")]
    assert head[:9] == ["workflow", "budget", "caches at start", "configuration", "first prompt: to the latent",
                        "first prompt: to the frames", "repeat prompt: to the latent", "repeat prompt: to the frames",
                        "first prompt's first step, high / low"]
    by = {(c[0], c[2], c[3], c[11]): c for c in cells}
    wf = "GGUF Q4_K_M, 720p81, 4 steps, eager"
    base = by[(wf, "empty", "ComfyUI alone + SDPA", "`gguf-720p81-24gib`")]
    assert base[1] == "24 GiB" and base[4:8] == ["80.0 s", "88.8 s", "64.0 s", "70.0 s"]     # the baseline: no ratio
    est = by[(wf, "empty", "estimator + Sage", "`gguf-720p81-24gib`")]
    # the median of its two processes against ComfyUI alone's seconds: 80 / 81, 88.8 / 88.2, 64 / 51, 70 / 57
    assert est[4:8] == ["81.0 s (0.99×)", "88.2 s (1.01×)", "51.0 s (1.25×)", "57.0 s (1.23×)"]
    assert est[8] == "19.2 / 11.9 s" and est[9] == "33 s" and est[10] == "2" and est[12] == "`abc1234`"
    kept = by[(wf, "kept", "estimator + Sage", "`gguf-720p81-24gib`")]
    assert kept[4:6] == ["70.0 s (1.16×)", "76.5 s (1.15×)"] and kept[8] == "11.6 / 11.5 s"
    nodecode = by[(wf + ", no decode", "empty", "estimator + Sage", "`gguf-720p81-24gib`")]
    assert nodecode[4:8] == ["64.0 s (1.25×)", "—", "40.0 s (1.60×)", "—"]
    other = by[(wf, "empty", "estimator + Sage", "`gguf-720p81-24gib-other-machine`")]
    assert other[4:8] == ["60.0 s", "66.0 s", "40.0 s", "45.0 s"]               # no ComfyUI alone in its set
    assert "16 GiB" not in text                                              # the record marked not faithful
    # order: decoded before not decoded, empty caches before kept, ComfyUI alone first in each group
    assert [(c[0].endswith("no decode"), c[2], c[3]) for c in cells[:4]] == [
        (False, "empty", "ComfyUI alone + SDPA"), (False, "empty", "estimator + Sage"),
        (False, "empty", "estimator + Sage"), (False, "kept", "ComfyUI alone + SDPA")]


def test_the_headline_is_the_recommended_setup_from_empty_caches_against_its_own_comfyui_alone(files):
    """Above every round: one row per workflow and budget, the estimator + Sage run from empty caches that has
    ComfyUI alone in its own set (not the kept-caches row, not the one without decode, not the other machine's)."""
    lines = render_docs.whole_generation_section(files)
    head = [x for x in lines[:lines.index("Every round:\n")] if x.startswith("| GGUF")]
    assert len(head) == 1, head
    cells = [c.strip() for c in head[0].strip("|").split("|")]
    assert cells[:6] == ["GGUF Q4_K_M, 720p81, 4 steps, eager", "24 GiB", "empty", "88.2 s (1.01×)", "57.0 s (1.23×)",
                         "88.8 / 70.0 s"]
    assert cells[6] == "`gguf-720p81-24gib`"


def test_a_long_workflow_is_a_workflow_of_its_own(tmp_path):
    f = _write(tmp_path / "long.jsonl", [record(False, "sdpa", (300.0, 310.0), (280.0, 290.0), steps=20),
                                          record(True, "sage", (240.0, 250.0), (220.0, 230.0), steps=20),
                                          record(True, "sage", (80.0, 88.0), (60.0, 66.0))])
    rows = _rows(render_docs.whole_generation_section([f]))
    assert any("720p81, 20 steps, eager" in r and "240.0 s (1.25×)" in r for r in rows)
    assert any("720p81, 4 steps, eager" in r and "80.0 s |" in r for r in rows)    # no 4-step ComfyUI alone: no ratio


def test_no_section_without_whole_prompt_records(tmp_path):
    assert render_docs.whole_generation_section([]) == []
    plain = _write(tmp_path / "e2e.jsonl", [{"schema": "wan-sage-e2e/1", "run": "x", "config": {"estimator": True}}])
    assert render_docs.whole_generation_section([plain]) == []
    # the checkout's records: none has prompts yet, so the page has no such section (and no placeholder)
    if not any(r.get("prompts") for s in render_docs.whole_sets() for r in s["runs"]):
        assert render_docs.WHOLE_HEADING not in render_docs.benchmarks_doc()


def test_the_section_comes_first_in_benchmarks_md_when_records_exist(files, monkeypatch):
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: files)
    page = render_docs.benchmarks_doc()
    headings = [line for line in page.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Whole generation" and headings[1] == "## The case"


def test_a_later_round_without_comfyui_alone_is_compared_with_its_files_and_says_so(tmp_path):
    f = _write(tmp_path / "fp8.jsonl", [record(False, "sdpa", (80.0, 88.0), (60.0, 66.0)),
                                         record(True, "sage", (80.0, 88.0), (60.0, 66.0)),
                                         dict(record(True, "sage", (64.0, 80.0), (48.0, 55.0)), round="b")])
    rows = _rows(render_docs.whole_generation_section([f]))
    later = next(r for r in rows if "fp8 (b)" in r)
    assert "estimator + Sage (× against ComfyUI alone + SDPA of (a))" in later
    assert "64.0 s (1.25×)" in later and "55.0 s (1.20×)" in later
    # the README gives a budget's newest set: the later round's ratios, not the first's 1.00×
    heads = render_docs.whole_headlines([w for w in render_docs.whole_rows(render_docs.whole_sets([f]))
                                         if w["config"] == (True, "sage")])
    assert [h[1] for h in heads] == ["24 GiB **1.10× / 1.20×**"]


def test_a_round_without_comfyui_alone_keeps_the_baseline_before_it_when_later_rounds_come(tmp_path):
    recs = [record(False, "sdpa", (80.0, 88.0), (60.0, 66.0)),
            record(True, "sage", (80.0, 88.0), (60.0, 66.0)),
            dict(record(True, "sage", (64.0, 80.0), (48.0, 55.0)), round="b"),
            dict(record(False, "sdpa", (40.0, 44.0), (30.0, 33.0)), round="c"),   # appended later, another machine
            dict(record(True, "sage", (32.0, 40.0), (24.0, 30.0)), round="c")]
    rows = _rows(render_docs.whole_generation_section([_write(tmp_path / "fp8.jsonl", recs)]))
    b = next(r for r in rows if "fp8 (b)" in r)
    assert "(× against ComfyUI alone + SDPA of (a))" in b and "64.0 s (1.25×)" in b
    # with no set before it that has one, the first after it
    rows = _rows(render_docs.whole_generation_section([_write(tmp_path / "fp8-2.jsonl", recs[2:])]))
    first = next(r for r in rows if "64.0 s" in r)
    assert "(× against ComfyUI alone + SDPA of (b))" in first and "64.0 s (0.62×)" in first


def test_a_kept_row_without_comfyui_alone_kept_is_compared_with_its_empty_run_when_eager_and_says_so(tmp_path):
    recs = [record(False, "sdpa", (80.0, 88.0), (60.0, 66.0)),
            record(True, "sage", (66.0, 70.0), (48.0, 52.0), caches="kept")]
    rows = _rows(render_docs.whole_generation_section([_write(tmp_path / "kept.jsonl", recs)]))
    kept = next(r for r in rows if "| kept |" in r)
    assert "(× against ComfyUI alone + SDPA, caches empty: eager, it reads none of them)" in kept
    assert "70.0 s (1.26×)" in kept and "52.0 s (1.27×)" in kept
    # compiled, the caches hold its compiles: no stand-in, no ratio
    compiled = [dict(r, config=dict(r["config"], compile={"kind": "blocks"})) for r in recs]
    rows = _rows(render_docs.whole_generation_section([_write(tmp_path / "kept-compiled.jsonl", compiled)]))
    assert rows and not any("×" in r for r in rows), rows


def test_fp8_as_fp8_e4m3fn_fast_is_compared_with_stock_loading_the_same_files_and_stays_out_of_the_readme(
        tmp_path, monkeypatch):
    fast = record(True, "sage", (80.0, 84.0), (64.0, 67.0), steps=20)
    fast["config"]["weights"] = "fp8_fast"
    stock = record(False, "sdpa", (88.0, 90.8), (73.6, 75.5), steps=20)
    stock["config"]["weights"] = "fp8"
    f = _write(tmp_path / "fp8-20.jsonl", [fast, stock])
    rows = _rows(render_docs.whole_generation_section([f])) + [
        r for r in render_docs.whole_generation_section([f]) if r.startswith("| fp8")]
    row = next(r for r in rows if r.startswith("| fp8 as fp8_e4m3fn_fast"))
    assert "(× against ComfyUI alone + SDPA, the fp8 files loaded with the default weight dtype)" in row
    assert "84.0 s (1.08×)" in row and "67.0 s (1.13×)" in row
    # the README's whole-prompt lines are the formats the templates load; an fp8 row of the same set is there
    plain = record(True, "sage", (70.0, 72.0), (50.0, 52.0), steps=20)
    plain["config"]["weights"] = "fp8"
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [_write(tmp_path / "readme.jsonl",
                                                                           [fast, stock, plain])])
    readme = render_docs.readme_results(render_docs.forward_summary())
    assert "whole prompt: fp8, 832x480x81" not in readme and "fp8_e4m3fn_fast" not in readme
    assert "whole prompt: fp8, 720p81, 20 steps, eager | 24 GiB **1.26× / 1.45×**" in readme, readme


def _experts(resident_frac, peak_reserved, resident, reserved_for):
    e = {"resident_frac": resident_frac, "peak_reserved_gib": peak_reserved, "resident_gib": resident,
         "predicted_working_gib": reserved_for}
    return {"high": e, "low": dict(e, peak_reserved_gib=peak_reserved - 0.1)}


def test_streamed_estimator_rows_say_what_the_sampling_left_of_the_budget_in_their_newest_set(tmp_path):
    def rec(peak, **kw):
        r = record(True, "sage", (66.0, 70.0), (48.0, 52.0), budget=16.0, **kw)
        for p in r["prompts"]:
            p["experts"] = _experts(0.8, peak, 7.4, 8.0)
        return r
    older = dict(rec(12.0), round="a")
    newer = dict(rec(14.5), round="b")
    resident = record(True, "sage", (60.0, 64.0), (45.0, 49.0), budget=24.0)
    for p in resident["prompts"]:
        p["experts"] = _experts(1.0, 20.0, 9.3, 8.0)
    stock = record(False, "sdpa", (88.0, 90.0), (66.0, 69.0), budget=16.0)
    for p in stock["prompts"]:
        p["experts"] = _experts(0.2, 8.9, 1.8, 13.6)
    lines = render_docs.whole_generation_section([_write(tmp_path / "streamed.jsonl", [older, newer, resident, stock])])
    budget = [line for line in lines if "of the budget unused" in line]
    # one line: the newest set of the streamed estimator row; ComfyUI alone and the resident row have none
    assert len(budget) == 1, budget
    line = budget[0]
    assert "(b)" in line and "16 GiB" in line and "80 % of the weights resident" in line
    # 16 - 0.39 - 14.5 = 1.11 and 16 - 0.39 - 14.4 = 1.21; 8.0 / (14.5 - 7.4) = 1.13, 8.0 / (14.4 - 7.4) = 1.14
    assert "1.11–1.21 GiB of the budget unused beyond the 0.39 GiB ComfyUI keeps free;" in line
    assert "the reservation 1.13–1.14× what the allocator held" in line
    # where each expert's start says what the device held outside PyTorch's pool, that is used too
    for p in newer["prompts"]:
        p["phases"] = {name: {"pool_before": {"allocated_gib": 0.03, "reserved_gib": 0.15, "free_gib": 15.65}}
                       for name in ("high", "low")}
    lines = render_docs.whole_generation_section([_write(tmp_path / "streamed.jsonl", [older, newer, resident, stock])])
    line = next(line for line in lines if "of the budget unused" in line)
    # 16 - 15.65 - 0.15 = 0.20 outside the pool: 1.11 - 0.20 = 0.91, 1.21 - 0.20 = 1.01
    assert ("0.91–1.01 GiB of the budget unused beyond the 0.39 GiB ComfyUI keeps free, and the 0.20 GiB the device "
            "held outside PyTorch's pool") in line


def test_a_compiled_row_is_compared_with_comfyui_alone_eager_and_stays_out_of_the_readme(tmp_path, monkeypatch):
    stock = record(False, "sdpa", (78.0, 83.0), (59.0, 63.7), budget=16.0)
    compiled = [dict(record(True, "sage", (81.7, 86.2), (43.8, 48.2), budget=16.0), config=None),
                dict(record(True, "sage", (62.5, 67.1), (44.6, 49.0), budget=16.0, caches="kept"), config=None)]
    for r, base in zip(compiled, (record(True, "sage", (0, 0), (0, 0), budget=16.0),) * 2):
        r["config"] = dict(base["config"], compile={"keys": ["diffusion_model.blocks.N"]})
    f = _write(tmp_path / "per-block.jsonl", [stock] + compiled)
    rows = [r for r in render_docs.whole_generation_section([f]) if r.startswith("| GGUF") and "compiled per block" in r]
    empty = next(r for r in rows if "| empty |" in r)
    kept = next(r for r in rows if "| kept |" in r)
    assert "(× against ComfyUI alone + SDPA, eager)" in empty and "86.2 s (0.96×)" in empty and "48.2 s (1.32×)" in empty
    assert "(× against ComfyUI alone + SDPA, eager; caches empty: eager, it reads none of them)" in kept
    assert "67.1 s (1.24×)" in kept
    # the README's lines are the eager setup the pack recommends: the compiled rows are left out of them
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [f])
    readme = render_docs.readme_results(render_docs.forward_summary())
    whole = [line for line in readme.splitlines() if line.startswith("| whole prompt")]
    assert not any("compiled" in line for line in whole) and "0.96×" not in readme, readme


def test_compiled_rows_say_what_dynamo_did_and_why_it_recompiled(tmp_path):
    r = record(True, "sage", (110.9, 115.6), (67.2, 72.0), budget=12.0)
    r["config"]["compile"] = {"keys": ["diffusion_model.blocks.N"]}
    causes = {"tensor 'x._parameters['bias']' dispatch key set mismatch. expected CPU": 2,
              "not ___dict_contains('comfy_cast_weights', self._modules['ffn'])": 1,
              "a.patches is b.patches": 1}
    r["prompts"][0]["compile"] = {"unique_graphs": 5, "recompiles": 4, "compile_s": 51.39,
                                  "by_expert": {"high": {"guard_causes": causes}, "low": {"guard_causes": {}}}}
    r["prompts"][1]["compile"] = {"unique_graphs": 1, "recompiles": 1, "compile_s": 2.6, "by_expert": {}}
    eager = record(True, "sage", (66.0, 70.0), (48.0, 52.0), budget=12.0)
    lines = render_docs.whole_generation_section([_write(tmp_path / "dynamo.jsonl", [r, eager])])
    said = [line for line in lines if "compiling" in line]
    assert len(said) == 1, said          # the eager row says nothing
    assert "first prompt 5 graphs, 4 recompiles, 51.4 s compiling; repeat prompt 1 graph, 1 recompile, 2.6 s" in said[0]
    assert ("a parameter's device (streamed on the CPU, or resident) (2×), ComfyUI's cast flag of a streamed layer "
            "(1×) and the LoRA patch list on a GGUF parameter (1×)") in said[0]


def test_the_attention_page_quotes_the_first_prompts_compile_seconds_empty_against_kept(tmp_path, monkeypatch):
    def compiled(caches, secs):
        r = record(True, "sage", (80.0, 86.0), (44.0, 48.0), budget=16.0, caches=caches)
        r["config"]["compile"] = {"keys": ["diffusion_model.blocks.N"]}
        r["prompts"][0]["compile"] = {"unique_graphs": 2, "recompiles": 1, "compile_s": secs}
        return r
    f = _write(tmp_path / "kept-compile.jsonl", [compiled("empty", 22.7), compiled("kept", 7.4),
                                                 record(True, "sage", (66.0, 70.0), (48.0, 52.0), budget=16.0)])
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [f])
    assert "22.7 s empty against 7.4 s kept (A14B 720p81, 16 GiB)" in render_docs.kept_compile_text()
    saved = []  # the same pair from a saved workflow's records is named by the workflow, not as the A14B's
    for r in (compiled("empty", 11.4), compiled("kept", 1.6)):
        r["config"].update(workflow="Wan 2.2 5B text to video 704p.json", weights="fp16")
        saved.append(r)
    g = _write(tmp_path / "saved-compile.jsonl", saved)
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [g])
    assert ("11.4 s empty against 1.6 s kept (the template Wan 2.2 5B text to video 704p, 720p81, 16 GiB)"
            in render_docs.kept_compile_text()), render_docs.kept_compile_text()
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [])
    assert render_docs.kept_compile_text() == ""


def test_a_process_that_kept_only_the_packs_caches_is_a_row_of_its_own_against_stock_eager(tmp_path):
    stock = record(False, "sdpa", (78.0, 83.0), (59.0, 63.7), budget=16.0)
    pack = record(True, "sage", (70.0, 75.0), (44.0, 48.0), budget=16.0, caches="kept")
    pack["caches"]["mode"] = "pack"
    pack["config"]["compile"] = {"keys": ["diffusion_model.blocks.N"]}
    lines = render_docs.whole_generation_section([_write(tmp_path / "pack.jsonl", [stock, pack])])
    row = next(line for line in lines if line.startswith("| GGUF") and "compiled per block" in line)
    assert "| the pack's only |" in row and "75.0 s (1.11×)" in row
    assert "(× against ComfyUI alone + SDPA, eager; caches empty: eager, it reads none of them)" in row


def test_the_first_process_after_wan_sage_bench_is_a_row_of_its_own(tmp_path):
    stock = record(False, "sdpa", (78.0, 83.0), (59.0, 63.7), budget=16.0)
    bench = {"s": 35.0, "rc": 0, "command": "wan-sage bench --preset wan2.2-a14b --width 1280 --height 720 --frames 81"}
    first, second = (record(True, "sage", (70.0 + i, 75.0 + i), (44.0, 48.0), budget=16.0, caches="kept", bench_first=bench)
                     for i in (0, 2))
    for i, r in enumerate((first, second), 1):
        r["caches"]["mode"], r["process"] = "pack", {"index": i, "count": 2}
    lines = render_docs.whole_generation_section([_write(tmp_path / "bench.jsonl", [stock, first, second])])
    rows = [line for line in lines if line.startswith("| GGUF") and "estimator" in line]
    assert len(rows) == 2
    assert "| wan-sage bench's only |" in rows[0] and "75.0 s (1.11×)" in rows[0]
    assert "| the pack's only |" in rows[1] and "77.0 s (1.08×)" in rows[1]


def test_compile_seconds_are_compared_within_one_machines_set_and_per_expert_for_the_packs_files(tmp_path, monkeypatch):
    def compiled(caches, secs, by=None, streamed_high=False, rnd=None, mode=None):
        r = record(True, "sage", (80.0, 86.0), (44.0, 48.0), budget=16.0, caches=caches)
        r["config"]["compile"] = {"keys": ["diffusion_model.blocks.N"]}
        r["prompts"][0]["compile"] = {"unique_graphs": 2, "recompiles": 1, "compile_s": secs,
                                      "by_expert": {e: {"compile_s": s} for e, s in (by or {}).items()}}
        r["prompts"][0]["experts"] = {"high": {"resident_frac": 0.47 if streamed_high else 1.0},
                                      "low": {"resident_frac": 1.0}}
        if mode:
            r["caches"]["mode"] = mode
        if rnd:
            r["round"] = rnd
        return r
    f = _write(tmp_path / "kept-compile.jsonl", [
        compiled("empty", 22.7), compiled("kept", 7.4),
        compiled("empty", 40.2, {"high": 22.2, "low": 18.0}, True, "b"),
        compiled("kept", 32.9, {"high": 26.2, "low": 6.7}, True, "b", mode="pack")])
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [f])
    text = render_docs.kept_compile_text()
    assert "22.7 s empty against 7.4 s kept (A14B 720p81, 16 GiB)" in text
    assert "40.2 s empty against 32.9 s with only the pack's folder kept (A14B 720p81, 16 GiB)" in text
    assert "40.2 s empty against 7.4 s kept" not in text and "22.7 s empty against 32.9" not in text
    assert render_docs.pack_expert_text() == (" (the high-noise expert, its weights streamed, 26.2 s against 22.2 s; "
                                              "the low-noise expert, every weight resident, 6.7 s against 18.0 s)")


def test_the_text_encoder_host_copy_is_a_configuration_of_its_own_against_comfyui_alone_of_its_set(tmp_path):
    p = _write(tmp_path / "gguf-720p81-24gib.jsonl", [
        record(False, "sdpa", (80.0, 88.0), (64.0, 70.0)),
        record(True, "sage", (70.0, 77.0), (50.0, 56.0)),
        dict(record(True, "sage", (60.0, 66.0), (50.0, 56.0)),
             config={**record(True, "sage", (0, 0), (0, 0))["config"], "te_host_copy": True}),
    ])
    rows = _rows(render_docs.whole_generation_section([p]))
    mine = [r for r in rows if "| estimator + Sage + text encoder host copy |" in r]
    plain = [r for r in rows if "| estimator + Sage |" in r]
    assert len(mine) == 1 and len(plain) == 1
    assert "60.0 s (1.33×)" in mine[0] and "66.0 s (1.33×)" in mine[0]
    assert "70.0 s (1.14×)" in plain[0]


def _compiled(rec, pack_only=False, fresh_dir=f"/tmp/caches/{e2e.PACK_TEMP}"):
    rec["config"]["compile"] = {"node": "Wan Compile Blocks"}
    if pack_only:
        rec["caches"] = {"mode": "pack", "filled_at_start": True, "fresh_dir": fresh_dir}
        rec["process"] = {"index": 2, "count": 2}
    return rec


def test_the_readme_gives_the_compile_node_where_the_payback_model_says_it_pays_back_and_eager_elsewhere(
        tmp_path, monkeypatch):
    recs = []
    for steps in (4, 20):
        recs += [record(False, "sdpa", (90.0, 100.0), (80.0, 90.0), steps=steps),
                 record(True, "sage", (75.0, 80.0), (65.0, 72.0), steps=steps),
                 _compiled(record(True, "sage", (76.0, 82.0), (55.0, 60.0), steps=steps)),
                 _compiled(record(True, "sage", (66.0, 71.0), (55.0, 60.0), steps=steps), pack_only=True)]
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [_write(tmp_path / "w.jsonl", recs)])
    readme = render_docs.readme_results(render_docs.forward_summary())
    # 4 steps of 1280x720x81 (2 per expert) do not pay back even the kept graph's 5 s: eager
    assert "whole prompt: GGUF Q4_K_M, 720p81, 4 steps, eager | 24 GiB **1.25× / 1.25×** |" in readme, readme
    # 20 steps do: the node, from empty caches, and the first prompt after a restart with the pack's file
    assert ("whole prompt: GGUF Q4_K_M, 720p81, 20 steps, Wan Compile Blocks | 24 GiB **1.22× / 1.50×**, "
            "after a restart **1.41×** |") in readme, readme
    # a workflow whose compiled setup was not measured keeps its eager line
    only_eager = [r for r in recs if not r["config"].get("compile")]
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [_write(tmp_path / "e.jsonl", only_eager)])
    readme = render_docs.readme_results(render_docs.forward_summary())
    assert "whole prompt: GGUF Q4_K_M, 720p81, 20 steps, eager | 24 GiB **1.25× / 1.25×** |" in readme, readme


def test_a_budget_whose_compiled_setup_ran_only_after_a_restart_keeps_its_eager_line(tmp_path, monkeypatch):
    recs = []
    for budget in (24.0, 16.0):
        recs += [record(False, "sdpa", (90.0, 100.0), (80.0, 90.0), steps=20, budget=budget),
                 record(True, "sage", (75.0, 80.0), (65.0, 72.0), steps=20, budget=budget)]
    recs += [_compiled(record(True, "sage", (76.0, 82.0), (55.0, 60.0), steps=20)),
             _compiled(record(True, "sage", (66.0, 71.0), (55.0, 60.0), steps=20, budget=16.0), pack_only=True),
             # a restart whose inductor folder had a new path (the harness before it kept one): not evidence
             _compiled(record(True, "sage", (60.0, 62.0), (55.0, 60.0), steps=20), pack_only=True,
                       fresh_dir=".e2e/e2e-work/caches-pack-2rm8g23x")]
    monkeypatch.setattr(render_docs, "whole_prompt_files", lambda: [_write(tmp_path / "w.jsonl", recs)])
    readme = render_docs.readme_results(render_docs.forward_summary())
    assert "whole prompt: GGUF Q4_K_M, 720p81, 20 steps, Wan Compile Blocks | 24 GiB **1.22× / 1.50×** |" in readme
    assert "whole prompt: GGUF Q4_K_M, 720p81, 20 steps, eager | 16 GiB **1.25× / 1.25×** |" in readme, readme
    assert "after a restart" not in readme


def test_a_saved_workflows_variants_are_rows_of_its_own_workflow_with_ratios_to_its_stock_variant(tmp_path):
    """bench.whole_prompt --workflow records: the variant is the configuration (comfy: ComfyUI alone; template: the
    pack's nodes), the workflow is the saved file's (its own model, decoded), compared with its own stock run."""
    def wf(variant, first, repeat):
        return {"schema": e2e.WHOLE_SCHEMA, "run": f"T/{variant}@24", "status": "ok", "workflow": "T.json",
                "config": {"workflow": "T.json", "variant": variant, "budget_gib": 24.0, "width": 1280, "height": 704,
                           "frames": 121, "steps": 20, "cfg": 5.0, "weights": "fp16"},
                "caches": {"mode": "none"}, "process": {"index": 1, "count": 1},
                "budget": {"requested_gib": 24.0, "faithful": True},
                "prompts": [{"prompt": p, "status": "ok", "to_latent_s": t[0], "to_frames_s": t[1]}
                            for p, t in (("first", first), ("repeat", repeat))],
                "env": ENV, "commit": ENV["wan_sage_commit"]}
    f = _write(tmp_path / "template.jsonl", [wf("comfy", (50.0, 60.0), (40.0, 50.0)),
                                              wf("template", (40.0, 48.0), (32.0, 40.0))])
    rows = [r for r in render_docs.whole_generation_section([f]) if r.startswith("| the template T (fp16)")]
    assert len(rows) == 2 and all("1280×704×121, 20 steps, cfg 5, no LoRA, eager |" in r for r in rows)
    assert "| ComfyUI alone + SDPA | 50.0 s | 60.0 s |" in rows[0]
    assert "| estimator + Sage + text encoder host copy | 40.0 s (1.25×) | 48.0 s (1.25×) | 32.0 s (1.25×) |" in rows[1]
