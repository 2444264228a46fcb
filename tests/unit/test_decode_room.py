"""When a sampling ends, the estimator's clone is unloaded for the VAE decode where the decode's room is not free.

ComfyUI's side (the free memory, the unload) is stood in for; what is tested is the decision: unload exactly
where the free memory is short of the decode's room plus what ComfyUI keeps free, only for a model whose
weights keep their host copies, never failing the sampling."""
import logging

import pytest

from wan_sage.memory import vae_decode
from wan_sage.nodes import comfy_bridge, decode_room, host_copy

GiB = 1 << 30
LATENT = (1, 16, 21, 90, 160)  # 1280x720x81
KEPT_FREE = 400 << 20
NEED = vae_decode.decode_bytes(LATENT, 2) + KEPT_FREE


class Patcher:
    load_device = "cuda:0"


@pytest.fixture
def seen(monkeypatch):
    unloads = []
    monkeypatch.setattr(host_copy, "installed", lambda p: getattr(p, "host_copies", True))
    monkeypatch.setattr(host_copy, "kept_bytes", lambda p: 5 * GiB)
    monkeypatch.setattr(comfy_bridge, "is_dynamic", lambda p: getattr(p, "dynamic", False))
    monkeypatch.setattr(comfy_bridge, "device_of", lambda p: p.load_device)
    monkeypatch.setattr(comfy_bridge, "vae_dtype_size", lambda dev: None if dev == "cpu" else 2)
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: KEPT_FREE)
    monkeypatch.setattr(comfy_bridge, "unload", lambda p: unloads.append(p) or True)
    return unloads


@pytest.mark.parametrize("free, unloaded", [(NEED - 1, True), (NEED, False), (NEED - 8 * GiB, True), (80 * GiB, False)])
def test_the_model_is_unloaded_exactly_where_the_decodes_room_is_short(seen, free, unloaded):
    p = Patcher()
    assert decode_room.make_room(p, LATENT, free_bytes=lambda dev: free) is unloaded
    assert seen == ([p] if unloaded else [])


def test_the_room_is_the_decodes_for_its_latent_and_vae(seen):
    p = Patcher()
    assert decode_room.needed(p, LATENT) == NEED
    smaller = (1, 16, 21, 60, 104)  # 832x480: a smaller decode, so less free memory suffices
    assert decode_room.needed(p, smaller) < NEED
    assert not decode_room.make_room(p, smaller, free_bytes=lambda dev: NEED - 1)
    assert decode_room.needed(p, (1, 48, 31, 44, 80)) == vae_decode.decode_bytes((1, 48, 31, 44, 80), 2) + KEPT_FREE
    assert decode_room.needed(p, (1, 36, 21, 90, 160)) is None  # no Wan VAE decodes it


@pytest.mark.parametrize("why", ["no host copies", "dynamic VRAM", "cpu"])
def test_nothing_is_unloaded_where_the_unload_would_copy_or_comfyui_manages_it(seen, why):
    p = Patcher()
    if why == "no host copies":
        p.host_copies = False
    elif why == "dynamic VRAM":
        p.dynamic = True
    else:
        p.load_device = "cpu"
    assert decode_room.needed(p, LATENT) is None
    assert not decode_room.make_room(p, LATENT, free_bytes=lambda dev: 0)
    assert seen == []


class Guider:
    def __init__(self, patcher):
        self.model_patcher = patcher


class Executor:
    """ComfyUI's WrapperExecutor for CFGGuider.outer_sample, as a wrapper gets it."""

    def __init__(self, patcher, events):
        self.class_obj, self.events = Guider(patcher), events

    def __call__(self, noise, latent_image, sampler, sigmas, *args, **kwargs):
        self.events.append("sampled")
        return "latent"


class Noise:
    shape = LATENT


def test_the_wrapper_samples_first_then_makes_the_room(seen, monkeypatch):
    events, p = [], Patcher()
    monkeypatch.setattr(comfy_bridge, "free_memory", lambda dev: events.append("free?") or 0)
    out = decode_room.outer_sample(Executor(p, events), Noise(), None, None, None, None, None, False, 0)
    assert out == "latent" and events == ["sampled", "free?"] and seen == [p]


def test_a_failing_unload_never_fails_the_sampling_and_is_logged_once(seen, monkeypatch, caplog):
    from wan_sage.nodes import log_once
    monkeypatch.setattr(log_once, "warned", set())

    def boom(p):
        raise RuntimeError("free_memory moved")
    monkeypatch.setattr(comfy_bridge, "unload", boom)
    monkeypatch.setattr(comfy_bridge, "free_memory", lambda dev: 0)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        for _ in range(2):
            out = decode_room.outer_sample(Executor(Patcher(), []), Noise(), None, None, None)
            assert out == "latent"
    warned = [r for r in caplog.records if "unloading the model for the VAE decode failed" in r.getMessage()]
    assert len(warned) == 1 and "free_memory moved" in warned[0].getMessage()


def test_the_unload_goes_through_free_memory_as_current_comfyui_takes_it(monkeypatch):
    """comfy_bridge.unload asks ComfyUI's free_memory (0.3.64's signature, and current ComfyUI's with its keyword
    additions for_dynamic, pins_required, ram_required) to free more than the device holds while keeping every
    other loaded model: only the sampled model's LoadedModel (any patcher of its BaseModel) goes."""
    import sys
    import types

    class LoadedModel:
        def __init__(self, patcher, device="cuda:0"):
            self.model, self.device = patcher, device

        def __eq__(self, other):
            return self.model is other.model

    base, other_base = object(), object()
    ours = types.SimpleNamespace(model=base)
    ours_clone = types.SimpleNamespace(model=base)
    theirs = types.SimpleNamespace(model=other_base)
    calls = []

    def free_memory(memory_required, device, keep_loaded=[], for_dynamic=False, pins_required=0, ram_required=0):
        calls.append((memory_required, device))
        for lm in list(mm.current_loaded_models):
            if lm.device == device and lm not in keep_loaded:
                mm.current_loaded_models.remove(lm)  # model_unload(memory_to_free >= loaded): a whole unload
        return []

    mm = types.SimpleNamespace(current_loaded_models=[LoadedModel(theirs), LoadedModel(ours), LoadedModel(ours_clone)],
                               free_memory=free_memory)
    comfy = types.ModuleType("comfy")
    comfy.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    assert comfy_bridge.unload(ours_clone)
    assert [lm.model for lm in mm.current_loaded_models] == [theirs]
    assert calls and calls[0][0] >= 1 << 60 and calls[0][1] == "cuda:0"
    assert not comfy_bridge.unload(ours)  # nothing of it loaded any more
