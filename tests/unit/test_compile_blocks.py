"""Wan Compile Blocks (nodes/compile_blocks.py) without ComfyUI: the stand-in that runs a block compiled only
while its weights are resident, how the pack reads the node's compile scope, and the payback it gives a run
whose blocks partly streamed."""
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from wan_sage.memory import activation_model, compile_payback as cp
from wan_sage.nodes import comfy_bridge, compile_advice, compile_blocks

A14B = activation_model.PRESETS["wan2.2-a14b"]
LATENT_720P81 = (1, 16, 21, 90, 160)


class Block(torch.nn.Module):
    """A block whose forward records that it ran eagerly; its weights on ``device`` (meta stands for a device
    other than the input's: the host copy of a streamed block)."""

    def __init__(self, device="cpu"):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, device=device)
        self.register_buffer("scale", torch.ones(4, device=device))
        self.calls = 0

    def forward(self, x, e=None):
        self.calls += 1
        return x + 1


class Compiled:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return args[0] + 2 if args else kwargs["x"] + 2


def test_a_resident_block_runs_compiled_and_a_streamed_one_eagerly():
    x = torch.zeros(2, 4)
    resident, streamed = Block(), Block("meta")
    c_res, c_str = Compiled(), Compiled()
    assert torch.equal(compile_blocks.BlockStandIn(resident, c_res)(x, e=1), x + 2)
    assert torch.equal(compile_blocks.BlockStandIn(streamed, c_str)(x, e=1), x + 1)
    assert (len(c_res.calls), resident.calls) == (1, 0) and (len(c_str.calls), streamed.calls) == (0, 1)
    assert len(c_res.calls[0][0]) == 1 and c_res.calls[0][1] == {"e": 1}  # the call is passed on as made


def test_one_streamed_tensor_makes_the_block_run_eagerly_and_x_by_name_is_read():
    b = Block()
    b.scale = torch.ones(4, device="meta")  # a buffer left on the host
    c = Compiled()
    stand_in = compile_blocks.BlockStandIn(b, c)
    assert torch.equal(stand_in(x=torch.zeros(1, 4)), torch.ones(1, 4))
    assert (len(c.calls), b.calls) == (0, 1)
    b.scale = torch.ones(4)  # loaded before the next prompt: the compiled path, no other change
    stand_in(x=torch.zeros(1, 4))
    assert len(c.calls) == 1



class CastLinear(torch.nn.Linear):
    """A layer with ComfyUI's cast flag as its ops define it: a class attribute."""
    comfy_cast_weights = False


class CastBlock(Block):
    def __init__(self, device="cpu"):
        super().__init__(device)
        self.a, self.b, self.c = CastLinear(4, 4, device=device), CastLinear(4, 4, device=device), CastLinear(4, 4, device=device)


class FlagsSeen(Compiled):
    """A compiled block that notes which of ``block``'s modules hold the cast flag as their own when it is called."""

    def __init__(self, block):
        super().__init__()
        self.block, self.seen = block, None

    def __call__(self, *args, **kwargs):
        self.seen = {n: "comfy_cast_weights" in m.__dict__ for n, m in self.block.named_children()}
        return super().__call__(*args, **kwargs)


def test_the_compiled_path_sees_the_cast_flags_of_a_freshly_loaded_block():
    """After ComfyUI's partial unload and full reload, a module holds the flag as its own attribute with its
    class's value (dropped for the compiled call), a module still streamed holds ``prev_comfy_cast_weights``
    (kept), and a flag that differs from its class's is a different state (kept).  After the call every module
    holds what it held before: the modules are shared with the model's other clones."""
    b = CastBlock()
    c = FlagsSeen(b)
    b.a.comfy_cast_weights = False
    b.b.comfy_cast_weights, b.b.prev_comfy_cast_weights = True, False
    b.c.comfy_cast_weights = True
    compile_blocks.BlockStandIn(b, c)(torch.zeros(1, 4))
    assert len(c.calls) == 1 and {k: c.seen[k] for k in "abc"} == {"a": False, "b": True, "c": True}
    assert b.a.__dict__["comfy_cast_weights"] is False
    assert b.b.__dict__["comfy_cast_weights"] is True and b.c.__dict__["comfy_cast_weights"] is True


def test_the_cast_flags_are_put_back_when_the_compiled_call_raises():
    class Raising(FlagsSeen):
        def __call__(self, *args, **kwargs):
            super().__call__(*args, **kwargs)
            raise RuntimeError("inductor")
    b = CastBlock()
    c = Raising(b)
    b.a.comfy_cast_weights = False
    with pytest.raises(RuntimeError):
        compile_blocks.BlockStandIn(b, c)(torch.zeros(1, 4))
    assert c.seen["a"] is False and b.a.__dict__["comfy_cast_weights"] is False


class AlwaysCastLinear(torch.nn.Linear):
    """A layer whose class casts always, as ComfyUI-GGUF's ``GGMLLayer`` and ComfyUI's manual-cast ops."""
    comfy_cast_weights = True


def test_a_layer_whose_class_always_casts_gets_its_class_value_back_too():
    b, c = CastBlock(), Compiled()
    b.g = AlwaysCastLinear(4, 4)
    b.g.comfy_cast_weights = True   # put back by the reload: the class's value
    b.a.comfy_cast_weights = True   # a bf16 layer flagged to cast: not its class's value
    c = FlagsSeen(b)
    compile_blocks.BlockStandIn(b, c)(torch.zeros(1, 4))
    assert c.seen["g"] is False and c.seen["a"] is True
    assert b.g.__dict__["comfy_cast_weights"] is True and b.a.__dict__["comfy_cast_weights"] is True


def test_the_eager_path_leaves_the_cast_flags_as_they_are():
    b, c = CastBlock("meta"), Compiled()
    b.a.comfy_cast_weights = False
    compile_blocks.BlockStandIn(b, c)(torch.zeros(1, 4))
    assert (len(c.calls), b.calls) == (0, 1) and "comfy_cast_weights" in b.a.__dict__

def test_the_stand_in_adds_no_parameters_to_the_model_it_is_swapped_into():
    stand_in = compile_blocks.BlockStandIn(Block(), Compiled())
    assert list(stand_in.parameters()) == [] and list(stand_in.children()) == []


def _wrapper_closing_over(keys, marked):
    compiled_module_dict = {k: object() for k in keys}

    def wrapper(executor, *args, **kwargs):
        return compiled_module_dict, executor
    if marked:
        setattr(wrapper, comfy_bridge.COMPILE_BLOCKS_MARK, True)
    return wrapper


BLOCK_KEYS = [f"diffusion_model.blocks.{i}" for i in range(40)]


def _patcher(wrapper, blocks=None, lowvram=True):
    dm = SimpleNamespace(dim=5120, ffn_dim=13824, num_heads=40, blocks=blocks if blocks is not None else [0] * 40,
                         in_dim=16, out_dim=16, patch_size=(1, 2, 2), img_emb=None)
    base = SimpleNamespace(diffusion_model=dm, model_config=SimpleNamespace(unet_config={"model_type": "t2v"}),
                           latent_format=SimpleNamespace(latent_channels=16), model_lowvram=lowvram)
    return SimpleNamespace(model=base, wrappers={"apply_model": {comfy_bridge.COMPILE_WRAPPER_KEY: [wrapper]}},
                           object_patches={}, load_device=torch.device("cpu"),
                           model_options={"transformer_options": {}, "torch_compile_kwargs": {"backend": "inductor"}})


def test_the_nodes_compile_reads_as_blocks_and_as_its_own():
    ours, comfys = _patcher(_wrapper_closing_over(BLOCK_KEYS, True)), _patcher(_wrapper_closing_over(BLOCK_KEYS, False))
    assert comfy_bridge.compile_scope(ours) == (comfy_bridge.BLOCKS, "Wan Compile Blocks, streamed blocks staged")
    assert comfy_bridge.compile_scope(comfys) == (comfy_bridge.BLOCKS, "ComfyUI's compile wrapper")
    assert comfy_bridge.compile_blocks_node(ours) and not comfy_bridge.compile_blocks_node(comfys)


def _guider(patcher):
    return SimpleNamespace(model_patcher=patcher, model_options=patcher.model_options, cfg=1.0)


def _args():
    return (torch.randn(LATENT_720P81), torch.zeros(LATENT_720P81), object(), torch.linspace(1.0, 0.0, 5)[:3])


def test_a_streamed_run_under_the_node_compiles_one_graph_for_its_resident_blocks():
    blocks = [Block() for _ in range(10)] + [Block("meta") for _ in range(30)]  # 10 of 40 resident
    p = compile_advice.payback_for(_guider(_patcher(_wrapper_closing_over(BLOCK_KEYS, True), blocks)), _args(), {})
    tokens = activation_model.tokens(A14B, 21, 90, 160)
    full = cp.compile_payback(A14B, tokens, 1, 2, shared_by=2)
    assert (p.graphs, p.shared_by, p.compile_s) == (1, 2, cp.FIRST_GRAPH_S)
    assert p.step_gain_s == pytest.approx(full.step_gain_s * 10 / 40)
    # ComfyUI's own per-block compile of the same streamed run: up to one graph per block, not shared
    theirs = compile_advice.payback_for(_guider(_patcher(_wrapper_closing_over(BLOCK_KEYS, False), blocks)),
                                        _args(), {})
    assert (theirs.graphs, theirs.shared_by) == (40, 1) and theirs.step_gain_s == pytest.approx(full.step_gain_s)


def test_a_run_whose_every_block_streamed_ran_nothing_compiled_and_gets_no_compile_line():
    blocks = [Block("meta") for _ in range(40)]
    assert compile_advice.payback_for(_guider(_patcher(_wrapper_closing_over(BLOCK_KEYS, True), blocks)),
                                      _args(), {}) is None


def test_a_resident_run_under_the_node_is_the_block_graph_of_every_block():
    blocks = [Block() for _ in range(40)]
    p = compile_advice.payback_for(_guider(_patcher(_wrapper_closing_over(BLOCK_KEYS, True), blocks, lowvram=False)),
                                   _args(), {})
    tokens = activation_model.tokens(A14B, 21, 90, 160)
    assert p == cp.compile_payback(A14B, tokens, 1, 2, shared_by=2)


def test_count_compiled_blocks():
    pt = _patcher(None, [Block(), Block("meta"), Block()])
    assert compile_blocks.count_compiled_blocks(pt) == (2, 0, 3)  # a plain torch Linear is not a kind it stages
    assert compile_blocks.count_compiled_blocks(_patcher(None, [])) is None


class HostLinear(torch.nn.Linear):
    """A layer as ComfyUI streams it: its parameter off the input's device (meta) and its forward casting a host
    copy for the call.  ``cast`` gives the host copy, as the layer's own cast would."""

    def __init__(self, seed):
        super().__init__(4, 4, device="meta")
        g = torch.Generator().manual_seed(seed)
        self.host = (torch.randn(4, 4, generator=g), torch.randn(4, generator=g))
        self.weight_function = [lambda w: w]  # a LoRA patched in at each call: staged, not lifted

    def forward(self, x):
        return torch.nn.functional.linear(x, *self.host)


def host_cast(layer, x):
    return layer.host


class StreamedBlock(torch.nn.Module):
    """Two streamed layers and a resident buffer; its forward is the layers' composition."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Module()
        self.inner.a = HostLinear(0)
        self.b = HostLinear(1)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.b(self.inner.a(x)) * self.scale


@pytest.fixture
def stager(monkeypatch):
    """The staging with ``host_cast`` as the cast of :class:`HostLinear` (the unit tier has no ComfyUI), and no
    layer kind checked yet."""
    from wan_sage.nodes import staged_blocks
    monkeypatch.setattr(staged_blocks, "_agreed", {})
    monkeypatch.setattr(staged_blocks, "caster", lambda layer: host_cast if isinstance(layer, HostLinear) else None)
    return staged_blocks


def test_a_streamed_block_runs_compiled_with_its_layers_staged_and_then_put_back(stager):
    block, x = StreamedBlock(), torch.randn(3, 4)
    layers = (block.inner.a, block.b)
    seen = []

    def compiled(x):
        seen.append((type(block.inner.a), type(block.b)))
        assert block.inner.a.weight is layers[0].host[0] and block.b.bias is layers[1].host[1]
        return block(x)  # the block as the graph sees it: its layers staged
    out = compile_blocks.BlockStandIn(block, compiled)(x)
    assert seen == [(stager.StagedLinear, stager.StagedLinear)]
    assert (block.inner.a, block.b) == layers and all(isinstance(m, HostLinear) for m in layers)
    assert torch.equal(out, block(x))
    assert compile_blocks.count_compiled_blocks(SimpleNamespace(
        model=SimpleNamespace(diffusion_model=SimpleNamespace(blocks=[block]), manual_cast_dtype=torch.float32),
        load_device=torch.device("cpu"))) == (0, 1, 1)


def test_the_layers_are_put_back_when_the_compiled_call_fails(stager):
    block = StreamedBlock()
    layers = (block.inner.a, block.b)

    def failing(x):
        raise RuntimeError("compile failed")
    with pytest.raises(RuntimeError, match="compile failed"):
        compile_blocks.BlockStandIn(block, failing)(torch.randn(2, 4))
    assert (block.inner.a, block.b) == layers


def test_a_block_with_another_tensor_streamed_or_a_layer_of_another_kind_runs_eagerly(stager):
    block, calls = StreamedBlock(), []
    block.scale = torch.ones(4, device="meta")  # a buffer outside the layers left on the host
    stand_in = compile_blocks.BlockStandIn(block, lambda x: calls.append(x))
    x = torch.randn(2, 4)
    with pytest.raises((NotImplementedError, RuntimeError)):  # the eager block itself, on its meta buffer
        stand_in(x)
    assert calls == []
    other = StreamedBlock()
    other.c = torch.nn.Linear(4, 4)  # a Linear of a kind with no known cast
    compile_blocks.BlockStandIn(other, lambda x: calls.append(x))(x)
    assert calls == [] and type(other.b) is HostLinear


def test_staged_weights_that_miss_the_layers_own_output_by_one_bit_keep_that_kind_eager(stager, monkeypatch, caplog):
    def off_by_one_bit(layer, x):
        w, b = layer.host
        return w, b.clone().view(torch.int32).add_(1).view(torch.float32)
    monkeypatch.setattr(stager, "caster", lambda layer: off_by_one_bit if isinstance(layer, HostLinear) else None)
    calls = []
    block, x = StreamedBlock(), torch.randn(2, 4)
    with caplog.at_level("WARNING"):
        out = compile_blocks.BlockStandIn(block, lambda x: calls.append(x))(x)
        compile_blocks.BlockStandIn(block, lambda x: calls.append(x))(x)
    assert calls == [] and torch.equal(out, block(x)) and type(block.b) is HostLinear
    assert stager._agreed == {HostLinear: False}
    assert sum("do not give its own output" in r.getMessage() for r in caplog.records) == 1


def test_a_run_under_the_node_with_streamed_blocks_staged_pays_for_a_second_graph():
    tokens = activation_model.tokens(A14B, 21, 90, 160)
    full = cp.compile_payback(A14B, tokens, 1, 4, shared_by=2)
    mixed = cp.compile_payback(A14B, tokens, 1, 4, shared_by=2, compiled_blocks=40, staged_blocks=30)
    assert (mixed.graphs, mixed.compile_s) == (2, 2 * cp.FIRST_GRAPH_S)
    assert mixed.step_gain_s == pytest.approx(full.step_gain_s)
    every = cp.compile_payback(A14B, tokens, 1, 4, shared_by=2, kept=True, compiled_blocks=40, staged_blocks=40)
    assert (every.graphs, every.compile_s) == (1, cp.FIRST_GRAPH_S)  # the kept file holds no staged graph


def test_the_backend_is_checked_and_the_offered_ones_need_no_lookup_of_dynamos(monkeypatch):
    thing = object()  # not a Wan model: it passes through once the inputs are valid
    with pytest.raises(ValueError, match="backend must be one of inductor, cudagraphs; got 'nope'"):
        compile_blocks.apply_compile_blocks(thing, "nope")
    with pytest.raises(ValueError, match="mode must be one of"):
        compile_blocks.apply_compile_blocks(thing, "inductor", "fast")
    assert compile_blocks.apply_compile_blocks(thing, "eager")[0] is thing  # a dynamo backend the node does not offer

    def no_lookup(*a, **k):
        raise AssertionError("dynamo's backends were listed for a backend the node offers")
    monkeypatch.setattr(torch._dynamo, "list_backends", no_lookup)
    for backend in compile_blocks.BACKENDS:
        assert compile_blocks.apply_compile_blocks(thing, backend)[0] is thing


class QLayer(torch.nn.Linear):
    """Stands in for a ComfyUI-GGUF layer: the plain-tensor cast is found for it (monkeypatched below)."""

    def cast_bias_weight(self, input=None, dtype=None, device=None, bias_dtype=None):
        return self.weight * 1, self.bias * 1


def _plain(s, input=None, dtype=None, device=None, bias_dtype=None):
    return s.weight * 1, s.bias * 1


def test_the_compiled_call_alone_sees_the_plain_gguf_cast_and_the_layers_are_restored(monkeypatch):
    from wan_sage.nodes import gguf_cast
    monkeypatch.setattr(gguf_cast, "_checked_fns", {})
    monkeypatch.setattr(gguf_cast, "cast_for", lambda mod: _plain if isinstance(mod, QLayer) else None)
    block = Block()
    block.q = QLayer(4, 4)
    block.q2 = QLayer(4, 4)
    block.q2.cast_bias_weight = "its own"  # an attribute the layer already holds is left alone
    seen = []

    class Recording(Compiled):
        def __call__(self, *args, **kwargs):
            seen.append((getattr(block.q.__dict__.get("cast_bias_weight"), "__func__", None),
                         block.q2.__dict__.get("cast_bias_weight"), "cast_bias_weight" in block.lin.__dict__))
            if kwargs.get("fail"):
                raise RuntimeError("compiled call failed")
            return super().__call__(*args, **kwargs)
    stand_in = compile_blocks.BlockStandIn(block, Recording())
    stand_in(torch.zeros(1, 4))
    assert seen == [(_plain, "its own", False)]
    assert "cast_bias_weight" not in block.q.__dict__ and block.q2.cast_bias_weight == "its own"
    with pytest.raises(RuntimeError):
        stand_in(torch.zeros(1, 4), fail=True)
    assert len(seen) == 2 and "cast_bias_weight" not in block.q.__dict__
    block.q.weight = torch.nn.Parameter(torch.ones(4, 4, device="meta"))  # streamed: eager, GGUF's own cast
    stand_in(torch.zeros(1, 4))
    assert len(seen) == 2 and block.calls == 1 and "cast_bias_weight" not in block.q.__dict__


def test_a_plain_cast_that_differs_from_ggufs_own_in_one_bit_is_never_given(monkeypatch, caplog):
    from wan_sage.nodes import gguf_cast, log_once

    def off_by_one_bit(s, input=None, dtype=None, device=None, bias_dtype=None):
        w = s.weight * 1
        w.view(torch.int32)[0, 0] ^= 1
        return w, s.bias * 1
    monkeypatch.setattr(gguf_cast, "_checked_fns", {})
    monkeypatch.setattr(log_once, "warned", set())
    monkeypatch.setattr(gguf_cast, "cast_for", lambda mod: off_by_one_bit if isinstance(mod, QLayer) else None)
    block = Block()
    block.q = QLayer(4, 4)
    seen = []

    class Recording(Compiled):
        def __call__(self, *args, **kwargs):
            seen.append("cast_bias_weight" in block.q.__dict__)
            return super().__call__(*args, **kwargs)
    stand_in = compile_blocks.BlockStandIn(block, Recording())
    with caplog.at_level("WARNING", logger="wan_sage"):
        stand_in(torch.zeros(1, 4))
        stand_in(torch.zeros(1, 4))
    assert seen == [False, False]  # the compiled calls ran with the layer's own cast
    assert sum("plain-tensor cast" in r.getMessage() for r in caplog.records) == 1


class QuantLinear(torch.nn.Linear):
    """A ComfyUI-GGUF-like layer with quantized weights, marked as ComfyUI marks a module it streams."""

    def __init__(self):
        super().__init__(4, 4)
        self.comfy_cast_weights, self.prev_comfy_cast_weights = True, False
        self.weight_function, self.bias_function = [], []

    def is_ggml_quantized(self):
        return True

    def cast_bias_weight(self, x):
        return self.weight, self.bias


class QuantBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = QuantLinear(), QuantLinear()

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture
def lifter(monkeypatch, stager):
    """ComfyUI-GGUF's cast for :class:`QuantLinear`, and a block read as streamed by ComfyUI's mark (the unit tier's
    tensors are all on the CPU, where a streamed weight is on the host on a GPU)."""
    monkeypatch.setattr(stager, "caster", lambda layer: stager._gguf_cast if isinstance(layer, QuantLinear) else None)
    monkeypatch.setattr(compile_blocks, "block_resident", lambda block, device: not any(
        "prev_comfy_cast_weights" in m.__dict__ for m in block.modules()))
    return stager


def test_a_streamed_quantized_layer_is_lifted_as_a_resident_one_and_its_marks_put_back(lifter):
    block, x = QuantBlock(), torch.randn(2, 4)
    layers, weights = (block.a, block.b), (block.a.weight, block.b.weight)
    seen = []

    def compiled(x):
        seen.append([sorted(k for k in ("comfy_cast_weights", "prev_comfy_cast_weights") if k in m.__dict__)
                     for m in (block.a, block.b)])
        assert (block.a, block.b) == layers  # the layers themselves, not stand-ins: the resident graph
        return block(x)
    out = compile_blocks.BlockStandIn(block, compiled)(x)
    assert seen == [[[], []]] and torch.equal(out, block(x))
    assert all(m.__dict__["comfy_cast_weights"] is True and m.__dict__["prev_comfy_cast_weights"] is False
               for m in layers)
    assert (block.a.weight, block.b.weight) == weights and lifter._agreed == {QuantLinear: True}
    model = SimpleNamespace(model=SimpleNamespace(diffusion_model=SimpleNamespace(blocks=[block, QuantBlock()]),
                                                  manual_cast_dtype=torch.float32), load_device=torch.device("cpu"))
    assert compile_blocks.count_compiled_blocks(model) == (2, 0, 2)  # a lifted block runs the resident graph


def test_a_streamed_quantized_layer_with_a_patch_function_is_staged_not_lifted(lifter):
    block, seen = QuantBlock(), []
    block.b.weight_function = [lambda w: w]  # a per-call patch, which lifting would leave out of the graph
    compile_blocks.BlockStandIn(block, lambda x: seen.append((type(block.a), type(block.b))))(torch.randn(2, 4))
    assert seen == [(lifter.StagedLinear, lifter.StagedLinear)] and "prev_comfy_cast_weights" in block.a.__dict__


def test_a_streamed_module_beside_the_layers_is_lifted_and_one_with_a_patch_function_keeps_the_block_eager(lifter):
    block, seen = QuantBlock(), []
    block.norm = torch.nn.LayerNorm(4)
    block.norm.comfy_cast_weights, block.norm.prev_comfy_cast_weights = True, False
    compile_blocks.BlockStandIn(block, lambda x: seen.append("comfy_cast_weights" in block.norm.__dict__))(
        torch.randn(2, 4))
    assert seen == [False] and block.norm.__dict__["prev_comfy_cast_weights"] is False
    block.norm.weight_function = [lambda w: w]
    compile_blocks.BlockStandIn(block, lambda x: seen.append("compiled"))(torch.randn(2, 4))
    assert seen == [False]


def test_a_copy_that_fails_leaves_the_block_eager_and_as_it_was(lifter, caplog, monkeypatch):
    from wan_sage.nodes import log_once
    monkeypatch.setattr(log_once, "warned", set())
    block, calls = QuantBlock(), []
    block.a.weight = torch.nn.Parameter(torch.ones(4, 4, device="meta"), requires_grad=False)
    block.a.__dict__["weight_function"] = []
    meta = block.a.weight
    stand_in = compile_blocks.BlockStandIn(block, lambda x: calls.append(x))
    with caplog.at_level("WARNING"):
        try:
            stand_in(torch.randn(2, 4))  # the eager block itself, on its meta weight
        except (NotImplementedError, RuntimeError):
            pass
    assert calls == [] and block.a.weight is meta and "prev_comfy_cast_weights" in block.a.__dict__
    assert any("ran eagerly" in r.getMessage() for r in caplog.records)
    (why,) = stand_in.why  # the node's count names the failure
    assert why.startswith("putting its weights on the GPU failed (") and stand_in.ran == {"eager": 1}


def test_a_cast_that_raises_leaves_the_block_eager_but_a_cancel_goes_on_up(stager, monkeypatch):
    class InterruptProcessingException(Exception):
        pass

    def failing(layer, x):
        raise ValueError("too many values to unpack")
    monkeypatch.setattr(stager, "caster", lambda layer: failing if isinstance(layer, HostLinear) else None)
    block, calls = StreamedBlock(), []
    layers = (block.inner.a, block.b)
    compile_blocks.BlockStandIn(block, lambda x: calls.append(x))(torch.randn(2, 4))
    assert calls == [] and (block.inner.a, block.b) == layers

    def cancelled(layer, x):
        raise InterruptProcessingException()
    monkeypatch.setattr(stager, "caster", lambda layer: cancelled if isinstance(layer, HostLinear) else None)
    with pytest.raises(InterruptProcessingException):
        compile_blocks.BlockStandIn(block, lambda x: calls.append(x))(torch.randn(2, 4))
    assert (block.inner.a, block.b) == layers


def test_each_call_is_counted_by_the_path_it_took_and_an_eager_one_says_why(lifter):
    resident = compile_blocks.BlockStandIn(QuantBlock(), lambda x: x)
    for m in resident.block.modules():  # loaded: no streaming mark
        m.__dict__.pop("prev_comfy_cast_weights", None)
    lifted = compile_blocks.BlockStandIn(QuantBlock(), lambda x: x)
    staged_block = QuantBlock()
    staged_block.b.weight_function = [lambda w: w]
    staged = compile_blocks.BlockStandIn(staged_block, lambda x: x)
    eager_block = QuantBlock()
    eager_block.norm = torch.nn.LayerNorm(4)
    eager_block.norm.prev_comfy_cast_weights, eager_block.norm.weight_function = False, [lambda w: w]
    eager = compile_blocks.BlockStandIn(eager_block, lambda x: x)
    x = torch.randn(2, 4)
    for s in (resident, lifted, staged, eager, eager):
        s(x)
    assert [dict(s.ran) for s in (resident, lifted, staged)] == [{"resident": 1}, {"lifted": 1}, {"staged": 1}]
    assert dict(eager.ran) == {"eager": 2}
    assert dict(eager.why) == {"a streamed LayerNorm has a LoRA or other patch applied at each call": 2}


def test_a_weight_of_another_dtype_with_a_per_call_lora_is_named_as_why_the_block_runs_eagerly(stager):
    block = StreamedBlock()
    block.b.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float16, device="meta"))
    actions, why = stager.plan_why(block, torch.device("cpu"), torch.float32)
    assert actions is None and why == "float16 weights with a LoRA applied at each call"
    block.b.weight = torch.nn.Parameter(torch.zeros(4, 4, device="meta"))
    block.c = torch.nn.Linear(4, 4, device="meta")
    assert stager.plan_why(block, torch.device("cpu"), torch.float32) == (
        None, "a Linear of a kind wan-sage does not stage (Linear)")


def _node_patcher(stand_ins: dict):
    """A patcher carrying a Wan Compile Blocks wrapper over ``stand_ins``, as apply_compile_blocks leaves it."""
    wrapper = _wrapper_closing_over(stand_ins, True)
    setattr(wrapper, compile_blocks.STAND_INS, stand_ins)
    return _patcher(wrapper, [s.block for s in stand_ins.values()])


def _ran(stand_in, **calls):
    stand_in.ran.update(calls)
    return stand_in


def test_blocks_are_counted_by_the_path_most_of_their_calls_took_and_begin_run_starts_afresh():
    s = {f"diffusion_model.blocks.{i}": compile_blocks.BlockStandIn(Block(), Compiled()) for i in range(4)}
    blocks = list(s.values())
    _ran(blocks[0], resident=4)
    _ran(blocks[1], lifted=3, eager=1)
    blocks[1].why["putting its weights on the GPU failed (OutOfMemoryError)"] += 1
    _ran(blocks[2], staged=4)
    _ran(blocks[3], eager=4)
    blocks[3].why["float8_e4m3fn weights with a LoRA applied at each call"] += 4
    p = _node_patcher(s)
    ran = compile_blocks.blocks_ran(p)
    assert ran.blocks == {"resident": 1, "lifted": 1, "staged": 1, "eager": 1} and ran.compiled == 3
    assert ran.calls == {"resident": 4, "lifted": 3, "staged": 4, "eager": 5}
    line = compile_blocks.blocks_ran_text(ran)
    assert line.startswith("Wan Compile Blocks: 3 of 4 blocks ran compiled (1 resident, 1 streamed, lifted")
    assert ("5 of 16 block calls ran eagerly: float8_e4m3fn weights with a LoRA applied at each call (4); "
            "putting its weights on the GPU failed (OutOfMemoryError) (1)") in line
    compile_blocks.begin_run(p)
    assert not compile_blocks.blocks_ran(p).any_calls and not blocks[3].why
    assert compile_blocks.blocks_ran(_patcher(_wrapper_closing_over(BLOCK_KEYS, True))) is None  # no stand-ins


def test_the_payback_counts_the_blocks_as_they_ran_not_as_the_model_is_loaded_after():
    """After the sampling ComfyUI may have loaded the model otherwise (the other expert's load); the payback of the
    run reads how its blocks ran: here 10 of 40 in the resident graph, 30 eagerly, while every block is loaded
    now."""
    s = {k: compile_blocks.BlockStandIn(Block(), Compiled()) for k in BLOCK_KEYS}
    for i, stand_in in enumerate(s.values()):
        _ran(stand_in, **({"resident": 2} if i < 10 else {"eager": 2}))
    p = compile_advice.payback_for(_guider(_node_patcher(s)), _args(), {})
    tokens = activation_model.tokens(A14B, 21, 90, 160)
    full = cp.compile_payback(A14B, tokens, 1, 2, shared_by=2)
    assert p.graphs == 1 and p.step_gain_s == pytest.approx(full.step_gain_s * 10 / 40)
    for stand_in in s.values():
        stand_in.ran.clear()
        _ran(stand_in, eager=2)
    assert compile_advice.payback_for(_guider(_node_patcher(s)), _args(), {}) is None  # nothing ran compiled


def test_the_node_counts_each_sampling_afresh_logs_it_and_never_fails_the_sampling_over_it(monkeypatch, caplog):
    s = {k: compile_blocks.BlockStandIn(Block(), Compiled()) for k in BLOCK_KEYS[:2]}
    p = _node_patcher(s)
    _ran(next(iter(s.values())), eager=7)  # a previous sampling's count

    def sampling(*args, **kwargs):
        for stand_in in s.values():
            stand_in(torch.zeros(1, 4))
        return "latent"
    executor = _executor(_guider(p), sampling)
    with caplog.at_level("INFO", logger="wan_sage"):
        assert compile_blocks.outer_sample(executor) == "latent"
    assert [r.getMessage() for r in caplog.records if "Wan Compile Blocks" in r.getMessage()] == [
        "wan-sage: Wan Compile Blocks: 2 of 2 blocks ran compiled (2 resident)"]

    def broken(*a, **k):
        raise RuntimeError("no stand-ins today")
    monkeypatch.setattr(compile_blocks, "stand_ins", broken)
    assert compile_blocks.outer_sample(executor) == "latent"


def _executor(guider, fn):
    """An OUTER_SAMPLE executor as ComfyUI passes one: callable, with the guider as ``class_obj``."""
    class Executor:
        class_obj = guider

        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)
    return Executor()


def test_the_sage_patchs_panel_line_says_how_the_blocks_ran():
    from wan_sage.nodes import sage_patch
    s = {k: compile_blocks.BlockStandIn(Block(), Compiled()) for k in BLOCK_KEYS}
    for i, stand_in in enumerate(s.values()):
        _ran(stand_in, **({"resident": 2} if i < 30 else {"lifted": 2}))
    summary = sage_patch._compile_payback(_guider(_node_patcher(s)), _args(), {})
    assert summary["text"].endswith(". Wan Compile Blocks: 40 of 40 blocks ran compiled (30 resident, 10 streamed, "
                                    "lifted into the resident block's graph)")
    assert summary["blocks"]["blocks"] == {"resident": 30, "lifted": 10, "staged": 0, "eager": 0}
    plain = sage_patch._compile_payback(_guider(_patcher(_wrapper_closing_over(BLOCK_KEYS, True),
                                                         [Block() for _ in range(40)])), _args(), {})
    assert "blocks" not in plain and "Wan Compile Blocks" not in plain["text"]  # nothing counted: the payback alone


def test_the_estimator_hears_how_the_streamed_blocks_ran_since_the_stand_ins_were_made(lifter):
    """streamed_blocks_ran: "" until a streamed call ran compiled, "lifted" or "staged" after, and "" for good once a
    call ran eagerly; begin_run (a new sampling) forgets none of it."""
    resident_block = QuantBlock()
    for m in resident_block.modules():  # loaded: no streaming mark
        m.__dict__.pop("prev_comfy_cast_weights", None)
    resident = compile_blocks.BlockStandIn(resident_block, lambda x: x)
    lifted = compile_blocks.BlockStandIn(QuantBlock(), lambda x: x)
    p = _node_patcher({"diffusion_model.blocks.0": resident, "diffusion_model.blocks.1": lifted})
    x = torch.randn(2, 4)
    assert compile_blocks.streamed_blocks_ran(p) == ""
    resident(x)
    assert compile_blocks.streamed_blocks_ran(p) == ""  # a resident call says nothing about streaming
    lifted(x)
    compile_blocks.begin_run(p)
    assert compile_blocks.streamed_blocks_ran(p) == "lifted"

    staged_block = QuantBlock()
    staged_block.b.weight_function = [lambda w: w]
    staged = compile_blocks.BlockStandIn(staged_block, lambda x: x)
    p = _node_patcher({"diffusion_model.blocks.0": lifted, "diffusion_model.blocks.1": staged})
    staged(x)
    assert compile_blocks.streamed_blocks_ran(p) == "staged"

    eager_block = QuantBlock()
    eager_block.norm = torch.nn.LayerNorm(4)
    eager_block.norm.prev_comfy_cast_weights, eager_block.norm.weight_function = False, [lambda w: w]
    eager = compile_blocks.BlockStandIn(eager_block, lambda x: x)
    p = _node_patcher({"diffusion_model.blocks.0": lifted, "diffusion_model.blocks.1": eager})
    eager(x)
    compile_blocks.begin_run(p)
    lifted(x)
    assert compile_blocks.streamed_blocks_ran(p) == ""
    assert compile_blocks.streamed_blocks_ran(_patcher(_wrapper_closing_over(BLOCK_KEYS, False))) == ""  # not the node


def test_a_streamed_call_that_lifted_no_linear_does_not_lower_the_plan(lifter):
    """A block whose only streamed module is one beside its Linears (its ``modulation``, a norm) runs the resident
    block's graph, but says nothing of how its Linears will run once they stream: the eager floor stands."""
    block = QuantBlock()
    for m in (block.a, block.b):  # the Linears resident
        m.__dict__.pop("prev_comfy_cast_weights")
    block.norm = torch.nn.LayerNorm(4)
    block.norm.comfy_cast_weights, block.norm.prev_comfy_cast_weights = True, False
    only_norm = compile_blocks.BlockStandIn(block, lambda x: x)
    p = _node_patcher({"diffusion_model.blocks.0": only_norm})
    only_norm(torch.randn(2, 4))
    assert only_norm.ran == {"lifted": 1}  # the sampling's log still calls it lifted
    assert compile_blocks.streamed_blocks_ran(p) == ""
    linears = compile_blocks.BlockStandIn(QuantBlock(), lambda x: x)
    p = _node_patcher({"diffusion_model.blocks.0": only_norm, "diffusion_model.blocks.1": linears})
    linears(torch.randn(2, 4))
    assert compile_blocks.streamed_blocks_ran(p) == "lifted"


def test_a_sampling_that_fails_keeps_the_eager_floor_for_good_but_a_cancel_does_not(lifter):
    """Out of memory (or any failure) in a sampling planned from the compiled streamed path: the next estimate
    goes back to the eager floor, and stays there.  A cancel is the user's, not the plan's."""
    lifted = compile_blocks.BlockStandIn(QuantBlock(), lambda x: x)
    p = _node_patcher({"diffusion_model.blocks.0": lifted})
    x = torch.randn(2, 4)

    def sampling_then(error):
        def run(*a, **k):
            lifted(x)
            if error is not None:
                raise error
            return "latent"
        return _executor(_guider(p), run)

    assert compile_blocks.outer_sample(sampling_then(None)) == "latent"
    assert compile_blocks.streamed_blocks_ran(p) == "lifted"
    InterruptProcessingException = type("InterruptProcessingException", (Exception,), {})
    with pytest.raises(InterruptProcessingException):
        compile_blocks.outer_sample(sampling_then(InterruptProcessingException()))
    assert compile_blocks.streamed_blocks_ran(p) == "lifted"
    with pytest.raises(torch.OutOfMemoryError):
        compile_blocks.outer_sample(sampling_then(torch.OutOfMemoryError("CUDA out of memory")))
    assert compile_blocks.streamed_blocks_ran(p) == ""
    assert compile_blocks.outer_sample(sampling_then(None)) == "latent"
    assert compile_blocks.streamed_blocks_ran(p) == ""


@pytest.fixture
def kept_in(monkeypatch, tmp_path):
    """The pack's cache folder in ``tmp_path``, read afresh as a new ComfyUI start reads it."""
    from wan_sage.nodes import streamed_record
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(streamed_record._file, "read", {})
    return streamed_record


def _one_block_model(stand_in):
    p = _node_patcher({"diffusion_model.blocks.0": stand_in})
    p.model.manual_cast_dtype = torch.float16
    return p


def _restart(record, block):
    """The same model in a new process: new stand-ins over the same block, and the record read from disk."""
    record._file.read.clear()
    stand_in = compile_blocks.BlockStandIn(block, lambda x: x)
    return stand_in, _one_block_model(stand_in)


def _sample(p, calls):
    def run(*a, **k):
        calls()
        return "latent"
    return compile_blocks.outer_sample(_executor(_guider(p), run))


def test_a_new_start_plans_the_streamed_path_an_earlier_start_saw_until_a_block_runs_eagerly(lifter, kept_in):
    """The first prompt of a new process plans the streamed blocks as they ran compiled in an earlier one (the
    eager floor otherwise, as before any streamed call); a block that runs eagerly in any start takes that back,
    for this process and the next."""
    block, x = QuantBlock(), torch.randn(2, 4)
    lifted = compile_blocks.BlockStandIn(block, lambda x: x)
    p = _one_block_model(lifted)
    assert compile_blocks.streamed_path(p) == ("", False)
    assert _sample(p, lambda: lifted(x)) == "latent"
    assert compile_blocks.streamed_path(p) == ("lifted", False)  # this process's own evidence

    again, p2 = _restart(kept_in, block)
    assert compile_blocks.streamed_path(p2) == ("lifted", True)
    other = QuantBlock()
    other.norm = torch.nn.LayerNorm(4)  # another kind of weighted module: another model as far as the record goes
    assert compile_blocks.streamed_path(_restart(kept_in, other)[1]) == ("", False)

    lifter._agreed[QuantLinear] = False  # its lifted output missed its own by a bit here: the block runs eagerly
    assert _sample(p2, lambda: again(x)) == "latent" and again.ever["eager"] == 1
    assert compile_blocks.streamed_path(p2) == ("", False)
    assert compile_blocks.streamed_path(_restart(kept_in, block)[1]) == ("", False)


def test_a_failed_sampling_forgets_the_kept_path_a_cancel_or_a_resident_run_does_not(lifter, kept_in):
    block, x = QuantBlock(), torch.randn(2, 4)
    lifted = compile_blocks.BlockStandIn(block, lambda x: x)
    p = _one_block_model(lifted)
    _sample(p, lambda: lifted(x))
    resident_block = QuantBlock()
    for m in resident_block.modules():
        m.__dict__.pop("prev_comfy_cast_weights", None)
    stand_in, p2 = _restart(kept_in, resident_block)
    _sample(p2, lambda: stand_in(x))  # every weight resident: nothing learnt, nothing forgotten
    assert compile_blocks.streamed_path(_restart(kept_in, block)[1]) == ("lifted", True)

    InterruptProcessingException = type("InterruptProcessingException", (Exception,), {})
    for error, kept in ((InterruptProcessingException(), ("lifted", True)),
                        (torch.OutOfMemoryError("CUDA out of memory"), ("", False))):
        stand_in, p3 = _restart(kept_in, block)

        def fails():
            stand_in(x)
            raise error
        with pytest.raises(type(error)):
            compile_blocks.outer_sample(_executor(_guider(p3), fails))
        assert compile_blocks.streamed_path(_restart(kept_in, block)[1]) == kept


def _kept_lifted(record, block, x):
    """A sampling over ``block``, streamed and lifted, that keeps "lifted"; the file's path."""
    from wan_sage.nodes import compile_cache
    lifted = compile_blocks.BlockStandIn(block, lambda x: x)
    _sample(_one_block_model(lifted), lambda: lifted(x))
    return Path(comfy_bridge.cache_dir()) / compile_cache.SUBDIR / record.FILE_NAME


def test_a_staged_path_is_kept_as_staged_and_one_model_kinds_failure_holds_for_the_other(lifter, kept_in):
    """Wan 2.2's two experts share a key: once one of them ran eagerly or failed, the other's compiled run does not
    bring the kept path back; a sampling that fails before any block call counts too."""
    block, x = QuantBlock(), torch.randn(2, 4)
    block.b.weight_function = [lambda w: w]  # a per-call patch: staged
    staged, p = _restart(kept_in, block)
    _sample(p, lambda: staged(x))
    assert compile_blocks.streamed_path(_restart(kept_in, block)[1]) == ("staged", True)

    high, low = QuantBlock(), QuantBlock()
    first, p_high = _restart(kept_in, high)

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):
        compile_blocks.outer_sample(_executor(_guider(p_high), oom))  # before any block call
    second, p_low = _restart(kept_in, low)
    _sample(p_low, lambda: second(x))
    assert compile_blocks.streamed_path(p_low) == ("lifted", False)  # what this model saw
    assert compile_blocks.streamed_path(_restart(kept_in, high)[1]) == ("", False)  # the kind keeps the eager floor


KEY_CHANGES = {
    "torch build or GPU": lambda m, p, b: m.setattr(
        __import__("wan_sage.nodes.compile_cache", fromlist=["x"]), "build_prefix", lambda t, d: "torch-9.9-gpu"),
    "ComfyUI version": lambda m, p, b: m.setitem(__import__("sys").modules, "comfyui_version",
                                                 SimpleNamespace(__version__="9.9.9")),
    "pack version": lambda m, p, b: m.setattr(__import__("wan_sage.nodes.streamed_record", fromlist=["x"]),
                                              "__version__", "9.9.9"),
    "dims": lambda m, p, b: m.setattr(p.model.diffusion_model, "dim", 2048),
    "compute dtype": lambda m, p, b: m.setattr(p.model, "manual_cast_dtype", torch.bfloat16),
    "a LoRA on a block's weight": lambda m, p, b: m.setattr(
        p, "patches", {"diffusion_model.blocks.0.a.weight": [()]}, raising=False),
    "a LoRA on another weight": lambda m, p, b: m.setattr(
        p, "patches", {"diffusion_model.blocks.7.norm.weight": [()]}, raising=False),
    "a weight wrapper": lambda m, p, b: m.setattr(
        p, "weight_wrapper_patches", {"diffusion_model.blocks.0.b.weight": [len]}, raising=False),
    "a weight dtype": lambda m, p, b: m.setattr(
        b.a, "weight", torch.nn.Parameter(b.a.weight.detach().half(), requires_grad=False)),
    "a cast the pack does not know": lambda m, p, b: m.setattr(
        __import__("wan_sage.nodes.staged_blocks", fromlist=["x"]), "caster", lambda layer: None),
}


@pytest.mark.parametrize("change", list(KEY_CHANGES))
def test_each_part_of_the_key_makes_another_model_kind(lifter, kept_in, monkeypatch, change):
    block, x = QuantBlock(), torch.randn(2, 4)
    _kept_lifted(kept_in, block, x)
    _, p = _restart(kept_in, block)
    assert compile_blocks.streamed_path(p) == ("lifted", True)
    with monkeypatch.context() as m:
        KEY_CHANGES[change](m, p, block)
        assert compile_blocks.streamed_path(_restart(kept_in, block)[1] if change == "a weight dtype" else p) == (
            "", False)


def test_a_second_block_of_another_kind_makes_another_model_kind(lifter, kept_in):
    x = torch.randn(2, 4)

    def two_blocks(second):
        stand_ins = {"diffusion_model.blocks.0": compile_blocks.BlockStandIn(QuantBlock(), lambda x: x),
                     "diffusion_model.blocks.1": compile_blocks.BlockStandIn(second, lambda x: x)}
        p = _node_patcher(stand_ins)
        p.model.manual_cast_dtype = torch.float16
        return p, list(stand_ins.values())
    p, (one, two) = two_blocks(QuantBlock())
    _sample(p, lambda: (one(x), two(x)))
    kept_in._file.read.clear()
    assert compile_blocks.streamed_path(two_blocks(QuantBlock())[0]) == ("lifted", True)
    other = QuantBlock()
    other.a = torch.nn.Linear(4, 4)  # a Linear of a kind the pack does not lift, in the second block only
    assert compile_blocks.streamed_path(two_blocks(other)[0]) == ("", False)


def test_the_file_is_read_again_when_another_process_changes_it_and_a_broken_file_is_no_file(lifter, kept_in):
    block, x = QuantBlock(), torch.randn(2, 4)
    path = _kept_lifted(kept_in, block, x)
    _, p = _restart(kept_in, block)
    assert compile_blocks.streamed_path(p) == ("lifted", True)
    data = json.loads(path.read_text())
    data["paths"] = {k: "eager" for k in data["paths"]}  # another ComfyUI sharing the folder saw a block run eagerly
    path.write_text(json.dumps(data))
    os.utime(path, ns=(1, 1))
    assert compile_blocks.streamed_path(p) == ("", False)  # no restart: read again on its change

    for broken in ("{not json", "[" * 100_000 + "]" * 100_000):  # the second nests past Python's recursion limit
        path.write_text(broken)
        stand_in, p = _restart(kept_in, block)
        assert compile_blocks.streamed_path(p) == ("", False)
        assert _sample(p, lambda: stand_in(x)) == "latent"  # the next sampling writes a whole file again
        assert compile_blocks.streamed_path(_restart(kept_in, block)[1]) == ("lifted", True)


def test_an_eager_run_that_cannot_be_written_removes_the_file_or_says_so(lifter, kept_in, monkeypatch, caplog):
    from wan_sage.nodes import kept_file, log_once, streamed_record
    monkeypatch.setattr(log_once, "warned", set())
    block, x = QuantBlock(), torch.randn(2, 4)
    path = _kept_lifted(kept_in, block, x)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(kept_file, "replace_atomically", full)
    lifter._agreed[QuantLinear] = False  # the block runs eagerly
    stand_in, p = _restart(kept_in, block)
    assert _sample(p, lambda: stand_in(x)) == "latent"
    assert not path.exists() and compile_blocks.streamed_path(_restart(kept_in, block)[1]) == ("", False)

    path.write_text(json.dumps({"format": 1, "paths": {streamed_record.record_key(p, [block]): "lifted"}}))
    monkeypatch.setattr(os, "remove", full)
    stand_in, p = _restart(kept_in, block)
    with caplog.at_level("WARNING", logger="wan_sage"):
        assert _sample(p, lambda: stand_in(x)) == "latent"
    assert [r.getMessage() for r in caplog.records if "could not be changed to say so" in r.getMessage()], \
        caplog.records


@pytest.mark.parametrize("mode", compile_blocks.MODES)
@pytest.mark.parametrize("backend", compile_blocks.BACKENDS)
def test_torch_compile_takes_the_node_s_arguments_for_every_backend_and_mode(backend, mode):
    """torch.compile refuses a mode and options together, and options for a backend that takes none."""
    kwargs = compile_blocks.compile_kwargs(backend, mode)
    torch.compile(torch.nn.Linear(2, 2), **kwargs)
    if backend == "inductor" and mode != "default":
        assert kwargs["options"]["max_autotune"]  # the mode's own options are kept
