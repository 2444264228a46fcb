"""Host tier: the estimator's clone is unloaded for the VAE decode through ComfyUI 0.3.64's own ``free_memory``.

The models are loaded to ``meta`` through real ``LoadedModel``s in ComfyUI's list of loaded models (the CPU
is the only real device here): a model unloaded by ComfyUI's copy fails (a meta tensor cannot be copied),
so the other loaded model must stay loaded untouched, and the estimator's clone must get its host tensors
back.  ComfyUI's free-memory query, which reads a CUDA device, answers "nothing free"."""
import pytest
import torch

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

META = torch.device("meta")
LATENT = (1, 16, 21, 90, 160)  # the decode of a 1280x720x81 video


@pytest.fixture
def meta_device(comfy, monkeypatch):
    """ComfyUI's memory queries for the meta device: nothing free, nothing loaded; the VAE decodes in bf16."""
    import comfy.model_management as mm
    from wan_sage.nodes import comfy_bridge
    monkeypatch.setattr(mm, "current_loaded_models", [])
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (0, 0) if torch_free_too else 0)
    monkeypatch.setattr(comfy_bridge, "vae_dtype_size", lambda dev: 2)
    return mm


@pytest.fixture
def loaded(meta_device):
    from wan_sage.nodes import host_copy
    from wan_sage.nodes.estimator import Settings, apply_estimator
    mm = meta_device
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, _est, _text = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])
    base.load_device = m.load_device = META
    assert host_copy.install(m)
    other = comfy_env.tiny_wan_patcher(num_layers=1, seed=1)  # another model on the device, without host copies
    other.load_device = META
    sampled = m.clone()  # the sampler's clone, as a workflow node after the estimator makes it
    before = {k: t.data_ptr() for k, t in [*sampled.model.named_parameters(), *sampled.model.named_buffers()]}
    for p in (other, sampled):
        lm = mm.LoadedModel(p)
        lm.model_load(0)  # the whole model onto the load device
        mm.current_loaded_models.insert(0, lm)
    assert all(t.device == META for t in sampled.model.parameters())
    return mm, sampled, other, before


def test_the_sampled_model_is_unloaded_whole_and_nothing_else(loaded):
    from wan_sage.nodes import decode_room
    mm, sampled, other, before = loaded
    assert decode_room.make_room(sampled, LATENT)
    assert [lm.model for lm in mm.current_loaded_models] == [other]
    assert all(t.device == META for t in other.model.parameters())
    for k, t in [*sampled.model.named_parameters(), *sampled.model.named_buffers()]:
        assert t.device.type == "cpu" and t.data_ptr() == before[k], f"{k} was copied back"
    assert sampled.model.model_loaded_weight_memory == 0 and not sampled.model.model_lowvram


def test_with_the_decodes_room_free_it_stays_loaded(loaded):
    from wan_sage.nodes import decode_room
    mm, sampled, other, _before = loaded
    assert not decode_room.make_room(sampled, LATENT, free_bytes=lambda dev: 1 << 40)
    assert len(mm.current_loaded_models) == 2 and all(t.device == META for t in sampled.model.parameters())


def test_the_estimators_clone_carries_the_wrapper_and_the_plan_keeps_no_decode_room(meta_device):
    from wan_sage.nodes import decode_room
    from wan_sage.nodes.estimator import Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, est, _text = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])
    import comfy.patcher_extension as pe
    # on the CPU, load and offload are one device: no host copies, no unload wrapper
    assert decode_room.KEY not in m.wrappers.get(pe.WrappersMP.OUTER_SAMPLE, {})
    base.load_device = META
    m, est, _text = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])
    assert m.wrappers[pe.WrappersMP.OUTER_SAMPLE][decode_room.KEY] == [decode_room.outer_sample]
    assert est.setup.decode_by_unload and est.decode_floor == 0
    c = m.clone()  # the wrapper and the host copies go with every clone
    assert c.wrappers[pe.WrappersMP.OUTER_SAMPLE][decode_room.KEY] == [decode_room.outer_sample]
