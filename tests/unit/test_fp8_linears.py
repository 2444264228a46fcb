"""Wan Compile Blocks' fp8 matmuls (nodes/fp8_matmul.py) on the CPU: the row-scaled matmul against bf16, which
calls the mode takes, the mode under dynamo, when a device is said to run them, and how the stand-in and the
estimator see the node's choice.  torch's CPU ``_scaled_mm`` runs the same arithmetic as the GPU's; the GPU's
own figures are the gpu tier's (tests/gpu/test_fp8_matmul_gpu.py)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from wan_sage.memory import activation_model
from wan_sage.nodes import comfy_bridge, compile_blocks, fp8_matmul

pytestmark = pytest.mark.skipif(fp8_matmul.FP8 is None, reason="this torch has no float8_e4m3fn")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _data(rows=300, k=512, n=256, outlier=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, k, generator=g)
    if outlier:
        x[..., 3] *= outlier  # a channel far above the rest, as Wan's activations have
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g)
    return x.bfloat16(), w.bfloat16(), b.bfloat16()


@pytest.mark.parametrize("outlier", [0.0, 300.0])
def test_the_row_scaled_matmul_keeps_fp8s_rounding_error_where_an_unscaled_cast_does_not(outlier):
    x, w, b = _data(outlier=outlier)
    ref = F.linear(x.float(), w.float(), b.float())
    got = fp8_matmul.rowwise_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    assert _rel(got, ref) < 0.05
    # ComfyUI's own fp8_linear casts the input unscaled (clamped to +-448): small inputs lose their bits
    small = _data()[0] / 2000
    ref_small = F.linear(small.float(), w.float())
    unscaled = torch._scaled_mm(small.reshape(-1, 512).clamp(-448, 448).to(fp8_matmul.FP8), w.to(fp8_matmul.FP8).t(),
                                scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.bfloat16)
    assert _rel(unscaled.reshape(ref_small.shape), ref_small) > 0.2
    assert _rel(fp8_matmul.rowwise_linear(small, w), ref_small) < 0.05


def test_a_zero_row_gives_zeros_and_the_bias():
    x, w, b = _data(rows=4)
    x[0, 1] = 0
    out = fp8_matmul.rowwise_linear(x, w, b)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 1], b)


class Sub(torch.Tensor):
    """Another tensor class (ComfyUI-GGUF's GGMLTensor, a QuantizedTensor): its own code decides its matmul."""


@pytest.mark.parametrize("case", ["fp32", "fp16", "k", "n", "weight3d", "subclass", "bias_subclass", "empty"])
def test_the_mode_takes_only_plain_bf16_calls_of_aligned_sizes(case):
    x, w, b = _data(rows=8)
    if case == "fp32":
        x, w = x.float(), w.float()
    elif case == "fp16":
        x, w = x.half(), w.half()
    elif case == "k":
        x, w = x[..., :500], w[:, :500]
    elif case == "n":
        w, b = w[:250], b[:250]
    elif case == "weight3d":
        w = w.unsqueeze(0)
    elif case == "subclass":
        w = w.as_subclass(Sub)
    elif case == "bias_subclass":
        b = b.as_subclass(Sub)
    elif case == "empty":
        x = x[:, :0]
    x0, w0, b0 = _data(rows=8)
    assert fp8_matmul.takes(x0, w0, b0) and fp8_matmul.takes(x0, torch.nn.Parameter(w0, requires_grad=False))
    assert not fp8_matmul.takes(x, w, b)


def test_within_the_mode_a_linear_layer_multiplies_in_fp8_and_everything_else_runs_as_it_would():
    x, w, b = _data()
    layer = torch.nn.Linear(512, 256, dtype=torch.bfloat16).requires_grad_(False)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    odd = torch.nn.Linear(500, 8, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        plain, plain_odd = layer(x), odd(x[..., :500])
        with fp8_matmul.Fp8Linears():
            got, got_odd, got_by_name = layer(x), odd(x[..., :500]), F.linear(input=x, weight=w, bias=b)
    assert torch.equal(got, fp8_matmul.rowwise_linear(x, w, b)) and torch.equal(got_by_name, got)
    assert not torch.equal(got, plain) and _rel(got, plain) < 0.05
    assert torch.equal(got_odd, plain_odd)  # 500 columns: not _scaled_mm's shape, so bf16 as before


def test_dynamo_traces_the_mode_into_one_graph_that_a_new_mode_reuses():
    torch._dynamo.reset()
    graphs = []

    def counter(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    x, w, b = _data()
    block = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.GELU(), torch.nn.Linear(256, 512))
    block = block.to(torch.bfloat16).requires_grad_(False)
    compiled = torch.compile(block, backend=counter)
    with torch.no_grad():
        with fp8_matmul.Fp8Linears():
            eager = block(x)
        for _ in range(3):
            with fp8_matmul.Fp8Linears():
                got = compiled(x)
            assert torch.equal(got, eager)
    assert len(graphs) == 1
    assert any("_scaled_mm" in str(n.target) for n in graphs[0].graph.nodes)
    torch._dynamo.reset()


def test_a_cpu_or_an_old_gpu_is_refused_with_the_reason_and_a_gpu_is_probed_once(monkeypatch):
    ok, why = fp8_matmul.available("cpu")
    assert not ok and "CUDA GPUs only" in why
    monkeypatch.setattr(fp8_matmul, "_probed", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (8, 6))
    ok, why = fp8_matmul.available("cuda")
    assert not ok and "8.6" in why and "8.9" in why
    def no_driver(i=None):
        raise RuntimeError("Found no NVIDIA driver on your system")
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_driver)
    assert fp8_matmul.available("cuda") == (False, "the GPU's compute capability could not be read (RuntimeError)")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    probes = []

    def probe(device):
        probes.append(device)
        return False, "torch's row-wise scaled fp8 matmul does not run here (no kernel)"
    monkeypatch.setattr(fp8_matmul, "_probe", probe)
    assert fp8_matmul.available("cuda:0") == (False, "torch's row-wise scaled fp8 matmul does not run here (no kernel)")
    assert fp8_matmul.available("cuda") == fp8_matmul.available("cuda:0")
    assert len(probes) == 1


def test_the_probe_passes_the_row_scaled_matmul_and_fails_one_that_is_off(monkeypatch):
    assert fp8_matmul._probe(torch.device("cpu")) == (True, "")
    monkeypatch.setattr(fp8_matmul, "rowwise_linear", lambda x, w, b=None: F.linear(x, w) * 1.2)
    ok, why = fp8_matmul._probe(torch.device("cpu"))
    assert not ok and "off by 0.200" in why


class Lin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(512, 256, dtype=torch.bfloat16).requires_grad_(False)
        self.register_buffer("scale", torch.ones(1, dtype=torch.bfloat16))

    def forward(self, x):
        return self.lin(x) * self.scale.to(x.device)


def _choice(ok):
    c = compile_blocks.Fp8Choice()
    c._on["cpu"] = ok
    return c


def test_the_stand_in_runs_its_compiled_calls_in_the_mode_and_its_eager_calls_without():
    x, _w, _b = _data()
    block = Lin()
    with torch.no_grad():
        plain = block(x)
        on = compile_blocks.BlockStandIn(block, block, _choice(True))(x)  # the block as its own "compiled" call
        off = compile_blocks.BlockStandIn(block, block, _choice(False))(x)
        none = compile_blocks.BlockStandIn(block, block)(x)
        assert torch.equal(on, fp8_matmul.rowwise_linear(x, block.lin.weight, block.lin.bias))
        assert torch.equal(off, plain) and torch.equal(none, plain)
        block.scale = torch.ones(1, dtype=torch.bfloat16, device="meta")  # streamed, not stageable: eager
        streamed = compile_blocks.BlockStandIn(block, lambda *a: pytest.fail("compiled call"), _choice(True))
        block.forward = lambda x: block.lin(x)  # the meta buffer stands for the host copy; the call runs eagerly
        eager = streamed(x)
    assert streamed.ran == {"eager": 1} and torch.equal(eager, plain)


def test_a_device_without_fp8_matmuls_is_said_once_and_multiplies_as_before(monkeypatch, caplog):
    monkeypatch.setattr(fp8_matmul, "available", lambda d: (False, "this GPU has no fp8 tensor cores"))
    c = compile_blocks.Fp8Choice()
    with caplog.at_level("WARNING", logger="wan_sage"):
        assert not c.runs_on(torch.device("cuda", 0)) and not c.runs_on(torch.device("cuda", 0))
    said = [r.getMessage() for r in caplog.records if "fp8 matmuls are off" in r.getMessage()]
    assert len(said) <= 1 and (not said or "no fp8 tensor cores" in said[0])


def test_the_node_refuses_a_choice_that_is_not_true_or_false():
    with pytest.raises(ValueError, match="fp8_matmuls must be true or false; got 'yes'"):
        compile_blocks.apply_compile_blocks(object(), "inductor", "default", "yes")


def test_the_estimator_plans_the_fp8_copies_where_the_node_multiplies_in_fp8():
    dims = activation_model.PRESETS["wan2.2-a14b"]
    tokens = 75600
    for ws in (activation_model.WeightSetup(), activation_model.WeightSetup("gguf", gguf_bytes_per_param=0.6,
                                                                            lora=True, streamed=True)):
        plain = activation_model.weight_transient(dims, ws, "bf16", tokens)
        on = activation_model.WeightSetup(**{**ws.__dict__, "rowwise_fp8": True})
        fp8 = activation_model.weight_transient(dims, on, "bf16", tokens)
        # the FFN down-projection's input (tokens x f) and weight (d x f) in fp8 bytes, at least, on top
        assert fp8 - plain >= tokens * dims.ffn_dim + dims.dim * dims.ffn_dim
    on = SimpleNamespace(model_options={comfy_bridge.FP8_MATMULS_KEY: True})
    assert comfy_bridge.fp8_matmuls(on) and not comfy_bridge.fp8_matmuls(SimpleNamespace(model_options={}))
    assert comfy_bridge.fp8_matmuls(SimpleNamespace(model_options={}), on.model_options)


def test_fp8_matmuls_that_fail_are_turned_off_and_the_call_runs_again_in_bf16(caplog):
    x, _w, _b = _data()
    block = Lin()
    calls = []

    def compiled(x):
        calls.append(torch.overrides._get_current_function_mode() is not None)
        if calls[-1]:
            raise RuntimeError("InductorError: fp8 cast failed to build")
        return block(x)
    choice = _choice(True)
    stand_in = compile_blocks.BlockStandIn(block, compiled, choice)
    with torch.no_grad(), caplog.at_level("WARNING", logger="wan_sage"):
        first, second = stand_in(x), stand_in(x)
    assert calls == [True, False, False] and not choice.runs_on("cpu")
    assert torch.equal(first, block(x)) and torch.equal(second, first)
    assert any("fp8 matmuls failed" in r.getMessage() and "fp8 cast failed" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"), KeyboardInterrupt()])
def test_out_of_memory_and_the_users_cancel_are_not_taken_for_an_fp8_failure(error):
    x, _w, _b = _data()
    block = Lin()

    class InterruptProcessingException(Exception):
        pass
    err = InterruptProcessingException() if isinstance(error, KeyboardInterrupt) else error

    def compiled(x):
        raise err
    choice = _choice(True)
    with pytest.raises(type(err)):
        compile_blocks.BlockStandIn(block, compiled, choice)(x)
    assert choice.runs_on("cpu")
