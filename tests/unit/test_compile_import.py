"""The imports of a process's first torch.compile made on a thread of their own (nodes/compile_import.py): the
node's compiled blocks are made at their first call, after those imports, and nothing imports TorchInductor from
two threads at once.  torch.compile is a stand-in here, except in the last test, which runs a fresh process."""
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from types import SimpleNamespace

from wan_sage.nodes import comfy_bridge, compile_cache, compile_import, worker


@pytest.fixture
def fresh(monkeypatch):
    """compile_import as in a process that has not started its worker."""
    monkeypatch.setattr(compile_import, "_worker", worker.Worker("wan-sage-compile-imports"))
    yield compile_import
    compile_import.wait()


def _recording_compile(monkeypatch, gate=None):
    made = []

    def fake_compile(module, **kwargs):
        if gate is not None:
            assert gate.wait(10), "the import thread was never let go"
        made.append((module, kwargs, threading.current_thread().name))
        return lambda *a, **k: ("compiled", module, a, k)
    monkeypatch.setattr(torch, "compile", fake_compile)
    return made


def test_the_imports_start_once_per_process_with_the_nodes_arguments(fresh, monkeypatch):
    made = _recording_compile(monkeypatch)
    kwargs = {"backend": "inductor", "options": {"dynamic_scale_rblock": False}, "mode": None}
    assert fresh.start(kwargs) is True
    assert fresh.start({"backend": "cudagraphs"}) is False
    fresh.wait()
    assert len(made) == 1
    module, got, thread = made[0]
    assert isinstance(module, torch.nn.Identity) and got == kwargs and thread == "wan-sage-compile-imports"


def test_a_block_is_compiled_at_its_first_call_only_after_the_imports_are_done(fresh, monkeypatch):
    gate = threading.Event()
    made = _recording_compile(monkeypatch, gate)
    fresh.start({"backend": "inductor"})
    block = torch.nn.Linear(2, 2)
    lazy = fresh.LazyCompile(block, {"backend": "inductor", "options": {}})
    assert made == [] and lazy.fn is None  # the node's run compiles nothing

    out = []
    caller = threading.Thread(target=lambda: out.append(lazy(1, x=2)))
    caller.start()
    caller.join(0.3)
    assert caller.is_alive() and out == []  # the first call waits for the import thread
    gate.set()
    caller.join(10)
    assert out == [("compiled", block, (1,), {"x": 2})]
    assert [m[0] for m in made] == [made[0][0], block]  # the import thread's call came first
    assert made[1][1] == {"backend": "inductor", "options": {}}

    lazy(3)
    assert len(made) == 2  # made once, called again


def test_wait_returns_at_once_where_no_import_was_started(fresh, monkeypatch):
    made = _recording_compile(monkeypatch)
    fresh.wait()
    assert fresh.LazyCompile(torch.nn.Identity(), {})(5)[0] == "compiled" and len(made) == 1


def test_a_failed_import_leaves_the_failure_to_the_first_compiled_call(fresh, monkeypatch):
    def failing(module, **kwargs):
        raise RuntimeError("no inductor here")
    monkeypatch.setattr(torch, "compile", failing)
    fresh.start({"backend": "inductor"})
    fresh.wait()
    with pytest.raises(RuntimeError, match="no inductor here"):
        fresh.LazyCompile(torch.nn.Identity(), {})(1)
    ran = []
    assert fresh.later(ran.append, "after the failed job")  # the worker goes on
    fresh.wait()
    assert ran == ["after the failed job"]


def test_a_job_that_raises_systemexit_leaves_the_worker_running(fresh, monkeypatch):
    _recording_compile(monkeypatch)
    fresh.start({"backend": "inductor"})

    def exits():
        raise SystemExit(3)
    ran = []
    fresh.later(exits)
    fresh.later(ran.append, "next")
    fresh.wait()
    assert ran == ["next"] and compile_import._worker.thread.is_alive()


def test_jobs_run_on_the_worker_in_order_and_none_without_it(fresh, monkeypatch):
    made = _recording_compile(monkeypatch)
    assert fresh.later(print) is False and compile_import._worker.thread is None
    fresh.start({"backend": "inductor"})
    order = []
    assert fresh.later(lambda: order.append(("job", len(made), threading.current_thread().name)))
    fresh.wait()
    assert compile_import._worker.thread is not None and order == [("job", 1, "wan-sage-compile-imports")]  # after imports


def test_a_hot_load_on_another_thread_waits_for_the_workers_jobs(fresh, monkeypatch, tmp_path):
    gate = threading.Event()
    made = _recording_compile(monkeypatch, gate)
    fresh.start({"backend": "inductor"})
    (tmp_path / "torch-x-cpu-abc.bin").write_bytes(b"artifacts")
    seen = []

    class Compiler:
        @staticmethod
        def load_cache_artifacts(data):
            seen.append(len(made))
            return object()
    monkeypatch.setattr(compile_cache, "_loaded", set())
    loader = threading.Thread(target=compile_cache.load, args=(str(tmp_path), "torch-x-cpu",
                                                               SimpleNamespace(compiler=Compiler)))
    loader.start()
    loader.join(0.3)
    assert loader.is_alive() and seen == []
    gate.set()
    loader.join(10)
    assert seen == [1]  # after the imports


def _marked_patcher(node: bool):
    """A patcher compiled one block at a time, by Wan Compile Blocks (``node``) or by another compile."""
    compiled_module_dict = {f"diffusion_model.blocks.{i}": object() for i in range(40)}

    def wrapper(executor, *args, **kwargs):
        return compiled_module_dict, executor
    if node:
        setattr(wrapper, comfy_bridge.COMPILE_BLOCKS_MARK, True)
    dm = SimpleNamespace(dim=5120, ffn_dim=13824, num_heads=40, blocks=[0] * 40, in_dim=16, out_dim=16,
                         patch_size=(1, 2, 2), img_emb=None)
    base = SimpleNamespace(diffusion_model=dm, model_config=SimpleNamespace(unet_config={"model_type": "t2v"}),
                           latent_format=SimpleNamespace(latent_channels=16), model_lowvram=False)
    return SimpleNamespace(model=base, wrappers={"apply_model": {comfy_bridge.COMPILE_WRAPPER_KEY: [wrapper]}},
                           object_patches={}, model_options={"transformer_options": {},
                                                             comfy_bridge.COMPILE_KWARGS_KEY: {"backend": "inductor"}},
                           load_device=torch.device("cpu"))


@pytest.mark.parametrize("node", [True, False])
def test_the_hot_load_goes_to_the_worker_only_for_a_model_wan_compile_blocks_compiles(fresh, monkeypatch,
                                                                                        tmp_path, node):
    _recording_compile(monkeypatch)
    fresh.start({"backend": "inductor"})
    threads = []

    class Compiler:
        @staticmethod
        def load_cache_artifacts(data):
            threads.append(threading.current_thread().name)
            return object()

        @staticmethod
        def save_cache_artifacts():
            return None
    monkeypatch.setattr(torch, "compiler", Compiler)
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache, "_loaded", set())
    (tmp_path / "compile").mkdir()
    prefix = compile_cache.build_prefix(torch, torch.device("cpu"))
    (tmp_path / "compile" / f"{prefix}-abc.bin").write_bytes(b"artifacts")
    path = compile_cache.before_sampling(_marked_patcher(node), None, (1, 16, 21, 90, 160))
    assert path is not None
    fresh.wait()
    assert threads == ["wan-sage-compile-imports" if node else threading.current_thread().name]


def test_in_a_fresh_process_the_thread_makes_the_imports_a_first_torch_compile_makes():
    code = textwrap.dedent("""
        import importlib.util, sys, torch
        root = sys.argv[1]
        spec = importlib.util.spec_from_file_location("wan_sage", root + "/__init__.py",
                                                      submodule_search_locations=[root])
        sys.modules["wan_sage"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["wan_sage"])
        from wan_sage.nodes import compile_import
        assert "torch._inductor.compile_fx" not in sys.modules
        compile_import.start({"backend": "inductor", "options": {"dynamic_scale_rblock": False}, "mode": None,
                              "fullgraph": False, "dynamic": None})
        compile_import.wait()
        assert "torch._inductor.compile_fx" in sys.modules
        lazy = compile_import.LazyCompile(torch.nn.Linear(4, 4), {"backend": "eager"})
        x = torch.randn(2, 4)
        assert torch.equal(lazy(x), lazy.module(x))
        print("ok")
        """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
