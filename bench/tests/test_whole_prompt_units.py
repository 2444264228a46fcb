"""Unit tier: the pure parts of the whole-prompt apparatus (no ComfyUI): run specs with steps, cfg, LoRA
and decode, the cache folders of a process, the driver's options, skip and budget rules, and what one
prompt's entry of a record holds."""
import json
import os
import sys

import pytest

from bench import e2e, whole_prompt


def test_a_spec_names_steps_cfg_lora_and_decode_and_keeps_its_label():
    s = e2e.RunSpec.parse("est+sage@24:832x480x81:20steps:cfg3.5:nolora:nodecode")
    assert (s.estimator, s.attention, s.budget_gib, s.res) == (True, "sage", 24.0, (832, 480, 81))
    assert (s.steps, s.cfg, s.lora, s.decode) == (20, 3.5, False, False)
    assert s.label == "est+sage@24:832x480x81:20steps:cfg3.5:nolora:nodecode"
    assert e2e.RunSpec.parse(s.label) == s                        # the label parses back to the same spec
    # a spec without options reads as before, so earlier records keep their labels (--skip-done)
    plain = e2e.RunSpec.parse("comfy+sdpa@full:720p81")
    assert plain.label == "comfy+sdpa@full:1280x720x81" and (plain.steps, plain.cfg, plain.lora, plain.decode) == (
        None, None, True, None)
    assert e2e.RunSpec.parse("est+sage+compileblocks@16:480p81:4steps:decode").label == \
        "est+sage+compileblocks@16:832x480x81:4steps:decode"
    # the options come in any order; the label has one order
    assert e2e.RunSpec.parse("est+sage@24:720p81:nodecode:20steps").label == "est+sage@24:1280x720x81:20steps:nodecode"


@pytest.mark.parametrize("bad", ["est+sage@24", "est+sage@24:720p81:20step", "est+sage@24:720p81:1steps",
                                 "est+sage@24:720p81:4steps:8steps", "est+sage@24:720p81:decode:nodecode",
                                 "est+sage@24:720p81:cfg", "est+sage@24:720p81:lora"])
def test_bad_spec_options_are_refused_with_the_form(bad):
    with pytest.raises(SystemExit, match=r"\[:Nsteps\]\[:cfgX\]\[:nolora\]\[:decode\|:nodecode\]"):
        e2e.RunSpec.parse(bad)


def test_steps_and_cfg_fall_back_to_the_command_line():
    args = e2e.parse_args(["--models-dir", "m", "--steps", "6", "--cfg", "2.0"])
    assert e2e.RunSpec.parse("est+sage@24:720p81").steps_of(args) == 6
    assert e2e.RunSpec.parse("est+sage@24:720p81:20steps").steps_of(args) == 20
    assert e2e.RunSpec.parse("est+sage@24:720p81").cfg_of(args) == 2.0
    assert e2e.RunSpec.parse("est+sage@24:720p81:cfg3.5").cfg_of(args) == 3.5
    none = e2e.parse_args(["--models-dir", "m", "--decode", "none"])
    assert e2e.whole_decode(e2e.RunSpec.parse("est+sage@24:720p81"), none) is False
    assert e2e.whole_decode(e2e.RunSpec.parse("est+sage@24:720p81:decode"), none) is True
    first = e2e.parse_args(["--models-dir", "m", "--decode", "first"])   # both prompts of a process decode
    assert e2e.whole_decode(e2e.RunSpec.parse("est+sage@24:720p81"), first) is True


def test_whole_prompt_runs_one_spec_and_must_say_its_caches(capsys):
    base = ["--models-dir", "m", "--whole-prompt"]
    for argv, says in ((["--runs", "est+sage@24:720p81"], "needs --caches none, --caches kept DIR or --caches pack DIR"),
                       (["--runs", "est+sage@24:720p81,comfy+sdpa@24:720p81", "--caches", "none"], "exactly one spec"),
                       (["--runs", "est+sage@24:720p81", "--caches", "kept"], "needs --caches none, --caches kept"),
                       (["--runs", "est+sage@24:720p81", "--caches", "pack"], "needs --caches none, --caches kept"),
                       (["--runs", "est+sage@24:720p81", "--caches", "none", "--warmup"], "--warmup do not apply")):
        with pytest.raises(SystemExit):
            e2e.parse_args(base + argv)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e.parse_args(["--models-dir", "m", "--runs", "est+sage@24:720p81", "--caches", "none"])
    assert "--caches applies to --whole-prompt runs only" in capsys.readouterr().err
    a = e2e.parse_args(base + ["--runs", "est+sage@24:720p81", "--caches", "kept", "/x"])
    assert a.caches == ["kept", "/x"] and a.process_index == 1 and a.repeat_seed is None


def test_caches_none_are_fresh_empty_folders_and_kept_ones_are_reused(tmp_path, monkeypatch):
    for var in e2e.CACHE_FOLDERS:
        monkeypatch.setenv(var, "/somewhere/else")
    a = e2e.set_caches("none", None, tmp_path)
    b = e2e.set_caches("none", None, tmp_path)
    assert a["dir"] != b["dir"] and a["mode"] == "none" and a["filled_at_start"] is False
    assert os.environ["WAN_SAGE_CACHE_DIR"] == b["folders"]["WAN_SAGE_CACHE_DIR"]      # the last one set is in use
    assert all(v == {"files": 0, "bytes": 0} for v in a["at_start"].values())
    e2e.drop_caches(a)
    assert not os.path.exists(a["dir"])
    kept = tmp_path / "kept"
    k1 = e2e.set_caches("kept", str(kept), tmp_path)
    assert k1["folders"] == {var: str(kept / name) for var, name in e2e.CACHE_FOLDERS.items()}
    assert k1["filled_at_start"] is False
    (kept / "triton" / "abc").mkdir()
    (kept / "triton" / "abc" / "kernel.bin").write_bytes(b"x" * 10)
    e2e.drop_caches(k1)                                      # kept folders stay for the next process
    k2 = e2e.set_caches("kept", str(kept), tmp_path)
    assert k2["filled_at_start"] is True and k2["at_start"]["TRITON_CACHE_DIR"] == {"files": 1, "bytes": 10}
    assert os.environ["TRITON_CACHE_DIR"] == str(kept / "triton")
    with pytest.raises(SystemExit):
        e2e.set_caches("kept", None, tmp_path)


def test_caches_pack_keep_only_the_packs_folder_and_give_torch_fresh_ones(tmp_path, monkeypatch):
    for var in e2e.CACHE_FOLDERS:
        monkeypatch.setenv(var, "/somewhere/else")
    kept = tmp_path / "kept"
    p1 = e2e.set_caches("pack", str(kept), tmp_path)
    assert p1["mode"] == "pack" and p1["folders"]["WAN_SAGE_CACHE_DIR"] == str(kept / "wan-sage")
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert p1["folders"][var].startswith(p1["fresh_dir"]) and not p1["folders"][var].startswith(str(kept / "wan-sage"))
    (kept / "wan-sage" / "compile").mkdir()
    (kept / "wan-sage" / "compile" / "a.bin").write_bytes(b"x" * 4)
    with open(os.path.join(p1["folders"]["TORCHINDUCTOR_CACHE_DIR"], "graph"), "wb") as f:
        f.write(b"y")
    e2e.drop_caches(p1)                                       # torch's folders go, the pack's stays
    assert not os.path.exists(p1["fresh_dir"]) and (kept / "wan-sage" / "compile" / "a.bin").exists()
    p2 = e2e.set_caches("pack", str(kept), tmp_path)
    assert p2["filled_at_start"] is True and p2["at_start"]["WAN_SAGE_CACHE_DIR"] == {"files": 1, "bytes": 4}
    assert p2["at_start"]["TORCHINDUCTOR_CACHE_DIR"] == {"files": 0, "bytes": 0}
    # the same path as process 1's, emptied: a kernel's saved autotuning is looked up beside its compiled path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == p2["folders"]["TORCHINDUCTOR_CACHE_DIR"] == p1["folders"]["TORCHINDUCTOR_CACHE_DIR"]
    with open(os.path.join(p2["folders"]["TRITON_CACHE_DIR"], "left"), "wb") as f:
        f.write(b"z")                                         # a process stopped before its exit left this
    p3 = e2e.set_caches("pack", str(kept), tmp_path)
    assert p3["at_start"]["TRITON_CACHE_DIR"] == {"files": 0, "bytes": 0}
    # what the records are read by: these processes kept the path; one with a new folder (the harness before) not
    assert e2e.kept_path(p2) and e2e.kept_path(p3)
    assert not e2e.kept_path({"fresh_dir": str(tmp_path / "caches-pack-2rm8g23x")}) and not e2e.kept_path({})
    with pytest.raises(SystemExit):
        e2e.set_caches("pack", None, tmp_path)


def test_the_process_age_is_read_from_the_kernel():
    age = e2e.process_age_s()
    if sys.platform.startswith("linux"):
        assert age is not None and 0 <= age < 24 * 3600
    else:
        assert age is None


def _row(steps_high, steps_low, calibration=(12.5, 0.0), graphs=None):
    att = lambda c: {"sage_calls": 40, "sdpa_calls": 2, "calibration_ms": c}  # noqa: E731
    row = {"schema": e2e.SCHEMA, "run": "est+sage@24:1280x720x81", "config": {"steps": 4}, "budget": {"ballast_gib": 100},
           "status": "ok", "to_latent_s": 80.0, "to_frames_s": 86.0,
           "experts": {"high": {"step_s": steps_high, "wall_s": 40.0, "attention": att(calibration[0])},
                       "low": {"step_s": steps_low, "wall_s": 30.0, "attention": att(calibration[1])}}}
    if graphs is not None:
        row["compile"] = {"by_expert": {"high": {"unique_graphs": graphs[0], "recompiles": 0},
                                        "low": {"unique_graphs": graphs[1], "recompiles": 3}}}
    return row


def test_a_prompt_entry_keeps_the_run_and_sums_up_each_expert():
    p = e2e.prompt_entry("first", _row([19.2, 11.6], [12.0, 11.5, 11.7], graphs=(2, 0)))
    assert p["prompt"] == "first" and p["to_latent_s"] == 80.0 and p["to_frames_s"] == 86.0
    assert not {"schema", "run", "config", "budget"} & set(p)        # the process record holds these once
    assert p["first_step_s"] == {"high": 19.2, "low": 12.0}
    hi, lo = p["by_expert"]["high"], p["by_expert"]["low"]
    assert (hi["later_step_s"], lo["later_step_s"]) == (11.6, 11.6)
    assert (hi["calibration_ms"], hi["sage_calls"], hi["sdpa_calls"], hi["wall_s"]) == (12.5, 40, 2, 40.0)
    assert (hi["graphs"], lo["graphs"], lo["recompiles"]) == (2, 0, 3)
    eager = e2e.prompt_entry("repeat", _row([11.6, 11.6], [11.5, 11.4]))
    assert eager["by_expert"]["high"]["graphs"] is None


def _driver(*argv):
    return whole_prompt.parse_args(["--models-dir", "m", *argv])


def test_the_driver_passes_its_unknown_options_to_each_process_and_gives_each_configuration_its_kept_folders(tmp_path):
    a = _driver("--runs", "est+sage@24:720p81,comfy+sdpa@24:720p81:nodecode", "--caches", "kept", str(tmp_path),
                "--weights", "fp8", "--scale", "tiny")
    assert a.processes == 2 and a.weights == "fp8" and len(a.specs) == 2
    cmd = whole_prompt.process_command(a, a.specs[1], 2)
    assert cmd[:3] == [sys.executable, "-m", "bench.e2e"]
    assert cmd[3:9] == ["--models-dir", "m", "--weights", "fp8", "--scale", "tiny"]
    i = cmd.index("--caches")
    assert cmd[i + 1] == "kept" and cmd[i + 2] == str(tmp_path.resolve() / "fp8-comfy-sdpa-24-1280x720x81-nodecode")
    assert cmd[cmd.index("--runs") + 1] == "comfy+sdpa@24:1280x720x81:nodecode"
    assert cmd[-4:] == ["--process-index", "2", "--process-count", "2"] and "--whole-prompt" in cmd
    n = _driver("--runs", "est+sage@24:720p81", "--caches", "none")
    assert n.processes == 1 and whole_prompt.process_command(n, n.specs[0], 1).count("none") == 1
    pk = _driver("--runs", "est+sage@24:720p81", "--caches", "pack", str(tmp_path))
    cmd = whole_prompt.process_command(pk, pk.specs[0], 1)
    i = cmd.index("--caches")
    assert pk.processes == 2 and cmd[i + 1:i + 3] == ["pack", str(tmp_path.resolve() / "gguf-est-sage-24-1280x720x81")]


@pytest.mark.parametrize("argv", [["--runs", "est+sage@24:720p81", "--caches", "kept"],
                                  ["--runs", "est+sage@24:720p81", "--caches", "none", "/x"],
                                  ["--runs", "est+sage@24:720p81", "--caches", "none", "--out=x", "--bogus"],
                                  ["--runs", "est+sage@24:720p81", "--caches", "none", "--not-an-e2e-option"]])
def test_the_driver_stops_before_any_process_on_bad_options(argv):
    with pytest.raises(SystemExit):
        _driver(*argv)


def test_a_configuration_is_done_when_its_last_process_has_a_record(tmp_path):
    spec = e2e.RunSpec.parse("est+sage@24:720p81")
    f = tmp_path / "w.jsonl"

    def rec(index, status="ok", mode="kept", weights="gguf", **extra):
        return {"schema": e2e.WHOLE_SCHEMA, "run": spec.label, "status": status, "prompts": [{}],
                "config": {"weights": weights}, "caches": {"mode": mode}, "process": {"index": index, "count": 2}, **extra}
    f.write_text("\n".join(json.dumps(r) for r in (rec(1), rec(2, "error"), rec(2, mode="none"), rec(2, weights="fp8"),
                                                   rec(2, budget={"faithful": False}))) + "\n")
    assert not whole_prompt.done(str(f), spec, "gguf", "kept", 2)      # only process 1 of gguf / kept completed
    assert whole_prompt.done(str(f), spec, "gguf", "kept", 1)
    assert whole_prompt.done(str(f), spec, "gguf", "none", 2) and whole_prompt.done(str(f), spec, "fp8", "kept", 2)
    with open(f, "a") as out:
        out.write(json.dumps(rec(2, "oom")) + "\n")
    assert whole_prompt.done(str(f) + ",missing.jsonl", spec, "gguf", "kept", 2)


def test_the_budget_clock_counts_from_t0():
    c = whole_prompt.Clock(t0=1000.0, budget_s=None)
    assert c.fits(1e9) and c.left() is None
    import time
    c = whole_prompt.Clock(t0=time.time() - 100, budget_s=300)
    assert c.fits(150) and not c.fits(250) and 199 < c.left() <= 200.5


def test_a_process_past_the_budget_is_stopped_and_its_output_kept():
    rc, out, err = whole_prompt.run_process([sys.executable, "-c", "import time,sys; print('{\"a\": 1}', flush=True); "
                                             "print('e2e step', file=sys.stderr, flush=True); time.sleep(60)"], 3, None)
    assert rc is None and out == ['{"a": 1}\n'] and err == ["e2e step\n"]
    rc, out, _ = whole_prompt.run_process([sys.executable, "-c", "print(1)"], None, None)
    assert rc == 0 and out == ["1\n"]


def test_a_record_names_the_cache_folders_inside_the_checkout_relative_to_it():
    from bench import e2e
    root = str(e2e.ROOT)
    caches = {"mode": "none", "dir": f"{root}/.e2e/e2e-work/caches-none-x",
              "folders": {"TRITON_CACHE_DIR": f"{root}/.e2e/e2e-work/caches-none-x/triton"},
              "in_use": {"triton": f"{root}/.e2e/e2e-work/caches-none-x/triton", "wan_sage_timing": "? (ImportError)"}}
    rec = e2e.record_caches(caches)
    assert rec["dir"] == ".e2e/e2e-work/caches-none-x" and rec["folders"]["TRITON_CACHE_DIR"].startswith(".e2e/")
    assert rec["in_use"] == {"triton": ".e2e/e2e-work/caches-none-x/triton", "wan_sage_timing": "? (ImportError)"}
    assert caches["dir"].startswith(root)  # the process keeps its own paths (drop_caches removes that folder)
    kept = e2e.record_caches({"mode": "kept", "dir": "/tmp/wan-sage-caches/x", "folders": {}})
    assert kept["dir"] == "/tmp/wan-sage-caches/x"


def test_the_page_cache_read_covers_torch_and_cuda_libraries_only(tmp_path, monkeypatch):
    import importlib.util
    torch_dir, nvidia_dir = tmp_path / "torch", tmp_path / "nvidia"
    for d in (torch_dir / "lib", nvidia_dir / "cudnn" / "lib", nvidia_dir / "cublas" / "include",
              tmp_path / "sageattention"):
        d.mkdir(parents=True)
    (torch_dir / "lib" / "libtorch_cuda.so").write_bytes(b"x" * 100)
    (nvidia_dir / "cudnn" / "lib" / "libcudnn.so.9").write_bytes(b"x" * 50)
    (nvidia_dir / "cublas" / "include" / "cublas.h").write_bytes(b"x" * 7)  # not a library
    (tmp_path / "sageattention" / "_qattn_sm90.so").write_bytes(b"x" * 1000)  # one configuration's own
    found = {"torch": torch_dir, "nvidia": nvidia_dir}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: type(
        "Spec", (), {"submodule_search_locations": [str(found[name])]})() if name in found else None)
    assert [p.name for p in whole_prompt.shared_libraries()] == ["libcudnn.so.9", "libtorch_cuda.so"]
    primed = whole_prompt.prime_page_cache()
    assert primed["primed"] and primed["bytes"] == 150


def test_bench_first_fills_the_packs_folder_once_and_every_record_of_the_configuration_says_so(tmp_path, monkeypatch):
    with pytest.raises(SystemExit):
        _driver("--runs", "est+sage@16:720p81", "--caches", "none", "--bench-first")
    a = _driver("--runs", "est+sage+compileblocks@16:720p81", "--caches", "pack", str(tmp_path), "--bench-first")
    spec = a.specs[0]
    cmd = whole_prompt.bench_command(a, spec)
    assert cmd[:4] == [sys.executable, "-m", "bench.wan_sage_cli", "bench"]
    assert cmd[cmd.index("--preset") + 1] == "wan2.2-a14b"
    assert [cmd[cmd.index(f) + 1] for f in ("--width", "--height", "--frames")] == ["1280", "720", "81"]
    folder = tmp_path.resolve() / "gguf-est-sage-compileblocks-16-1280x720x81" / "wan-sage"
    assert cmd[cmd.index("--cache-dir") + 1] == str(folder)
    assert "--dtype" not in cmd  # the CLI's default, the fp16 ComfyUI runs Wan in
    ran = []

    def run(cmd, timeout, log):
        ran.append(cmd)
        if cmd[2] == "bench.wan_sage_cli":
            folder.mkdir(parents=True)
            (folder / "attention_calibration.json").write_text("{}")
            return 0, ["table\n"], []
        return 0, [json.dumps({"schema": e2e.WHOLE_SCHEMA, "run": spec.label, "status": "ok"}) + "\n"], []
    monkeypatch.setattr(whole_prompt, "run_process", run)
    monkeypatch.setattr(whole_prompt, "prime_page_cache", lambda: {"bytes": 0, "s": 0.0})
    out = tmp_path / "w.jsonl"
    argv = ["--models-dir", "m", "--runs", spec.label, "--caches", "pack", str(tmp_path), "--bench-first",
            "--out", str(out), "--log", str(tmp_path / "w.log")]
    assert whole_prompt.main(argv) == 0
    assert [c[2] for c in ran] == ["bench.wan_sage_cli", "bench.e2e", "bench.e2e"]
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 2 and all(r["bench_first"]["rc"] == 0 for r in recs)
    assert recs[0]["bench_first"]["command"].startswith("wan-sage bench --preset wan2.2-a14b --width 1280")
    assert "table" in (tmp_path / "w.log").read_text()
    ran.clear()
    assert whole_prompt.main(argv) == 0  # the folder holds a timing cache now: not run again
    assert [c[2] for c in ran] == ["bench.e2e", "bench.e2e"]
    assert all("bench_first" not in json.loads(x) for x in out.read_text().splitlines()[2:])
