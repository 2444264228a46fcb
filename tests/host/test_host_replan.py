"""Host tier: the reservation planned again between model calls moves a real ComfyUI 0.3.64 patcher's weights.

The estimator's clone of a tiny real Wan model, its load device ``meta`` (the CPU is the only real device here, and
a meta tensor cannot be copied: a weight that is not given its host tensor back fails), is loaded in part as a
streamed sampling's start leaves it.  A lower plan then loads more of it through ComfyUI's own ``partially_load``; a
higher one unloads part through ``partially_unload``; the unload after either gives every host tensor back."""
import pytest
import torch

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

META = torch.device("meta")
SHAPE = [1, 16, 2, 8, 8]


def _partly_loaded(comfy, monkeypatch, free):
    from wan_sage.nodes import comfy_bridge, host_copy, replan
    from wan_sage.nodes.estimator import Settings, apply_estimator
    monkeypatch.setattr(replan, "MIN_MOVE_BYTES", 1)  # the tiny model's weights are under a real partial load's floor
    base = comfy_env.tiny_wan_patcher(num_layers=4)
    m, _, _ = apply_estimator(base, Settings(), SHAPE)
    base.load_device = m.load_device = META
    assert host_copy.install(m)
    c = m.clone()  # the sampler's clone
    c.patch_model(META, lowvram_model_memory=c.model_size() // 4)
    assert c.model.model_lowvram and 0 < c.loaded_size() < c.model_size()
    c.model.current_patcher = c
    monkeypatch.setattr(comfy_bridge, "free_memory", lambda dev: free(c))
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 0)
    return c, {k: (t.data_ptr(), t.detach().clone()) for k, t in m.model.state_dict().items()
               if t.device.type == "cpu"}


def _all_given_back(c, before):
    c.detach()
    for k, t in c.model.state_dict().items():
        assert t.device.type == "cpu", k
        if k in before:
            assert t.data_ptr() == before[k][0], f"{k} was copied back"
            assert torch.equal(t, before[k][1]), k


def test_a_lower_plan_loads_every_weight_the_room_holds(comfy, monkeypatch):
    import comfy.model_management as mm
    from wan_sage.nodes import replan
    c, before = _partly_loaded(comfy, monkeypatch,
                               lambda c: int(mm.minimum_inference_memory()) + c.model_size() - c.loaded_size())
    start = c.loaded_size()
    replan.begin(c, SHAPE, lambda patcher, shape: 0, 1 << 30)
    assert replan.before_call(c.model) == 0  # the first call
    moved = replan.before_call(c.model)
    assert moved == c.loaded_size() - start > 0
    assert not c.model.model_lowvram  # nothing streams: every Linear on the device (a block's modulation, which
    assert all(m.weight.device == META  # Wan casts at each call, stays where ComfyUI's partial load leaves it)
               for m in c.model.modules() if isinstance(m, torch.nn.Linear))
    assert replan.moves(c.model) == [(2, 1 << 30, 0, moved)]
    _all_given_back(c, before)


def test_a_higher_plan_unloads_to_the_free_memory_it_needs(comfy, monkeypatch):
    import comfy.model_management as mm
    from wan_sage.nodes import replan
    c, before = _partly_loaded(comfy, monkeypatch, lambda c: int(mm.minimum_inference_memory()))
    c.partially_load(META, extra_memory=1 << 40)  # every weight resident: no free memory beyond the minimum
    loaded = c.loaded_size()
    need = loaded // 2
    replan.begin(c, SHAPE, lambda patcher, shape: int(mm.minimum_inference_memory()) + need, 0)
    replan.before_call(c.model)
    moved = replan.before_call(c.model)
    assert -moved == loaded - c.loaded_size() >= need and c.model.model_lowvram
    assert any(t.device.type == "cpu" for t in c.model.parameters())
    _all_given_back(c, before)


def test_comfyui_ggufs_patcher_moves_with_comfyuis_own_methods(comfy, tmp_path):
    """ComfyUI-GGUF's patcher keeps ComfyUI's partial load and unload, so its samplings are planned again; a
    patcher class that replaces them is not."""
    import workflow_check
    from wan_sage.nodes import replan
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    with torch.inference_mode():
        model = comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path)
    assert type(model).__name__ == "GGUFModelPatcher" and replan._comfy_moves(model.clone())

    class OwnMoves(type(model)):
        def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
            return 0

        def __del__(self):  # never initialised here: nothing to clean up
            pass
    assert not replan._comfy_moves(OwnMoves.__new__(OwnMoves))


@pytest.mark.parametrize("compiled", [None, "blocks", "whole model"])
def test_a_sampling_is_planned_again_unless_one_graph_compiles_the_whole_model(comfy, compiled):
    """The estimator's PREPARE_SAMPLING wrapper notes the sampling for the re-plan, except under ComfyUI's
    TorchCompileModel: its one graph would compile again for weights moved between calls."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    from wan_sage.nodes import comfy_bridge, estimator, replan
    m, _, _ = estimator.apply_estimator(comfy_env.tiny_wan_patcher(num_layers=2), estimator.Settings(), SHAPE)
    if compiled == "blocks":
        m = m.clone()
        set_torch_compile_wrapper(m, backend="inductor", keys=[f"diffusion_model.blocks.{i}" for i in range(2)])
    elif compiled == "whole model":
        m = TorchCompileModel.execute(model=m, backend="inductor")[0]
    scope = comfy_bridge.compile_scope(m, m.model_options)
    assert (scope and scope[0]) == compiled
    replan.end(m.model)
    prepare = estimator._prepare_wrapper(estimator.Settings())
    assert prepare(lambda *a, **k: "loaded", m, SHAPE, {}, m.model_options) == "loaded"
    assert (replan._get(m.model) is not None) is (compiled != "whole model")
    replan.end(m.model)
