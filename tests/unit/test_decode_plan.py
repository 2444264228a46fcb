"""The Sage patch plans the Wan VAE decode's late convolutions right after its sampling: which convolutions
(memory/vae_decode.py's late_convs, checked against a real decode in tests/host), under which free memory
(Conv.plan_bytes), once per shape, and never at the sampling's cost (nodes/decode_plan.py)."""
import logging
from types import SimpleNamespace

import pytest
import torch

from wan_sage.memory import vae_decode
from wan_sage.memory.vae_decode import GiB, Conv
from wan_sage.nodes import comfy_bridge, decode_plan, sage_patch
from wan_sage.nodes.log_once import warned

LATENT_720P = (1, 16, 21, 90, 160)


def test_the_convolutions_of_a_720p_decode_with_their_outputs():
    convs = vae_decode.late_convs(LATENT_720P)
    assert [(c.input, c.weight, c.output()) for c in convs] == [
        ((4, 384, 360, 640), (192, 384, 3, 3), (4, 192, 360, 640)),
        ((1, 192, 6, 362, 642), (192, 192, 3, 3, 3), (1, 192, 4, 360, 640)),
        ((4, 192, 720, 1280), (96, 192, 3, 3), (4, 96, 720, 1280)),
        ((1, 96, 6, 722, 1282), (3, 96, 3, 3, 3), (1, 3, 4, 720, 1280)),
        ((1, 96, 6, 722, 1282), (96, 96, 3, 3, 3), (1, 96, 4, 720, 1280)),
    ]


@pytest.mark.parametrize("latent", [(1, 48, 21, 44, 80), (2, 16, 21, 90, 160), (1, 16, 1, 90, 160), (1, 16, 21)])
def test_no_convolutions_where_no_wan_2_1_decode_of_one_video_follows(latent):
    # the 2.2 VAE, a batch ComfyUI may split, one latent frame (no second frame), not a video latent
    assert vae_decode.late_convs(latent) == []


def test_plan_bytes_covers_the_measured_workspace_with_the_allocators_halving():
    # bench.conv_workspace (H200, bf16): the 96-channel 1280x720 convolution got its fast engine with 2.5 GiB
    # free before its first call and not with 2.0; the room asked for holds even where the allocator offers only
    # half of what is free after the input, weight and output
    conv = vae_decode.late_convs(LATENT_720P)[-1]
    io = (vae_decode._numel(conv.input) + vae_decode._numel(conv.output())) * 2
    need = conv.plan_bytes(2)
    assert need > 2.5 * GiB
    assert (need - io - vae_decode._numel(conv.weight) * 2) / 2 >= 1.84 * GiB
    assert abs(conv.plan_bytes(4) - 2 * need) <= 2          # fp32 decodes: twice the bytes


@pytest.fixture
def cuda_like(monkeypatch):
    """A CUDA device as decode_plan sees it: free memory read from ``state["free"]``, the convolutions it runs
    and the trims it asks for recorded, nothing run on a device."""
    state = {"free": 64 * GiB, "ran": [], "trims": [], "oom": set()}
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (state["free"], 80 * GiB))
    monkeypatch.setattr(comfy_bridge, "vae_dtype", lambda dev: torch.bfloat16)
    monkeypatch.setattr(comfy_bridge, "trim_allocator", lambda dev, when: state["trims"].append(when))

    def run(conv, dev, dtype):
        if conv.input in state["oom"]:
            raise torch.OutOfMemoryError("CUDA out of memory")
        state["ran"].append((conv.input, conv.weight, dtype))
    monkeypatch.setattr(decode_plan, "_run", run)
    monkeypatch.setattr(decode_plan, "_planned", set())
    warned.clear()
    yield state
    warned.clear()


CUDA = torch.device("cuda", 0)


def test_each_shape_is_planned_once_per_process_and_the_cache_handed_back(cuda_like):
    convs = vae_decode.late_convs(LATENT_720P)
    ran = decode_plan.plan_decode(LATENT_720P, CUDA)
    assert ran == [(c.input, c.weight) for c in convs]
    assert [r[2] for r in cuda_like["ran"]] == [torch.bfloat16] * 5
    assert cuda_like["trims"] == ["after planning the decode"]
    # the repeat prompt: every engine is kept already, nothing runs and nothing is trimmed
    assert decode_plan.plan_decode(LATENT_720P, CUDA) == [] and cuda_like["trims"] == ["after planning the decode"]


def test_a_shape_whose_room_is_not_free_is_left_to_the_decode_and_planned_later(cuda_like):
    convs = vae_decode.late_convs(LATENT_720P)
    cuda_like["free"] = convs[-1].plan_bytes(2) - 1        # all but the two largest fit
    ran = decode_plan.plan_decode(LATENT_720P, CUDA)
    assert ran == [(c.input, c.weight) for c in convs if c.plan_bytes(2) <= cuda_like["free"]]
    assert (convs[-1].input, convs[-1].weight) not in ran and (convs[2].input, convs[2].weight) not in ran
    cuda_like["free"] = 64 * GiB
    assert decode_plan.plan_decode(LATENT_720P, CUDA) == [(convs[2].input, convs[2].weight),
                                                          (convs[-1].input, convs[-1].weight)]


def test_out_of_memory_leaves_that_shape_to_the_decode_quietly(cuda_like, caplog):
    convs = vae_decode.late_convs(LATENT_720P)
    cuda_like["oom"] = {convs[2].input}
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        ran = decode_plan.plan_decode(LATENT_720P, CUDA)
    assert (convs[2].input, convs[2].weight) not in ran and len(ran) == 4 and not caplog.records
    cuda_like["oom"] = set()
    assert decode_plan.plan_decode(LATENT_720P, CUDA) == [(convs[2].input, convs[2].weight)]


def test_a_failure_is_logged_once_and_never_reaches_the_sampling(cuda_like, monkeypatch, caplog):
    def broken(dev):
        raise RuntimeError("no vae dtype here")
    monkeypatch.setattr(comfy_bridge, "vae_dtype", broken)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        assert decode_plan.plan_decode(LATENT_720P, CUDA) == []
        assert decode_plan.plan_decode(LATENT_720P, CUDA) == []
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "planning the VAE decode's convolutions failed (RuntimeError: no vae dtype here)" in msgs[0]
    assert cuda_like["trims"] == []


@pytest.mark.parametrize("dev", [torch.device("cpu"), None, "cuda"])
def test_nothing_runs_off_a_cuda_device(cuda_like, dev):
    assert decode_plan.plan_decode(LATENT_720P, dev) == [] and cuda_like["ran"] == []


class _Exec:
    def __init__(self, guider, result):
        self.class_obj, self.result = guider, result

    def __call__(self, *args, **kwargs):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def _wrapper_run(monkeypatch, result):
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    calls = []
    monkeypatch.setattr(decode_plan, "plan_decode", lambda latent, dev: calls.append(("plan", latent, dev)))
    monkeypatch.setattr(comfy_bridge, "trim_allocator", lambda dev, when: calls.append(("trim", when)))
    ov = SageAttentionOverride(PatchConfig())
    guider = SimpleNamespace(model_options={"transformer_options": {"optimized_attention_override": ov}},
                             model_patcher=SimpleNamespace(load_device=CUDA))
    wrapper = sage_patch._stats_wrapper(ov.patch_id, "t")
    return wrapper, _Exec(guider, result), calls


def test_the_sage_sampling_trims_then_plans_the_decode_of_its_latent(monkeypatch):
    wrapper, ex, calls = _wrapper_run(monkeypatch, torch.zeros(LATENT_720P[:3] + (2, 2)))
    assert tuple(wrapper(ex).shape) == LATENT_720P[:3] + (2, 2)
    assert calls == [("trim", "after sampling"), ("plan", LATENT_720P[:3] + (2, 2), CUDA)]


def test_a_failed_sampling_plans_no_decode(monkeypatch):
    wrapper, ex, calls = _wrapper_run(monkeypatch, RuntimeError("interrupted"))
    with pytest.raises(RuntimeError, match="interrupted"):
        wrapper(ex)
    assert calls == [("trim", "after sampling")]
