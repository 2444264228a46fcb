"""Host tier: whole prompts (``python -m bench.whole_prompt`` driving ``python -m bench.e2e --whole-prompt``) at
--scale tiny on the CPU through real ComfyUI and ComfyUI-GGUF: two prompts in one fresh process, the caches each
process was given, and the record's fields."""
import json
from pathlib import Path

import pytest

from bench import _host, e2e, whole_prompt
from bench.tests.whole_prompt_checks import host_gguf_or_skip, prompts_ran

GGUF = host_gguf_or_skip()

KEPT_SPEC = "comfy+sdpa@full:64x64x5:6steps:nodecode"


def _drive(tmp, *argv, timeout=900):
    p, rows = _host.run_tool("whole_prompt", [*argv, "--out", tmp / "records.jsonl", "--log", tmp / "processes.log",
                                              "--models-dir", tmp / "models", "--scale", "tiny", "--quiet"],
                             timeout, COMFYUI_GGUF_PATH=str(GGUF))
    assert p.returncode == 0, p.stderr[-4000:]
    return rows, p.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("whole")
    none, err_none = _drive(tmp, "--runs", "est+sage@full:64x64x5", "--caches", "none")
    # a file already in a configuration's kept folder: each process must say it found it there
    kept_dir = tmp / "kept"
    slug = whole_prompt.caches_slug("gguf", e2e.RunSpec.parse(KEPT_SPEC))
    (kept_dir / slug / "triton").mkdir(parents=True)
    (kept_dir / slug / "triton" / "left-by-an-earlier-process.bin").write_bytes(b"0123456789")
    kept, err_kept = _drive(tmp, "--runs", KEPT_SPEC, "--caches", "kept", kept_dir)
    return dict(tmp=tmp, none=none, kept=kept, err=err_none + err_kept, kept_dir=kept_dir / slug)


def _prompts_ok(r):
    first, repeat = prompts_ran(r)
    for p in r["prompts"]:
        assert p["to_latent_s"] > 0 and p["to_latent_s"] >= sum(e["wall_s"] for e in p["experts"].values()) - 0.01
        assert p["latent_finite"] is True and p["peak_alloc_gib"] is None     # no CUDA: no memory readings
        assert set(p["experts"]) == set(p["first_step_s"]) == set(p["by_expert"]) == {"high", "low"}
        for e, x in p["experts"].items():
            assert p["first_step_s"][e] == x["step_s"][0] > 0
    # the first prompt encodes and loads; the repeat is served the text encode and the experts' chains
    assert "encode" in first["phases"] and first["reused"] == []
    assert "encode" not in repeat["phases"] and repeat["reused"] == ["encode", "expert high", "expert low"]
    assert repeat["to_latent_s"] < first["to_latent_s"]
    return first, repeat


def test_two_prompts_in_one_fresh_process_with_empty_caches(runs):
    (r,) = runs["none"]
    first, repeat = _prompts_ok(r)
    assert r["run"] == "est+sage@full:64x64x5" and r["process"] == {"index": 1, "count": 1}
    c = r["config"]
    assert (c["estimator"], c["attention"], c["weights"], c["steps"], c["decode"], c["budget_gib"]) == (
        True, "sage", "gguf", 4, True, None)
    assert (c["width"], c["height"], c["frames"], c["cfg"], c["lora_rank"]) == (64, 64, 5, 1.0, 64)
    for p in (first, repeat):
        assert p["to_frames_s"] > p["to_latent_s"] and p["decoded"] == [5, 64, 64, 3]
        assert all(len(x["step_s"]) == 2 for x in p["experts"].values())
        for x in p["by_expert"].values():     # the patch on the CPU: every call on SDPA, nothing to calibrate
            assert x["sage_calls"] == 0 and x["sdpa_calls"] == 8 and x["calibration_ms"] == 0
    # caches: fresh empty folders, the ones the pack, inductor and Triton read, removed at the end
    caches = r["caches"]
    assert caches["mode"] == "none" and caches["filled_at_start"] is False
    assert set(caches["folders"]) == {"WAN_SAGE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}
    assert all(v == {"files": 0, "bytes": 0} for v in caches["at_start"].values())
    assert caches["in_use"] == {"wan_sage_timing": caches["folders"]["WAN_SAGE_CACHE_DIR"],
                                "torchinductor": caches["folders"]["TORCHINDUCTOR_CACHE_DIR"],
                                "triton": caches["folders"]["TRITON_CACHE_DIR"]}
    assert not Path(caches["dir"]).exists()
    # the process's start apart from the prompts
    assert r["process_start_s"] > r["startup"]["comfyui_import_s"] > 0
    assert set(r["startup"]) == {"python_s", "comfyui_import_s", "model_files_s", "main_to_prompt_s"}
    assert r["env"]["device"] == "cpu" and r["env"]["comfyui"] and r["commit"] == r["env"]["wan_sage_commit"]
    assert r["budget"]["ballast_gib"] == 0


def test_kept_caches_are_one_folder_set_reused_by_the_next_process(runs):
    assert [r["process"] for r in runs["kept"]] == [{"index": 1, "count": 2}, {"index": 2, "count": 2}]
    for r in runs["kept"]:
        first, repeat = _prompts_ok(r)
        assert r["run"] == "comfy+sdpa@full:64x64x5:6steps:nodecode"
        assert r["config"]["steps"] == 6 and r["config"]["decode"] is False
        for p in (first, repeat):
            assert p["to_frames_s"] is None and "decoded" not in p
            assert all(len(x["step_s"]) == 3 for x in p["experts"].values())       # 6 steps: 0-3 and 3-6
            assert all(x["attention"] is None for x in p["experts"].values())
        caches = r["caches"]
        assert caches["mode"] == "kept" and Path(caches["dir"]) == runs["kept_dir"].resolve()
        assert caches["folders"]["TRITON_CACHE_DIR"] == str(runs["kept_dir"].resolve() / "triton")
        assert caches["in_use"]["triton"] == caches["folders"]["TRITON_CACHE_DIR"]
        assert caches["in_use"]["wan_sage_timing"] == caches["folders"]["WAN_SAGE_CACHE_DIR"]
        assert caches["filled_at_start"] is True and caches["at_start"]["TRITON_CACHE_DIR"] == {"files": 1, "bytes": 10}
    assert (runs["kept_dir"] / "triton" / "left-by-an-earlier-process.bin").is_file()     # kept, not removed


def test_the_records_go_to_the_out_file_and_the_progress_to_stderr(runs):
    lines = [json.loads(x) for x in (runs["tmp"] / "records.jsonl").read_text().splitlines()]
    assert [r["run"] for r in lines] == [r["run"] for r in runs["none"] + runs["kept"]]
    assert "e2e prompt repeat: ok" in runs["err"] and "process 2/2" in runs["err"]
    log = (runs["tmp"] / "processes.log").read_text()     # every line of the processes' stderr
    assert log.count("e2e prompt first:") == 2 * 3 and "e2e step high 1/2" in log


def test_done_configurations_are_skipped_and_a_budget_too_small_starts_nothing(runs):
    tmp = runs["tmp"]
    rows, err = _drive(tmp, "--runs", f"{KEPT_SPEC},comfy+sdpa@full:64x64x5", "--caches", "kept", runs["kept_dir"].parent,
                       "--skip-done", tmp / "records.jsonl", "--budget-s", "30", "--process-s", "60")
    assert "already recorded, skipped" in err
    (r,) = rows
    assert r["run"] == "comfy+sdpa@full:64x64x5" and r["status"] == "skipped" and "budget" in r["error"]
    assert "prompts" not in r
