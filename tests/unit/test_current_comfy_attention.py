"""ComfyUI 0.38's attention seams, with stand-ins written after the real code (no ComfyUI import):

* the override slot and ``AttentionTensorContainer`` (comfy/ldm/modules/attention.py at
  05080f6022b2572df36a0aa6bcba413209c3d265: ``AttentionTensorContainer``, ``wrap_attn``);
* Wan's call sites (comfy/ldm/wan/model.py at 0c9a69aefdb1fcf6b9c60478aa9e511b01f8e96f:
  ``WanSelfAttention.forward``, ``WanT2VCrossAttention.forward``, ``WanI2VCrossAttention.forward``):
  q/k/v in containers, ``preferred_attention=self.comfy_attention``, and the image cross-attention's
  ``low_precision_attention=False``;
* ``ModelPatcher.set_model_optimized_attention`` (comfy/model_patcher.py at
  08d0e510f4e539a1db39072589817136ac6cfa7d), whose closure carries the attention function's
  ``container_function`` when it has one (comfy-kitchen int8 attention).

Each test fails when the pack's side of its seam breaks; docs/compatibility.md lists them."""
import functools
import weakref

import pytest
import torch
import torch._dynamo

from fakegpu import qkv
from wan_sage.attention import head_groups, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa


# ------------------------------------------------------------------ stand-ins (attention.py@05080f60)

class AttentionTensorContainer:
    """ComfyUI's single-owner box for q, k or v: ``peek`` reads the tensor, ``take`` hands it over."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor = None
        return tensor


def wrap_attn(func):
    """``wrap_attn`` as 0.38 has it: ``preferred_attention`` is popped; with containers, an override that
    has ``container_function`` gets the containers (and no ``func``), another override gets the taken
    tensors as ``override(func, ...)``; without an override, the preferred function, the wrapper's own
    ``container_function`` or ``func``."""
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred_attention = kwargs.pop("preferred_attention", None)
        containers = None
        if len(args) >= 3 and isinstance(args[0], AttentionTensorContainer):
            if not isinstance(args[1], AttentionTensorContainer) or not isinstance(args[2], AttentionTensorContainer):
                raise TypeError("q, k, and v must all be attention tensor containers")
            containers = args[:3]
        remove_key = False
        try:
            if "_inside_attn_wrapper" not in kwargs:
                options = kwargs.get("transformer_options", None)
                remove_key = True
                kwargs["_inside_attn_wrapper"] = True
                if options is not None and "optimized_attention_override" in options:
                    override = options["optimized_attention_override"]
                    if containers is not None:
                        if hasattr(override, "container_function"):
                            return override.container_function(*args, **kwargs)
                        args = tuple(c.take() for c in containers) + args[3:]
                    return override(func, *args, **kwargs)
                if preferred_attention is not None and preferred_attention.function is not None:
                    return preferred_attention.function(*args, **kwargs)
            if containers is not None:
                if wrapper.container_function is not None:
                    return wrapper.container_function(*args, **kwargs)
                args = tuple(c.take() for c in containers) + args[3:]
            return func(*args, **kwargs)
        finally:
            if remove_key:
                del kwargs["_inside_attn_wrapper"]
    wrapper.container_function = None
    return wrapper


attention_pytorch = wrap_attn(attention_sdpa)  # ComfyUI's optimized_attention on CUDA by default
optimized_attention = attention_pytorch


class ComfyAttention:
    """``ComfyAttention``: the per-module preferred backend (``function`` None unless a checkpoint names one)."""

    def __init__(self, function=None):
        self.function = function


def set_model_optimized_attention(model_options, optimized_attention_fn):
    """``ModelPatcher.set_model_optimized_attention`` (model_patcher.py@08d0e510): the same slot, no chaining,
    the attention function's ``container_function`` copied onto the closure."""
    def optimized_attention_override(_, *args, **kwargs):
        return optimized_attention_fn(*args, **kwargs)
    if getattr(optimized_attention_fn, "container_function", None) is not None:
        optimized_attention_override.container_function = optimized_attention_fn.container_function
    model_options.setdefault("transformer_options", {})["optimized_attention_override"] = optimized_attention_override


# ------------------------------------------------------------------ Wan's call sites (wan/model.py@0c9a69ae)

def wan_self_attention(q, k, v, heads, options, comfy_attention):
    """``WanSelfAttention.forward`` after RoPE: the roped q/k and v handed over in containers."""
    return optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v),
                               heads=heads, preferred_attention=comfy_attention, transformer_options=options)


def wan_i2v_cross_attention(q, k_img, v_img, k, v, heads, options, comfy_attention):
    """``WanI2VCrossAttention.forward``: the image cross-attention with ``low_precision_attention=False``
    (Sage NaNs there), then the text cross-attention on the same q."""
    img_x = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k_img),
                                AttentionTensorContainer(v_img), heads=heads, preferred_attention=comfy_attention,
                                transformer_options=options, low_precision_attention=False)
    x = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v),
                            heads=heads, preferred_attention=comfy_attention, transformer_options=options)
    return x + img_x


# ------------------------------------------------------------------ tests

@pytest.fixture
def override(fake_gpu):
    return SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))


def _no_plain_call(monkeypatch):
    def refuse(self, func, *a, **k):
        raise AssertionError("a container call must reach container_function, not override(func, ...)")
    monkeypatch.setattr(SageAttentionOverride, "__call__", refuse)


def test_the_override_takes_the_containers_and_runs_the_kernel(fake_gpu, override, monkeypatch):
    _no_plain_call(monkeypatch)
    monkeypatch.setattr(head_groups, "INTO_Q_SLACK_BYTES", 0)  # a call of a few MiB: no allocator slack
    q, k, v = qkv()
    expect = attention_sdpa(q, k, v, 4)
    boxes = [AttentionTensorContainer(t) for t in (q, k, v)]
    refs = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v
    out = optimized_attention(*boxes, heads=4, preferred_attention=ComfyAttention(),
                              transformer_options={"optimized_attention_override": override})
    # q was handed over: the kernel wrote the output into it, head group by head group
    assert fake_gpu.into_q_calls and fake_gpu.kernel_calls("sage2_sm90") == len(fake_gpu.into_q_calls)
    assert all(b.tensor is None for b in boxes)           # taken: the call site holds nothing
    assert refs[0]() is out                                # the output is q's memory
    assert refs[1]() is None and refs[2]() is None         # and the pack kept no reference to k and v
    assert torch.allclose(out.float(), expect.float(), atol=2e-2)


def test_wan_self_attention_site_with_preferred_attention_runs_on_sage(fake_gpu, override, monkeypatch):
    """``preferred_attention`` (popped by wrap_attn) never decides a call the override is in the slot for:
    the preferred function is not run, the call runs on Sage."""
    _no_plain_call(monkeypatch)

    def preferred(*a, **k):
        raise AssertionError("the preferred function runs only when no override is in the slot")
    q, k, v = qkv()
    stats.begin_run(override.patch_id)
    out = wan_self_attention(q, k, v, 4, {"optimized_attention_override": override}, ComfyAttention(preferred))
    # A caller that hands the override the call site's kwargs as they are (preferred_attention not popped)
    # gets the same decision.
    direct = override.container_function(*(AttentionTensorContainer(t) for t in (q, k, v)), heads=4,
                                         preferred_attention=ComfyAttention(preferred), transformer_options={})
    s = stats.end_run(override.patch_id)
    assert s["by_kernel"] == {"sage2_sm90": 2} and out.shape == direct.shape == q.shape


def test_a_declined_container_call_goes_to_sdpa_with_the_tensors_taken(fake_gpu, override, monkeypatch):
    _no_plain_call(monkeypatch)
    q, k, v = qkv()
    mask = torch.zeros(q.shape[1], k.shape[1], dtype=q.dtype)
    boxes = [AttentionTensorContainer(t) for t in (q, k, v)]
    stats.begin_run(override.patch_id)
    out = optimized_attention(*boxes, 4, mask, transformer_options={"optimized_attention_override": override})
    s = stats.end_run(override.patch_id)
    assert s["reasons"] == {"mask": 1} and fake_gpu.kernel_calls() == 0
    assert all(b.tensor is None for b in boxes)
    assert torch.equal(out, attention_sdpa(q, k, v, 4, mask))


def test_a_declined_call_hands_the_untouched_containers_to_a_previous_container_function(fake_gpu, monkeypatch):
    """set_model_optimized_attention with an attention function that owns containers (comfy-kitchen int8)
    and the Sage patch after it: a call Sage declines reaches that function's container_function with the
    containers still full, as ComfyUI would call it without Sage."""
    _no_plain_call(monkeypatch)
    seen = []

    def ck_attention(q, k, v, heads, **kw):
        raise AssertionError("the container path must be taken")

    def ck_containers(q, k, v, heads, mask=None, **kw):
        seen.append(tuple(c.tensor is not None for c in (q, k, v)))
        return attention_sdpa(q.take(), k.take(), v.take(), heads, mask)
    ck_attention.container_function = ck_containers
    mo = {"transformer_options": {}}
    set_model_optimized_attention(mo, ck_attention)
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False),
                               prev=mo["transformer_options"]["optimized_attention_override"])
    q, k, v = qkv()
    mask = torch.zeros(q.shape[1], k.shape[1], dtype=q.dtype)
    boxes = [AttentionTensorContainer(t) for t in (q, k, v)]
    out = optimized_attention(*boxes, 4, mask, transformer_options={"optimized_attention_override": ov})
    assert seen == [(True, True, True)] and all(b.tensor is None for b in boxes)
    assert torch.equal(out, attention_sdpa(q, k, v, 4, mask))


def test_a_declined_call_reaches_a_plain_previous_override_with_tensors_and_sdpa_as_func(fake_gpu, monkeypatch):
    _no_plain_call(monkeypatch)
    seen = []

    def previous(func, q, k, v, heads, **kw):
        seen.append((func, type(q)))
        return func(q, k, v, heads, **kw)
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False), prev=previous)
    q, k, v = qkv(dtype=torch.float32)                    # fp32: declined statically ("dtype")
    out = optimized_attention(*(AttentionTensorContainer(t) for t in (q, k, v)), heads=4,
                              transformer_options={"optimized_attention_override": ov})
    assert seen == [(ov.sdpa, torch.Tensor)]
    assert torch.equal(out, attention_sdpa(q, k, v, 4))


def test_the_i2v_image_cross_attention_stays_off_sage(fake_gpu, override, monkeypatch):
    """WanI2VCrossAttention's image call passes low_precision_attention=False: declined (counted as
    low_precision_off) and run on SDPA; the text call of the same block is the override's to decide."""
    _no_plain_call(monkeypatch)
    q, _k, _v = qkv(N=2048)
    _q, k_img, v_img = qkv(N=2048, Nk=257, seed=1)
    _q, k, v = qkv(N=2048, Nk=512, seed=2)
    stats.begin_run(override.patch_id)
    out = wan_i2v_cross_attention(q, k_img, v_img, k, v, 4, {"optimized_attention_override": override},
                                  ComfyAttention())
    s = stats.end_run(override.patch_id)
    assert s["reasons"].get("low_precision_off") == 1
    assert fake_gpu.kernel_calls() == 0                    # the text call: cross-attention, SDPA without timing
    expect = attention_sdpa(q, k, v, 4) + attention_sdpa(q, k_img, v_img, 4)
    assert torch.allclose(out.float(), expect.float(), atol=1e-2)


class Block(torch.nn.Module):
    """Wan-style self-attention, text cross-attention and a masked call, each with its q/k/v in containers."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.comfy_attention = ComfyAttention()

    def forward(self, x, context, options):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + wan_self_attention(q, k, v, self.heads, options, self.comfy_attention)
        x = x + optimized_attention(AttentionTensorContainer(x), AttentionTensorContainer(context),
                                    AttentionTensorContainer(context), heads=self.heads,
                                    preferred_attention=self.comfy_attention, transformer_options=options)
        mask = torch.zeros(x.shape[1], context.shape[1], dtype=x.dtype)
        return x + optimized_attention(AttentionTensorContainer(x), AttentionTensorContainer(context),
                                       AttentionTensorContainer(context), self.heads, mask,
                                       transformer_options=options)


def test_container_calls_compile_without_a_graph_break_and_match_eager(fake_gpu):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block().bfloat16().eval()
    x = torch.randn(1, 2048, 256).bfloat16()
    context = torch.randn(1, 512, 256).bfloat16()
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))
    options = {"optimized_attention_override": ov}
    try:
        with torch.no_grad():
            expect = block(x, context, options)           # eager: calibrates and settles both shapes
            explained = torch._dynamo.explain(block)(x, context, options)
            assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
            fake_gpu.calls.clear()
            got = torch.compile(block, fullgraph=True, backend="eager")(x, context, options)
        assert fake_gpu.kernel_calls("sage2_sm90") == 2     # self- and cross-attention, settled on Sage
        assert torch.equal(got, expect)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("static", [False, True])
def test_a_container_call_known_declined_skips_the_checks_and_keeps_its_route(fake_gpu, monkeypatch, static):
    """Wan's container calls (the 0.38 entry) on a shape settled on SDPA (after the call that settles it), or
    refused by the static shape checks, are declined by one lookup: no checks run again, the tensors are taken, a
    static refusal still reaches the previous override, and every call is counted by its reason."""
    prev_calls = []

    def prev(func, *args, **kwargs):
        prev_calls.append(args[0].shape)
        return func(*args, **kwargs)
    o = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir), prev=prev)
    options = {"optimized_attention_override": o}
    if static:
        q, k, v = qkv(N=256)  # short: a static shape refusal
    else:
        fake_gpu.times["sage2_sm90"] = 17.0  # the timing measures SDPA faster: settled on SDPA
        q, k, v = qkv()
        fake_gpu.settle(lambda: wan_self_attention(q, k, v, 4, options, ComfyAttention()))  # times and settles
    _no_plain_call(monkeypatch)
    stats.begin_run(o.patch_id)
    for _ in range(2):  # checks and settles, or finds the shape settled
        wan_self_attention(q, k, v, 4, options, ComfyAttention())
    checks = []
    monkeypatch.setattr(SageAttentionOverride, "_static", lambda *a, **kw: checks.append(1))
    for _ in range(3):
        boxes = [AttentionTensorContainer(t) for t in (q, k, v)]
        out = optimized_attention(*boxes, heads=4, preferred_attention=ComfyAttention(), transformer_options=options)
        assert torch.equal(out, attention_sdpa(q, k, v, 4)) and all(b.tensor is None for b in boxes)
    s = stats.end_run(o.patch_id)
    assert not checks and s["sage_calls"] == 0
    assert s["reasons"] == ({"short": 5} if static else {"slower": 5})
    assert len(prev_calls) == (5 if static else 0)


def _roped_site(q, k, v, heads, options):
    """0.38's ``WanSelfAttention.forward`` after RoPE (wan/model.py@0c9a69ae): the roped ``[B, N, H, D]`` q and k,
    viewed ``[B, N, H*D]`` into containers whose names replace them."""
    b, s, n, d = *q.shape[:2], heads, q.shape[-1] // heads
    q = (q * 1.0).view(b, s, n, d)  # a fresh tensor, as apply_rope1's output is
    k = (k * 1.0).view(b, s, n, d)
    q = AttentionTensorContainer(q.view(b, s, n * d))
    k = AttentionTensorContainer(k.view(b, s, n * d))
    v = AttentionTensorContainer(v)
    return optimized_attention(q, k, v, heads=heads, preferred_attention=ComfyAttention(), transformer_options=options)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_the_0_38_site_hands_over_its_roped_q_view_as_comfyui_runs_nodes(fake_gpu, override, monkeypatch, mode):
    """The container holds a view of the roped q.  Under ``torch.inference_mode`` (ComfyUI's executor runs every
    node in it) a view keeps no base tensor, so the call owns q's memory and the kernel writes the output into it;
    under ``no_grad`` the view keeps its base alive, another tensor on q's memory, so the call keeps the
    ordinary path and returns a new output."""
    monkeypatch.setattr(head_groups, "INTO_Q_SLACK_BYTES", 0)  # a call of a few MiB: no allocator slack
    q, k, v = qkv()
    expect = attention_sdpa(q, k, v, 4)
    with getattr(torch, mode)():
        out = _roped_site(q, k, v, 4, {"optimized_attention_override": override})
    assert torch.allclose(out.float(), expect.float(), atol=2e-2)
    assert bool(fake_gpu.into_q_calls) == (mode == "inference_mode")
    assert fake_gpu.kernel_calls("sage2_sm90") > 0
class WanSelfAttention038(torch.nn.Module):
    """``WanSelfAttention.forward`` (wan/model.py@0c9a69ae) without its norms and RoPE: q and k are fresh tensors
    (the roped ones there), viewed ``[B, N, H*D]`` into containers whose names replace them; with ``attn1_patch``
    patches the call site keeps q as ``q_patch`` and hands it to them after the call."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.comfy_attention = ComfyAttention()

    def forward(self, x, options):
        patches = options.get("patches", {})
        b, s, n, d = *x.shape[:2], self.heads, x.shape[-1] // self.heads
        q = (self.q(x) * 1.5).view(b, s, n, d)
        k = (self.k(x) * 1.5).view(b, s, n, d)
        if patches.get("attn1_patch"):
            q_patch = q
        q = AttentionTensorContainer(q.view(b, s, n * d))
        k = AttentionTensorContainer(k.view(b, s, n * d))
        v = AttentionTensorContainer(self.v(x).view(b, s, n * d))
        x = optimized_attention(q, k, v, heads=self.heads, preferred_attention=self.comfy_attention,
                                transformer_options=options)
        for p in patches.get("attn1_patch", ()):
            x = p({"x": x, "q": q_patch})
        return self.o(x)


@pytest.mark.parametrize("patched", [False, True])
def test_compiled_container_self_attention_writes_into_q_unless_the_site_keeps_q(fake_gpu, monkeypatch, patched):
    """Compiled (fullgraph, inductor), Wan's container self-attention is the write-into-q op, reinplaced on q's
    buffer, and matches eager; where ``attn1_patch`` patches make the call site keep q, the ordinary op, and the
    patch reads q as it was."""
    from torch._inductor.utils import run_and_get_code

    from wan_sage.attention import op
    if op.INTO_Q_OP is None:
        pytest.skip("this torch has no torch.library.custom_op")
    monkeypatch.setattr(head_groups, "INTO_Q_SLACK_BYTES", 0)  # a call of a few MiB: no allocator slack
    torch.manual_seed(0)
    attn = WanSelfAttention038().bfloat16().eval()
    x = torch.randn(1, 2048, 256).bfloat16()
    seen = []
    options = {"optimized_attention_override": SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir,
                                                                                 calibrate=False))}
    if patched:
        options["patches"] = {"attn1_patch": [lambda a: seen.append(a["q"].clone()) or a["x"]]}
    torch._dynamo.reset()
    try:
        with torch.inference_mode():  # as ComfyUI's executor runs every node
            eager = attn(x, options)
            fake_gpu.into_q_calls.clear()
            got, code = run_and_get_code(torch.compile(attn, fullgraph=True, backend="inductor"), x, options)
    finally:
        torch._dynamo.reset()
    assert torch.allclose(got.float(), eager.float(), atol=3e-2, rtol=3e-2)
    if patched:
        assert "attention_into_q" not in code[0] and not fake_gpu.into_q_calls
        assert torch.equal(seen[0], seen[1])        # q reached the patch unchanged, eager and compiled
    else:
        assert "attention_into_q" in code[0] and "clone" not in code[0]
        assert fake_gpu.into_q_calls                # the compiled call wrote into q's heads


def test_compiled_container_cross_attention_keeps_the_ordinary_op(fake_gpu):
    """The I2V site hands one q to two cross-attention calls: a compiled cross-attention call never writes into q."""
    from wan_sage.attention import op
    if op.INTO_Q_OP is None:
        pytest.skip("this torch has no torch.library.custom_op")
    ov = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    options = {"optimized_attention_override": ov}

    def two_calls(q, k, v):
        a = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v),
                                heads=4, transformer_options=options)
        b = optimized_attention(AttentionTensorContainer(q), AttentionTensorContainer(k), AttentionTensorContainer(v),
                                heads=4, transformer_options=options)
        return a + b
    q, k, v = qkv()
    k, v = k[:, :512].contiguous(), v[:, :512].contiguous()
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(two_calls)(q, k, v)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0
    assert not any("attention_into_q" in g.code for g in explained.graphs)
