"""The nodes' failure paths are seen: each failure that the nodes survive is logged once with its
reason, and the handlers catch only what they mean to (no ComfyUI import: stand-in modules)."""
import logging
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from wan_sage.nodes import comfy_bridge, estimator, log_once, sage_patch


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(log_once, "warned", set())


def _module(monkeypatch, name, **attrs):
    """Install a stand-in module (and its parent packages) for ``name``."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        package = types.ModuleType(".".join(parts[:i]))
        package.__path__ = []                                          # a package: submodules are imported
        monkeypatch.setitem(sys.modules, package.__name__, package)
    mod = sys.modules[name]
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def _warnings(caplog, text):
    return [r for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def test_a_wanmodel_import_failure_is_logged_once_and_not_read_as_not_wan(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "comfy.ldm.wan.model", None)       # the import fails
    model = SimpleNamespace(model=SimpleNamespace(diffusion_model=object()))
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert comfy_bridge.is_wan(model) is False
        assert comfy_bridge.is_wan(model) is False
    (record,) = _warnings(caplog, "WanModel could not be imported")
    assert "import of comfy.ldm.wan.model halted" in record.getMessage()


def test_a_wan_model_is_recognised_without_a_warning(monkeypatch, caplog):
    class WanModel:
        pass
    _module(monkeypatch, "comfy.ldm.wan.model", WanModel=WanModel)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert comfy_bridge.is_wan(SimpleNamespace(model=SimpleNamespace(diffusion_model=WanModel())))
        assert not comfy_bridge.is_wan(SimpleNamespace(model=SimpleNamespace(diffusion_model=object())))
    assert not caplog.records


def test_the_node_cache_honours_wan_sage_cache_dir(monkeypatch, tmp_path):
    _module(monkeypatch, "folder_paths", get_user_directory=lambda: str(tmp_path / "ComfyUI" / "user"))
    monkeypatch.delenv("WAN_SAGE_CACHE_DIR", raising=False)
    assert comfy_bridge.cache_dir() == str(tmp_path / "ComfyUI" / "user" / "wan_sage")
    monkeypatch.setenv("WAN_SAGE_CACHE_DIR", str(tmp_path / "shared-cache"))
    assert comfy_bridge.cache_dir() == str(tmp_path / "shared-cache")
    monkeypatch.setenv("WAN_SAGE_CACHE_DIR", "")                          # empty: as if unset
    assert comfy_bridge.cache_dir() == str(tmp_path / "ComfyUI" / "user" / "wan_sage")
    monkeypatch.setitem(sys.modules, "folder_paths", None)               # outside ComfyUI
    assert comfy_bridge.cache_dir() is None


def test_a_failed_stats_event_is_logged_once_and_no_server_is_silent(monkeypatch, caplog):
    class Closed:
        def send_sync(self, event, data):
            raise RuntimeError("Event loop is closed")
    _module(monkeypatch, "server", PromptServer=SimpleNamespace(instance=Closed()))
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        comfy_bridge.send_event("wan_sage.stats", {})
        comfy_bridge.send_event("wan_sage.stats", {})
    (record,) = _warnings(caplog, "to the web panel failed")
    assert "RuntimeError: Event loop is closed" in record.getMessage()
    caplog.clear()
    monkeypatch.setitem(sys.modules, "server", None)
    comfy_bridge.send_event("wan_sage.stats", {})
    assert not caplog.records


def test_capacity_skips_only_freed_models(monkeypatch):
    class Freed:
        device = torch.device("cpu")

        def model_loaded_memory(self):
            return None.loaded_size()                                  # the dead weak reference of ComfyUI

    class Loaded:
        device = torch.device("cpu")

        def model_loaded_memory(self):
            return 5
    mm = _module(monkeypatch, "comfy.model_management", get_free_memory=lambda dev: 100,
                 current_loaded_models=[Freed(), Loaded()])
    model = SimpleNamespace(load_device=torch.device("cpu"))
    assert comfy_bridge.capacity(model) == 105

    class Broken(Loaded):
        def model_loaded_memory(self):
            raise RuntimeError("a real bug")
    mm.current_loaded_models = [Broken()]
    with pytest.raises(RuntimeError, match="a real bug"):
        comfy_bridge.capacity(model)


def test_capacity_counts_a_loaded_model_by_the_memory_its_weights_hold(monkeypatch):
    # ComfyUI's count of a loaded model (module sizes) can exceed the memory its tensors hold; unloading it
    # frees only what they hold, each storage once
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    net[1].weight = net[0].weight                                          # one storage, two parameters
    held = sum(t.untyped_storage().nbytes() for t in (net[0].weight, net[0].bias, net[1].bias))
    assert comfy_bridge.device_bytes(net, "cpu") == held

    class Loaded:
        device = torch.device("cpu")

        def __init__(self, counted):
            self.counted = counted
            self.model = SimpleNamespace(model=net)

        def model_loaded_memory(self):
            return self.counted
    _module(monkeypatch, "comfy.model_management", get_free_memory=lambda dev: 100,
            current_loaded_models=[Loaded(held + 4096)])
    model = SimpleNamespace(load_device=torch.device("cpu"))
    assert comfy_bridge.capacity(model) == 100 + held
    import comfy.model_management as mm
    mm.current_loaded_models = [Loaded(held - 8)]                          # counted less than held: the count
    assert comfy_bridge.capacity(model) == 100 + held - 8
    assert comfy_bridge.device_bytes(net, "cuda") == 0 and comfy_bridge.device_bytes(object(), "cpu") is None


def test_comfyui_without_dynamic_vram_and_a_failing_dynamic_check(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "comfy.memory_management", None)     # ComfyUI 0.3.64
    assert comfy_bridge.aimdo_enabled() is False

    class Patcher:
        def is_dynamic(self):
            raise KeyError("model_options")
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert comfy_bridge.is_dynamic(Patcher()) is False
        assert comfy_bridge.is_dynamic(Patcher()) is False
    (record,) = _warnings(caplog, "dynamic VRAM is on failed")
    assert "KeyError" in record.getMessage()


def test_comfyuis_attention_missing_is_logged_once_with_the_fallback(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", None)
    _module(monkeypatch, "comfy.ldm.modules")
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert comfy_bridge.raw_sdpa() is None
        assert comfy_bridge.raw_sdpa() is None
    (record,) = _warnings(caplog, "attention module could not be imported")
    assert "wan-sage's own PyTorch SDPA" in record.getMessage()


def test_a_failing_cond_batch_estimate_is_logged_once_and_sampling_goes_on(monkeypatch, caplog):
    def broken(model):
        raise ValueError("no unet_config")
    monkeypatch.setattr(comfy_bridge, "wan_dims", broken)
    wrapper = estimator._cond_batch_wrapper(estimator.Settings())
    calls = []

    def executor(*args, **kwargs):
        calls.append(args)
        return "sampled"
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        for _ in range(2):
            assert wrapper(executor, SimpleNamespace(), [], torch.zeros(1), 0, {}) == "sampled"
    assert len(calls) == 2
    (record,) = _warnings(caplog, "cond/uncond batching failed")
    assert "ValueError: no unet_config" in record.getMessage()


def test_a_failing_cache_trim_is_logged_once(monkeypatch, caplog):
    def soft_empty_cache():
        raise RuntimeError("CUDA error: unspecified launch failure")
    _module(monkeypatch, "comfy.model_management", soft_empty_cache=soft_empty_cache)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        estimator._trim_after_load(torch.device("cuda", 0))
        estimator._trim_after_load(torch.device("cuda", 0))
        estimator._trim_after_load(torch.device("cpu"))                  # CPU: nothing to trim
    (record,) = _warnings(caplog, "emptying the allocator cache after loading failed")
    assert "unspecified launch failure" in record.getMessage()


def test_the_later_patch_note_failing_is_logged_once(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")
    monkeypatch.setattr(estimator, "setup_for", broken)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        for _ in range(2):
            note = estimator._later_patch_note(None, [1, 16, 2, 8, 8], {}, estimator.Settings(), None)
            assert note == "Sage patch: none on the model here; one after this node is counted when sampling starts"
    (record,) = _warnings(caplog, "Sage patch after the Working-Memory Estimator")
    assert "ZeroDivisionError" in record.getMessage()


def test_an_unreadable_gpu_is_named_in_the_patch_status_and_logged_once(monkeypatch, caplog):
    def unreadable(dev):
        raise RuntimeError("CUDA error: no CUDA-capable device is detected")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sage_patch.kernels, "device_cc", unreadable)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        text = sage_patch.status_text("auto")
        sage_patch.status_text("auto")
    assert "GPU: unreadable (RuntimeError: CUDA error: no CUDA-capable device is detected)" in text
    assert len(_warnings(caplog, "compute capability could not be read")) == 1


def test_an_unreadable_gpu_in_the_estimate_falls_back_to_sm90_and_says_so(monkeypatch, caplog):
    def unreadable(dev):
        raise AssertionError("Torch not compiled with CUDA enabled")
    monkeypatch.setattr(estimator.kernels, "device_cc", unreadable)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert estimator._cc(torch.device("cuda", 0)) is None
        assert estimator._cc(torch.device("cuda", 0)) is None
        assert estimator._cc(torch.device("cpu")) is None
    (record,) = _warnings(caplog, "compute capability of cuda:0 could not be read")
    assert "assumes sm90" in record.getMessage()


@pytest.mark.parametrize("fails", [False, True])
def test_sage_sampling_hands_the_cached_blocks_back_when_it_ends(monkeypatch, fails):
    """The patch's OUTER_SAMPLE wrapper empties the allocator cache after the sampling on a CUDA model, once,
    after the sampler ran (the VAE decode that follows gets the room in one piece), also when the sampling
    raised; on a CPU model it does not."""
    events = []
    _module(monkeypatch, "comfy.model_management", soft_empty_cache=lambda: events.append("trim"))
    wrapper = sage_patch._stats_wrapper("trim-test", "t")

    def run(device):
        class Exec:
            class_obj = SimpleNamespace(model_options={}, model_patcher=SimpleNamespace(load_device=device))

            def __call__(self, *a, **k):
                events.append("sample")
                if fails:
                    raise torch.OutOfMemoryError("fake")
                return "sampled"
        try:
            return wrapper(Exec())
        except torch.OutOfMemoryError:
            return "raised"

    assert run(torch.device("cuda", 0)) == ("raised" if fails else "sampled")
    assert events == ["sample", "trim"]
    events.clear()
    run(torch.device("cpu"))
    assert events == ["sample"]
