"""Host tier: the plain-tensor GGUF cast of Wan Compile Blocks (nodes/gguf_cast.py) against ComfyUI-GGUF's own, on
the miniature A14B expert with its LoRA in a real ComfyUI 0.3.64 with ComfyUI-GGUF, on the CPU.

The cast must give ComfyUI-GGUF's weights bit for bit, and dynamo must trace none of the dequantization through
ComfyUI-GGUF's tensor subclass: its FX nodes carry ``Tensor.__torch_function__`` in their stack when it does, as
every node of ComfyUI-GGUF's own cast on a quantized weight does."""
import contextlib

import pytest
import torch

import comfy_env
import workflow_check

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)


@pytest.fixture(scope="module")
def loaded(comfy, tmp_path_factory):
    """The expert loaded (its LoRA hung on the quantized weights) and the first block's call, captured from a
    one-step sampling: (patcher, blocks, args, kwargs)."""
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    with torch.inference_mode():
        m = comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path_factory.mktemp("gguf-cast"), lora_rank=8)
        m.model.manual_cast_dtype = torch.bfloat16  # computing in bf16, as on the GPU
        blocks = m.model.diffusion_model.blocks
        got = {}

        def capture(mod, args, kwargs):
            got.setdefault("call", (args, dict(kwargs)))
        h = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            comfy_env.sample_tiny(m, steps=1, cfg=1.0)
        finally:
            h.remove()
        import comfy.model_management as mm
        mm.load_models_gpu([m])  # loaded again: the LoRA stays hung on the weights for the checks
    args, kwargs = got["call"]
    return m, blocks, args, kwargs


def _gguf_layers(blocks):
    from wan_sage.nodes import gguf_cast
    return [mod for b in blocks for mod in b.modules()
            if gguf_cast.cast_for(mod) is not None and getattr(mod, "weight", None) is not None]


def test_the_plain_cast_gives_ggufs_weights_bit_for_bit(loaded):
    from wan_sage.nodes import gguf_cast
    _m, blocks, args, _kw = loaded
    layers = _gguf_layers(blocks)
    x = args[0]
    types_seen, patched = set(), 0
    with torch.inference_mode():
        for layer in layers:
            w0, b0 = layer.cast_bias_weight(x)
            w1, b1 = gguf_cast.cast_for(layer)(layer, x)
            assert type(w1) is torch.Tensor and w1.dtype == w0.dtype and torch.equal(w1, torch.Tensor(w0)), layer
            assert (b0 is None) == (b1 is None) and (b1 is None or torch.equal(b1, torch.Tensor(b0))), layer
            types_seen.add(getattr(getattr(layer.weight, "tensor_type", None), "name", None))
            patched += bool(getattr(layer.weight, "patches", None))
    assert {"Q4_K", "Q6_K"} <= types_seen, types_seen  # both quantized types of the real A14B file
    assert patched >= 10  # the LoRA's weights ride on the quantized ones


def test_no_op_of_the_dequantization_runs_on_ggufs_tensor_subclass(loaded, monkeypatch):
    from wan_sage.nodes import gguf_cast
    _m, blocks, args, _kw = loaded
    layer = blocks[0].ffn[0]
    cls = type(layer.weight)
    calls = []
    original = cls.__torch_function__

    def counting(klass, func, types, a=(), kw=None):
        calls.append(func)
        return original.__func__(klass, func, types, a, kw)
    monkeypatch.setattr(cls, "__torch_function__", classmethod(counting))
    with torch.inference_mode():
        layer.cast_bias_weight(args[0])
        own = len(calls)
        calls.clear()
        gguf_cast.cast_for(layer)(layer, args[0])
    assert own > 20 and calls == [], (own, calls[:5])  # the test can fail: ComfyUI-GGUF's own cast runs many


@contextlib.contextmanager
def _recording():
    """A dynamo backend that only records each graph it is given (the graph then runs its own ops, as eager does),
    from a reset dynamo with its counters cleared: yields (backend, graphs, counters); dynamo is reset again after."""
    from torch._dynamo.utils import counters
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch._dynamo.reset()
    counters.clear()
    try:
        yield recording, graphs, counters
    finally:
        torch._dynamo.reset()


def _pair(first, second, args, kwargs):
    """The two blocks' outputs as the model chains them (the second takes the first one's output)."""
    x = first(*args, **kwargs)
    return x, second(x, *args[1:], **kwargs)


def _compiled_pair(blocks, args, kwargs, backend, graphs):
    """:func:`_pair` through Wan Compile Blocks' stand-ins compiled with ``backend``: (first output, second output,
    graphs recorded after the first block, the paths each stand-in counted)."""
    from wan_sage.nodes import compile_blocks
    first, second = (compile_blocks.BlockStandIn(b, torch.compile(b, backend=backend)) for b in blocks[:2])
    x = first(*args, **kwargs)
    after_first = len(graphs)
    return x, second(x, *args[1:], **kwargs), after_first, [dict(first.ran), dict(second.ran)]


def _traced(block, args, kwargs, plain: bool):
    """(FX graphs, nodes whose stack passes through Tensor.__torch_function__, output) of ``block`` compiled with a
    backend that only records the graph: through Wan Compile Blocks' stand-in (``plain``), or compiled as it is."""
    from wan_sage.nodes import compile_blocks, gguf_cast
    with _recording() as (recording, graphs, _counters), torch.inference_mode():
        compiled = torch.compile(block, backend=recording)
        if plain:
            with gguf_cast.plain_casts(block, args[0]) as n:
                assert n >= 10
            out = compile_blocks.BlockStandIn(block, compiled)(*args, **kwargs)
        else:
            out = compiled(*args, **kwargs)
    subclass_nodes = sum(1 for g in graphs for node in g.graph.nodes
                         if "__torch_function__" in (node.meta.get("stack_trace") or ""))
    return graphs, subclass_nodes, out


@pytest.fixture
def sdpa(monkeypatch):
    """The block's attention on PyTorch's SDPA, as on the GPU (the CPU's default, sub-quadratic attention reads the
    host's free memory inside the block: a graph break of its own)."""
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.wan.model as wan
    monkeypatch.setattr(wan, "optimized_attention", attention.attention_pytorch)


def test_a_compiled_block_traces_no_subclass_op_and_runs_as_eager(loaded, sdpa):
    _m, blocks, args, kwargs = loaded
    with torch.inference_mode():
        eager = blocks[0](*args, **kwargs)
    graphs, own_nodes, out_own = _traced(blocks[0], args, kwargs, plain=False)
    assert own_nodes > 100  # the test can fail: ComfyUI-GGUF's cast traces through its subclass
    graphs, nodes, out = _traced(blocks[0], args, kwargs, plain=True)
    assert len(graphs) == 1 and nodes == 0
    assert torch.equal(out, eager) and torch.equal(out_own, eager)
    assert type(out) is type(eager) is torch.Tensor  # the next block's input: a subclass would fail its guard
    assert all("cast_bias_weight" not in mod.__dict__ for b in blocks for mod in b.modules())


def test_the_blocks_share_one_graph_with_the_plain_cast(loaded, sdpa):
    """Every block binds the same cast function, so the second block runs the first one's graph."""
    _m, blocks, args, kwargs = loaded
    assert len(blocks) >= 2
    with _recording() as (recording, graphs, counters):
        with torch.inference_mode():
            _compiled_pair(blocks, args, kwargs, recording, graphs)
        assert len(graphs) == 1 and not counters["recompiles"], (len(graphs), dict(counters["recompiles"]))


def test_a_streamed_gguf_block_is_lifted_into_the_resident_blocks_graph(loaded, sdpa, monkeypatch):
    """Wan Compile Blocks on a ComfyUI-GGUF block that streams, after a resident one: its quantized layers lifted
    (ComfyUI's marks of a streamed module taken off for the call; on the CPU the weights are already on the compute
    device, so the marks stand for streaming, as the node's test for a resident block is told here), the block runs
    the resident block's graph with no recompile, its output eager's bit for bit (the recording backend runs the
    graph's own ops), and the marks are back afterwards."""
    from wan_sage.nodes import compile_blocks, staged_blocks
    _m, blocks, args, kwargs = loaded
    monkeypatch.setattr(compile_blocks, "block_resident", lambda block, device: not any(
        "prev_comfy_cast_weights" in m.__dict__ for m in block.modules()))
    monkeypatch.setattr(staged_blocks, "_agreed", {})
    streamed = [m for m in blocks[1].modules() if isinstance(m, torch.nn.Linear)]
    assert len(streamed) >= 10 and all(staged_blocks._quantized(m) for m in streamed)
    try:
        for m in streamed:  # as ComfyUI's lowvram load marks the modules it streams
            m.comfy_cast_weights, m.prev_comfy_cast_weights = True, True
        with _recording() as (recording, graphs, counters):
            with torch.inference_mode():
                e0, eager = _pair(blocks[0], blocks[1], args, kwargs)
                x, out, after_first, paths = _compiled_pair(blocks, args, kwargs, recording, graphs)
            assert after_first == 1 and paths == [{"resident": 1}, {"lifted": 1}]
            assert len(graphs) == 1 and not counters["recompiles"], (len(graphs), dict(counters["recompiles"]))
        assert torch.equal(x, e0) and torch.equal(out, eager) and type(out) is torch.Tensor
        assert staged_blocks._agreed == {type(streamed[0]): True}
        assert all(m.__dict__.get("prev_comfy_cast_weights") is True for m in streamed)
    finally:
        for m in streamed:
            m.__dict__.pop("comfy_cast_weights", None)
            m.__dict__.pop("prev_comfy_cast_weights", None)


def test_weights_moved_as_lifting_moves_them_pass_the_resident_graphs_guards(loaded, sdpa):
    """Lifting builds a streamed module's tensors anew on the GPU (``staged_blocks.moved``). On the CPU, a block whose
    quantized weights and ``modulation`` are built that way (copies, as a move to another device makes) runs the graph
    of a block loaded by ComfyUI: no recompile, eager's output bit for bit. A guard on anything ``moved`` loses (the
    subclass, its LoRA, ``Parameter``) would compile again."""
    from wan_sage.nodes import staged_blocks
    _m, blocks, args, kwargs = loaded
    mods = [m for m in blocks[1].modules() if staged_blocks._quantized(m)] + [blocks[1]]
    saved = [(m, dict(m._parameters)) for m in mods]
    try:
        with _recording() as (recording, graphs, counters):
            with torch.inference_mode():
                _e0, eager = _pair(blocks[0], blocks[1], args, kwargs)
                for m in mods:
                    for k, t in list(m._parameters.items()):
                        if t is not None:
                            m._parameters[k] = staged_blocks.moved(t, t.device, copy=True)
                assert blocks[1].modulation.data_ptr() != saved[-1][1]["modulation"].data_ptr()
                assert type(blocks[1].modulation) is type(saved[-1][1]["modulation"])
                _x, out, _after_first, _paths = _compiled_pair(blocks, args, kwargs, recording, graphs)
            assert len(graphs) == 1 and not counters["recompiles"], (len(graphs), dict(counters["recompiles"]))
        assert torch.equal(out, eager)
    finally:
        for m, params in saved:
            m._parameters.update(params)


def test_a_gguf_expert_comfyui_loads_in_part_runs_every_block_in_the_resident_graph(comfy, sdpa, tmp_path, monkeypatch):
    """Wan Compile Blocks on a ComfyUI-GGUF expert with its LoRA that ComfyUI's own lowvram load left partly
    streamed (its marks and patch-function lists on the streamed Linears and norms, as the load sets them): over two
    steps every block is lifted and runs one graph, nothing recompiles, the latent is eager's, and the node's count
    says so.  On the CPU the streamed weights stay on the compute device, so
    the node's test for weights off the input's device is stood in for by ComfyUI's mark of a streamed module."""
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    import comfy.model_management as mm
    from torch._dynamo.utils import counters
    from wan_sage.nodes import compile_blocks, staged_blocks
    load = mm.LoadedModel.model_load

    def partial_load(self, lowvram_model_memory=0, force_patch_weights=False):  # 10 % of the expert's size
        return load(self, max(1, int(self.model.model_size() * 0.1)), force_patch_weights)
    monkeypatch.setattr(mm.LoadedModel, "model_load", partial_load)
    monkeypatch.setattr(compile_blocks, "block_resident", lambda block, device: not any(
        "prev_comfy_cast_weights" in m.__dict__ for m in block.modules()))
    monkeypatch.setattr(staged_blocks, "_agreed", {})
    try:
        with torch.inference_mode():
            m = comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path, lora_rank=8)
            m.model.manual_cast_dtype = torch.bfloat16
            eager = comfy_env.sample_tiny(m, steps=2, cfg=1.0)
            mm.unload_all_models()
            c, _text = compile_blocks.apply_compile_blocks(m, "eager")
            torch._dynamo.reset()
            counters.clear()
            latent = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
            ran = compile_blocks.blocks_ran(c)
            streamed = [any("prev_comfy_cast_weights" in mod.__dict__ for mod in b.modules())
                        for b in c.model.diffusion_model.blocks]
            graphs, recompiles = counters["stats"].get("unique_graphs", 0), sum(counters["recompiles"].values())
            mm.unload_all_models()
    finally:
        torch._dynamo.reset()
    assert all(streamed), streamed  # as at 12 GiB on the H200, ComfyUI streams part of every block
    assert ran.blocks == {"resident": streamed.count(False), "lifted": streamed.count(True), "staged": 0,
                          "eager": 0}, ran
    assert graphs == 1 and recompiles == 0, (graphs, dict(counters["recompiles"]))
    assert torch.equal(latent, eager)


def test_blocks_whose_layers_share_their_lora_list_or_not_run_one_graph(loaded, sdpa):
    """ComfyUI-GGUF's loader gives every tensor one default ``patches`` list, and a move (``.to``) gives the tensor a
    copy: a block whose layers were never moved holds one list in all of them, a block loaded onto the GPU a list
    per tensor.  A graph traced on the first guards on that sharing (``...v.bias.patches is ...ffn.0.bias.patches``:
    on the H200 the resident low-noise expert recompiled once after the high-noise one, part of it streamed, had
    traced the graph).  With the plain cast each layer's list reaches the graph as its own: both blocks run one
    graph, and each tensor holds its own list object again afterwards."""
    _m, blocks, args, kwargs = loaded
    shared, saved, given = [], [], []
    for i, block in enumerate(blocks[:2]):
        for mod in _gguf_layers([block]):
            for t in (mod.weight, mod.bias):
                if t is not None and hasattr(t, "patches") and not t.patches:
                    saved.append((t, t.patches))
                    t.patches = shared if i == 0 else []  # block 0 as the loader leaves it, block 1 as moved
                    given.append((t, t.patches))
    assert len(given) >= 20 and sum(p is shared for _t, p in given) >= 10
    try:
        with _recording() as (recording, graphs, counters):
            with torch.inference_mode():
                _compiled_pair(blocks, args, kwargs, recording, graphs)
                _compiled_pair(blocks, args, kwargs, recording, graphs)
            assert len(graphs) == 1 and not counters["recompiles"], (len(graphs), dict(counters["recompiles"]))
        assert all(t.patches is p for t, p in given)
    finally:
        for t, p in saved:
            t.patches = p
