"""gpu tier: the Working-Memory Estimator's clone, unloaded by ComfyUI 0.3.64 from the GPU, gets back the
very host tensors its weights were loaded from, or the page-locked copies of them the pack made beside the
sampling (nothing copied back), and samples the same latent afterwards
as the model ComfyUI unloads and reloads itself.  A full-precision model with and without a LoRA, and a
GGUF one with its LoRA (ComfyUI-GGUF in COMFYUI_GGUF_PATH); each skips, with its reason, without them."""
import gc
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
import comfy_env  # noqa: E402
import workflow_check  # noqa: E402

if comfy_env.skip_reason():
    pytest.skip(f"gpu tier unload: {comfy_env.skip_reason()}", allow_module_level=True)

KEY = "diffusion_model.blocks.0.self_attn.q.weight"


@pytest.fixture(scope="module")
def comfy():
    from bench import _host
    _host.ensure_av(allow_stub=True)  # ComfyUI 0.3.64's nodes import PyAV; no video I/O here
    return comfy_env.boot(cpu=False, attention="pytorch")


def _gguf_model(comfy, tmp_path):
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    return comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path)


def _model(comfy, kind, tmp_path):
    if kind == "gguf":
        return _gguf_model(comfy, tmp_path)
    base = comfy_env.tiny_wan_patcher(dim=512, ffn_dim=1024, num_layers=2)
    if kind == "lora":
        w = comfy.utils.get_attr(base.model, KEY)
        base.add_patches({KEY: ("diff", (torch.full_like(w, 0.01),))}, 1.0)
    return base


def _stock_then_estimator(comfy, kind, tmp_path):
    """(the stock model's latents for seeds 0 and 1, the empty latent, and the estimator's clone with its estimate
    and report) for a model of ``kind``; every model unloaded after the stock samplings (call under
    ``torch.inference_mode``)."""
    from wan_sage.nodes.estimator import Settings, apply_estimator
    mm = comfy.model_management
    base = _model(comfy, kind, tmp_path)
    mm.unload_all_models()
    stock = [comfy_env.sample_tiny(base, steps=2, seed=s) for s in (0, 1)]  # loads, unloads, loads again
    mm.unload_all_models()
    latent = comfy_env.empty_wan_latent(base)
    m, est, text = apply_estimator(base, Settings(), list(latent.shape))
    return stock, latent, m, est, text


def _host_state(model):
    # as_subclass: a GGUF tensor's clone() returns the tensor itself
    return {k: (t.data_ptr(), t.detach().as_subclass(torch.Tensor).clone())
            for k, t in [*model.named_parameters(), *model.named_buffers()]}


def _assert_on_host_tensors(model, before, moved=frozenset()):
    """Every weight and buffer of ``model`` is the very host tensor ``before`` (:func:`_host_state`) noted, or
    the page-locked copy of it the pack made beside the sampling (:func:`wan_sage.nodes.host_copy.pin_kept`):
    the same bytes, at the same data pointer or in one of the pack's page-locked buffers; those in ``moved`` the
    same bytes."""
    from wan_sage.nodes import pinned_host
    after = _host_state(model)
    assert after.keys() == before.keys()
    for k, (ptr, value) in before.items():
        assert k in moved or after[k][0] == ptr or pinned_host._in_buffer(after[k][0]), \
            f"{k} was copied back, not given its host tensor"
        assert torch.equal(after[k][1], value), k


@pytest.mark.parametrize("kind", ["plain", "lora", "gguf"])
def test_unloaded_weights_are_their_host_tensors_and_sampling_after_is_unchanged(comfy, kind, tmp_path):
    from wan_sage.nodes import host_copy
    mm = comfy.model_management
    with torch.inference_mode():
        stock, latent, m, _, text = _stock_then_estimator(comfy, kind, tmp_path)
        assert host_copy.installed(m) and "copies nothing back" in text
        before = _host_state(m.model)
        first = comfy_env.sample_tiny(m, steps=2, seed=0)
        assert host_copy.kept_bytes(m) > 0
        assert all(t.device.type == "cuda" for t in m.model.parameters())
        mm.unload_all_models()  # ComfyUI's unload: LoadedModel.model_unload -> detach -> unpatch_model
        _assert_on_host_tensors(m.model, before)
        second = comfy_env.sample_tiny(m, steps=2, seed=1)
        mm.unload_all_models()
    torch.testing.assert_close(first, stock[0])
    torch.testing.assert_close(second, stock[1])


@pytest.mark.parametrize("kind", ["plain", "gguf"])
def test_kept_host_copies_are_page_locked_beside_the_sampling_and_the_next_load_reads_them(comfy, kind, tmp_path):
    """After a load the pack's worker copies the kept host copies of the loaded weights into page-locked buffers
    (``cudaHostRegister`` for real); the unload gives the weights those, and the next sampling, loading from them,
    gives the stock latent."""
    from wan_sage.nodes import host_copy, pinned_host
    mm = comfy.model_management
    with torch.inference_mode():
        stock, latent, m, _, _text = _stock_then_estimator(comfy, kind, tmp_path)
        before = _host_state(m.model)
        pinned_host.wait()
        gc.collect()  # buffers of models earlier tests dropped go now, not while this one counts
        start = pinned_host.pinned_bytes()
        first = comfy_env.sample_tiny(m, steps=2, seed=0)
        pinned_host.wait()
        kept = host_copy.kept_bytes(m)
        keys = [key for key, k in host_copy._KEPT[m.model].items() if k.loaded is not None]
        assert kept > 0 and pinned_host.pinned_bytes() - start >= kept
        mm.unload_all_models()
        tensors = dict([*m.model.named_parameters(), *m.model.named_buffers()])
        for k in keys:
            t = tensors[k]
            assert t.device.type == "cpu" and t.is_pinned() and pinned_host._in_buffer(t.data_ptr()), k
        _assert_on_host_tensors(m.model, before)
        second = comfy_env.sample_tiny(m, steps=2, seed=1)
        mm.unload_all_models()
    torch.testing.assert_close(first, stock[0])
    torch.testing.assert_close(second, stock[1])


@pytest.mark.parametrize("kind", ["plain", "gguf"])
def test_a_sampling_short_of_the_decodes_room_ends_unloaded_and_samples_the_same_after(comfy, kind, tmp_path,
                                                                                       monkeypatch):
    """The estimator's OUTER_SAMPLE wrapper, in ComfyUI's own sampler: with the decode's room never free (a decode
    that needs more than the card), each sampling ends with the model unloaded whole onto its host tensors, and
    the next sampling loads it again and gives the stock latent."""
    from wan_sage.nodes import decode_room, host_copy
    mm = comfy.model_management
    with torch.inference_mode():
        stock, latent, m, est, _text = _stock_then_estimator(comfy, kind, tmp_path)
        assert host_copy.installed(m) and est.setup.decode_by_unload
        before = _host_state(m.model)
        assert decode_room.needed(m, latent.shape) is not None
        monkeypatch.setattr(decode_room, "needed", lambda patcher, shape: 1 << 60)
        got = []
        for seed in (0, 1):
            got.append(comfy_env.sample_tiny(m, steps=2, seed=seed))
            assert not any(getattr(lm.model, "model", None) is m.model for lm in mm.current_loaded_models)
            _assert_on_host_tensors(m.model, before)
        mm.unload_all_models()
    torch.testing.assert_close(got[0], stock[0])
    torch.testing.assert_close(got[1], stock[1])


@pytest.mark.parametrize("kind", ["plain", "lora", "gguf"])
def test_a_partial_unload_moves_unpatched_modules_onto_their_host_tensors_and_samples_the_same(comfy, kind, tmp_path):
    """ComfyUI frees a third of the loaded clone (``partially_unload``, as for the next expert where both do not
    fit): the modules it moves hold their very host tensors where unpatched, and GGUF ones with the LoRA too (as
    twins carrying it), and the next sampling, streaming them or loading them again, gives the stock latent (a
    LoRA on GGUF weights rides on the loaded tensor and must not be lost)."""
    from wan_sage.nodes import pinned_host
    mm = comfy.model_management
    with torch.inference_mode():
        stock, latent, m, _est, _text = _stock_then_estimator(comfy, kind, tmp_path)
        before = _host_state(m.model)
        first = comfy_env.sample_tiny(m, steps=2, seed=0)
        assert any(getattr(lm.model, "model", None) is m.model for lm in mm.current_loaded_models)
        loaded = m.model.model_loaded_weight_memory
        freed = m.partially_unload(m.offload_device, memory_to_free=loaded // 3)
        assert freed >= loaded // 3 and m.model.model_lowvram
        moved = [(n, mod) for n, mod in m.model.named_modules()
                 if getattr(mod, "comfy_cast_weights", False) and getattr(mod, "comfy_patched_weights", None) is False]
        assert moved
        for n, mod in moved:
            assert "to" not in mod.__dict__
            for name, t in mod.named_parameters(recurse=False):
                key = f"{n}.{name}"
                assert t.device.type == "cpu", key
                if key not in m.patches or kind == "gguf":  # full-precision LoRA: ComfyUI's backup comes back
                    assert t.data_ptr() == before[key][0] or pinned_host._in_buffer(t.data_ptr()), \
                        f"{key} was copied back"
        second = comfy_env.sample_tiny(m, steps=2, seed=1)
        mm.unload_all_models()
    torch.testing.assert_close(first, stock[0])
    torch.testing.assert_close(second, stock[1])


def _forward(patcher, latent, text):
    dev = patcher.load_device
    sigma = torch.tensor([0.7], device=dev)
    return patcher.model.apply_model(latent.to(dev), sigma, c_crossattn=text.to(dev)).float().cpu()


def test_a_gguf_model_first_loaded_in_part_streams_page_locked_and_runs_as_stock_does(comfy, tmp_path):
    """The first load of a GGUF model that leaves modules streaming: ComfyUI-GGUF copies each of them to the GPU
    and back (off the file's memory map); the estimator's clone copies them once into page-locked host buffers
    instead (:mod:`wan_sage.nodes.pinned_host`). Its streamed weights keep their bytes and the LoRA on them, its
    loaded ones get their very host tensors back on the unload, and its forward equals the one after
    ComfyUI-GGUF's copy."""
    from wan_sage.nodes import host_copy
    mm = comfy.model_management
    dev = mm.get_torch_device()
    with torch.inference_mode():
        base = _gguf_model(comfy, tmp_path)
        mm.unload_all_models()
        latent = torch.randn(comfy_env.empty_wan_latent(base).shape, generator=torch.Generator().manual_seed(0))
        text = comfy_env.text_cond(1, text_dim=base.model.diffusion_model.text_dim)[0][0]
        from wan_sage.nodes.estimator import Settings, apply_estimator
        m, _est, _text = apply_estimator(base, Settings(), list(latent.shape))
        before = _host_state(m.model)
        m.patch_model(dev, lowvram_model_memory=m.model_size() // 4)
        assert m.mmap_released and m.model.model_lowvram and host_copy.kept_bytes(m) > 0
        params = dict(m.model.named_parameters())
        streamed = {k for k, t in params.items() if t.device.type == "cpu"}
        assert streamed and any(getattr(params[k], "patches", None) for k in streamed)
        # the weights of layers that cast them per call; a block's own modulation is cast by its forward and stays
        cast = {k for k in streamed
                if getattr(m.model.get_submodule(k.rpartition(".")[0]), "comfy_cast_weights", False)}
        assert cast
        for k in streamed:
            if k in cast:
                assert params[k].is_pinned() and params[k].data_ptr() != before[k][0], f"{k} is not page-locked"
            else:
                assert params[k].data_ptr() == before[k][0], f"{k} was copied off its host tensor"
            assert torch.equal(params[k].detach().as_subclass(torch.Tensor), before[k][1]), k
        ours = _forward(m, latent, text)
        m.detach()
        _assert_on_host_tensors(m.model, before, moved=cast)
        assert base.mmap_released is False
        base.patch_model(dev, lowvram_model_memory=base.model_size() // 4)  # ComfyUI-GGUF's copy
        assert base.mmap_released
        moved = [k for k, t in base.model.named_parameters() if t.device.type == "cpu" and t.data_ptr() != before[k][0]]
        assert moved  # the stock load did copy the streamed weights
        stock = _forward(base, latent, text)
        base.detach()
    torch.testing.assert_close(ours, stock)
