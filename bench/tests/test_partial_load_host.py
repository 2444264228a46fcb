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
