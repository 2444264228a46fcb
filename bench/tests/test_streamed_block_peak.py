"""bench.streamed_block_peak's compiled-around-eager-layers call, on the CPU without ComfyUI: the Linears of the
block stand behind stand-ins only for the call, and are back afterwards, also when the call fails."""
import pytest
import torch

from bench import streamed_block_peak as sbp


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        self.out = torch.nn.Linear(4, 4)


def _types(block):
    return {n: type(m).__name__ for n, m in block.named_modules() if n}


def test_the_linears_run_behind_stand_ins_for_the_call_only():
    b = Block()
    before = {n: m for n, m in b.named_modules() if n}
    seen = []

    def compiled(x):
        seen.append(_types(b))
        return b.out(b.attn(x))
    x = torch.randn(2, 4)
    expected = b.out(b.attn(x))
    assert torch.allclose(sbp.around_eager_layers(torch, b, compiled, x), expected)
    assert seen[0]["attn.0"] == seen[0]["out"] == "EagerLayer" and seen[0]["attn.1"] == "LayerNorm"
    assert {n: m for n, m in b.named_modules() if n} == before


def test_the_linears_come_back_when_the_call_fails():
    b = Block()
    before = {n: m for n, m in b.named_modules() if n}

    def compiled(x):
        raise RuntimeError("the compiled call failed")
    with pytest.raises(RuntimeError, match="compiled call failed"):
        sbp.around_eager_layers(torch, b, compiled, torch.zeros(1, 4))
    assert {n: m for n, m in b.named_modules() if n} == before


def test_the_staged_call_runs_plain_layers_on_the_cast_weights_and_puts_the_layers_back():
    b = Block()
    before = {n: m for n, m in b.named_modules() if n}
    casts, seen = [], []

    def cast(layer, x):
        casts.append(layer)
        return layer.weight.detach() * 2, layer.bias.detach()

    def compiled(x):
        seen.append(_types(b))
        return b.out(b.attn(x))
    x = torch.randn(2, 4)
    lin0, norm, out = b.attn[0], b.attn[1], b.out
    expected = torch.nn.functional.linear(norm(torch.nn.functional.linear(x, 2 * lin0.weight, lin0.bias)),
                                          2 * out.weight, out.bias)
    got = sbp.staged(torch, cast, b, compiled, x)
    assert torch.allclose(got, expected)
    assert sorted(map(id, casts)) == sorted(map(id, [lin0, out]))  # each Linear cast once, before the call
    assert seen[0]["attn.0"] == seen[0]["out"] == "StagedLinear" and seen[0]["attn.1"] == "LayerNorm"
    assert {n: m for n, m in b.named_modules() if n} == before


class Run(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return self.block.out(self.block.attn(x * 2) + 1)


@pytest.mark.parametrize("mode", ["eager layers", "staged"])
def test_a_repeated_compiled_call_compiles_nothing_new(mode):
    """The stand-ins are one class per process: a class made anew per call fails dynamo's guard on the module's
    type at every call, which compiles again (and measures the compile, not the block)."""
    import torch._dynamo
    torch._dynamo.reset()
    b = Block()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    compiled = torch.compile(Run(b), backend=backend)
    x = torch.randn(2, 4)

    def call():
        if mode == "staged":
            return sbp.staged(torch, lambda layer, x: (layer.weight.detach(), layer.bias.detach()), b, compiled, x)
        return sbp.around_eager_layers(torch, b, compiled, x)
    call()
    first = len(graphs)
    assert first >= 1
    for _ in range(3):
        call()
    assert len(graphs) == first
    torch._dynamo.reset()
