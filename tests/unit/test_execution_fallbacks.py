"""The run-time fallbacks of attention/execution.py on injected fake kernels: out of memory and errors
while a shape is timed on its first calls and after it, the memory its timing may use, the one-time self-test outside
the state lock, and the sampled NaN/Inf check."""
import logging
import threading

import torch

from fakegpu import FakeGPU, qkv
from wan_sage.attention import kernel_bytes, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa


def raw_func(*a, **k):  # stands for ComfyUI's `func`; never called without a previous override
    raise AssertionError("func must not be called when there is no previous override")


def ov(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return SageAttentionOverride(PatchConfig(**cfg))


def margin_need(path, shape):
    return kernel_bytes.with_margin(kernel_bytes.extra_bytes(path, shape)) + (256 << 20)


def test_out_of_memory_while_a_shape_is_timed_is_remembered_and_charged_to_the_budget(fake_gpu):
    fake_gpu.modes["sage2_sm90"] = "oom"
    q, k, v = qkv()
    o = ov(fake_gpu)
    stats.begin_run(o.patch_id)
    for _ in range(3):
        assert torch.equal(o(raw_func, q, k, v, heads=4), attention_sdpa(q, k, v, 4))
    s = stats.end_run(o.patch_id)
    assert fake_gpu.kernel_calls("sage2_sm90") == 1  # one attempt, not one per call
    assert fake_gpu.spent_s() > 0
    assert s["sdpa_calls"] == 3 and s["fallbacks"] == {"oom": 1}


def test_an_error_while_a_shape_is_timed_is_charged_to_the_kernel_that_raised(monkeypatch, tmp_path, caplog):
    fake = FakeGPU(monkeypatch, tmp_path, candidates=("sage2_sm90", "sage1"))
    fake.modes["sage1"] = "raise"
    q, k, v = qkv()
    o = ov(fake)
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        outs = fake.settle(lambda: o(raw_func, q, k, v, heads=4))
        assert all(torch.allclose(out.float(), attention_sdpa(q, k, v, 4).float(), atol=2e-2) for out in outs)
        assert fake.kernel_calls("sage1") == 1
        stats.begin_run(o.patch_id)
        o(raw_func, q, k, v, heads=4)
        s = stats.end_run(o.patch_id)
    assert s["by_kernel"] == {"sage2_sm90": 1}  # the healthy kernel keeps serving
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(m.startswith("wan-sage: sage1 raised") for m in warnings)
    assert not any(m.startswith("wan-sage: sage2_sm90 raised") for m in warnings)
    fake.reset_state()


def test_a_shape_is_timed_only_on_the_candidates_that_fit_in_free_memory(monkeypatch, tmp_path):
    fake = FakeGPU(monkeypatch, tmp_path, candidates=("sage2_sm90", "sage1"))
    q, k, v = qkv()
    shape = kernel_bytes.AttnShape(1, 4, 2048, 2048, 64)
    assert margin_need("sage1", shape) > margin_need("sage2_sm90", shape)
    fake.free = margin_need("sage2_sm90", shape)  # sm90's own need: each call holds one run, as settled
    o = ov(fake)
    stats.begin_run(o.patch_id)
    fake.settle(lambda: o(raw_func, q, k, v, heads=4))
    s = stats.end_run(o.patch_id)
    assert fake.kernel_calls("sage1") == 0 and s["reasons"]["memory"] == 1  # sage1's turn went to SDPA
    assert fake.kernel_calls("sage2_sm90") == s["by_kernel"]["sage2_sm90"] == 3  # warm-up and two timed runs
    assert o.plan(q, k, v, 4).kernel == "sage2_sm90"
    fake.reset_state()


def test_a_steady_out_of_memory_is_remembered_until_free_memory_grows_by_the_need(fake_gpu):
    q, k, v = qkv()
    need = margin_need("sage2_sm90", kernel_bytes.AttnShape(1, 4, 2048, 2048, 64))
    o = ov(fake_gpu, calibrate=False)
    fake_gpu.free = 1 << 34
    fake_gpu.mode = "oom"
    stats.begin_run(o.patch_id)
    for _ in range(4):
        assert torch.equal(o(raw_func, q, k, v, heads=4), attention_sdpa(q, k, v, 4))
    assert fake_gpu.kernel_calls() == 1
    fake_gpu.free += need // 2  # grown, but by less than the kernel needs
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 1
    fake_gpu.free += need  # grown by more than it needs: tried again
    fake_gpu.mode = "ok"
    o(raw_func, q, k, v, heads=4)
    o(raw_func, q, k, v, heads=4)
    s = stats.end_run(o.patch_id)
    assert fake_gpu.kernel_calls() == 3
    assert s["fallbacks"] == {"oom": 1} and s["by_kernel"] == {"sage2_sm90": 2}
    assert s["reasons"] == {"oom": 1, "memory": 4}


def test_the_self_test_runs_once_and_outside_the_state_lock(fake_gpu):
    fake_gpu.self_test_delay_s = 0.2
    q, k, v = qkv()
    o = ov(fake_gpu, calibrate=False)
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(o(raw_func, q, k, v, heads=4))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 4
    assert fake_gpu.self_tests == ["sage2_sm90"] and fake_gpu.lock_held_in_self_test == [False]


def test_steady_state_calls_are_not_each_checked_for_nan(fake_gpu):
    q, k, v = qkv(N=64, H=2)
    o = ov(fake_gpu, calibrate=False, min_tokens=0)
    for _ in range(200):
        o(raw_func, q, k, v, heads=2)
    assert 1 <= fake_gpu.output_checks <= 10  # the first calls and a sample, not 200 host syncs


def test_a_kernel_that_starts_returning_nan_later_is_caught_and_its_shape_moves_to_sdpa(fake_gpu):
    fake_gpu.nan_from = 101
    q, k, v = qkv(N=64, H=2)
    o = ov(fake_gpu, calibrate=False, min_tokens=0)
    stats.begin_run(o.patch_id)
    bad = 0
    for _ in range(300):
        bad += not bool(torch.isfinite(o(raw_func, q, k, v, heads=2)).all())
    s = stats.end_run(o.patch_id)
    assert s["fallbacks"] == {"nonfinite": 1}
    assert 0 < bad <= 64  # outputs between two sampled checks
    assert s["reasons"]["nonfinite"] == 300 - s["sage_calls"]
    assert fake_gpu.kernel_calls() == s["sage_calls"] + 1


def test_check_finite_off_never_checks(fake_gpu):
    q, k, v = qkv(N=64, H=2)
    o = ov(fake_gpu, calibrate=False, check_finite=False, min_tokens=0)
    for _ in range(10):
        o(raw_func, q, k, v, heads=2)
    assert fake_gpu.output_checks == 0


def test_an_interrupt_inside_a_timed_call_leaves_the_shape_able_to_settle(fake_gpu, monkeypatch):
    """ComfyUI's cancel (or any BaseException) raised inside one of a shape's timed calls ends that step:
    the shape's later calls finish its timing and settle it, instead of waiting on the step for ever."""
    q, k, v = qkv()
    o = ov(fake_gpu)
    run = fake_gpu.run
    interrupts = []

    def interrupted(name, *a):
        if not interrupts:
            interrupts.append(name)
            raise KeyboardInterrupt
        return run(name, *a)
    monkeypatch.setattr("wan_sage.attention.kernels.run", interrupted)
    try:
        o(raw_func, q, k, v, heads=4)
    except KeyboardInterrupt:
        pass
    assert interrupts == ["sage2_sm90"]
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert o.plan(q, k, v, 4).kernel == "sage2_sm90" and not fake_gpu.state.trials
