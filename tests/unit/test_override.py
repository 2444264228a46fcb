"""The override end to end with injected fake kernels on the CPU: static refusals, a new shape timed
on its first calls and the timing cache, head split, fallbacks, chaining to a previous override,
immutability."""
import copy
import math

import pytest
import torch

from fakegpu import qkv
from wan_sage.attention import stats, timing
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa


def raw_func(*a, **k):  # stands for ComfyUI's `func` (the raw attention the call site was bound to)
    raise AssertionError("func must not be called when there is no previous override")


def ov(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return SageAttentionOverride(PatchConfig(**cfg))


def close(a, b, tol=2e-2):
    return (a.float() - b.float()).norm() / b.float().norm() < tol


def test_cpu_calls_go_to_sdpa_with_reason_cpu():
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig())
    stats.begin_run(o.patch_id)
    out = o(raw_func, q, k, v, heads=4, transformer_options={})
    assert torch.equal(out, attention_sdpa(q, k, v, 4))
    s = stats.end_run(o.patch_id)
    assert s["reasons"] == {"cpu": 1} and s["sage_calls"] == 0


@pytest.mark.parametrize("kwargs,reason", [
    ({"mask": torch.zeros(2048, 2048)}, "mask"),
    ({"low_precision_attention": False}, "low_precision_off"),
    ({"enable_gqa": True}, "gqa"),
])
def test_static_refusals(fake_gpu, kwargs, reason):
    q, k, v = qkv()
    o = ov(fake_gpu)
    assert o.plan(q, k, v, 4, (q, k, v), kwargs).reason == reason


def test_fp32_and_short_are_refused(fake_gpu):
    o = ov(fake_gpu)
    q, k, v = qkv(dtype=torch.float32)
    assert o.plan(q, k, v, 4).reason == "dtype"
    q, k, v = qkv(N=512)
    assert o.plan(q, k, v, 4).reason == "short"


def test_self_attention_uses_kernel_after_its_first_calls_time_it_and_caches_it(fake_gpu):
    q, k, v = qkv()
    o = ov(fake_gpu, memory_mode="fastest")
    stats.begin_run(o.patch_id)
    outs = fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert all(close(out, attention_sdpa(q, k, v, 4)) for out in outs)
    store = timing.TimingCache(fake_gpu.cache_dir)
    entries = store.entries()
    assert len(entries) == 1
    (key, e), = entries.items()
    assert e["kernel_ms"] == 7.0 and e["sdpa_ms"] == 10.0 and "sage2_sm90" in key
    timed = stats.end_run(o.patch_id)
    assert timed["sage_calls"] + timed["sdpa_calls"] == len(outs) and set(timed["reasons"]) == {"timing"}
    # each of those calls ran once, on the kernel or on SDPA: the timing added no run
    assert fake_gpu.kernel_calls() == timed["sage_calls"] and timed["sdpa_calls"] >= 1
    stats.begin_run(o.patch_id)
    n_calls = len(fake_gpu.calls)
    o(raw_func, q, k, v, heads=4)  # settled: exactly one kernel call, no timing
    o(raw_func, q, k, v, heads=4)
    assert len(fake_gpu.calls) == n_calls + 2
    s = stats.end_run(o.patch_id)
    assert s["sage_calls"] == 2 and s["by_kernel"] == {"sage2_sm90": 2}
    assert math.isclose(s["saved_ms"], 6.0)


def test_calibration_keeps_sdpa_when_kernel_is_slower(fake_gpu):
    fake_gpu.times["sage2_sm90"] = 9.9  # within the 2 % hysteresis: "not faster"
    q, k, v = qkv()
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    stats.begin_run(o.patch_id)
    out = o(raw_func, q, k, v, heads=4)
    assert torch.equal(out, attention_sdpa(q, k, v, 4))
    o(raw_func, q, k, v, heads=4)
    s = stats.end_run(o.patch_id)
    assert s["sage_calls"] == 0 and s["reasons"] == {"slower": 2}


def test_cross_attention_measured_slower_goes_to_sdpa(fake_gpu):
    fake_gpu.times["sage2_sm90"] = 17.0
    q, k, v = qkv(N=4096, Nk=512)
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert o.plan(q, k, v, 4).reason == "cross_slower"
    stats.begin_run(o.patch_id)
    o(raw_func, q, k, v, heads=4)
    assert stats.end_run(o.patch_id)["reasons"] == {"cross_slower": 1}


def test_without_calibration_cross_goes_to_sdpa_and_self_to_kernel(fake_gpu):
    o = ov(fake_gpu, calibrate=False)
    q, k, v = qkv(N=4096, Nk=512)
    assert o.plan(q, k, v, 4).reason == "cross_slower"
    q, k, v = qkv()
    assert o.plan(q, k, v, 4).kernel == "sage2_sm90"


def test_head_split_when_vram_is_short_and_output_is_correct(fake_gpu):
    fake_gpu.times["sage2_sm90"] = 1.0
    q, k, v = qkv(H=8)
    o = ov(fake_gpu, memory_margin_mb=0)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=8))  # timed with plenty of memory
    full = o.plan(q, k, v, 8)
    assert full.groups == 1
    fake_gpu.free = full.need - 1  # not enough for all heads at once
    stats.begin_run(o.patch_id)
    plan = o.plan(q, k, v, 8)
    assert plan.kernel == "sage2_sm90" and plan.groups > 1
    fake_gpu.calls.clear()
    out = o(raw_func, q, k, v, heads=8)
    assert len(fake_gpu.calls) == plan.groups
    assert close(out, attention_sdpa(q, k, v, 8))
    assert stats.end_run(o.patch_id)["head_split_calls"] == 1


def test_sdpa_when_not_even_one_head_group_fits(fake_gpu):
    q, k, v = qkv(H=8)
    o = ov(fake_gpu, calibrate=False)
    fake_gpu.free = 1 << 20
    assert o.plan(q, k, v, 8).reason == "memory"


@pytest.mark.parametrize("mode,reason", [("oom", "oom"), ("nan", "nonfinite"), ("raise", "error")])
def test_kernel_failures_fall_back_to_sdpa(fake_gpu, mode, reason):
    q, k, v = qkv()
    o = ov(fake_gpu, calibrate=False)
    fake_gpu.mode = mode
    stats.begin_run(o.patch_id)
    out = o(raw_func, q, k, v, heads=4)
    assert torch.equal(out, attention_sdpa(q, k, v, 4))
    s = stats.end_run(o.patch_id)
    assert s["fallbacks"] == {reason: 1} and s["reasons"] == {reason: 1}


def test_a_kernel_that_raised_is_not_retried_for_that_shape(fake_gpu):
    q, k, v = qkv()
    o = ov(fake_gpu, calibrate=False)
    fake_gpu.mode = "raise"
    o(raw_func, q, k, v, heads=4)
    fake_gpu.calls.clear()
    assert o.plan(q, k, v, 4).reason == "failed"
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.calls == []


def test_failed_self_test_disables_the_kernel(fake_gpu, caplog):
    fake_gpu.self_test_result = "returned non-finite values (uninitialised output?)"
    q, k, v = qkv()
    o = ov(fake_gpu)
    with caplog.at_level("ERROR", logger="wan_sage"):
        assert o.plan(q, k, v, 4).reason == "disabled"
        assert o.plan(q, k, v, 4).reason == "disabled"
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "ff71e1e" in errors[0].getMessage()


def test_declined_calls_chain_to_the_previous_override():
    seen = []

    def prev(func, *args, **kwargs):
        seen.append((func, kwargs.get("heads")))
        return "from-prev"
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(), prev=prev)
    assert o(raw_func, q, k, v, heads=4, transformer_options={}) == "from-prev"
    assert seen == [(raw_func, 4)]


def test_override_is_deepcopy_safe_and_immutable():
    o = SageAttentionOverride(PatchConfig(kernel="sage2_sm90"))
    opts = {"transformer_options": {"optimized_attention_override": o}}
    c = copy.deepcopy(opts)
    assert c["transformer_options"]["optimized_attention_override"] is o
    assert copy.copy(o) is o
    with pytest.raises(AttributeError):
        o.config = PatchConfig()
    with pytest.raises(Exception):
        o.config.kernel = "sage1"
    assert callable(o.container_function)  # ComfyUI 0.38 hands it q/k/v containers (test_current_comfy_attention.py)


def test_bad_config_names_the_fix():
    with pytest.raises(ValueError, match="choose auto or one of"):
        PatchConfig(kernel="sage9")
    with pytest.raises(ValueError):
        PatchConfig(min_tokens=-1)


def test_4d_kv_face_block_and_hnd_layouts(fake_gpu):
    o = ov(fake_gpu, calibrate=False, min_tokens=0)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 256, 4 * 64, generator=g).bfloat16()
    k = torch.randn(6, 32, 4, 64, generator=g).bfloat16()  # [(B*T), N_face, heads, hd]
    v = torch.randn(6, 32, 4, 64, generator=g).bfloat16()
    out = o(raw_func, q, k, v, heads=4)
    assert out.shape == (6, 256, 256)
    assert close(out, attention_sdpa(q, k, v, 4))
    qh, kh, vh = (torch.randn(2, 4, 2048, 64, generator=g).bfloat16() for _ in range(3))
    out = o(raw_func, qh, kh, vh, heads=4, skip_reshape=True, skip_output_reshape=True)
    assert out.shape == (2, 4, 2048, 64)
    assert close(out, attention_sdpa(qh, kh, vh, 4, skip_reshape=True, skip_output_reshape=True))
    out = o(raw_func, qh, kh, vh, 4, None, None, True, False)  # positional, NHD output
    assert out.shape == (2, 2048, 256)


def test_scale_kwarg_is_passed_to_the_kernel(fake_gpu):
    o = ov(fake_gpu, calibrate=False)
    q, k, v = qkv()
    out = o(raw_func, q, k, v, heads=4, scale=0.05)
    assert close(out, attention_sdpa(q, k, v, 4, scale=0.05))
    assert not close(out, attention_sdpa(q, k, v, 4), tol=1e-3)


def test_calibration_budget_bounds_the_one_time_cost(fake_gpu):
    o = ov(fake_gpu, calibration_budget_s=0.0)
    q, k, v = qkv()
    plan = o.plan(q, k, v, 4)
    assert plan.calibrate == () and plan.kernel == "sage2_sm90"


@pytest.mark.parametrize("field, value", [("min_tokens", -1), ("memory_margin_mb", -5), ("calibration_budget_s", -0.5),
                                          ("memory_margin_mb", float("nan"))])
def test_a_negative_setting_is_refused_naming_it(field, value):
    """The Sage patch's numbers can come linked from another node, past ComfyUI's widget ranges."""
    with pytest.raises(ValueError, match=f"^{field} must be 0 or more, got"):
        PatchConfig(**{field: value})
