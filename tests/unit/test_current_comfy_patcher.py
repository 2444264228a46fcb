"""Newer-ComfyUI code paths, tested against their documented signatures with stand-in objects
(no ComfyUI import): PREPARE_SAMPLING kwargs, dynamic VRAM, patcher free memory, chaining to a
ModelAttentionBackend-style closure, the displacement warning.  The stand-ins written after ComfyUI
0.38's code, one per seam, are in test_current_comfy_*.py (docs/compatibility.md)."""
import logging
from types import SimpleNamespace

import pytest
import torch

from fakegpu import qkv
from wan_sage.attention import stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.nodes import comfy_bridge
from wan_sage.nodes import estimator
from wan_sage.nodes import sage_patch


class Base:
    """Stands in for comfy.model_base.WAN21: the shared BaseModel."""

    def __init__(self):
        self.diffusion_model = SimpleNamespace(dim=5120, ffn_dim=13824, num_heads=40, blocks=[0] * 40, in_dim=16,
                                               out_dim=16, patch_size=(1, 2, 2), img_emb=None)
        self.model_config = SimpleNamespace(unet_config={"model_type": "t2v", "dim": 5120})
        self.latent_format = SimpleNamespace(latent_channels=16)
        self.manual_cast_dtype = None

    def get_dtype(self):
        return torch.bfloat16

    def parameters(self):
        return iter([torch.zeros(1, dtype=torch.bfloat16)])

    def memory_required(self, input_shape, cond_shapes={}):
        return 123


class Patcher:
    def __init__(self, dynamic=False):
        self.model = Base()
        self.load_device = torch.device("cpu")
        self.model_options = {"transformer_options": {}}
        self._dynamic = dynamic

    def model_size(self):
        return 1 << 30

    def is_dynamic(self):
        return self._dynamic

    def get_model_object(self, name):
        return getattr(self.model, name)


@pytest.fixture
def roomy(monkeypatch):
    monkeypatch.setattr(comfy_bridge, "capacity", lambda model: 200 << 30)
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 400 << 20)
    monkeypatch.setattr(comfy_bridge, "vae_dtype_size", lambda dev: 2)   # bf16, as ComfyUI decodes a Wan VAE on CUDA


@pytest.mark.parametrize("dynamic", [False, True])
def test_prepare_wrapper_forwards_new_kwargs_and_swaps_only_on_the_legacy_path(roomy, dynamic):
    m = Patcher(dynamic)
    seen = {}

    def executor(model, noise_shape, conds, *args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        seen["mr"] = model.model.__dict__.get("memory_required")
        return "loaded"
    w = estimator._prepare_wrapper(estimator.Settings())
    out = w(executor, m, [1, 16, 21, 90, 160], {}, {"transformer_options": {}}, force_full_load=True, force_offload=False)
    assert out == "loaded"
    assert seen["kwargs"] == {"force_full_load": True, "force_offload": False} and len(seen["args"]) == 1
    if dynamic:
        assert seen["mr"] is None
    else:
        assert isinstance(seen["mr"], estimator.MemoryRequired)
        # the reservation in force: the room the Wan 2.1 VAE decode that follows takes (its bf16 memory_used_decode
        # for a 90 x 160 latent plus 1.1 x the VAE, and the workspace of its last 96-channel convolution, input
        # 6 x 722 x 1282 and output 4 x 720 x 1280), more than the sampling's own 6.5-8 GiB
        assert seen["mr"](input_shape=[1, 16, 21, 90, 160]) == (int(7000 * 90 * 160 * 64 * 2 + 1.1 * 126_892_531 * 2)
                                                               + 96 * (6 * 722 * 1282 + 4 * 720 * 1280) * 2)
    assert "memory_required" not in m.model.__dict__


def test_the_estimate_logged_when_sampling_starts_has_the_nodes_cfg_and_the_same_reservation(roomy, caplog):
    m = Patcher()
    texts = {}
    for cfg in (1.0, 5.0):
        caplog.clear()
        w = estimator._prepare_wrapper(estimator.Settings(), cfg)
        with caplog.at_level(logging.INFO, logger="wan_sage"):
            w(lambda model, *a, **k: model.model.memory_required([1, 16, 21, 90, 160]), m, [1, 16, 21, 90, 160], {},
              {"transformer_options": {}})
        (texts[cfg],) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("wan-sage estimate:")]
    assert "cfg 1: no uncond pass" in texts[1.0] and "cfg batched (2 rows)" not in texts[1.0]
    assert "cfg 5: cond and uncond one after the other" in texts[5.0] and "cfg batched (2 rows)" in texts[5.0]
    # one row per forward is planned either way: ComfyUI asks for the rows it batches
    line = [ln for ln in texts[1.0].splitlines() if "reservation in force" in ln]
    assert line and line == [ln for ln in texts[5.0].splitlines() if "reservation in force" in ln]


def test_memory_required_accepts_keyword_input_shape_and_extra_kwargs(roomy):
    m = Patcher()
    fn, est = estimator.sampling_plan(m, [1, 16, 21, 90, 160], m.model_options,
                                      estimator.Settings(policy=estimator.POLICIES[1]))
    assert fn(input_shape=[1, 16, 21, 90, 160], memory_efficient_attention=True) == est.reservation
    assert est.reservation >= est.comfy_estimate > 0  # the max policy: at least ComfyUI's own figure


def test_patcher_free_memory_reads_the_current_patcher():
    base = Base()
    base.current_patcher = SimpleNamespace(get_free_memory=lambda dev: 77)
    f = comfy_bridge.PatcherFreeMemory(base)
    assert f(torch.device("cpu")) == 77
    import copy
    assert copy.deepcopy(f) is f


def test_chains_to_a_model_attention_backend_closure():
    calls = []

    def backend(*a, **kw):
        calls.append(kw.get("heads"))
        return "backend-output"
    closure = lambda _, *a, **kw: backend(*a, **kw)  # noqa: E731  (set_model_optimized_attention's shape)
    ov = SageAttentionOverride(PatchConfig(), prev=closure)
    q, k, v = qkv()
    assert ov(None, q, k, v, heads=4, low_precision_attention=False, transformer_options={}) == "backend-output"
    assert calls == [4]


def test_outer_sample_wrapper_warns_once_when_displaced_and_closes_the_window(caplog):
    ov = SageAttentionOverride(PatchConfig())
    wrapper = sage_patch._stats_wrapper(ov.patch_id, "t")
    guider = SimpleNamespace(model_options={"transformer_options": {"optimized_attention_override": lambda *a, **k: None}})
    executor = SimpleNamespace(class_obj=guider)

    class Exec:
        class_obj = guider

        def __call__(self, *a, **k):
            stats.record(ov.patch_id, reason="cpu")
            return "sampled"
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert wrapper(Exec()) == "sampled"
        assert wrapper(Exec()) == "sampled"
    assert sum("replaced the Sage attention override" in r.getMessage() for r in caplog.records) == 1
    assert stats.last_runs()[ov.patch_id]["reasons"] == {"cpu": 1}
    guider.model_options["transformer_options"]["optimized_attention_override"] = ov
    assert sage_patch.find_override(guider.model_options["transformer_options"]) is ov
    del executor
