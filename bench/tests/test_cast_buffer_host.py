"""Host tier: bench.cast_buffer on the CPU through real ComfyUI 0.3.64's ops: the buffered cast gives ComfyUI's
output bit for bit (an fp8 weight cast to bf16, with and without a weight function on it), every layer writes into
the one buffer, scaled fp8 and layers that do not cast keep ComfyUI's forward, and everything is put back, also when
the block raises."""
import pytest
import torch


from bench import _host, cast_buffer

comfy_env = _host.comfy_env()
if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)


@pytest.fixture(scope="module")
def ops():
    comfy_env.boot(cpu=True)
    import comfy.ops
    return comfy.ops


def _fp8_linear(cls, d_in, d_out, seed):
    g = torch.Generator().manual_seed(seed)
    layer = cls(d_in, d_out, bias=True, dtype=torch.float8_e4m3fn)
    layer.weight = torch.nn.Parameter((torch.randn(d_out, d_in, generator=g) * 0.1).to(torch.float8_e4m3fn),
                                      requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(d_out, generator=g).to(torch.bfloat16), requires_grad=False)
    return layer


class Model(torch.nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.a = _fp8_linear(ops.manual_cast.Linear, 32, 48, 0)
        self.b = _fp8_linear(ops.manual_cast.Linear, 48, 16, 1)
        self.scaled = _fp8_linear(ops.scaled_fp8_ops().Linear, 16, 16, 2)
        self.plain = torch.nn.Linear(16, 16).to(torch.bfloat16)

    def forward(self, x):
        return self.plain(self.scaled(self.b(self.a(x))))


def _lora_like(delta):
    def fn(weight):
        weight += delta.to(weight.dtype)  # in place, as ComfyUI's calculate_weight adds a LoRA
        return weight
    return fn


def test_the_buffered_cast_gives_comfyuis_output_bit_for_bit(ops):
    model = Model(ops)
    model.b.weight_function = [_lora_like(torch.full((16, 48), 0.25))]
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
        with cast_buffer.buffered_casts(model) as (buffers, stand_ins):
            got = model(x)
            assert [s.layer for s in stand_ins] == [model.a, model.b]
            assert [s.calls for s in stand_ins] == [1, 1]
            assert set(buffers.tensors) == {("cast", "cpu", torch.bfloat16)}
            assert buffers.nbytes() == 48 * 32 * 2            # the largest weight, in bf16, once
        again = model(x)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert "forward_comfy_cast_weights" not in model.a.__dict__ and "forward_comfy_cast_weights" not in model.b.__dict__
    assert model.a.weight.dtype == torch.float8_e4m3fn     # the stored weight is untouched


def test_the_weight_function_does_not_reach_the_stored_weight(ops):
    model = Model(ops)
    stored = model.a.weight.detach().clone()
    model.a.weight_function = [_lora_like(torch.ones(48, 32))]
    x = torch.randn(2, 32).to(torch.bfloat16)
    with torch.inference_mode(), cast_buffer.buffered_casts(model):
        first, second = model(x), model(x)
    assert torch.equal(first, second)                      # the function ran on a fresh copy each call
    assert torch.equal(model.a.weight.view(torch.uint8), stored.view(torch.uint8))


def test_everything_is_put_back_when_the_block_raises(ops):
    model = Model(ops)
    with pytest.raises(RuntimeError, match="the sampling failed"):
        with cast_buffer.buffered_casts(model):
            raise RuntimeError("the sampling failed")
    assert all("forward_comfy_cast_weights" not in m.__dict__ for m in model.modules())
