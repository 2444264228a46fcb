"""bench.cast_buffer's buffers without ComfyUI: one flat tensor per role, device and dtype, every view of it
starting at its first element, and a weight larger than the buffer refused rather than written past it."""
import pytest
import torch

from bench import cast_buffer


def test_views_of_one_role_and_dtype_share_one_tensor():
    b = cast_buffer.Buffers(12)
    w1 = b.view("cast", "cpu", torch.bfloat16, (3, 4))
    w2 = b.view("cast", "cpu", torch.bfloat16, (2, 5))
    assert w1.data_ptr() == w2.data_ptr() and w2.shape == (2, 5)
    s = b.view("stage", "cpu", torch.float8_e4m3fn, (3, 4))
    assert s.data_ptr() != w1.data_ptr() and s.dtype == torch.float8_e4m3fn
    assert b.nbytes() == 12 * 2 + 12 * 1


def test_a_weight_larger_than_the_buffer_is_refused():
    b = cast_buffer.Buffers(6)
    with pytest.raises(ValueError, match="does not fit the cast buffer of 6"):
        b.view("cast", "cpu", torch.bfloat16, (2, 4))


def test_without_comfyui_no_layer_is_taken():
    layer = torch.nn.Linear(4, 4)
    with cast_buffer.buffered_casts(layer) as (buffers, stand_ins):
        assert stand_ins == [] and buffers.numel == 0
    assert "forward_comfy_cast_weights" not in layer.__dict__
