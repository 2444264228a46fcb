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


def _on_a_gpu(monkeypatch):
    """ComfyUI's VRAM state as on an NVIDIA GPU with enough memory for a partial load (booted with --cpu here: no
    floor of weights kept loaded, MIN_WEIGHT_MEMORY_RATIO 0), and the tiny models' weights above a real partial
    load's floor."""
    import comfy.model_management as mm
    from wan_sage.nodes import replan
    monkeypatch.setattr(mm, "vram_state", mm.VRAMState.NORMAL_VRAM)
    monkeypatch.setattr(mm, "MIN_WEIGHT_MEMORY_RATIO", 0.0)
    monkeypatch.setattr(replan, "MIN_MOVE_BYTES", 1)


def _partly_loaded(comfy, monkeypatch, free):
    from wan_sage.nodes import comfy_bridge, host_copy
    from wan_sage.nodes.estimator import Settings, apply_estimator
    _on_a_gpu(monkeypatch)
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
def test_a_sampling_is_planned_again_unless_one_graph_compiles_the_whole_model(comfy, monkeypatch, compiled):
    """The estimator's PREPARE_SAMPLING wrapper notes the sampling for the re-plan, except under ComfyUI's
    TorchCompileModel: its one graph would compile again for weights moved between calls."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    from wan_sage.nodes import comfy_bridge, estimator, replan
    monkeypatch.setattr(replan, "_placed_in_part", lambda patcher: True)  # the tiny model loads on the CPU here
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


def test_a_sampling_of_a_setup_seen_before_loads_for_what_it_held(comfy, monkeypatch, tmp_path):
    """The estimator's PREPARE_SAMPLING wrapper: where an earlier sampling of the same setup kept what its calls
    held, ComfyUI's load sizes the partial load for that figure with the margin (its one-row memory_required), the
    cond + uncond figure stays the plan's, and the model's own memory_required is back afterwards."""
    from dataclasses import replace

    from wan_sage.nodes import comfy_bridge, estimator, held_record, replan
    monkeypatch.setattr(replan, "_placed_in_part", lambda patcher: True)
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(held_record, "_here", {})
    monkeypatch.setattr(replan, "MEASURED_FLOOR", 1 << 20)  # the tiny model's whole plan is under the real floor
    real = estimator.sampling_plan

    def streamed(*a, **k):  # the tiny model fits anywhere: the verdict that its weights stream
        fn, est = real(*a, **k)
        return estimator.MemoryRequired(replace(fn.setup, streamed=True)), replace(est, streamed=True)
    monkeypatch.setattr(estimator, "sampling_plan", streamed)
    m, _, _ = estimator.apply_estimator(comfy_env.tiny_wan_patcher(num_layers=2), estimator.Settings(), SHAPE)
    fn, _ = estimator.sampling_plan(m, SHAPE, m.model_options, estimator.Settings())
    one, two = SHAPE, [2 * SHAPE[0]] + SHAPE[1:]
    planned = fn(one)
    prepare = estimator._prepare_wrapper(estimator.Settings())
    seen = []

    def load(model, *a, **k):
        seen.append((model.model.memory_required(one), model.model.memory_required(two)))
        return "loaded"
    replan.end(m.model)
    assert prepare(load, m, SHAPE, {}, m.model_options) == "loaded"
    assert seen[-1] == (planned, fn(two))  # nothing kept: the plan
    held_record.keep(held_record.record_key(fn.setup, comfy_bridge.device_of(m)), planned // 4)
    assert prepare(load, m, SHAPE, {}, m.model_options) == "loaded"
    start = replan.measured_reservation(planned // 4)
    assert start < planned and seen[-1] == (start, fn(two))
    assert replan.lowered_by_measure(m.model) and "memory_required" not in m.model.__dict__
    replan.end(m.model)


UNIT = comfy_env.GAP_UNIT


def _gap_filled(comfy, monkeypatch, force_cast=False):
    """comfy_env.gap_filled_patcher's three Linears loaded for 11 units (the 6 and the 4 kept, the 5 streaming), on
    the CPU (a meta tensor holds no values to compare), taken as a GPU's."""
    from wan_sage.nodes import replan
    _on_a_gpu(monkeypatch)
    monkeypatch.setattr(replan, "_placed_in_part", lambda patcher: True)
    return comfy_env.gap_filled_patcher(torch.device("cpu"), force_cast)


def _free_for(monkeypatch, p, budget):
    """Free memory such that load_models_gpu would have ``budget`` bytes of ``p``'s weights loaded (plan 0)."""
    import comfy.model_management as mm
    from wan_sage.nodes import comfy_bridge
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 0)
    monkeypatch.setattr(comfy_bridge, "free_memory",
                        lambda dev: int(mm.minimum_inference_memory()) + budget - p.loaded_size())


def _lora_applied_once(p, patched):
    x = torch.randn(3, 64)
    return torch.allclose(p.model.c(x), x @ patched.T, atol=1e-5)


def _counted(p, comfy):
    """Whether the patcher counts every module loaded whole as loaded."""
    return p.loaded_size() == sum(comfy.model_management.module_size(m) for m in (p.model.a, p.model.b, p.model.c)
                                  if getattr(m, "comfy_patched_weights", False) is True)


@pytest.mark.parametrize("force_cast", [False, True])
def test_a_lower_plan_never_sets_a_module_on_the_device_to_stream(comfy, monkeypatch, force_cast):
    """With 13 units ComfyUI's load would keep the 6 and the 5 and set the 4 to stream where it lies (its LoRA,
    merged at the first load, applied again at each call, and its bytes counted off; with every module cast per
    call, left on the device uncounted).  No budget of more than 10 units keeps the 4 and loads anything, so
    nothing moves."""
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch, force_cast)
    assert _lora_applied_once(p, patched)
    _free_for(monkeypatch, p, 13 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: 0, 1 << 30)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0
    assert p.loaded_size() == 10 * UNIT and _counted(p, comfy)
    assert _lora_applied_once(p, patched)


def test_a_load_comfyui_would_set_a_module_to_stream_in_is_placed_again(comfy, monkeypatch, caplog):
    """The load with 13 units as ComfyUI does it: the 4 is set to stream on the device; the model is detached and
    loaded again for the larger plan, its LoRA applied once."""
    import logging
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch)
    monkeypatch.setattr(replan, "safe_budget", lambda order, budget, least: budget)
    _free_for(monkeypatch, p, 13 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: 0, 1 << 30)
    replan.before_call(p.model)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        replan.before_call(p.model)
    assert "1 module(s) on the device were set to stream" in caplog.text
    assert _lora_applied_once(p, patched)
    assert p.loaded_size() == sum(comfy.model_management.module_size(m) for m in (p.model.a, p.model.b, p.model.c)
                                  if not hasattr(m, "prev_comfy_cast_weights"))


def test_a_lower_plan_with_room_for_every_weight_loads_them_all(comfy, monkeypatch):
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch)
    _free_for(monkeypatch, p, 16 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: 0, 1 << 30)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 5 * UNIT
    assert not p.model.model_lowvram and _lora_applied_once(p, patched)


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")


def test_a_load_and_its_reload_that_fail_leave_every_weight_that_can_stream_streaming(comfy, monkeypatch, caplog):
    """The lowered plan's load fails (ComfyUI detaches the model) and so does the load for the larger plan after it:
    the sampling goes on, with the model placed as a load of no weights places it (every Linear streams, the LoRA
    applied once at each call), and nothing more moves for a lower plan."""
    import logging
    import comfy.model_patcher as mp
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch)
    _free_for(monkeypatch, p, 16 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: 0, 1 << 30)
    replan.before_call(p.model)
    real = mp.ModelPatcher.patch_weight_to_device
    loads = {"n": 0}

    def fails_twice(self, *args, **kwargs):
        loads["n"] += 1
        if loads["n"] <= 2:
            _oom()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(mp.ModelPatcher, "patch_weight_to_device", fails_twice)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        replan.before_call(p.model)  # raised the second OutOfMemoryError before
    assert "it streams every weight it can" in caplog.text
    assert p.model.model_lowvram
    assert all(hasattr(m, "prev_comfy_cast_weights") for m in (p.model.a, p.model.b, p.model.c))
    assert _counted(p, comfy) and _lora_applied_once(p, patched)
    assert replan.before_call(p.model) == 0 and len(replan.moves(p.model)) == 1  # a lower plan moves nothing more


def test_an_unload_that_stops_midway_places_the_model_again_and_leaves_no_patch_behind(comfy, monkeypatch, caplog):
    """ComfyUI's partially_unload raises after moving one module: that module is marked streaming with its LoRA as a
    per-call patch, uncounted.  The model is placed again for the higher plan, counted as it lies; after ComfyUI's
    unload, a clone without the LoRA that streams the 4 runs it without that LoRA."""
    import logging
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch)
    p.partially_load(torch.device("cpu"), extra_memory=1 << 40)  # every weight loaded, the LoRA merged
    assert not p.model.model_lowvram and p.loaded_size() == 15 * UNIT
    _free_for(monkeypatch, p, 16 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: int(mm.minimum_inference_memory()) + 8 * UNIT, 0)
    replan.before_call(p.model)
    real, moved = mp.move_weight_functions, {"n": 0}

    def fails_on_the_second(m, device_to):
        moved["n"] += 1
        if moved["n"] == 2:
            raise RuntimeError("host allocation failed (raised by the test)")
        return real(m, device_to)

    monkeypatch.setattr(mp, "move_weight_functions", fails_on_the_second)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        replan.before_call(p.model)
    monkeypatch.setattr(mp, "move_weight_functions", real)
    assert "unloading weights between steps failed" in caplog.text
    assert _counted(p, comfy) and p.loaded_size() <= 8 * UNIT  # placed for the higher plan, counted as it lies
    assert _lora_applied_once(p, patched)
    p.detach()  # ComfyUI's unload when the prompt ends
    plain = mp.ModelPatcher(p.model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    plain.patch_model(torch.device("cpu"), lowvram_model_memory=7 * UNIT)  # the 4 does not fit: it streams
    x = torch.randn(3, 64)
    assert torch.allclose(plain.model.c(x), x @ plain.model.c.weight.detach().T, atol=1e-5)  # no stale LoRA


def test_after_a_failed_move_a_rise_of_the_plan_still_unloads(comfy, monkeypatch):
    """A failed lowered load keeps the sampling from loading more, not from unloading where a later call's plan
    rises (a block that ran eagerly brings the eager floor back)."""
    import comfy.model_management as mm
    import comfy.model_patcher as mp
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch)
    _free_for(monkeypatch, p, 16 * UNIT)
    plan = {"bytes": 0}
    replan.begin(p, SHAPE, lambda patcher, shape: plan["bytes"], 1 << 30)
    replan.before_call(p.model)
    real = mp.ModelPatcher.patch_weight_to_device
    monkeypatch.setattr(mp.ModelPatcher, "patch_weight_to_device", _oom)
    replan.before_call(p.model)  # fails; placed again for the start's 1 GiB plan would fail too: every Linear streams
    monkeypatch.setattr(mp.ModelPatcher, "patch_weight_to_device", real)
    p.partially_load(torch.device("cpu"), extra_memory=10 * UNIT)  # as a later load might place it
    loaded = p.loaded_size()
    assert loaded > 0
    plan["bytes"] = (1 << 30) + int(mm.minimum_inference_memory()) + 16 * UNIT  # above the placement's plan
    assert replan.before_call(p.model) < 0 and p.loaded_size() < loaded
    assert _lora_applied_once(p, patched)
