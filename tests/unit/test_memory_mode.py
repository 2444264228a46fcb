"""Sage at SDPA's memory: the memory mode's head groups in the dispatcher, on fake kernels."""
import pytest
import torch

from fakegpu import qkv
from wan_sage.attention import execution, head_groups, kernel_bytes, planning, stats, timing
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride, self_attention_groups, settled_shapes
from wan_sage.attention.sdpa import attention_sdpa

SHAPE = kernel_bytes.AttnShape(1, 4, 2048, 2048, 64)
OUT = 2 * 4 * 2048 * 64
MARGIN = 256 << 20


def raw_func(*a, **k):
    raise AssertionError("func must not be called when there is no previous override")


@pytest.fixture
def two_groups(monkeypatch):
    """Shrink SDPA's slack so that this small shape needs two head groups to stay within it."""
    slack = head_groups.split_bytes("sage2_sm90", SHAPE, 2) - OUT
    assert head_groups.split_bytes("sage2_sm90", SHAPE, 1) > OUT + slack
    monkeypatch.setattr(head_groups, "SDPA_SLACK_BYTES", slack)
    assert head_groups.head_groups("sage2_sm90", SHAPE, "sdpa").groups == 2


def ov(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return SageAttentionOverride(PatchConfig(**cfg))


def test_the_split_is_used_when_it_costs_at_most_two_percent(fake_gpu, two_groups):
    fake_gpu.group_cost = 0.015
    q, k, v = qkv()
    o = ov(fake_gpu)
    reference = fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))[-1]  # timed: SDPA, ungrouped, grouped
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert entry["kernel_ms"] == 7.0 and entry["grouped_ms"] == pytest.approx(7.105) and entry["groups"] == 2
    stats.begin_run(o.patch_id)
    fake_gpu.calls.clear()
    out = o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 2 and torch.equal(out, reference)
    s = stats.end_run(o.patch_id)
    assert s["by_kernel"] == {"sage2_sm90": 1} and s["head_split_calls"] == 1
    plan = o.plan(q, k, v, 4)
    assert plan.groups == 2
    rule = head_groups.head_groups("sage2_sm90", SHAPE, "sdpa")
    assert plan.need == kernel_bytes.with_margin(rule.extra_bytes) + MARGIN


def test_a_shape_where_the_split_costs_more_runs_ungrouped(fake_gpu, two_groups):
    fake_gpu.group_cost = 0.05
    q, k, v = qkv()
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    fake_gpu.calls.clear()
    for _ in range(3):
        o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 3
    assert o.plan(q, k, v, 4).groups == 1


def test_fastest_mode_times_and_runs_ungrouped(fake_gpu, two_groups):
    q, k, v = qkv()
    o = ov(fake_gpu, memory_mode="fastest")
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert fake_gpu.kernel_calls() == 3  # the ungrouped call only: its warm-up and two timed runs
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert entry["grouped_ms"] is None
    assert o.plan(q, k, v, 4).groups == 1


def test_short_free_memory_splits_further_and_the_count_sticks(fake_gpu, two_groups):
    q, k, v = qkv()
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    plan = o.plan(q, k, v, 4)
    assert plan.groups == 2
    four = kernel_bytes.with_margin(head_groups.split_bytes("sage2_sm90", SHAPE, 4)) + MARGIN
    fake_gpu.free = four
    assert plan.need > four
    assert o.plan(q, k, v, 4).groups == 4
    fake_gpu.free = 1 << 40
    assert o.plan(q, k, v, 4).groups == 4  # settled: steady from step to step
    fake_gpu.calls.clear()
    out = o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 4 and torch.allclose(out.float(), attention_sdpa(q, k, v, 4).float(), atol=2e-2)


def test_the_checked_bytes_include_the_output_copy_of_a_layout_change(fake_gpu):
    g = torch.Generator().manual_seed(5)
    qh, kh, vh = (torch.randn(1, 4, 2048, 64, generator=g).bfloat16() for _ in range(3))
    o = ov(fake_gpu, calibrate=False)
    plan = o.plan(qh, kh, vh, 4, (qh, kh, vh), {"skip_reshape": True})  # [B,H,N,D] in, [B,N,H*D] out
    assert plan.output_copy and plan.layout == "HND" and plan.out_layout == "NHD"
    assert plan.need == kernel_bytes.with_margin(head_groups.split_bytes("sage2_sm90", SHAPE, 1, True)) + MARGIN
    assert head_groups.split_bytes("sage2_sm90", SHAPE, 1, True) >= head_groups.split_bytes("sage2_sm90", SHAPE, 1)


@pytest.mark.parametrize("layout,out_layout", [("NHD", "NHD"), ("NHD", "HND"), ("HND", "NHD"), ("HND", "HND")])
@pytest.mark.parametrize("kernel", ["sage2_sm90", "ck_int8"])  # ck_int8 computes in [B,H,N,D] only
def test_grouped_and_ungrouped_runs_give_the_same_output_in_every_layout(fake_gpu, layout, out_layout, kernel):
    g = torch.Generator().manual_seed(7)
    B, H, N, D = 2, 6, 128, 64
    q4, k4, v4 = (torch.randn(B, N, H, D, generator=g).bfloat16() for _ in range(3))
    if layout == "HND":
        q4, k4, v4 = (t.transpose(1, 2).contiguous() for t in (q4, k4, v4))
    outs = [execution.run_kernel(kernel, q4, k4, v4, layout, out_layout, groups, None, 90) for groups in (1, 2, 4, 6)]
    expect = (B, N, H * D) if out_layout == "NHD" else (B, H, N, D)
    for out in outs:
        assert out.shape == expect and out.is_contiguous()
        assert torch.equal(out, outs[0])


def test_settled_shapes_report_the_groups_in_force(fake_gpu, two_groups):
    fake_gpu.group_cost = 0.05  # the split is measured too costly: this shape runs ungrouped
    q, k, v = qkv()
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    (shape,) = settled_shapes()
    assert (shape["kernel"], shape["groups"], shape["Nq"], shape["H"], shape["dtype"]) == ("sage2_sm90", 1, 2048, 4,
                                                                                           "bfloat16")
    assert shape["need_bytes"] == kernel_bytes.with_margin(head_groups.split_bytes("sage2_sm90", SHAPE, 1)) + MARGIN



def _groups(o, q):
    return self_attention_groups(o, q.device, q.dtype, 1, 4, 2048, 64)


def _timed_in_two_processes(fake_gpu, o, q, k, v):
    """The shape timed by two processes' first calls (a timing is trusted from its second measurement on),
    then a third process started: the timing cache file stays, the decisions go."""
    for _ in range(2):
        fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
        fake_gpu.reset_state()
    (entry,) = timing.TimingCache(fake_gpu.cache_dir).entries().values()
    assert timing.trusted(entry)


def test_after_a_restart_the_groups_are_known_from_the_timing_cache_before_the_first_call(fake_gpu, two_groups):
    fake_gpu.group_cost = 0.015
    q, k, v = qkv()
    o = ov(fake_gpu)
    assert _groups(o, q) is None  # nothing measured: the first calls time the shape ungrouped
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))
    assert _groups(o, q) == 2  # settled
    fake_gpu.reset_state()
    assert _groups(o, q) is None  # measured once: the next process's first calls time it again
    _timed_in_two_processes(fake_gpu, o, q, k, v)
    fake_gpu.calls.clear()
    fake_gpu.self_tests.clear()
    assert _groups(o, q) == 2  # the self-test pass kept by the earlier processes
    assert fake_gpu.calls == [] and fake_gpu.self_tests == [] and not settled_shapes()  # read, not run or settled
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.self_tests == ["sage2_sm90"]  # this process's own self-test still ran before the kernel
    assert fake_gpu.kernel_calls() == 2  # the first call ran in those two groups and timed nothing
    (shape,) = settled_shapes()
    assert shape["groups"] == 2 and not fake_gpu.state.trials


def test_while_the_warm_up_self_test_runs_the_groups_come_from_the_pass_kept_for_this_build(fake_gpu, two_groups,
                                                                                           monkeypatch):
    fake_gpu.group_cost = 0.015
    q, k, v = qkv()
    o = ov(fake_gpu)
    _timed_in_two_processes(fake_gpu, o, q, k, v)
    fake_gpu.self_test_delay_s = 0.5
    warm_up = o.warm_up(q.device, q.dtype)  # as when the patch is applied; its self-test is still running below
    try:
        assert _groups(o, q) == 2
    finally:
        warm_up.join(5)
    fake_gpu.reset_state()
    monkeypatch.setattr(planning, "kernel_build", lambda name: "rebuilt")  # timings and pass: another build's
    assert _groups(o, q) is None
    planning.prepare(q.device, "auto", q.dtype, cache_dir=fake_gpu.cache_dir)
    assert _groups(o, q) is None  # the rebuilt kernel passed here, but its shape has no timing yet


def test_a_kept_pass_does_not_outlast_a_self_test_that_fails_here(fake_gpu, two_groups):
    fake_gpu.group_cost = 0.015
    q, k, v = qkv()
    o = ov(fake_gpu)
    _timed_in_two_processes(fake_gpu, o, q, k, v)
    fake_gpu.self_test_result = "returned wrong values"
    planning.prepare(q.device, "auto", q.dtype, cache_dir=fake_gpu.cache_dir)
    assert _groups(o, q) == 0
    fake_gpu.reset_state()
    fake_gpu.self_test_result = "raised RuntimeError"
    fake_gpu.calls.clear()
    o(raw_func, q, k, v, heads=4)  # the kernel is off for this process: SDPA, whatever the cache keeps
    assert fake_gpu.kernel_calls() == 0 and _groups(o, q) == 0


def test_the_groups_read_before_the_first_call_follow_what_that_call_will_do(fake_gpu, two_groups):
    q, k, v = qkv()
    fake_gpu.group_cost = 0.05  # the split is measured too costly: the shape runs ungrouped
    o = ov(fake_gpu)
    _timed_in_two_processes(fake_gpu, o, q, k, v)
    planning.prepare(q.device, "auto", q.dtype, cache_dir=fake_gpu.cache_dir)
    assert _groups(o, q) == 1
    fake_gpu.reset_state()
    fake_gpu.self_test_result = "wrong output"
    planning.prepare(q.device, "auto", q.dtype, cache_dir=fake_gpu.cache_dir)
    assert _groups(o, q) == 0  # the kernel failed its self-test here: the calls run on SDPA
    fake_gpu.calls.clear()
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 0


def test_without_calibration_the_first_call_takes_the_cached_entry_measured_once(fake_gpu, two_groups):
    fake_gpu.group_cost = 0.015
    q, k, v = qkv()
    fake_gpu.settle(lambda: ov(fake_gpu)(raw_func, q, k, v, heads=4))
    fake_gpu.reset_state()
    planning.prepare(q.device, "auto", q.dtype, cache_dir=fake_gpu.cache_dir)
    assert _groups(ov(fake_gpu), q) is None
    o = ov(fake_gpu, calibrate=False)
    assert _groups(o, q) == 2
    fake_gpu.calls.clear()
    o(raw_func, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 2
