"""The kernel timing cache: what its key holds, repeat counts and re-timing, and safe writes."""
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from fakegpu import qkv
from wan_sage.attention import kernels, planning, registry, timing
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.file_lock import file_lock, lock_path
from wan_sage.attention.state import STATE

ROOT = Path(__file__).resolve().parents[2]


def raw_func(*a, **k):
    raise AssertionError("func must not be called when there is no previous override")


def test_the_key_holds_the_kernel_build_and_the_software(fake_gpu, monkeypatch):
    monkeypatch.setattr(planning, "kernel_build", lambda name: "2.2.0+5f0c1e2a9b3d")
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    (key,) = timing.TimingCache(fake_gpu.cache_dir).entries()
    assert "sage2_sm90=2.2.0+5f0c1e2a9b3d" in key
    assert timing.environment() in key and torch.__version__ in timing.environment()
    assert "cuda" in timing.environment() and "cudnn" in timing.environment()


def test_build_identity_hashes_the_extension_files(tmp_path, monkeypatch):
    package = tmp_path / "fake_sage_build"
    package.mkdir()
    (package / "__init__.py").write_text("")
    extension = package / "_qattn_sm90.so"
    extension.write_bytes(b"build one")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(registry.PACKAGES, "fake_sage_build",
                        registry.PackageSpec("fake_sage_build", ("fake_sage_build",), ("sage2",)))
    first = kernels.build_identity("fake_sage_build")
    with STATE.lock:
        STATE.build_ids.pop("fake_sage_build", None)
    extension.write_bytes(b"build two")
    second = kernels.build_identity("fake_sage_build")
    assert first.startswith("none+") and second.startswith("none+") and first != second
    with STATE.lock:
        STATE.build_ids.pop("fake_sage_build", None)


def test_a_bucket_timed_once_is_timed_again_by_the_next_process_then_trusted(fake_gpu):
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))
    call = lambda: o(raw_func, q, k, v, heads=4)  # noqa: E731
    timed = len(fake_gpu.settle(call))  # this process measures the bucket on the shape's first calls
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert entry["repeats"] == 1 and timed > 1
    before = fake_gpu.kernel_calls()
    call()
    assert fake_gpu.kernel_calls() == before + 1 and not fake_gpu.state.trials  # not timed twice in one process
    fake_gpu.reset_state()  # the next process: the same cache file, nothing learnt in memory
    assert len(fake_gpu.settle(call)) == timed
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert entry["repeats"] == 2
    fake_gpu.reset_state()  # trusted now: a later process only runs the call
    before = fake_gpu.kernel_calls()
    call()
    assert fake_gpu.kernel_calls() == before + 1 and not fake_gpu.state.trials


def test_what_the_bench_writes_is_what_the_node_reads(fake_gpu):
    key = planning.timing_key("FakeGPU", 90, "sage2_sm90", "bf16", 4, 64, 2048, 2048)
    timing.TimingCache(fake_gpu.cache_dir).put(key, 7.0, 10.0, 2048, 2048, repeats=5)
    q, k, v = qkv()
    SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 1  # no calibration: the bench's timing is trusted


def test_token_bucket_is_quarter_octave():
    assert timing.token_bucket(75600) == timing.token_bucket(76000)
    assert timing.token_bucket(75600) != timing.token_bucket(32760)
    assert timing.token_bucket(512) != timing.token_bucket(257)


def test_cache_roundtrip_merge_and_corruption(tmp_path):
    a = timing.TimingCache(tmp_path)
    b = timing.TimingCache(tmp_path)
    a.put("k1", 7.0, 10.0, 100, 100)
    b.put("k2", 3.0, 2.0, 50, 50)  # another process writes: merged, not lost
    c = timing.TimingCache(tmp_path)
    assert set(c.entries()) == {"k1", "k2"} and c.get("k1")["kernel_ms"] == 7.0
    (tmp_path / timing.FILE_NAME).write_text("{not json")
    d = timing.TimingCache(tmp_path)
    assert d.get("k1") is None and "ignored unreadable" in d.load_error
    d.put("k3", 1.0, 1.0, 1, 1)
    assert json.loads((tmp_path / timing.FILE_NAME).read_text())["entries"].keys() == {"k3"}


def test_a_passed_self_test_is_kept_beside_the_timings_of_every_writer(tmp_path):
    a = timing.TimingCache(tmp_path)
    b = timing.TimingCache(tmp_path)  # another process, which read the file before a's pass
    b.entries()
    a.put_self_test_passed("gpu|sm90|sage2_sm90=2.2.0+1|env|bfloat16")
    b.put("k1", 7.0, 10.0, 100, 100)  # its write keeps a's pass, as it keeps a's timings
    c = timing.TimingCache(tmp_path)
    assert c.passed_self_test("gpu|sm90|sage2_sm90=2.2.0+1|env|bfloat16") and c.get("k1")["kernel_ms"] == 7.0
    assert not c.passed_self_test("gpu|sm90|sage2_sm90=2.2.0+2|env|bfloat16")
    data = json.loads((tmp_path / timing.FILE_NAME).read_text())
    data.pop(timing.PASSED)  # a file without the section (an earlier release's) still loads its timings
    (tmp_path / timing.FILE_NAME).write_text(json.dumps(data))
    d = timing.TimingCache(tmp_path)
    assert d.get("k1") is not None and not d.passed_self_test("gpu|sm90|sage2_sm90=2.2.0+1|env|bfloat16")


def test_a_pass_the_file_holds_is_not_written_again(tmp_path):
    timing.TimingCache(tmp_path).put_self_test_passed("k")
    before = (tmp_path / timing.FILE_NAME).stat()
    time.sleep(0.01)
    timing.TimingCache(tmp_path).put_self_test_passed("k")  # the next start passes as this one did
    after = (tmp_path / timing.FILE_NAME).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not replaced


def test_the_warm_up_keeps_a_pass_for_its_build_and_dtype_and_never_a_failure(fake_gpu, monkeypatch):
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    o.warm_up(torch.device("cpu"), torch.bfloat16).join(5)
    info = STATE.devices[(0, "auto")]
    kept = timing.TimingCache(fake_gpu.cache_dir)
    assert kept.passed_self_test(planning.self_test_key(info, "sage2_sm90", torch.bfloat16))
    assert not kept.passed_self_test(planning.self_test_key(info, "sage2_sm90", torch.float16))
    fake_gpu.reset_state()
    fake_gpu.self_test_result = "returned wrong values"
    monkeypatch.setattr(planning, "kernel_build", lambda name: "2.2.0+broken")
    o.warm_up(torch.device("cpu"), torch.bfloat16).join(5)
    kept = timing.TimingCache(fake_gpu.cache_dir)
    assert not kept.passed_self_test(planning.self_test_key(info, "sage2_sm90", torch.bfloat16))
    assert list(json.loads((Path(fake_gpu.cache_dir) / timing.FILE_NAME).read_text())[timing.PASSED]) == [
        "FakeGPU|sm90|sage2_sm90=test|" + timing.environment() + "|bf16"]


def test_cache_is_thread_safe(tmp_path):
    s = timing.TimingCache(tmp_path)
    ts = [threading.Thread(target=lambda i=i: s.put(f"k{i}", i, i + 1, 1, 1)) for i in range(16)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert len(timing.TimingCache(tmp_path).entries()) == 16


def test_default_dir_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("WAN_SAGE_CACHE_DIR", str(tmp_path))
    assert timing.default_dir() == tmp_path



LOADER = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('wan_sage', {init!r}, submodule_search_locations=[{root!r}])\n"
    "mod = importlib.util.module_from_spec(spec); sys.modules['wan_sage'] = mod; spec.loader.exec_module(mod)\n"
    "from wan_sage.attention import timing\n")


def test_processes_writing_at_once_keep_every_measurement(tmp_path):
    code = LOADER.format(init=str(ROOT / "__init__.py"), root=str(ROOT)) + (
        "store = timing.TimingCache(sys.argv[1])\n"
        "for i in range(25):\n"
        "    store.put(f'{sys.argv[2]}-{i}', 1.0 + i, 2.0, 1, 1)\n"
        "    store.put('shared', 1.0, 2.0, 1, 1)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), f"p{n}"]) for n in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    entries = timing.TimingCache(tmp_path).entries()
    assert len(entries) == 4 * 25 + 1
    assert entries["shared"]["repeats"] == 100
    assert not list(tmp_path.glob(".calib-*"))  # no temp file left behind


def test_a_corrupt_cache_is_reported_once_and_rebuilt(tmp_path, caplog):
    (tmp_path / timing.FILE_NAME).write_text("{not json")
    store = timing.TimingCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        store.put("a", 1.0, 2.0, 1, 1)
        store.put("b", 1.0, 2.0, 1, 1)
    assert sum("timing cache" in r.getMessage() for r in caplog.records) == 1
    assert json.loads((tmp_path / timing.FILE_NAME).read_text())["entries"].keys() == {"a", "b"}


def test_a_cache_nested_past_pythons_recursion_limit_is_rebuilt(tmp_path, caplog):
    """A file of 100,000 nested lists makes json.loads raise RecursionError, not ValueError: read as corrupt."""
    (tmp_path / timing.FILE_NAME).write_text("[" * 100_000 + "]" * 100_000)
    store = timing.TimingCache(tmp_path)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert store.get("a") is None and not store.passed_self_test("x")
        store.put("a", 1.0, 2.0, 1, 1)
    assert sum("timing cache" in r.getMessage() for r in caplog.records) == 1
    assert json.loads((tmp_path / timing.FILE_NAME).read_text())["entries"].keys() == {"a"}


def test_an_unwritable_cache_is_reported_once_and_kept_in_memory(tmp_path, caplog):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    store = timing.TimingCache(blocker / "cache")
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        store.put("a", 1.0, 2.0, 1, 1)
        store.put("a", 0.5, 2.0, 1, 1)
    assert sum("could not write timing cache" in r.getMessage() for r in caplog.records) == 1
    assert store.get("a")["kernel_ms"] == 0.5 and store.get("a")["repeats"] == 2


def test_entries_merge_minimum_times_and_add_repeats(tmp_path):
    store = timing.TimingCache(tmp_path)
    store.put("k", 7.0, 10.0, 5, 5, grouped_ms=7.2, groups=7)
    store.put("k", 7.4, 9.8, 5, 5, grouped_ms=7.1, groups=7, repeats=3)
    e = timing.TimingCache(tmp_path).get("k")
    assert (e["kernel_ms"], e["sdpa_ms"], e["grouped_ms"], e["groups"], e["repeats"]) == (7.0, 9.8, 7.1, 7, 4)
    assert timing.trusted(e)


def test_the_portable_lock_file_excludes_and_is_taken_over_when_stale(tmp_path):
    path = tmp_path / "cache.json"
    with file_lock(path, portable=True) as held:
        assert held
        with file_lock(path, timeout=0.05, portable=True) as second:
            assert not second
    assert not lock_path(path).exists()
    lock_path(path).write_text("")  # left by a process that died holding it
    old = time.time() - 120
    os.utime(lock_path(path), (old, old))
    with file_lock(path, stale_s=60, portable=True) as held:
        assert held


def test_the_os_lock_excludes_another_process(tmp_path):
    path = tmp_path / "cache.json"
    code = LOADER.format(init=str(ROOT / "__init__.py"), root=str(ROOT)) + (
        "from wan_sage.attention.file_lock import file_lock\n"
        "with file_lock(__import__('pathlib').Path(sys.argv[1]), timeout=0.05) as held:\n"
        "    print(held)\n")
    with file_lock(path) as held:
        assert held
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                           check=False)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "False"


class _Timer:
    def __init__(self, ms):
        self._ms = ms

    def ms(self):
        return self._ms


def _run(trial, times, fail=None):
    """Take and report every step of ``trial`` as calls would: ``times`` gives each step's ms by its
    kernel ("sdpa" for SDPA); ``fail`` maps (kernel, groups) to the failure of that variant's first
    run.  Returns the steps taken and how many reports ended the trial."""
    taken, ends = [], 0
    while (step := trial.take()) is not None:
        taken.append(step)
        failure = (fail or {}).get((step.kernel, step.groups))
        if failure:
            ends += trial.done(step, failure=failure, whole_kernel=failure in ("error", "inaccurate"))
        else:
            ends += trial.done(step, _Timer(times[step.kernel or "sdpa"][len(taken) % 2]))
    return taken, ends


def test_a_shape_trial_warms_each_variant_once_then_alternates_its_timed_runs_with_sdpa():
    steps = timing.schedule([("sage2_sm90", 1), ("sage2_sm90", 3), ("sage1", 1)])
    assert [(s.kernel, s.groups, s.timed) for s in steps] == [
        ("sage2_sm90", 1, False), (None, 1, False), ("sage2_sm90", 1, True), (None, 1, True),
        ("sage2_sm90", 1, True), (None, 1, True), ("sage2_sm90", 3, False), ("sage2_sm90", 3, True),
        ("sage2_sm90", 3, True), ("sage1", 1, False), ("sage1", 1, True), ("sage1", 1, True)]
    assert sum(s.kernel is None and s.timed for s in steps) == timing.TIMED_RUNS


def test_a_shape_trial_keeps_the_least_time_of_each_variant_and_ends_once():
    trial = timing.ShapeTrial(timing.schedule([("sage2_sm90", 1), ("sage2_sm90", 3)]))
    taken, ends = _run(trial, {"sdpa": (10.0, 11.0), "sage2_sm90": (7.5, 7.0)})
    assert ends == 1 and len(taken) == 9 and trial.take() is None
    sdpa_ms, trials = trial.result()
    assert sdpa_ms == 10.0 and [(t.kernel, t.groups, t.ms) for t in trials] == [("sage2_sm90", 1, 7.0),
                                                                                ("sage2_sm90", 3, 7.0)]


def test_a_failed_variant_loses_its_steps_and_a_failed_kernel_all_of_its_variants():
    trial = timing.ShapeTrial(timing.schedule([("sage2_sm90", 1), ("sage2_sm90", 3), ("sage1", 1)]))
    taken, ends = _run(trial, {"sdpa": (10.0, 10.0), "sage2_sm90": (7.0, 7.0), "sage1": (8.0, 8.0)},
                       fail={("sage2_sm90", 1): "oom", ("sage1", 1): "error"})
    assert ends == 1
    # out of memory ungrouped: the split is still timed; an error: the kernel's one run, nothing after it
    assert [(s.kernel, s.groups) for s in taken if s.kernel] == [("sage2_sm90", 1), ("sage2_sm90", 3),
                                                                  ("sage2_sm90", 3), ("sage2_sm90", 3), ("sage1", 1)]
    sdpa_ms, trials = trial.result()
    assert sdpa_ms == 10.0
    assert [(t.kernel, t.groups, t.ms, t.failure) for t in trials] == [
        ("sage2_sm90", 1, None, "oom"), ("sage2_sm90", 3, 7.0, None), ("sage1", 1, None, "error")]


def test_sdpa_loses_its_steps_once_no_kernel_step_is_left():
    trial = timing.ShapeTrial(timing.schedule([("sage2_sm90", 1)]))
    taken, ends = _run(trial, {"sdpa": (10.0, 10.0)}, fail={("sage2_sm90", 1): "inaccurate"})
    assert ends == 1 and [s.kernel for s in taken] == ["sage2_sm90"]  # SDPA's turns dropped with it
    assert trial.result() == (None, [timing.Trial("sage2_sm90", 1, failure="inaccurate")])


def test_a_trial_ends_with_the_last_report_when_calls_overlap():
    trial = timing.ShapeTrial(timing.schedule([("sage2_sm90", 1)]))
    steps = [trial.take() for _ in range(6)]
    assert trial.take() is None
    ends = [trial.done(step, _Timer(7.0 if step.kernel else 10.0)) for step in reversed(steps)]
    assert ends == [False] * 5 + [True]
