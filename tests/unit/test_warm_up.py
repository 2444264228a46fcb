"""The warm-up a patch starts when it is applied: the kernels' self-test runs ahead of the first call, once,
and the first call then finds its verdict (or waits for it) instead of paying for it."""
import threading

import torch

from fakegpu import qkv
from wan_sage.attention import planning
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride


def raw_func(*a, **k):
    raise AssertionError("never called without a previous override")


def patch(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return SageAttentionOverride(PatchConfig(**cfg))


def test_the_warm_up_runs_the_self_test_and_the_first_call_waits_for_it(fake_gpu):
    fake_gpu.self_test_delay_s = 0.3
    o = patch(fake_gpu, calibrate=False)
    thread = o.warm_up(torch.device("cpu"), torch.bfloat16)
    assert thread is not None
    q, k, v = qkv()
    out = o(raw_func, q, k, v, heads=4)  # arrives while the warm-up's self-test runs
    thread.join(5)
    assert not thread.is_alive()
    assert fake_gpu.self_tests == ["sage2_sm90"]  # once, not once more for the call
    assert fake_gpu.kernel_calls() == 1 and out.shape == q.shape


def test_after_the_warm_up_the_first_call_runs_no_self_test(fake_gpu):
    o = patch(fake_gpu, calibrate=False)
    o.warm_up(torch.device("cpu"), torch.float16).join(5)
    assert fake_gpu.self_tests == ["sage2_sm90"]
    q, k, v = qkv(dtype=torch.float16)
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.self_tests == ["sage2_sm90"] and fake_gpu.kernel_calls() == 1


def test_a_failed_warm_up_self_test_turns_the_kernel_off_for_the_call(fake_gpu):
    fake_gpu.self_test_result = "returned wrong values"
    o = patch(fake_gpu, calibrate=False)
    o.warm_up(torch.device("cpu"), torch.bfloat16).join(5)
    q, k, v = qkv()
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 0


def test_prepare_names_the_kernels_that_passed_for_the_dtype(fake_gpu):
    assert planning.prepare(torch.device("cpu"), "auto", torch.bfloat16) == ("sage2_sm90",)
    assert planning.prepare(torch.device("cpu"), "auto", torch.float32) == ()  # no kernel takes fp32
    fake_gpu.reset_state()
    fake_gpu.self_test_result = "raised RuntimeError"
    assert planning.prepare(torch.device("cpu"), "auto", torch.bfloat16) == ()


def test_prepare_beside_calls_in_other_threads_tests_once(fake_gpu):
    fake_gpu.self_test_delay_s = 0.2
    o = patch(fake_gpu, calibrate=False)
    q, k, v = qkv()
    threads = [threading.Thread(target=planning.prepare, args=(torch.device("cpu"), "auto", torch.bfloat16))]
    threads += [threading.Thread(target=lambda: o(raw_func, q, k, v, heads=4)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert fake_gpu.self_tests == ["sage2_sm90"]


def test_nothing_is_started_where_there_is_nothing_to_warm(fake_gpu, monkeypatch):
    o = patch(fake_gpu)
    assert o.warm_up(None, torch.bfloat16) is None
    assert o.warm_up(torch.device("cpu"), torch.float32) is None  # no kernel takes fp32
    assert patch(fake_gpu, self_test=False).warm_up(torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert o.warm_up(torch.device("cuda"), torch.bfloat16) is None
    assert fake_gpu.self_tests == []
