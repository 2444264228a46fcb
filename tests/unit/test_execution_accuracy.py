"""Never wrong: on injected fake kernels, an output beyond the accuracy bound against SDPA never
serves a call when it is wrong from the first call (the first run's check rejects it), is caught within one sampling interval when it goes wrong later (the shape settles on SDPA,
reason "inaccurate"), and a kernel within the bound still serves; the sm120 FP8-PV token limit
moves long calls to the FP16-PV kernel or SDPA."""
import logging

import pytest
import torch

from fakegpu import FakeGPU, qkv
from wan_sage.attention import accuracy, execution, policy, registry, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa


def raw_func(*a, **k):  # stands for ComfyUI's `func`; never called without a previous override
    raise AssertionError("func must not be called when there is no previous override")


def ov(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return SageAttentionOverride(PatchConfig(**cfg))


def rel_l2(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("calibrate", [True, False])
@pytest.mark.parametrize("mode", ["noise", "gray"])
def test_a_kernel_wrong_from_its_first_call_never_serves_a_call(fake_gpu, caplog, calibrate, mode):
    fake_gpu.mode = mode  # finite, so a NaN/Inf check alone passes it; and faster than SDPA
    q, k, v = qkv()
    o = ov(fake_gpu, calibrate=calibrate)
    stats.begin_run(o.patch_id)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        for _ in range(5):
            assert torch.equal(o(raw_func, q, k, v, heads=4), attention_sdpa(q, k, v, 4))
    s = stats.end_run(o.patch_id)
    assert s["sage_calls"] == 0 and s["by_kernel"] == {}
    assert s["reasons"] == {"inaccurate": 5} and s["fallbacks"] == {"inaccurate": 1}
    assert fake_gpu.kernel_calls() == 1  # the one checked output; never timed, never run again
    assert o.plan(q, k, v, 4).reason == "inaccurate"
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("wan-sage: sage2_sm90's output differed from SDPA's")


@pytest.mark.parametrize("calibrate", [True, False])
def test_a_kernel_that_turns_to_noise_later_is_caught_within_one_sampling_interval(fake_gpu, calibrate):
    fake_gpu.noise_from = 101
    q, k, v = qkv(N=64, H=2)
    o = ov(fake_gpu, calibrate=calibrate, min_tokens=0)
    stats.begin_run(o.patch_id)
    bad = 0
    for _ in range(300):
        out = o(raw_func, q, k, v, heads=2)
        assert bool(torch.isfinite(out).all())
        bad += rel_l2(out, attention_sdpa(q, k, v, 2)) > accuracy.MAX_REL_L2
    s = stats.end_run(o.patch_id)
    assert 0 < bad < execution.CHECK_EVERY <= 64  # the outputs between two sampled checks
    assert s["fallbacks"] == {"inaccurate": 1}
    timing_turns = s["reasons"].pop("timing", 0)  # SDPA's calls while the shape was timed
    assert bool(timing_turns) == calibrate
    assert s["reasons"] == {"inaccurate": 300 - s["sage_calls"] - timing_turns} and s["sage_calls"] > 0
    assert fake_gpu.kernel_calls() == s["sage_calls"] + 1  # every run served its call but the rejected one
    assert o.plan(q, k, v, 2).reason == "inaccurate"


def test_the_sampled_check_costs_sdpa_on_a_slice_of_query_rows(fake_gpu, monkeypatch):
    rows = []
    reference = accuracy.reference

    def recording(q4, k4, v4, layout, out_layout, scale):
        ref = reference(q4, k4, v4, layout, out_layout, scale)
        rows.append((ref.output.shape, k4.shape))
        return ref
    monkeypatch.setattr(accuracy, "reference", recording)
    q, k, v = qkv(N=2048)
    o = ov(fake_gpu, calibrate=False)
    for _ in range(3):
        o(raw_func, q, k, v, heads=4)
    assert rows == [((1, accuracy.CHECK_ROWS, 256), (1, 2048, 4, 64))] * 3  # 256 of 2048 rows, all keys


@pytest.mark.parametrize("error,serves", [(0.04, True), (0.15, False)])
def test_a_kernel_within_the_bound_serves_and_one_beyond_it_does_not(fake_gpu, error, serves):
    fake_gpu.perturb = error  # about sage2_sm90's error against fp32 (0.036-0.039), and well beyond it
    q, k, v = qkv(N=256, H=2)
    ref = attention_sdpa(q, k, v, 2)
    o = ov(fake_gpu, min_tokens=0)
    stats.begin_run(o.patch_id)
    outs = [o(raw_func, q, k, v, heads=2) for _ in range(2 * execution.CHECK_EVERY)]  # two sampled checks
    s = stats.end_run(o.patch_id)
    n = len(outs)
    if serves:  # every call on the kernel, but SDPA's turns while the shape was timed
        turns = s["reasons"].pop("timing")
        assert s["by_kernel"] == {"sage2_sm90": n - turns} and s["reasons"] == {} and s["fallbacks"] == {}
        assert sum(0.02 < rel_l2(out, ref) < accuracy.MAX_REL_L2 for out in outs) == n - turns
        assert sum(torch.equal(out, ref) for out in outs) == turns
    else:
        assert s["sage_calls"] == 0 and s["reasons"] == {"inaccurate": n}
        assert all(torch.equal(out, ref) for out in outs)


def test_timing_settles_on_an_accurate_candidate_when_the_fastest_is_rejected(monkeypatch, tmp_path):
    fake = FakeGPU(monkeypatch, tmp_path, candidates=("sage2_sm90", "ck_int8"))
    fake.modes["sage2_sm90"] = "noise"  # the fastest (7 ms) is noise; ck_int8 (8 ms) beats SDPA (10 ms)
    q, k, v = qkv()
    o = ov(fake)
    outs = fake.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert all(rel_l2(out, attention_sdpa(q, k, v, 4)) < 0.02 for out in outs)  # the noise served no call
    stats.begin_run(o.patch_id)
    for _ in range(3):
        out = o(raw_func, q, k, v, heads=4)
        assert rel_l2(out, attention_sdpa(q, k, v, 4)) < 0.02
    s = stats.end_run(o.patch_id)
    assert s["by_kernel"] == {"ck_int8": 3}
    assert o.plan(q, k, v, 4).kernel == "ck_int8"
    assert fake.kernel_calls("sage2_sm90") == 1
    fake.reset_state()


def test_a_rejected_kernel_stays_off_its_shape_when_the_shape_plans_again(monkeypatch, tmp_path):
    """The shape's decision is forgotten when the kernel serving it raises; planning again must not
    bring back the kernel its timing rejected there."""
    fake = FakeGPU(monkeypatch, tmp_path, candidates=("sage2_sm90", "ck_int8"))
    fake.modes["sage2_sm90"] = "noise"
    q, k, v = qkv()
    o = ov(fake)
    fake.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert o.plan(q, k, v, 4).kernel == "ck_int8"
    fake.modes["ck_int8"] = "raise"
    o(raw_func, q, k, v, heads=4)
    assert o.plan(q, k, v, 4).reason == "failed"  # not sage2_sm90
    fake.reset_state()


@pytest.mark.parametrize("values,failure", [
    ((-1.0, 1.0, 0.0, 0.0, 0.0, 0.0), None),  # zero reference, zero output
    ((-1.0, float("nan"), 0.0, 1.0, 1.0, 1.0), "nonfinite"),
    ((float("-inf"), 1.0, 0.0, 1.0, 1.0, 1.0), "nonfinite"),
    ((-1.0, 1.0, 0.099, 1.0, 0.999, 1.0), None),
    ((-1.0, 1.0, 0.101, 1.0, 0.999, 1.0), "inaccurate"),  # relative L2 beyond the bound
    ((-1.0, 1.0, 0.05, 1.0, 0.99, 1.0), "inaccurate"),  # cosine beyond the bound
    ((-1.0, 1.0, 0.0, 1.0, float("nan"), 1.0), "inaccurate"),
])
def test_the_verdict_of_the_measured_numbers(values, failure):
    assert accuracy.verdict(values).failure == failure


def test_inaccurate_is_a_reason_code():
    assert "inaccurate" in policy.REASONS and "inaccurate" in policy.__doc__
    assert policy.REASONS[-2:] == ("nonfinite", "inaccurate")


# ------------------------------------------------------------------ the sm120 FP8-PV token limit
def fp8_limit() -> int:
    return registry.KERNELS["sage2_fp8_cuda"].token_limits[120]


def test_the_fp8_pv_kernel_declares_a_token_limit_on_sm120_and_sm121_only():
    fp8, LIMIT = registry.KERNELS["sage2_fp8_cuda"], fp8_limit()
    assert 100_000 < LIMIT < 154_000  # below the last clean length of thu-ml/SageAttention#388
    for cc in (120, 121):
        assert fp8.allows(cc, LIMIT, LIMIT) and not fp8.allows(cc, LIMIT + 1, LIMIT + 1)
        assert not fp8.allows(cc, LIMIT + 1, 512)
        assert registry.auto_order(cc)[:2] == ("sage2_fp8_cuda", "sage2_fp16_cuda")
    assert fp8.allows(89, 10**6, 10**6) and fp8.allows(90, 10**6, 10**6)
    assert all(spec.allows(120, 10**6, 10**6) for name, spec in registry.KERNELS.items() if name != "sage2_fp8_cuda")


def test_the_estimate_plans_long_calls_off_the_fp8_pv_kernel_when_given_the_length():
    assert registry.planned_candidates("auto", 120)[0][0] == "sage2_fp8_cuda"  # no length: as before
    names, why = registry.planned_candidates("auto", 120, tokens=200_000)
    assert "sage2_fp8_cuda" not in names and names[0] == "sage2_fp16_cuda" and why is None
    assert registry.planned_candidates("sage2_fp8_cuda", 120, tokens=200_000)[0] == ()
    assert registry.planned_candidates("sage2_fp8_cuda", 89, tokens=200_000)[0] == ("sage2_fp8_cuda",)
    names, LIMIT = registry.auto_order(120), fp8_limit()
    assert registry.unmeasured_paths(names, 120) == (registry.memory_path("sage2_fp8_cuda", 120), "sdpa",
                                                     "sage2_fp8_cuda")
    assert registry.unmeasured_paths(names, 120, tokens=LIMIT + 1) == (registry.memory_path("sage2_fp16_cuda", 120),
                                                                       "sdpa", "sage2_fp16_cuda")
    assert registry.unmeasured_paths(names, 120, tokens=LIMIT)[2] == "sage2_fp8_cuda"


@pytest.mark.parametrize("cc,candidates,long_kernel,long_reason", [
    (120, ("sage2_fp8_cuda", "sage2_fp16_cuda"), "sage2_fp16_cuda", None),
    (121, ("sage2_fp8_cuda",), None, "inaccurate"),
    (89, ("sage2_fp8_cuda", "sage2_fp16_cuda"), "sage2_fp8_cuda", None),
])
def test_the_dispatcher_moves_calls_above_the_limit_off_the_fp8_pv_kernel(monkeypatch, tmp_path, cc, candidates,
                                                                        long_kernel, long_reason):
    fake = FakeGPU(monkeypatch, tmp_path, candidates=candidates, cc=cc)
    o = ov(fake, calibrate=False)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, fp8_limit() + 8, 16, generator=g).bfloat16() for _ in range(3))  # one head of 16
    plan = o.plan(q, k, v, 1)
    assert (plan.kernel, plan.reason) == (long_kernel, long_reason)
    q, k, v = qkv(N=2048, H=1, D=16)
    assert o.plan(q, k, v, 1).kernel == "sage2_fp8_cuda"
    fake.reset_state()


def test_calls_above_the_limit_run_on_the_fp16_pv_kernel(monkeypatch, tmp_path):
    fake = FakeGPU(monkeypatch, tmp_path, candidates=("sage2_fp8_cuda", "sage2_fp16_cuda"), cc=120)
    monkeypatch.setitem(registry.KERNELS["sage2_fp8_cuda"].token_limits, 120, 1024)
    fake.times.update(sage2_fp8_cuda=6.0, sage2_fp16_cuda=9.0)
    o = ov(fake)
    for n in (1024, 2048):
        q, k, v = qkv(N=n)
        fake.settle(lambda: o(raw_func, q, k, v, heads=4))
    stats.begin_run(o.patch_id)
    for n in (1024, 2048):
        q, k, v = qkv(N=n)
        for _ in range(2):
            assert rel_l2(o(raw_func, q, k, v, heads=4), attention_sdpa(q, k, v, 4)) < 0.02
    s = stats.end_run(o.patch_id)
    assert s["by_kernel"] == {"sage2_fp8_cuda": 2, "sage2_fp16_cuda": 2}
    assert {shape[1] for name, shape in fake.calls if name == "sage2_fp8_cuda"} == {1024}
    fake.reset_state()
