"""gpu tier: real kernels at real Wan shapes (accuracy, exact extra bytes, head-split under a
VRAM cap, SDPA fallback, broken-build detection).  Speed is reported by `wan-sage bench`.
The memory mode and the failure paths on real kernels are in test_execution_gpu.py, compile in
test_compile_gpu.py."""
import gc
import logging

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

from wan_sage.attention import kernel_bytes, kernels, registry, stats  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride  # noqa: E402
from wan_sage.attention.sdpa import attention_sdpa  # noqa: E402
from wan_sage.attention.state import STATE  # noqa: E402

DEV = torch.device("cuda")
CC = kernels.device_cc(DEV)
AVAILABLE = [n for n in registry.KERNELS if kernels.available(n, CC)]
if not AVAILABLE:
    pytest.skip("no SageAttention / comfy-kitchen kernel installed", allow_module_level=True)

SHAPES = {"a14b_720p81_self": (1, 40, 75600, 75600, 128), "a14b_480p81_self": (1, 40, 32760, 32760, 128),
          "a14b_720p81_cross": (1, 40, 75600, 512, 128), "ti2v5b_704p121_self": (1, 24, 27280, 27280, 128)}


def make(B, H, NQ, NK, D, dtype=torch.bfloat16, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(B, n, H * D, device=DEV, dtype=dtype, generator=g) for n in (NQ, NK, NK))


def ref_slice(q, k, v, H, nq=512):
    B, _, C = q.shape
    D = C // H
    r = F.scaled_dot_product_attention(*(t.reshape(B, -1, H, D).transpose(1, 2).float()
                                         for t in (q[:, :nq], k, v)))
    return r.transpose(1, 2).reshape(B, -1, C)


@pytest.fixture(autouse=True)
def fresh(tmp_path):
    STATE.reset()
    yield
    STATE.reset()
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("name", AVAILABLE)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_accuracy_and_exact_extra_bytes(name, shape):
    B, H, NQ, NK, D = SHAPES[shape]
    q, k, v = make(B, H, NQ, NK, D)
    q4, k4, v4 = (t.view(B, -1, H, D) for t in (q, k, v))
    kernels.run(name, q4, k4, v4, "NHD", None, CC)  # warm-up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o = kernels.run(name, q4, k4, v4, "NHD", None, CC)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    formula = kernel_bytes.extra_bytes(registry.KERNELS[name].memory_path(CC), kernel_bytes.AttnShape(B, H, NQ, NK, D))
    assert abs(measured - formula) <= 0.01 * formula, (measured, formula)
    ref = ref_slice(q, k, v, H)
    out = o.reshape(B, NQ, H * D)[:, :ref.shape[1]].float()
    cos = F.cosine_similarity(out.flatten(), ref.flatten(), dim=0).item()
    assert torch.isfinite(out).all() and cos > 0.995, cos


def test_head_split_keeps_sage_running_under_a_vram_cap(ballast, tmp_path):
    B, H, NQ, NK, D = SHAPES["a14b_720p81_self"]
    q, k, v = make(B, H, NQ, NK, D)
    o = SageAttentionOverride(PatchConfig(calibrate=False, memory_mode="fastest", cache_dir=str(tmp_path)))
    full = o.plan(q, k, v, H)  # also runs the self-test, before the cap is set
    assert full.kernel is not None and full.groups == 1
    ref = ref_slice(q, k, v, H)  # the fp32 reference needs more than the cap leaves
    ballast(full.need // 2)
    plan = o.plan(q, k, v, H)
    assert plan.kernel is not None and plan.groups >= 2, plan
    stats.begin_run(o.patch_id)
    out = o(attention_sdpa, q, k, v, heads=H)
    s = stats.end_run(o.patch_id)
    assert s["sage_calls"] == 1 and s["head_split_calls"] == 1, s
    cos = F.cosine_similarity(out[:, :ref.shape[1]].float().flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.995


def test_sdpa_when_no_head_group_fits(ballast, tmp_path):
    B, H, NQ, NK, D = SHAPES["a14b_720p81_self"]
    q, k, v = make(B, H, NQ, NK, D)
    o = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=str(tmp_path)))
    assert o.plan(q, k, v, H).kernel is not None  # self-test done before the cap is set
    ballast(q.numel() * 2 + (300 << 20))  # room for SDPA's output, not for Sage's buffers
    assert o.plan(q, k, v, H).reason == "memory"
    stats.begin_run(o.patch_id)
    out = o(attention_sdpa, q, k, v, heads=H)
    assert stats.end_run(o.patch_id)["reasons"] == {"memory": 1}
    assert out.shape == q.shape


def test_broken_build_is_detected_by_the_self_test(tmp_path, caplog):
    name = kernels.auto_candidates(CC)[0]
    real = kernels.entry_point(name)
    kernels.install_test_kernel(name, lambda q, k, v, **kw: torch.empty_like(q))
    try:
        STATE.reset()
        B, H, NQ, NK, D = SHAPES["a14b_480p81_self"]
        q, k, v = make(B, H, NQ, NK, D)
        o = SageAttentionOverride(PatchConfig(kernel=name, calibrate=False, cache_dir=str(tmp_path)))
        with caplog.at_level(logging.ERROR, logger="wan_sage"):
            assert o.plan(q, k, v, H).reason == "disabled"
            out = o(attention_sdpa, q, k, v, heads=H)
        assert torch.equal(out, attention_sdpa(q, k, v, H))
        assert sum("self-test" in r.getMessage() for r in caplog.records) == 1
    finally:
        kernels.install_test_kernel(name, real)


def test_oom_from_the_kernel_is_redone_on_sdpa(tmp_path):
    name = kernels.auto_candidates(CC)[0]
    real = kernels.entry_point(name)

    def oom(q, k, v, **kw):
        _ = torch.empty(1 << 50, device=q.device)  # a real allocator OutOfMemoryError
    kernels.install_test_kernel(name, oom)
    try:
        B, H, NQ, NK, D = SHAPES["a14b_480p81_self"]
        q, k, v = make(B, H, NQ, NK, D)
        o = SageAttentionOverride(PatchConfig(kernel=name, calibrate=False, self_test=False, cache_dir=str(tmp_path)))
        stats.begin_run(o.patch_id)
        out = o(attention_sdpa, q, k, v, heads=H)
        s = stats.end_run(o.patch_id)
        assert s["fallbacks"] == {"oom": 1}
        assert torch.equal(out, attention_sdpa(q, k, v, H))
    finally:
        kernels.install_test_kernel(name, real)
