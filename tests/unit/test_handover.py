"""The Sage patch's own Wan self-attention forward on a ComfyUI without attention containers
(nodes/handover.py): installed only over a forward that reads 0.3.64's names, it computes what that forward
computes and hands q, k and v to the patch, whose write-into-q path then serves the call, compiled too (the
write-into-q op in the graph); with another override on top of the slot, it runs the class forward unchanged.  A stand-in of 0.3.64's
WanSelfAttention (Comfy-Org/ComfyUI comfy/ldm/wan/model.py@a125cd84) and a fake kernel on the CPU."""
import sys
import types

import pytest
import torch

from wan_sage.attention import head_groups, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa
from wan_sage.nodes import handover


def apply_rope1(x, freqs):
    """A rotation of pairs of channels by ``freqs`` [N, 1, D/2] (angles), as 0.3.64's apply_rope1 rotates."""
    x2 = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = torch.cos(freqs), torch.sin(freqs)
    out = torch.stack((x2[..., 0] * c - x2[..., 1] * s, x2[..., 0] * s + x2[..., 1] * c), dim=-1)
    return out.reshape(*x.shape).type_as(x)


def optimized_attention(q, k, v, heads, transformer_options={}):  # noqa: B006
    """0.3.64's wrap_attn in short: the override in the slot, else SDPA."""
    ov = transformer_options.get("optimized_attention_override")
    if ov is not None:
        return ov(attention_sdpa, q, k, v, heads=heads, transformer_options=transformer_options)
    return attention_sdpa(q, k, v, heads)


class WanSelfAttention(torch.nn.Module):
    """0.3.64's self-attention: the same layers and the same names read in forward."""

    def __init__(self, dim=512, num_heads=8):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = torch.nn.RMSNorm(dim, eps=1e-6), torch.nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, freqs, transformer_options={}):  # noqa: B006
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim

        def qkv_fn_q(x):
            q = self.norm_q(self.q(x)).view(b, s, n, d)
            return apply_rope1(q, freqs)

        def qkv_fn_k(x):
            k = self.norm_k(self.k(x)).view(b, s, n, d)
            return apply_rope1(k, freqs)
        q = qkv_fn_q(x)
        k = qkv_fn_k(x)
        x = optimized_attention(q.view(b, s, n * d), k.view(b, s, n * d), self.v(x).view(b, s, n * d),
                                heads=self.num_heads, transformer_options=transformer_options)
        return self.o(x)


class NewerSelfAttention(WanSelfAttention):
    def forward(self, x, freqs, transformer_options={}):  # noqa: B006
        patches = transformer_options.get("patches", {})  # reads a name 0.3.64's forward does not
        return super().forward(x, freqs, transformer_options) if patches is not None else None


class Patcher:
    """The object-patch part of ComfyUI's ModelPatcher: ``add_object_patch``, applied to the module."""

    def __init__(self, dm):
        self.dm, self.object_patches = dm, {}

    def add_object_patch(self, key, obj):
        self.object_patches[key] = obj

    def apply(self):
        for key, obj in self.object_patches.items():
            path = key.split(".")[1:]
            target = self.dm
            for name in path[:-1]:
                target = getattr(target, name)
            setattr(target, path[-1], obj)


@pytest.fixture
def comfy_math(monkeypatch):
    for name in ("comfy", "comfy.ldm", "comfy.ldm.flux"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    math = types.ModuleType("comfy.ldm.flux.math")
    math.apply_rope1 = apply_rope1
    monkeypatch.setitem(sys.modules, "comfy.ldm.flux.math", math)
    monkeypatch.setattr(head_groups, "INTO_Q_SLACK_BYTES", 0)  # calls of a few MiB (see test_into_q.py)


def model(cls=WanSelfAttention, blocks=2):
    torch.manual_seed(0)
    dm = torch.nn.Module()
    dm.blocks = torch.nn.ModuleList(torch.nn.Module() for _ in range(blocks))
    for block in dm.blocks:
        block.self_attn = cls().bfloat16().eval()
    return dm


def inputs(n=2048):
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, n, 512, generator=g).bfloat16(), torch.rand(n, 1, 32, generator=g) * 6.28


def test_the_forward_hands_q_over_and_computes_what_the_stock_forward_computes(fake_gpu, comfy_math):
    dm = model()
    x, freqs = inputs()
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    options = {"optimized_attention_override": ov}
    with torch.inference_mode():
        stock = [b.self_attn(x, freqs, transformer_options=options) for b in dm.blocks]
        assert fake_gpu.into_q_calls == []  # the stock forward keeps q: the ordinary path
        p = Patcher(dm)
        assert handover.install(p, dm) == 2 and handover.installed_blocks(p) == 2
        p.apply()
        stats.begin_run(ov.patch_id)
        handed = [b.self_attn(x, freqs, transformer_options=options) for b in dm.blocks]
    assert fake_gpu.into_q_calls and stats.end_run(ov.patch_id)["by_kernel"] == {"sage2_sm90": 2}
    for a, b in zip(stock, handed):
        assert ((a.float() - b.float()).norm() / a.float().norm()) < 0.01


def test_another_override_on_top_runs_the_class_forward(fake_gpu, comfy_math, monkeypatch):
    dm = model(blocks=1)
    x, freqs = inputs()
    p = Patcher(dm)
    handover.install(p, dm)
    p.apply()
    stock = WanSelfAttention.forward
    ran = []

    def recorded(self, *args, **kwargs):
        ran.append(type(kwargs["transformer_options"].get("optimized_attention_override")).__name__)
        return stock(self, *args, **kwargs)
    monkeypatch.setattr(WanSelfAttention, "forward", recorded)

    def other(func, *args, **kwargs):
        return func(*args[:3], kwargs["heads"])
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    with torch.inference_mode():
        dm.blocks[0].self_attn(x, freqs, transformer_options={"optimized_attention_override": other})
        dm.blocks[0].self_attn(x, freqs, transformer_options={"optimized_attention_override": ov})
    assert ran == ["function"]  # the second call was handed over
    assert fake_gpu.into_q_calls


def test_compiled_the_forward_runs_the_write_into_q_op_in_the_graph(fake_gpu, comfy_math):
    """Under torch.compile (fullgraph, inductor) the hand-over forward puts the write-into-q op in the graph:
    the kernel writes into q's heads group by group, and the result is the eager one."""
    from torch._inductor.utils import run_and_get_code

    from wan_sage.attention import op
    if op.INTO_Q_OP is None:
        pytest.skip("this torch has no torch.library.custom_op")
    dm = model(blocks=1)
    x, freqs = inputs()
    p = Patcher(dm)
    handover.install(p, dm)
    p.apply()
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    options = {"optimized_attention_override": ov}
    attn = dm.blocks[0].self_attn
    torch._dynamo.reset()
    with torch.no_grad():
        eager = attn(x, freqs, transformer_options=options)
        explained = torch._dynamo.explain(attn)(x, freqs, transformer_options=options)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert any("attention_into_q" in g.code for g in explained.graphs)
        torch._dynamo.reset()
        fake_gpu.into_q_calls.clear()
        got, code = run_and_get_code(torch.compile(attn, fullgraph=True, backend="inductor"), x, freqs,
                                     transformer_options=options)
    torch._dynamo.reset()
    assert fake_gpu.into_q_calls  # the compiled call wrote into q
    # reinplaced: the op is handed q's own buffer, not a clone of it (inductor clones a mutated input it
    # cannot reuse, and names the kernel that makes the copy "..._clone_...")
    assert "attention_into_q" in code[0] and "clone" not in code[0]
    assert torch.allclose(got.float(), eager.float(), atol=3e-2, rtol=3e-2)


def test_it_is_installed_only_over_the_forward_it_mirrors_and_no_other_patch(comfy_math):
    dm = model(NewerSelfAttention, blocks=1)
    p = Patcher(dm)
    assert handover.install(p, dm) == 0 and not handover.would_install(p, dm)
    dm = model(blocks=2)
    p = Patcher(dm)
    theirs = object()
    p.add_object_patch("diffusion_model.blocks.0.self_attn.forward", theirs)
    assert handover.install(p, dm) == 1 and p.object_patches["diffusion_model.blocks.0.self_attn.forward"] is theirs
    assert not handover.would_install(p, dm)
