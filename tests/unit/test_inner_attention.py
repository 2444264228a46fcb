"""The Sage patch as Raylight's inner-attention processor, in one process with injected fake kernels: the
dispatch on a rank's [B, N, H/U, D] share, the fallbacks to ``dense``, ring and unsupported options, the
chain to a previous processor, immutability, pickling, and the stats' rank."""
import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from wan_sage.attention import stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.inner_attention import INNER_ATTENTION_KEY, InnerAttention
from wan_sage.attention.override import SageAttentionOverride


def nhd(B=1, N=2048, H=4, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, N, H, D, generator=g).to(torch.bfloat16) for _ in range(3))


def reference(q, k, v, scale=None):
    o = F.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)), scale=scale)
    return o.transpose(1, 2)


class Dense:
    """Stands for xFuser's ring function: records its calls, returns (out, lse, None) like the ring code."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append(kwargs)
        return reference(q, k, v, kwargs.get("softmax_scale")).to(q.dtype), None, None


XFUSER_KWARGS = {"dropout_p": 0.0, "softmax_scale": None, "causal": False, "window_size": (-1, -1),
                 "alibi_slopes": None, "deterministic": False, "return_attn_probs": False, "group": None,
                 "attn_type": "TORCH", "attn_processor": None, "attn_layer": None, "joint_tensor_key": None,
                 "joint_tensor_value": None, "joint_strategy": "none", "q_descale": None, "k_descale": None,
                 "v_descale": None}


def processor(fake, **cfg):
    cfg.setdefault("cache_dir", fake.cache_dir)
    return InnerAttention(SageAttentionOverride(PatchConfig(calibrate=False, **cfg)))


def close(a, b, tol=2e-2):
    return (a.float() - b.float()).norm() / b.float().norm() < tol


def test_kernel_serves_the_share_and_matches_attention(fake_gpu):
    p, dense = processor(fake_gpu), Dense()
    q, k, v = nhd()
    stats.begin_run(p.override.patch_id)
    out = p(dense, q, k, v, transformer_options={}, **XFUSER_KWARGS)
    summary = stats.end_run(p.override.patch_id)
    assert out.shape == q.shape
    assert close(out, reference(q, k, v))
    assert fake_gpu.kernel_calls("sage2_sm90") == 1 and not dense.calls
    assert summary["sage_calls"] == 1 and summary["sdpa_calls"] == 0


def test_softmax_scale_reaches_the_kernel(fake_gpu):
    p = processor(fake_gpu)
    q, k, v = nhd()
    out = p(Dense(), q, k, v, transformer_options={}, **dict(XFUSER_KWARGS, softmax_scale=0.05))
    assert close(out, reference(q, k, v, 0.05))


@pytest.mark.parametrize("mode, reason", [("oom", "oom"), ("raise", "error"), ("nan", "nonfinite")])
def test_kernel_failure_falls_back_to_dense(fake_gpu, mode, reason):
    p, dense = processor(fake_gpu), Dense()
    fake_gpu.mode = mode
    q, k, v = nhd()
    stats.begin_run(p.override.patch_id)
    out = p(dense, q, k, v, transformer_options={}, **XFUSER_KWARGS)
    summary = stats.end_run(p.override.patch_id)
    assert close(out, reference(q, k, v))
    assert len(dense.calls) == 1 and dense.calls[0]["group"] is None  # dense got xFuser's options
    assert summary["reasons"] == {reason: 1}


def test_short_sequence_goes_to_dense(fake_gpu):
    p, dense = processor(fake_gpu), Dense()
    q, k, v = nhd(N=256)
    out = p(dense, q, k, v, transformer_options={}, **XFUSER_KWARGS)
    assert close(out, reference(q, k, v)) and len(dense.calls) == 1 and not fake_gpu.calls


@pytest.mark.parametrize("option", [{"causal": True}, {"dropout_p": 0.1}, {"window_size": (128, 128)},
                                    {"return_attn_probs": True}, {"joint_tensor_key": torch.zeros(1)},
                                    {"attn_layer": object()}])
def test_options_the_kernels_lack_go_to_dense(fake_gpu, option):
    p, dense = processor(fake_gpu), Dense()
    q, k, v = nhd()
    stats.begin_run(p.override.patch_id)
    p(dense, q, k, v, transformer_options={}, **dict(XFUSER_KWARGS, **option))
    assert stats.end_run(p.override.patch_id)["reasons"] == {"options": 1}
    assert len(dense.calls) == 1 and not fake_gpu.calls


def test_ring_group_of_two_goes_to_dense(fake_gpu, monkeypatch):
    from wan_sage.attention import inner_attention
    monkeypatch.setattr(inner_attention, "ring_size", lambda group: 2 if group == "ring" else 1)
    p, dense = processor(fake_gpu), Dense()
    q, k, v = nhd()
    stats.begin_run(p.override.patch_id)
    p(dense, q, k, v, transformer_options={}, **dict(XFUSER_KWARGS, group="ring"))
    assert stats.end_run(p.override.patch_id)["reasons"] == {"ring": 1}
    assert len(dense.calls) == 1 and not fake_gpu.calls
    assert InnerAttention.supports_ring is False


def test_fallback_goes_through_a_previous_processor(fake_gpu):
    seen = []

    def prev(dense, q, k, v, *, transformer_options, **kwargs):
        seen.append(transformer_options["step"])
        return dense(q, k, v, **kwargs)
    base = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=fake_gpu.cache_dir))
    p, dense = InnerAttention(base, prev), Dense()
    fake_gpu.mode = "oom"
    q, k, v = nhd()
    out = p(dense, q, k, v, transformer_options={"step": 3}, **XFUSER_KWARGS)
    assert close(out, reference(q, k, v)) and seen == [3] and len(dense.calls) == 1


def test_immutable_deepcopy_safe_and_pickles(fake_gpu):
    p = processor(fake_gpu)
    with pytest.raises(AttributeError):
        p.prev = None
    options = {"transformer_options": {INNER_ATTENTION_KEY: p}}
    assert copy.deepcopy(options)["transformer_options"][INNER_ATTENTION_KEY] is p
    again = pickle.loads(pickle.dumps(p))
    assert isinstance(again, InnerAttention) and again.override.patch_id == p.override.patch_id


def test_create_builds_a_processor_from_patch_options():
    p = InnerAttention.create(kernel="auto", min_tokens=512)
    assert p.override.config.min_tokens == 512 and p.supports_ring is False


def test_stats_carry_the_rank_only_under_torch_distributed(monkeypatch):
    import torch.distributed as dist
    assert "rank" not in stats.RunStats("x").as_dict() or dist.is_initialized()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    d = stats.RunStats("x").as_dict()
    assert d["rank"] == 1
    assert stats.format_summary(d).startswith("rank 1: ")
