"""Never bigger: a call whose q is handed over (ComfyUI's attention containers, q held nowhere else) runs
on the kernel's write-into-q path, head group by head group, its output written into q's memory, in the
fewest groups whose peak is at or below SDPA's extra bytes; a q held anywhere else takes the ordinary
path.  The output check runs on a copy of query rows before q is written, and a kernel that fails in a
group leaves the rest of the heads to SDPA, so the output is whole.  Fake kernels on the CPU
(tests/unit/fakegpu.py); the real kernel's bytes and output are checked in tests/gpu."""
import pytest
import torch

from fakegpu import qkv
from test_current_comfy_attention import AttentionTensorContainer as Box
from wan_sage.attention import head_groups, kernel_bytes, planning, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa

H, D = 8, 64


@pytest.fixture(autouse=True)
def no_allocator_slack(request, monkeypatch):
    """The fake calls are a few MiB: the allocator's slack (a fact of CUDA's caching allocator, measured in
    tests/gpu) is left out of their group choice, except where a test says otherwise."""
    if "keep_slack" not in request.keywords:
        monkeypatch.setattr(head_groups, "INTO_Q_SLACK_BYTES", 0)


def ov(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    cfg.setdefault("calibrate", False)
    return SageAttentionOverride(PatchConfig(**cfg))


def boxed_call(o, n=2048, seed=0, keep=None):
    """One call as ComfyUI 0.38's Wan self-attention makes it: fresh q, k, v in containers (``keep``
    receives q as well, as another holder would)."""
    q, k, v = qkv(N=n, H=H, D=D, seed=seed)
    expected = attention_sdpa(q, k, v, H)
    q_ptr = q.data_ptr()
    if keep is not None:
        keep.append(q)
    boxes = (Box(q), Box(k), Box(v))
    del q, k, v
    out = o.container_function(*boxes, heads=H, transformer_options={})
    return out, expected, q_ptr


def close(out, expected):
    return (out.float() - expected.float()).norm() / expected.float().norm() < 0.02


def test_a_handed_over_q_receives_the_output_group_by_group(fake_gpu):
    o = ov(fake_gpu)
    stats.begin_run(o.patch_id)
    out, expected, q_ptr = boxed_call(o)
    assert out.data_ptr() == q_ptr and close(out, expected)
    probes = [(h0, h1) for _n, shape, h0, h1 in fake_gpu.into_q_calls if shape[1] == 256]
    groups = head_groups.into_q_groups("sage2_sm90_into_q", kernel_bytes.AttnShape(1, H, 2048, 2048, D))
    spans = [(h0, h1) for _n, shape, h0, h1 in fake_gpu.into_q_calls if shape[1] == 2048]
    per = -(-H // groups.groups)
    assert spans == [(h0, min(H, h0 + per)) for h0 in range(0, H, per)] and groups.groups > 1
    assert probes == spans  # the output check ran first, on CHECK_ROWS query rows of every head
    assert stats.end_run(o.patch_id)["by_kernel"] == {"sage2_sm90": 1}


@pytest.mark.keep_slack
def test_the_groups_keep_the_call_within_sdpas_bytes():
    for B, Hq, N, Dh in [(1, 40, 75600, 128), (1, 40, 32760, 128), (2, 12, 32760, 128), (1, 24, 109120, 128),
                         (1, 40, 7480, 128), (1, 16, 16384, 64)]:
        shape = kernel_bytes.AttnShape(B, Hq, N, N, Dh)
        found = head_groups.into_q_groups("sage2_sm90_into_q", shape)
        slack = head_groups.INTO_Q_SLACK_BYTES
        assert found is not None and found.extra_bytes + slack <= kernel_bytes.extra_bytes("sdpa", shape)
        fewer = [g for g in head_groups.group_counts(Hq) if g < found.groups]
        assert all(head_groups.split_bytes("sage2_sm90_into_q", shape, g) + slack > found.sdpa_bytes
                   for g in fewer)
        assert found.extra_bytes < head_groups.split_bytes("sage2_sm90", shape, found.groups)


def test_a_q_held_elsewhere_takes_the_ordinary_path(fake_gpu):
    o = ov(fake_gpu)
    kept = []
    out, expected, q_ptr = boxed_call(o, keep=kept)
    assert out.data_ptr() != q_ptr and close(out, expected)
    assert fake_gpu.into_q_calls == [] and torch.equal(kept[0], qkv(N=2048, H=H, D=D)[0])


def test_a_view_whose_base_is_alive_takes_the_ordinary_path(fake_gpu):
    o = ov(fake_gpu)
    q, k, v = qkv(N=2048, H=H, D=D)
    q4 = q.view(1, 2048, H, D).clone()  # the call site keeps the 4-D q; the container holds a view of it
    out = o.container_function(Box(q4.view(1, 2048, H * D)), Box(k), Box(v), heads=H, transformer_options={})
    assert fake_gpu.into_q_calls == [] and torch.equal(q4.view(1, 2048, H * D), q)
    assert close(out, attention_sdpa(q, k, v, H))


def test_a_probe_beyond_the_bound_leaves_q_intact_and_settles_sdpa(fake_gpu):
    fake_gpu.mode = "noise"
    o = ov(fake_gpu)
    stats.begin_run(o.patch_id)
    out, expected, q_ptr = boxed_call(o)
    assert torch.equal(out, expected)  # SDPA on the untouched q
    assert all(shape[1] < 2048 for _n, shape, _h0, _h1 in fake_gpu.into_q_calls)
    out, expected, _ = boxed_call(o, seed=1)
    assert torch.equal(out, expected)
    s = stats.end_run(o.patch_id)
    assert s["fallbacks"] == {"inaccurate": 1} and s["reasons"] == {"inaccurate": 2}


@pytest.mark.parametrize("mode", ["oom", "raise"])
def test_a_group_that_fails_leaves_its_heads_and_the_rest_to_sdpa(fake_gpu, monkeypatch, mode):
    o = ov(fake_gpu, check_finite=False)
    real = fake_gpu.run_into_q

    def fail_second_group(name, q4, k4, v4, scale, h0, h1, shared=None):
        if h0 > 0:
            raise torch.OutOfMemoryError("fake") if mode == "oom" else RuntimeError("fake")
        real(name, q4, k4, v4, scale, h0, h1, shared)
    from wan_sage.attention import kernels
    monkeypatch.setattr(kernels, "run_into_q", fail_second_group)
    stats.begin_run(o.patch_id)
    out, expected, q_ptr = boxed_call(o)
    assert out.data_ptr() == q_ptr and close(out, expected)
    assert stats.end_run(o.patch_id)["fallbacks"] == {"oom" if mode == "oom" else "error": 1}


def test_short_free_memory_splits_the_write_into_q_path_further(fake_gpu):
    o = ov(fake_gpu, check_finite=False)
    shape = kernel_bytes.AttnShape(1, H, 2048, 2048, D)
    groups = head_groups.into_q_groups("sage2_sm90_into_q", shape).groups
    more = [g for g in head_groups.group_counts(H) if g > groups][0]
    fake_gpu.free = planning.need_bytes("sage2_sm90", 90, shape, more, False, 0, True) + (
        o.config.memory_margin_mb << 20)
    out, expected, q_ptr = boxed_call(o)
    assert out.data_ptr() == q_ptr and close(out, expected)
    assert len(fake_gpu.into_q_calls) == more


@pytest.mark.keep_slack
def test_the_estimate_plans_the_write_into_q_path_where_comfyui_hands_q_over():
    """Where Wan hands q over (the node finds it so; the route and the CLI plan without it) the estimate plans
    eager Sage self-attention on the write-into-q path, in the dispatcher's groups, whatever the memory
    mode: its activation peak is then at or below the same forward on SDPA.  Compiled, or with q kept, it
    plans the ordinary path."""
    from setups import estimate
    from wan_sage.memory.activation_model import PRESETS
    a14b = PRESETS["wan2.2-a14b"]
    new = dict(kernel_set="comfy-kitchen", q_handed_over=True)
    sage = estimate(a14b, 1280, 720, 81, attention="sage-auto", **new)
    sdpa = estimate(a14b, 1280, 720, 81, attention="sdpa", **new)
    fastest = estimate(a14b, 1280, 720, 81, attention="sage-auto", sage_grouped=False, **new)
    found = head_groups.into_q_groups("sage2_sm90_into_q", kernel_bytes.AttnShape(1, a14b.num_heads, sage.tokens,
                                                                                   sage.tokens, a14b.head_dim))
    assert sage.sage_head_groups == fastest.sage_head_groups == found.groups > 1
    assert sage.resident["total"] <= sdpa.resident["total"]
    old = estimate(a14b, 1280, 720, 81, attention="sage-auto", kernel_set="comfy-kitchen")  # q kept
    compiled = estimate(a14b, 1280, 720, 81, attention="sage-auto", compiled=True, **new)
    compiled_old = estimate(a14b, 1280, 720, 81, attention="sage-auto", compiled=True)
    assert old.resident["total"] > sdpa.resident["total"]
    assert compiled.sage_head_groups == compiled_old.sage_head_groups


@pytest.mark.keep_slack
def test_a_call_too_small_for_the_slack_takes_the_ordinary_path(fake_gpu):
    """Where SDPA's output is not larger than one group's bytes plus the allocator's slack, no group count
    keeps the write-into-q call within SDPA's bytes: the call runs as if q were held."""
    o = ov(fake_gpu)
    out, expected, q_ptr = boxed_call(o)
    assert fake_gpu.into_q_calls == [] and out.data_ptr() != q_ptr and close(out, expected)


class _Core:
    """Stands in for ``sageattention.core`` on the CPU: records the order of the quantisation steps, the V
    and K's mean each step gets, with outputs of the real steps' shapes."""

    def __init__(self):
        self.steps = []
        self.sm90_compile = self

    def per_channel_fp8(self, v, tensor_layout, smooth_v):
        B, N, H, D = v.shape
        self.steps.append(("v", N, v.is_contiguous()))
        self.v = v.clone()
        return torch.zeros(B, D, H, -(-N // 64) * 64, dtype=torch.uint8), torch.ones(B, H, D), None

    def per_thread_int8_triton(self, q, k, km, **kw):
        self.steps.append(("qk", k.shape[1], km))
        return (torch.zeros(q.shape, dtype=torch.int8), torch.ones(1), torch.zeros(k.shape, dtype=torch.int8),
                torch.ones(1))

    def qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(self, q8, k8, v8, out, *args):
        self.steps.append(("attn", v8.shape[-1], None))


@pytest.mark.parametrize("N, copied", [(2048, False), (2000, False), (1950, True), (2100, True)])
def test_the_sm90_write_into_q_quantises_v_first_and_copies_it_only_to_pad_it(N, copied):
    """V is quantised before K's copy and the INT8 q and k exist (the peak is the larger of the two steps,
    not their sum: kernel_bytes), from its strided heads where SageAttention's padding to 64 tokens already
    reaches a multiple of 128, and from a zero-padded copy only where it does not; the kernel gets V padded
    to 128 tokens either way, and q and k get the call's shared mean of K for their heads."""
    from wan_sage.attention import registry
    core = _Core()
    q, k, v = (t.view(1, N, 4, 64) for t in qkv(N=N, H=4, D=64))
    km = registry.sm90_key_mean(k)
    registry._sage2_sm90_into_q(core, q, k, v, None, 1, 3, km)
    padded = -(-N // 128) * 128
    (v_step, qk_step, attn_step) = core.steps
    assert v_step == ("v", padded if copied else N, copied)
    assert torch.equal(core.v[:, :N], v[:, :, 1:3]) and not core.v[:, N:].any()  # zero-padded, not garbage
    assert qk_step[:2] == ("qk", N) and torch.equal(qk_step[2], km[:, :, 1:3])
    assert attn_step == ("attn", padded, None)


def test_the_sm90_key_mean_is_the_mean_over_tokens_for_any_layout_of_k():
    from wan_sage.attention import registry
    k = torch.randn(2, 3000, 6, 64, dtype=torch.float32)
    expected = k.mean(dim=1, keepdim=True)
    assert torch.allclose(registry.sm90_key_mean(k), expected, atol=1e-5)
    strided = torch.randn(2, 3000, 6, 128)[..., ::2]  # heads not viewable as one row per token
    assert torch.allclose(registry.sm90_key_mean(strided), strided.mean(dim=1, keepdim=True), atol=1e-5)
    bf16 = k.to(torch.bfloat16)
    got = registry.sm90_key_mean(bf16)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), expected, atol=2e-2)


def test_every_group_of_a_call_gets_the_shared_piece_computed_once(fake_gpu, monkeypatch):
    from wan_sage.attention import kernels
    o = ov(fake_gpu, check_finite=False)
    made, seen = [], []
    monkeypatch.setattr(kernels, "into_q_shared", lambda name, k4: made.append(object()) or made[-1])
    real = fake_gpu.run_into_q

    def record(name, q4, k4, v4, scale, h0, h1, shared=None):
        seen.append(shared)
        real(name, q4, k4, v4, scale, h0, h1, shared)
    monkeypatch.setattr(kernels, "run_into_q", record)
    out, expected, q_ptr = boxed_call(o)
    assert out.data_ptr() == q_ptr and close(out, expected)
    assert len(made) == 1 and len(seen) > 1 and all(s is made[0] for s in seen)


@pytest.mark.parametrize("mode", ["oom", "raise"])
def test_a_shared_piece_that_fails_leaves_the_call_to_sdpa_with_q_intact(fake_gpu, monkeypatch, mode):
    from wan_sage.attention import kernels
    o = ov(fake_gpu, check_finite=False)

    def fail(name, k4):
        raise torch.OutOfMemoryError("fake") if mode == "oom" else RuntimeError("fake")
    monkeypatch.setattr(kernels, "into_q_shared", fail)
    stats.begin_run(o.patch_id)
    out, expected, _q_ptr = boxed_call(o)
    assert close(out, expected) and fake_gpu.into_q_calls == []
    assert stats.end_run(o.patch_id)["fallbacks"] == {"oom" if mode == "oom" else "error": 1}
