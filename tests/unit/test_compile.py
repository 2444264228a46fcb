"""The patched attention under torch.compile, on the CPU with fake kernels: fullgraph with no
graph break, the compiled result equal to eager, the custom op's fake and real outputs agreeing."""
import pytest
import torch
import torch._dynamo

from fakegpu import qkv
from wan_sage.attention import op, stats
from wan_sage.attention.config import PatchConfig
from wan_sage.attention.override import SageAttentionOverride
from wan_sage.attention.sdpa import attention_sdpa


def wrap_attn(func):
    """A stand-in for ComfyUI's attention wrapper (``wrap_attn`` in comfy/ldm/modules/attention.py):
    marks the call as wrapped and hands it to the override in ``transformer_options`` with the raw
    function first."""
    def wrapper(*args, **kwargs):
        outermost = "_inside_attn_wrapper" not in kwargs
        try:
            if outermost:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                if options is not None and "optimized_attention_override" in options:
                    return options["optimized_attention_override"](func, *args, **kwargs)
            return func(*args, **kwargs)
        finally:
            if outermost:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


attention = wrap_attn(attention_sdpa)


class Block(torch.nn.Module):
    """Self-attention (Sage once its first calls timed it), text cross-attention (decided at run time) and a
    masked call (declined statically) through the wrapper, as a Wan block makes them."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, context, transformer_options):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        x = x + self.out(attention(q, k, v, heads=self.heads, transformer_options=transformer_options))
        x = x + attention(x, context, context, heads=self.heads, transformer_options=transformer_options)
        mask = torch.zeros(x.shape[1], context.shape[1], dtype=x.dtype)
        return x + attention(x, context, context, heads=self.heads, mask=mask, transformer_options=transformer_options)


@pytest.fixture
def setup(fake_gpu):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = Block().bfloat16().eval()
    x = torch.randn(1, 2048, 256).bfloat16()
    context = torch.randn(1, 512, 256).bfloat16()
    override = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir))
    yield block, x, context, {"optimized_attention_override": override}, override
    torch._dynamo.reset()


def test_fullgraph_has_no_graph_break(setup):
    block, x, context, options, _ = setup
    with torch.no_grad():
        explained = torch._dynamo.explain(block)(x, context, options)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("backend,grad_mode", [("eager", torch.inference_mode), ("inductor", torch.no_grad)])
def test_fullgraph_compile_runs_the_kernel_and_matches_eager(setup, fake_gpu, backend, grad_mode):
    block, x, context, options, override = setup
    with grad_mode():  # ComfyUI's executor samples under inference_mode
        fake_gpu.settle(lambda: block(x, context, options))  # eager: times and settles both shapes
        expect = block(x, context, options)
        compiled = torch.compile(block, fullgraph=True, backend=backend)
        stats.begin_run(override.patch_id)
        fake_gpu.calls.clear()
        got = compiled(x, context, options)
        got_again = compiled(x, context, options)
    s = stats.end_run(override.patch_id)
    assert s["by_kernel"] == {"sage2_sm90": 4} and fake_gpu.kernel_calls() == 4  # both shapes, both runs
    assert torch.equal(got, got_again)
    if backend == "eager":
        assert torch.equal(got, expect)
    else:
        assert torch.allclose(got.float(), expect.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("skip_reshape,skip_output_reshape",
                         [(False, False), (True, True), (True, False), (False, True)])
def test_the_op_passes_opcheck_in_every_layout(fake_gpu, skip_reshape, skip_output_reshape):
    override = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    q, k, v = qkv(N=1024)
    if skip_reshape:
        q, k, v = (t.view(1, -1, 4, 64).transpose(1, 2).contiguous() for t in (q, k, v))
    args = (q, k, v, 4, skip_reshape, skip_output_reshape, None, override.patch_id)
    torch.library.opcheck(op.OP, args)
    out = op.OP(*args)
    expect = attention_sdpa(q, k, v, 4, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    assert out.shape == expect.shape and out.is_contiguous()
    assert torch.allclose(out.float(), expect.float(), atol=2e-2)


def test_the_write_into_q_op_passes_opcheck_and_leaves_the_output_in_q(fake_gpu, monkeypatch):
    if op.INTO_Q_OP is None:
        pytest.skip("this torch has no torch.library.custom_op")
    from wan_sage.attention import head_groups
    monkeypatch.setattr(head_groups, "INTO_Q_SLACK_BYTES", 0)  # a call of a few MiB: no allocator slack
    override = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    q, k, v = qkv(N=1024)
    expect = attention_sdpa(q, k, v, 4)
    torch.library.opcheck(op.INTO_Q_OP, (q.clone(), k, v, 4, None, override.patch_id))
    ptr = q.data_ptr()
    assert op.INTO_Q_OP(q, k, v, 4, None, override.patch_id) is None
    assert q.data_ptr() == ptr and torch.allclose(q.float(), expect.float(), atol=2e-2)
    assert fake_gpu.into_q_calls  # the kernel wrote into q's heads


def test_eager_calls_do_not_go_through_the_dispatcher(fake_gpu, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("eager calls must run the implementation directly")
    monkeypatch.setattr(op, "OP", refuse)
    q, k, v = qkv()
    override = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, calibrate=False))
    out = override(None, q, k, v, heads=4)
    assert fake_gpu.kernel_calls() == 1 and out.shape == q.shape


def test_without_custom_op_the_run_time_part_is_kept_out_of_the_graph(setup, monkeypatch):
    block, x, context, options, override = setup
    monkeypatch.setattr(op, "OP", None)
    monkeypatch.setattr(op, "_RUN_UNTRACED", torch.compiler.disable(op.run_registered))
    with torch.no_grad():
        expect = block(x, context, options)
        explained = torch._dynamo.explain(block)(x, context, options)
        got = torch.compile(block, backend="eager")(x, context, options)
    assert explained.graph_break_count >= 1  # torch < 2.4: one break per call, still correct
    assert torch.equal(got, expect)


def test_patches_with_the_same_options_share_one_compiled_graph(setup, fake_gpu):
    """Wan 2.2 patches each expert with its own node (another label and node id), and a workflow that
    runs the patch node again makes a new patch: with the same options they compile once, and each
    compiled call is counted for the patch whose model is being sampled."""
    block, x, context, options, first = setup
    second = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, label="Wan Sage patch #7", node_id="7"))
    other = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, memory_mode="fastest"))
    assert first.patch_id != second.patch_id and first.graph_key == second.graph_key != other.graph_key
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(block, fullgraph=True, backend=counting)
    with torch.inference_mode():
        fake_gpu.settle(lambda: block(x, context, options))  # eager: times and settles both shapes
        runs = {}
        for ov in (first, second, first):
            stats.begin_run(ov.patch_id)
            compiled(x, context, {"optimized_attention_override": ov})
            runs.setdefault(ov.patch_id, []).append(stats.end_run(ov.patch_id))
        assert len(graphs) == 1
        compiled(x, context, {"optimized_attention_override": other})
    assert len(graphs) == 2                               # other options: another graph
    assert [r["sage_calls"] for r in runs[first.patch_id]] == [2, 2] and runs[second.patch_id][0]["sage_calls"] == 2


def test_a_compiled_call_outside_a_stats_window_runs_as_the_patch_made_last(fake_gpu):
    from wan_sage.attention.state import STATE
    a = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, label="a"))
    b = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, label="b"))
    assert STATE.override_for(a.graph_key) is b
    stats.begin_run(a.patch_id)
    try:
        assert STATE.override_for(a.graph_key) is a
    finally:
        stats.end_run(a.patch_id)
    assert STATE.override_for(a.patch_id) is a            # a patch id names its own patch
    b_id = b.patch_id
    del b
    import gc
    gc.collect()
    assert STATE.override_for(a.graph_key) is a           # the one still alive
    c = SageAttentionOverride(PatchConfig(cache_dir=fake_gpu.cache_dir, label="c"))
    assert list(STATE.graph_members[a.graph_key])[-2:] == [a.patch_id, c.patch_id]
    assert b_id not in STATE.graph_members[a.graph_key]   # a patch that is gone is dropped
