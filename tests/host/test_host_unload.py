"""Host tier: the estimator's clone unloads its weights without copying them, in a real ComfyUI 0.3.64.

The load device is ``meta`` (the CPU is the only real device here): ComfyUI's own unload
(``model.to(offload_device)``) cannot copy a meta tensor, so a weight that is not given its host tensor
back fails the unload, and one given back the wrong tensor shows in its data pointer and values."""
import pytest
import torch

import comfy_env
import workflow_check

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

META = torch.device("meta")
KEY = "diffusion_model.blocks.0.self_attn.q.weight"


def _on_meta(comfy, lora: bool):
    from wan_sage.nodes import host_copy
    from wan_sage.nodes.estimator import Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    if lora:  # a LoRA on one weight: ComfyUI backs it up and restores the backup itself
        w = comfy.utils.get_attr(base.model, KEY)
        base.add_patches({KEY: ("diff", (torch.full_like(w, 0.01),))}, 1.0)
    m, est, text = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])
    assert not host_copy.installed(m)  # the CPU is both load and offload device: nothing to keep
    base.load_device = m.load_device = META
    assert host_copy.install(m)
    return base, m


def _gguf_model(tmp_path):
    """The miniature GGUF expert with its LoRA, as ComfyUI-GGUF loads it (call under ``torch.inference_mode``);
    skips without ComfyUI-GGUF or the gguf package."""
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    return comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path)


def _gguf_on_meta(tmp_path):
    """:func:`_gguf_model` through the estimator, its load device ``meta``, its host copies installed."""
    from wan_sage.nodes import host_copy
    from wan_sage.nodes.estimator import Settings, apply_estimator
    model = _gguf_model(tmp_path)
    m, _, _ = apply_estimator(model, Settings(), [1, 16, 2, 8, 8])
    model.load_device = m.load_device = META
    assert host_copy.install(m)
    return m


def _state(model):
    # as_subclass: a GGUF tensor's clone() returns the tensor itself
    return {k: (t.data_ptr(), t.detach().as_subclass(torch.Tensor).clone())
            for k, t in [*model.named_parameters(), *model.named_buffers()]}


@pytest.mark.parametrize("lora", [False, True])
def test_an_unload_gives_the_loaded_weights_their_host_tensors_back(comfy, lora):
    from wan_sage.nodes import host_copy
    base, m = _on_meta(comfy, lora)
    before = _state(m.model)
    for _ in range(2):  # a second load and unload, from a clone as the next prompt's sampler gets it
        c = m.clone()
        c.patch_model(META, lowvram_model_memory=0)
        kept = host_copy.kept_bytes(c)
        assert all(t.device == META for t in c.model.parameters())
        tensors = list(c.model.named_parameters()) + list(c.model.named_buffers())
        assert kept == sum(t.numel() * t.element_size() for k, t in tensors if not (lora and k == KEY))
        c.detach()
        for k, t in [*m.model.named_parameters(), *m.model.named_buffers()]:
            assert t.device.type == "cpu", k
            assert t.data_ptr() == before[k][0], f"{k} was copied back"
            assert torch.equal(t.detach(), before[k][1]), k


def test_stock_comfyui_copies_so_the_test_can_fail(comfy):
    base, m = _on_meta(comfy, False)
    base.patch_model(META, lowvram_model_memory=0)  # the patcher without the estimator
    with pytest.raises(NotImplementedError):
        base.detach()


def test_a_gguf_expert_with_its_lora_keeps_its_quantized_host_tensors(comfy, tmp_path):
    """ComfyUI-GGUF moves a LoRA-patched quantized weight by replacing the tensor object (no backup) and
    the rest with ``module.to``: both come back as the very host tensors, with their quantisation type."""
    from wan_sage.nodes import host_copy

    with torch.inference_mode():
        m = _gguf_on_meta(tmp_path)
        quant = {k: t.tensor_type for k, t in m.model.named_parameters() if getattr(t, "tensor_type", None)
                 is not None and t.tensor_type.name.startswith("Q")}
        assert quant and any(k in m.patches for k in quant)  # quantized weights, some of them with the LoRA
        before = _state(m.model)
        for _ in range(2):
            m.patch_model(META, lowvram_model_memory=0)
            assert host_copy.kept_bytes(m) > 0
            assert all(t.device == META for t in m.model.parameters())
            m.detach()
            for k, t in [*m.model.named_parameters(), *m.model.named_buffers()]:
                assert t.device.type == "cpu" and t.data_ptr() == before[k][0], f"{k} was copied back"
                assert torch.equal(t.detach().as_subclass(torch.Tensor), before[k][1]), k
            assert {k: t.tensor_type for k, t in m.model.named_parameters() if k in quant} == quant


def test_a_gguf_expert_partly_loaded_leaves_its_streamed_modules_on_their_host_tensors(comfy, tmp_path):
    """ComfyUI-GGUF's first partial load copies each module left streaming to the load device and back, to take it
    off the file's memory map; on ``meta`` that copy fails. The estimator's clone keeps its loaded weights on that
    map in any case, and skips the copy: the streamed weights keep their very host tensors, with their LoRA."""
    from wan_sage.nodes import host_copy

    with torch.inference_mode():
        m = _gguf_on_meta(tmp_path)
        before = _state(m.model)
        c = m.clone()  # the sampler's clone
        assert c.mmap_released is False
        c.patch_model(META, lowvram_model_memory=c.model_size() // 4)
        assert c.mmap_released and c.model.model_lowvram and host_copy.kept_bytes(c) > 0
        params = dict(c.model.named_parameters())
        streamed = {k for k, t in params.items() if t.device.type == "cpu"}
        assert streamed and any(t.device == META for t in params.values())
        for k in streamed:
            assert params[k].data_ptr() == before[k][0], f"{k} was copied"
        assert any(getattr(params[k], "patches", None) for k in streamed)  # the LoRA rides on streamed weights
        c.detach()
        for k, t in [*c.model.named_parameters(), *c.model.named_buffers()]:
            assert t.device.type == "cpu" and t.data_ptr() == before[k][0], f"{k} was copied back"


def test_without_the_estimator_gguf_copies_its_streamed_modules_so_the_test_can_fail(comfy, tmp_path):
    with torch.inference_mode():
        model = _gguf_model(tmp_path)
        model.load_device = META
        with pytest.raises(NotImplementedError):
            model.patch_model(META, lowvram_model_memory=model.model_size() // 2)


@pytest.mark.parametrize("lora", [False, True])
def test_new_patches_on_the_loaded_model_reload_it_right_and_unload_it_whole(comfy, lora):
    """A clone with other patches (a LoRA strength changed between prompts) loaded while the model holds the
    first clone's: ComfyUI unpatches it in ``partially_load`` (an unload to the host, through the clone's
    ``unpatch_model``) and loads it again with the new patches. The weights must be the new clone's, and the
    unload after it must still give every host tensor back (a meta tensor cannot be copied)."""
    from wan_sage.nodes import host_copy
    base, m = _on_meta(comfy, lora)
    before = _state(m.model)
    m.patch_model(META, lowvram_model_memory=0)
    c = m.clone()
    w = comfy.utils.get_attr(c.model, KEY)
    c.add_patches({KEY: ("diff", (torch.full((tuple(w.shape)), 0.02, device="cpu"),))}, 1.0)
    assert c.patches_uuid != m.patches_uuid
    c.partially_load(META, extra_memory=1 << 40, force_patch_weights=True)
    assert KEY in c.backup and all(t.device == META for t in c.model.parameters())
    assert host_copy.kept_bytes(c) > 0
    c.detach()
    for k, t in [*c.model.named_parameters(), *c.model.named_buffers()]:
        assert t.device.type == "cpu" and torch.equal(t.detach(), before[k][1]), k


@pytest.mark.parametrize("lora", [False, True])
def test_a_partial_unload_gives_the_modules_it_frees_their_host_tensors(comfy, lora):
    """ComfyUI frees part of the loaded model for another one (``partially_unload``, smallest modules first): every
    module it moves must get its very host tensors (a meta tensor cannot be copied), be marked streamed as after a
    copy, and the rest stay loaded; the full unload after it gives back the rest."""
    from wan_sage.nodes import host_copy
    base, m = _on_meta(comfy, lora)
    before = _state(m.model)
    c = m.clone()
    c.patch_model(META, lowvram_model_memory=0)
    loaded = c.model.model_loaded_weight_memory
    freed = c.partially_unload(c.offload_device, memory_to_free=loaded // 3)
    assert loaded // 3 <= freed < loaded
    assert c.model.model_lowvram and c.model.model_loaded_weight_memory == loaded - freed
    moved = {n for n, mod in c.model.named_modules() if getattr(mod, "comfy_cast_weights", False)
             and not getattr(mod, "comfy_patched_weights", True)}
    assert moved
    for n, mod in c.model.named_modules():
        assert "to" not in mod.__dict__, n  # the instance moves are gone after the unload
        for name, t in mod.named_parameters(recurse=False):
            key = f"{n}.{name}"
            if n in moved:
                assert t.device.type == "cpu" and t.data_ptr() == before[key][0], f"{key} was copied back"
                assert torch.equal(t.detach(), before[key][1]), key
            elif mod.__dict__.get("comfy_patched_weights"):
                assert t.device == META, key
    assert host_copy.kept_bytes(c) > 0
    c.detach()
    for k, t in [*c.model.named_parameters(), *c.model.named_buffers()]:
        assert t.device.type == "cpu" and torch.equal(t.detach(), before[k][1]), k


def test_stock_comfyui_copies_on_a_partial_unload_so_the_test_can_fail(comfy):
    base, m = _on_meta(comfy, False)
    base.patch_model(META, lowvram_model_memory=0)
    with pytest.raises(NotImplementedError):
        base.partially_unload(base.offload_device, memory_to_free=base.model.model_loaded_weight_memory // 3)


def test_a_gguf_lora_on_the_loaded_tensor_is_not_interchangeable_with_the_host_one(comfy, tmp_path):
    """ComfyUI-GGUF hangs a LoRA on the loaded quantized tensor (``patches``): a module left streamed with the host
    tensor instead would lose it, so only the tensors that carry nothing more are interchangeable."""
    from wan_sage.nodes import host_copy

    with torch.inference_mode():
        m = _gguf_on_meta(tmp_path)
        m.patch_model(META, lowvram_model_memory=0)
        kept = host_copy._KEPT[m.model]
        verdict = {}
        for key, k in kept.items():
            cur = dict([*m.model.named_parameters(), *m.model.named_buffers()])[key]
            verdict[key] = host_copy._interchangeable(cur, k.host)
        patched = {key for key in kept if getattr(dict(m.model.named_parameters()).get(key), "patches", None)}
        assert patched and all(not verdict[key] for key in patched)
        assert any(verdict[key] for key in kept if key not in patched)
        m.detach()


def test_a_partial_unload_of_a_gguf_expert_keeps_its_lora_on_the_host_storage(comfy, tmp_path):
    """The real ComfyUI-GGUF expert with its LoRA, loaded on ``meta`` and partly unloaded: every module moved gets its
    weights back on their very host storage (a meta tensor cannot be copied, so a copy would raise), and each
    weight that carried the LoRA on the device still carries the same patches, as ComfyUI-GGUF's copy would."""
    with torch.inference_mode():
        m = _gguf_on_meta(tmp_path)
        before = _state(m.model)
        m.patch_model(META, lowvram_model_memory=0)
        loaded = m.model.model_loaded_weight_memory
        patches = {k: list(t.patches) for k, t in m.model.named_parameters() if getattr(t, "patches", None)}
        assert patches
        freed = m.partially_unload(m.offload_device, memory_to_free=loaded // 3)
        assert freed >= loaded // 3 and m.model.model_lowvram
        params = dict(m.model.named_parameters())
        moved = [k for k, t in params.items() if t.device.type == "cpu"]
        assert moved and any(k in patches for k in moved)
        for k in moved:
            assert params[k].data_ptr() == before[k][0], f"{k} was copied back"
            if k in patches:
                assert params[k].patches == patches[k], k
        m.detach()


def test_a_failing_give_back_on_a_partial_unload_leaves_it_to_comfyuis_copy(comfy, monkeypatch):
    """A give-back that fails never fails ComfyUI's partial unload: the module's own ``to`` runs (here it cannot
    copy a meta tensor, which shows it ran), and no instance ``to`` is left on a module."""
    from wan_sage.nodes import host_copy, log_once
    monkeypatch.setattr(log_once, "warned", set())
    base, m = _on_meta(comfy, False)
    c = m.clone()
    c.patch_model(META, lowvram_model_memory=0)

    def boom(*a, **k):
        raise RuntimeError("give-back broke")
    monkeypatch.setattr(host_copy, "_give_back", boom)
    with pytest.raises(NotImplementedError):  # ComfyUI's own copy ran, and a meta tensor cannot be copied
        c.partially_unload(c.offload_device, memory_to_free=c.model.model_loaded_weight_memory // 3)
    assert all("to" not in mod.__dict__ for mod in c.model.modules())
    assert host_copy.kept_bytes(c) == 0  # forgotten: the rest is ComfyUI's copy too


def test_a_gguf_twin_dequantises_with_its_lora_as_the_loaded_tensor_does(comfy, tmp_path):
    """What a module left streamed computes from its weight after the partial unload: ComfyUI-GGUF's own
    ``get_weight`` (dequantisation, then the LoRA from ``patches``) on the twin equals it on the loaded tensor,
    and on the bare host tensor it does not (the LoRA would be lost)."""
    from wan_sage.nodes import host_copy

    with torch.inference_mode():
        model = _gguf_model(tmp_path)
        model.patch_model(model.load_device)  # the CPU here: ComfyUI-GGUF hangs the LoRA on each loaded tensor
        mod, cur = next((mod, mod.weight) for mod in model.model.modules()
                        if getattr(getattr(mod, "weight", None), "patches", None)
                        and getattr(mod.weight, "tensor_type", None) is not None and hasattr(mod, "get_weight"))
        host = torch.Tensor.as_subclass(cur, type(cur))  # the same bytes without what the load hung on them
        for name in ("tensor_type", "tensor_shape"):
            setattr(host, name, getattr(cur, name))
        twin = host_copy._host_twin(cur, host)
        assert twin is not None and twin.data_ptr() == cur.data_ptr()
        torch.testing.assert_close(mod.get_weight(twin, torch.bfloat16), mod.get_weight(cur, torch.bfloat16),
                                   rtol=0, atol=0)
        assert not torch.equal(mod.get_weight(host, torch.bfloat16), mod.get_weight(cur, torch.bfloat16))
        model.detach()
