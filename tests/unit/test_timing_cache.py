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
    SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))(raw_func, q, k, v, heads=4)
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
    o(raw_func, q, k, v, heads=4)  # this process measures the bucket
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert entry["repeats"] == 1
    o(raw_func, q, k, v, heads=4)
    first = fake_gpu.kernel_calls()
    assert first == 4  # warm-up, timing, output run, then one plain call: not timed twice in one process
    fake_gpu.reset_state()  # the next process: the same cache file, nothing learnt in memory
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == first + 3
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert entry["repeats"] == 2
    fake_gpu.reset_state()  # trusted now: a later process only runs the call
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == first + 4


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


class _Output:
    """A stand-in for an attention output whose liveness the test can see."""

    def __init__(self, who):
        self.who = who


def _tracked_calibration(times: dict, fail_on_output_run=None):
    """Run timing.calibrate over fake runs that record how many outputs are alive when each
    starts; ``times`` maps "sdpa" and kernel names to ms."""
    import weakref
    alive, seen, runs = weakref.WeakSet(), [], []

    def runner(who):
        def run():
            seen.append((who, len(alive)))
            runs.append(who)
            if who == fail_on_output_run and runs.count(who) == 3:
                raise torch.OutOfMemoryError("fake out of memory")
            out = _Output(who)
            alive.add(out)
            return out
        return run

    def time_fn(fn, repeats=1):
        out = fn()
        who = out.who
        del out
        return times[who]

    variants = [timing.Variant(name, 1, 0, runner(name)) for name in times if name != "sdpa"]
    result = timing.calibrate(variants, runner("sdpa"), lambda need: True, torch.OutOfMemoryError, time_fn)
    return result, seen, runs


def test_calibration_keeps_no_output_alive_while_another_run_is_timed():
    result, seen, runs = _tracked_calibration({"sdpa": 10.0, "sage2_sm90": 7.0, "sage1": 12.0})
    assert seen and all(n == 0 for _, n in seen)  # each run starts with no earlier output alive
    assert result.output.who == "sage2_sm90" and result.output_from.kernel == "sage2_sm90"
    # warm-up and timed run of each, then one run of the winner for the output
    assert runs == ["sdpa", "sdpa", "sage2_sm90", "sage2_sm90", "sage1", "sage1", "sage2_sm90"]


def test_calibration_gives_sdpa_output_when_no_kernel_wins_or_the_winner_fails_on_its_output_run():
    result, _seen, runs = _tracked_calibration({"sdpa": 10.0, "sage2_sm90": 9.9})  # within the hysteresis
    assert result.output.who == "sdpa" and result.output_from is None and runs[-1] == "sdpa"
    result, seen, runs = _tracked_calibration({"sdpa": 10.0, "sage2_sm90": 7.0}, fail_on_output_run="sage2_sm90")
    assert result.output.who == "sdpa" and result.output_from is None
    assert [t.failure for t in result.trials] == [None, "oom"] and result.trials[0].ms == 7.0
    assert all(n == 0 for _, n in seen)
