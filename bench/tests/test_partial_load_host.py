"""Host tier: bench.partial_load's load peak through a real ComfyUI 0.3.64 sampling of a tiny Wan model on the CPU:
the peaks are read once per sampling, after the weights are placed and before the first forward, and the wrapper
changes nothing of what the sampling computes."""
import pytest
import torch

from bench import _host, partial_load

comfy_env = _host.comfy_env()
if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)


@pytest.fixture(scope="module")
def patcher():
    comfy_env.boot(cpu=True)
    return comfy_env.tiny_wan_patcher()


def _sample(m, events):
    hook = m.model.diffusion_model.register_forward_pre_hook(lambda *_: events.append("forward"))
    try:
        return comfy_env.sample_tiny(m, steps=3, cfg=1.0, callback=lambda *_: events.append("step"))
    finally:
        hook.remove()


def test_the_load_peak_is_read_once_before_the_first_forward(patcher):
    events = []

    def read():
        events.append("read")
        return (len(events), 0)

    m = patcher.clone()
    peaks = partial_load.add_load_peak(m, read)
    _sample(m, events)
    assert events == ["read", "forward", "step", "forward", "step", "forward", "step"]
    assert peaks == [(1, 0)]
    # a second sampling of the same clone reads nothing more: the list holds the first sampling's load
    _sample(m, events)
    assert events.count("read") == 1


def test_the_wrapper_leaves_the_sampling_and_the_base_patcher_as_they_were(patcher):
    expected = _sample(patcher.clone(), [])
    m = patcher.clone()
    partial_load.add_load_peak(m, lambda: (0, 0))
    assert torch.equal(_sample(m, []), expected)
    assert any(partial_load.LOAD_PEAK_KEY in by_key for by_key in m.wrappers.values())
    assert not any(partial_load.LOAD_PEAK_KEY in by_key for by_key in patcher.wrappers.values())


def test_the_warm_up_runs_every_block_at_its_small_latent_and_leaves_no_model_loaded(patcher):
    import comfy.model_management as mm
    blocks = patcher.model.diffusion_model.blocks
    ran, shapes = set(), []
    hooks = [b.register_forward_pre_hook(lambda mod, *_: ran.add(id(mod))) for b in blocks]

    def sample(m, shape):
        shapes.append(shape)
        w, h, f = partial_load.WARM_RES
        return comfy_env.sample_tiny(m, width=w, height=h, frames=f, steps=1, cfg=1.0)

    try:
        seconds = partial_load.warm_sampling(patcher.clone(), [1, 16, 21, 90, 160], sample)
    finally:
        for h in hooks:
            h.remove()
    assert shapes == [[1, 16, 2, 24, 40]]  # the measured run's batch and channels, WARM_RES's frames and size
    assert ran == {id(b) for b in blocks}
    assert not any(lm.model is not None and lm.model.model is patcher.model for lm in mm.current_loaded_models)
    assert seconds > 0
