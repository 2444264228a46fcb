"""Never slower: a call whose shape is settled on SDPA is declined before any run-time work (in the
eager override, and at the top of the custom op's implementation), still counted by its reason,
with SDPA's output in every layout; the call keys are named tuples read by field name.  (The
per-call cost is measured by ``python -m bench.dispatch_overhead``, not asserted here.)"""
import pytest
import torch

from fakegpu import qkv
from wan_sage.attention import execution, op, policy, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride, settled_shapes
from wan_sage.attention.sdpa import attention_sdpa
from wan_sage.attention.state import STATE, CallKey, Decision


def raw_func(*a, **k):
    raise AssertionError("func must not be called when there is no previous override")


def ov(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return SageAttentionOverride(PatchConfig(**cfg))


@pytest.fixture
def no_run_time_part(monkeypatch):
    """From now on, any call that reaches the run-time decision fails."""
    def refuse(*a, **k):
        raise AssertionError("a settled SDPA shape must not reach the run-time decision")
    yield lambda: (monkeypatch.setattr(execution, "_decide", refuse), monkeypatch.setattr(execution, "decide", refuse))


@pytest.mark.parametrize("n,nk,reason", [(2048, None, "slower"), (4096, 512, "cross_slower")])
def test_a_shape_settled_on_sdpa_is_declined_before_the_run_time_part(fake_gpu, no_run_time_part, n, nk, reason):
    fake_gpu.times["sage2_sm90"] = 17.0  # the timing measures SDPA faster
    q, k, v = qkv(N=n, Nk=nk)
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, heads=4))  # times and settles the shape on SDPA
    no_run_time_part()
    calls = fake_gpu.kernel_calls()
    stats.begin_run(o.patch_id)
    for _ in range(5):
        assert torch.equal(o(raw_func, q, k, v, heads=4), attention_sdpa(q, k, v, 4))
    s = stats.end_run(o.patch_id)
    assert s["reasons"] == {reason: 5} and s["sdpa_calls"] == 5 and s["sage_calls"] == 0
    assert fake_gpu.kernel_calls() == calls


def test_a_settled_sdpa_call_returns_what_plain_sdpa_returns_in_every_layout(fake_gpu, no_run_time_part):
    o = ov(fake_gpu, calibrate=False, min_tokens=0)
    g = torch.Generator().manual_seed(3)
    qh, kh, vh = (torch.randn(2, 4, 256, 64, generator=g).bfloat16() for _ in range(3))
    q, k, v = qkv(N=256)
    calls = [((q, k, v), {"heads": 4}), ((q, k, v), {"heads": 4, "scale": 0.05}),
             ((qh, kh, vh), {"heads": 4, "skip_reshape": True, "skip_output_reshape": True}),
             ((qh, kh, vh, 4, None, None, True, False), {})]
    for args, kwargs in calls:
        key = execution.call_key(o, args[0], o._static(args, kwargs)[6])
        STATE.settle(key, Decision(None, "slower", cc=90))
    no_run_time_part()
    stats.begin_run(o.patch_id)
    for args, kwargs in calls:
        heads = kwargs.get("heads", 4)
        extra = {name: kwargs[name] for name in ("scale", "skip_reshape", "skip_output_reshape") if name in kwargs}
        if len(args) > 4:
            extra = {"skip_reshape": args[6], "skip_output_reshape": args[7]}
        assert torch.equal(o(raw_func, *args, **kwargs), attention_sdpa(*args[:3], heads, **extra))
    assert stats.end_run(o.patch_id)["reasons"] == {"slower": 4}
    assert fake_gpu.kernel_calls() == 0


def test_a_static_refusal_still_goes_to_the_previous_override_on_a_settled_shape(fake_gpu):
    seen = []

    def prev(func, *args, **kwargs):
        seen.append(kwargs.get("mask") is not None)
        return "from-prev"
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False), prev=prev)
    STATE.settle(execution.call_key(o, q, policy.call_shape(q, k, 4, False, False)), Decision(None, "slower"))
    assert o(raw_func, q, k, v, heads=4, mask=torch.zeros(2048, 2048)) == "from-prev"
    assert torch.equal(o(raw_func, q, k, v, heads=4), attention_sdpa(q, k, v, 4))
    assert seen == [True]


def test_the_custom_op_declines_a_settled_shape_before_the_run_time_part(fake_gpu, no_run_time_part):
    o = ov(fake_gpu, calibrate=False)
    q, k, v = qkv()
    STATE.settle(execution.call_key(o, q, policy.call_shape(q, k, 4, False, False)), Decision(None, "nonfinite"))
    no_run_time_part()
    stats.begin_run(o.patch_id)
    out = op.run_registered(q, k, v, 4, False, False, None, o.graph_key)
    assert torch.equal(out, attention_sdpa(q, k, v, 4))
    assert stats.end_run(o.patch_id)["reasons"] == {"nonfinite": 1}


def test_a_shape_settled_on_a_kernel_still_runs_it(fake_gpu):
    o = ov(fake_gpu, calibrate=False)
    q, k, v = qkv()
    stats.begin_run(o.patch_id)
    for _ in range(3):
        o(raw_func, q, k, v, heads=4)
    assert stats.end_run(o.patch_id)["by_kernel"] == {"sage2_sm90": 3} and fake_gpu.kernel_calls() == 3


def test_call_keys_are_hashable_named_values_read_by_field(fake_gpu):
    q, k, v = qkv()
    o = ov(fake_gpu, calibrate=False)
    shape = policy.call_shape(q, k, 4, False, False)
    assert (shape.B, shape.H, shape.Nq, shape.Nk, shape.D, shape.layout, shape.out_layout) == (
        1, 4, 2048, 2048, 64, "NHD", "NHD")
    key = execution.call_key(o, q, shape)
    assert key == CallKey(o.config_key, 0, torch.bfloat16, policy.CallShape(1, 4, 2048, 2048, 64, "NHD", "NHD"))
    assert hash(key) == hash(CallKey(key.config_key, key.device_index, key.dtype, key.shape))
    assert key.shape is shape and key.dtype is torch.bfloat16
    o(raw_func, q, k, v, heads=4)
    (entry,) = settled_shapes()
    assert (entry["B"], entry["Nq"], entry["layout"], entry["kernel"]) == (1, 2048, "NHD", "sage2_sm90")


@pytest.mark.parametrize("kwargs,reason", [
    ({"mask": torch.zeros(2048, 2048)}, "mask"),
    ({"low_precision_attention": False}, "low_precision_off"),
    ({"enable_gqa": True}, "gqa"),
])
def test_a_call_like_one_seen_before_is_still_checked_for_its_options(fake_gpu, kwargs, reason):
    q, k, v = qkv()
    assert policy.options_allow(q, k, v, None, {}) and not policy.options_allow(q, k, v, kwargs.get("mask"), kwargs)
    assert policy.static_reason(q, k, v, kwargs.get("mask"), kwargs) == reason
    o = ov(fake_gpu, calibrate=False)
    stats.begin_run(o.patch_id)
    o(raw_func, q, k, v, heads=4)  # seen: its call key is remembered
    assert torch.equal(o(raw_func, q, k, v, heads=4, **kwargs), attention_sdpa(q, k, v, 4, **kwargs))
    s = stats.end_run(o.patch_id)
    assert s["reasons"] == {reason: 1} and s["by_kernel"] == {"sage2_sm90": 1}


def test_a_call_recording_autograd_is_declined_even_when_seen_before(fake_gpu):
    q, k, v = qkv()
    o = ov(fake_gpu, calibrate=False)
    o(raw_func, q, k, v, heads=4)
    stats.begin_run(o.patch_id)
    with torch.enable_grad():
        qg = q.clone().requires_grad_()
        assert policy.static_reason(qg, k, v, None, {}) == "grad" and not policy.options_allow(qg, k, v, None, {})
        o(raw_func, qg, k, v, heads=4)
    assert stats.end_run(o.patch_id)["reasons"] == {"grad": 1}


def test_shape_refusals_are_remembered_and_still_counted(fake_gpu):
    o = ov(fake_gpu, calibrate=False)
    stats.begin_run(o.patch_id)
    short, fp32 = qkv(N=512), qkv(dtype=torch.float32)
    q, k, v = qkv()
    grouped = (q, k.view(1, 2048, 4, 64)[:, :, :2].contiguous(), v.view(1, 2048, 4, 64)[:, :, :2].contiguous())
    for _ in range(3):
        o(raw_func, *short, heads=4)
        o(raw_func, *fp32, heads=4)
        assert torch.equal(o(raw_func, *grouped, heads=4), attention_sdpa(*grouped, 4))  # 2 k/v heads for 4
    s = stats.end_run(o.patch_id)
    assert s["reasons"] == {"short": 3, "dtype": 3, "gqa": 3} and fake_gpu.kernel_calls() == 0
    assert set(STATE.seen_calls.values()) == {"short", "dtype", "gqa"}
    assert set(policy.SHAPE_REASONS) < set(policy.STATIC_REASONS)


WAN_KWARGS = {"heads": 4, "transformer_options": {"block_index": 0}}


def test_wan_keyword_calls_settled_on_sdpa_are_declined_before_the_run_time_part(fake_gpu, no_run_time_part):
    """Wan's call sites pass heads and transformer_options only: the shorter key of that path finds a
    shape settled on SDPA, and the call returns plain SDPA's output, counted by its reason."""
    fake_gpu.times["sage2_sm90"] = 17.0
    q, k, v = qkv()
    o = ov(fake_gpu)
    fake_gpu.settle(lambda: o(raw_func, q, k, v, **WAN_KWARGS))  # times and settles the shape on SDPA
    no_run_time_part()
    stats.begin_run(o.patch_id)
    for _ in range(3):
        assert torch.equal(o(raw_func, q, k, v, **WAN_KWARGS), attention_sdpa(q, k, v, 4))
    assert stats.end_run(o.patch_id)["reasons"] == {"slower": 3}


def test_wan_keyword_calls_recording_autograd_never_reach_a_kernel(fake_gpu):
    """The autograd check of the Wan keyword path runs after its declined-call lookup: a call on a
    shape settled on a kernel still goes to SDPA (reason "grad") while it records autograd."""
    o = ov(fake_gpu, calibrate=False)
    q, k, v = qkv()
    o(raw_func, q, k, v, **WAN_KWARGS)  # settles the shape on the kernel
    before = fake_gpu.kernel_calls()
    qg = q.detach().clone().requires_grad_(True)
    stats.begin_run(o.patch_id)
    with torch.enable_grad():
        out = o(raw_func, qg, k, v, **WAN_KWARGS)
    assert out.requires_grad and fake_gpu.kernel_calls() == before
    o(raw_func, q, k, v, **WAN_KWARGS)
    s = stats.end_run(o.patch_id)
    assert s["reasons"] == {"grad": 1} and s["by_kernel"] == {"sage2_sm90": 1}


def test_wan_keyword_calls_with_mismatched_dtypes_keep_their_static_refusal(fake_gpu):
    """The key of the Wan keyword path holds all three dtypes: a k of another dtype than q's is
    refused statically every time (to the previous override), never served by the decision of the
    matching call."""
    def prev(func, *args, **kwargs):
        return "from-prev"
    q, k, v = qkv()
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False), prev=prev)
    o(raw_func, q, k, v, **WAN_KWARGS)
    stats.begin_run(o.patch_id)
    assert [o(raw_func, q, k.half(), v, **WAN_KWARGS) for _ in range(2)] == ["from-prev"] * 2
    assert torch.is_tensor(o(raw_func, q, k, v, **WAN_KWARGS))
    s = stats.end_run(o.patch_id)
    assert s["reasons"] == {"dtype": 2} and s["by_kernel"] == {"sage2_sm90": 1}


def test_available_memory_leaves_out_cached_blocks_split_off_segments_in_use(monkeypatch):
    """What the allocator caches in segments that are partly in use cannot be released for a large
    buffer: the dispatcher's measure of free memory counts only the driver's free memory and the
    cached memory the allocator can hand back."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (633 << 20, 140 << 30))
    stats_now = {"reserved_bytes.all.current": 10 << 30, "allocated_bytes.all.current": (10 << 30) - (900 << 20),
                 "inactive_split_bytes.all.current": 617 << 20}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats_now)
    assert execution.available_bytes(torch.device("cuda", 0), None) == (633 + 900 - 617) << 20
    stats_now["inactive_split_bytes.all.current"] = 0
    assert execution.available_bytes(torch.device("cuda", 0), None) == (633 + 900) << 20
    assert execution.available_bytes(torch.device("cuda", 0), lambda device: 123) == 123


def test_declined_calls_are_counted_in_their_window_across_a_new_decision(fake_gpu):
    """The declined table counts on its entries: the calls made before a window opens are not the window's,
    and the calls counted before a new decision empties the table stay counted."""
    fake_gpu.times["sage2_sm90"] = 17.0
    q, k, v = qkv()
    o = ov(fake_gpu)
    wrapped = dict(WAN_KWARGS, _inside_attn_wrapper=True)  # as ComfyUI's wrap_attn passes them
    fake_gpu.settle(lambda: o(raw_func, q, k, v, **wrapped))  # settles the shape on SDPA
    for _ in range(2):
        o(raw_func, q, k, v, **wrapped)  # declined calls outside a window
    stats.begin_run(o.patch_id)
    for _ in range(3):
        o(raw_func, q, k, v, **wrapped)
    q2, k2, v2 = qkv(N=4096)
    timed = fake_gpu.settle(lambda: o(raw_func, q2, k2, v2, **wrapped))  # a new shape: its decision empties
    for _ in range(2):                                                     # the declined table
        o(raw_func, q, k, v, **wrapped)
    assert stats.snapshot(o.patch_id)["reasons"]["slower"] == 5
    o(raw_func, q, k, v, **wrapped)
    s = stats.end_run(o.patch_id)
    assert s["reasons"]["slower"] == 6 and set(s["reasons"]) == {"slower", "timing"}
    assert s["sdpa_calls"] + s["sage_calls"] == 6 + len(timed)
