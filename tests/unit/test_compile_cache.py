"""torch.compile's caches kept across ComfyUI starts (nodes/compile_cache.py): which files a compiled run
hot-loads and writes, once per process, and that a failure never stops the sampling.  torch.compiler's two
calls are stand-ins here, except in the last test, which runs inductor on the CPU in two fresh processes."""
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from wan_sage.nodes import comfy_bridge, compile_cache
from wan_sage.nodes.log_once import warned

LATENT = (1, 16, 21, 90, 160)
BLOCK_KEYS = [f"diffusion_model.blocks.{i}" for i in range(40)]


def _compile_wrapper(keys):
    compiled_module_dict = {k: object() for k in keys}

    def apply_torch_compile_wrapper(executor, *args, **kwargs):
        return compiled_module_dict, executor
    return apply_torch_compile_wrapper


def _patcher(compiled=True):
    dm = SimpleNamespace(dim=5120, ffn_dim=13824, num_heads=40, blocks=[0] * 40, in_dim=16, out_dim=16,
                         patch_size=(1, 2, 2), img_emb=None)
    base = SimpleNamespace(diffusion_model=dm, model_config=SimpleNamespace(unet_config={"model_type": "t2v"}),
                           latent_format=SimpleNamespace(latent_channels=16), model_lowvram=False)
    wrappers = {"apply_model": {"torch.compile": [_compile_wrapper(BLOCK_KEYS)]}} if compiled else {}
    options = {"transformer_options": {}}
    if compiled:
        options["torch_compile_kwargs"] = {"backend": "inductor"}
    return SimpleNamespace(model=base, wrappers=wrappers, object_patches={}, model_options=options,
                           load_device=torch.device("cpu"))


class FakeCompiler:
    """torch.compiler's save_cache_artifacts / load_cache_artifacts: what this process has compiled or found
    is ``self.have``; a load appends to ``self.loaded``."""

    def __init__(self, have=b""):
        self.have, self.loaded = have, []

    def save_cache_artifacts(self):
        return (self.have, object()) if self.have else None

    def load_cache_artifacts(self, data):
        if data.startswith(b"corrupt"):  # torch logs "Failed to un-pickle cache artifacts" and loads nothing
            return None
        if data.startswith(b"raise"):
            raise RuntimeError("a torch that raises on a file it cannot read")
        self.loaded.append(data)
        return object()  # torch's CacheInfo


@pytest.fixture
def fake(monkeypatch, tmp_path):
    compiler = FakeCompiler()
    monkeypatch.setattr(torch, "compiler", compiler)
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache, "_loaded", set())
    monkeypatch.setattr(compile_cache, "_written", {})
    warned.clear()
    yield compiler
    warned.clear()


def _prefix():
    return compile_cache.build_prefix(torch, torch.device("cpu"))


def test_an_eager_model_reads_and_writes_nothing(fake, tmp_path):
    (tmp_path / "compile").mkdir()
    (tmp_path / "compile" / f"{_prefix()}-abc.bin").write_bytes(b"old")
    assert compile_cache.before_sampling(_patcher(compiled=False), None, LATENT) is None
    fake.have = b"new"
    compile_cache.after_sampling(None)
    assert fake.loaded == [] and sorted(os.listdir(tmp_path / "compile")) == [f"{_prefix()}-abc.bin"]


def test_no_cache_folder_outside_comfyui_means_nothing_to_do(fake, monkeypatch):
    monkeypatch.delenv(comfy_bridge.CACHE_ENV)
    monkeypatch.setitem(sys.modules, "folder_paths", None)  # not running inside ComfyUI
    assert compile_cache.before_sampling(_patcher(), None, LATENT) is None and fake.loaded == []


def test_a_compiled_run_hot_loads_this_builds_files_once_per_process_and_writes_its_own(fake, tmp_path):
    folder = tmp_path / "compile"
    folder.mkdir()
    (folder / f"{_prefix()}-other-size.bin").write_bytes(b"graphs of another size")
    (folder / "torch-0.0-some-gpu-sm80-key.bin").write_bytes(b"another torch build or GPU")
    path = compile_cache.before_sampling(_patcher(), None, LATENT)
    assert fake.loaded == [b"graphs of another size"]
    assert os.path.dirname(path) == str(folder) and os.path.basename(path).startswith(_prefix() + "-")
    fake.have = b"the graphs of this run"
    compile_cache.after_sampling(path)
    with open(path, "rb") as f:
        assert f.read() == b"the graphs of this run"
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert not [n for n in os.listdir(folder) if n.startswith(".partial-")]
    # the next run of this process reads nothing again, and writes only when it has more
    assert compile_cache.before_sampling(_patcher(), None, LATENT) == path and len(fake.loaded) == 1
    mtime = os.stat(path).st_mtime_ns
    compile_cache.after_sampling(path)
    assert os.stat(path).st_mtime_ns == mtime
    fake.have = b"the graphs of this run, and another"
    compile_cache.after_sampling(path)
    with open(path, "rb") as f:
        assert f.read() == fake.have


def test_a_torch_without_cache_artifacts_is_said_once_and_nothing_is_done(fake, monkeypatch, caplog):
    monkeypatch.setattr(torch, "compiler", SimpleNamespace())
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        assert compile_cache.before_sampling(_patcher(), None, LATENT) is None
        assert compile_cache.before_sampling(_patcher(), None, LATENT) is None
    said = [r.getMessage() for r in caplog.records if "no compile cache artifacts" in r.getMessage()]
    assert len(said) == 1 and not any(r.levelno >= logging.WARNING for r in caplog.records)


def test_the_file_is_per_size_and_compile_scope(fake):
    a = compile_cache.before_sampling(_patcher(), None, LATENT)
    b = compile_cache.before_sampling(_patcher(), None, (1, 16, 21, 60, 104))
    whole = _patcher()
    whole.wrappers = {"apply_model": {"torch.compile": [_compile_wrapper(["diffusion_model"])]}}
    c = compile_cache.before_sampling(whole, None, LATENT)
    assert len({a, b, c}) == 3 and a == compile_cache.before_sampling(_patcher(), None, LATENT)


def test_a_run_that_finds_its_file_whole_does_not_write_it_again(fake, tmp_path):
    path = compile_cache.before_sampling(_patcher(), None, LATENT)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:  # written by an earlier process
        f.write(b"everything this run needs")
    compile_cache._loaded.clear()
    compile_cache.before_sampling(_patcher(), None, LATENT)
    fake.have = b"everything"  # this process found part of it: never written over the whole file
    compile_cache.after_sampling(path)
    with open(path, "rb") as f:
        assert f.read() == b"everything this run needs"


def test_an_unreadable_file_is_logged_once_and_the_others_still_load(fake, tmp_path, caplog):
    folder = tmp_path / "compile"
    folder.mkdir()
    (folder / f"{_prefix()}-a.bin").write_bytes(b"corrupt bytes")
    (folder / f"{_prefix()}-b.bin").write_bytes(b"good")
    (folder / f"{_prefix()}-c.bin").write_bytes(b"raise")
    with caplog.at_level(logging.INFO, logger="wan_sage"):
        assert compile_cache.before_sampling(_patcher(), None, LATENT) is not None
    assert fake.loaded == [b"good"]
    said = [r.getMessage() for r in caplog.records if "could not be read" in r.getMessage()]
    assert len(said) == 2 and all("compiled again" in x for x in said)
    assert [r.getMessage() for r in caplog.records if "hot-loaded" in r.getMessage()] == [
        f"wan-sage: hot-loaded 1 torch.compile cache file(s) from {folder}"]


def test_a_failure_to_write_is_logged_once_leaves_no_partial_file_and_never_raises(fake, tmp_path, monkeypatch, caplog):
    path = compile_cache.before_sampling(_patcher(), None, LATENT)
    fake.have = b"graphs"

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(compile_cache.os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        compile_cache.after_sampling(path)
        compile_cache.after_sampling(path)
    assert not os.path.exists(path) and os.listdir(os.path.dirname(path)) == []
    assert sum("could not be written" in r.getMessage() for r in caplog.records) == 1
    monkeypatch.undo()


def test_the_sage_patch_wrapper_keeps_a_compiled_runs_caches(fake, tmp_path, monkeypatch):
    from wan_sage.attention import stats
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    from wan_sage.nodes import sage_patch
    monkeypatch.setattr(comfy_bridge, "send_event", lambda *a: None)
    patcher = _patcher()
    ov = SageAttentionOverride(PatchConfig())
    patcher.model_options["transformer_options"]["optimized_attention_override"] = ov
    guider = SimpleNamespace(model_patcher=patcher, model_options=patcher.model_options, cfg=1.0)

    def executor(*args, **kwargs):
        stats.record(ov.patch_id, kernel="sage2_sm90")
        fake.have = b"compiled while sampling"
        return "sampled"
    executor.class_obj = guider
    wrapper = sage_patch._stats_wrapper(ov.patch_id, "t")
    assert wrapper(executor, torch.zeros(LATENT), torch.zeros(LATENT), object(), torch.linspace(1, 0, 5)) == "sampled"
    files = os.listdir(tmp_path / "compile")
    assert len(files) == 1 and (tmp_path / "compile" / files[0]).read_bytes() == b"compiled while sampling"


INDUCTOR_CHILD = textwrap.dedent("""
    import importlib.util, sys, torch
    from torch._dynamo.utils import counters
    folder, mode, root = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = importlib.util.spec_from_file_location("wan_sage", root + "/__init__.py", submodule_search_locations=[root])
    sys.modules["wan_sage"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["wan_sage"])
    from wan_sage.nodes import compile_cache
    prefix = compile_cache.build_prefix(torch, torch.device("cpu"))
    if mode == "load":
        assert compile_cache.load(folder, prefix, torch) == 1
    f = torch.compile(lambda x: torch.nn.functional.gelu(x * 2.0 + 1.0).sum(dim=-1), backend="inductor")
    f(torch.randn(8, 16))
    if mode == "save":
        assert compile_cache.save(f"{folder}/{prefix}-key.bin", torch)
    print("hits", counters["inductor"]["fxgraph_cache_hit"], "misses", counters["inductor"]["fxgraph_cache_miss"])
""")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor on the CPU needs a C++ compiler (g++)")
def test_a_fresh_process_with_empty_inductor_caches_finds_the_graphs_a_saved_file_holds(tmp_path):
    """Real torch: process 1 compiles and writes the file; process 2, with inductor's and Triton's caches
    empty, hot-loads it and compiles nothing."""
    folder = tmp_path / "wan_sage" / "compile"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = []
    for mode in ("save", "load"):
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{mode}"),
                   TRITON_CACHE_DIR=str(tmp_path / f"triton-{mode}"), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
        done = subprocess.run([sys.executable, "-c", INDUCTOR_CHILD, str(folder), mode, root], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        out.append(done.stdout.split())
    assert out[0][1] == "0" and int(out[0][3]) >= 1   # process 1 compiled
    assert int(out[1][1]) >= 1 and out[1][3] == "0"   # process 2 found every graph in the loaded file
