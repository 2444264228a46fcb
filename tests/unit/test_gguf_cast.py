"""The plain-tensor GGUF cast's pieces that need no ComfyUI: which layers get it, and the compiled output handed on
in its input's class.  The cast itself is checked against ComfyUI-GGUF's in the host tier
(``tests/host/test_host_gguf_cast.py``)."""
import torch

from wan_sage.nodes import gguf_cast


class Sub(torch.Tensor):
    """A tensor subclass whose ops keep the subclass, as ComfyUI-GGUF's GGMLTensor does."""


def test_a_subclass_output_is_handed_on_as_a_plain_tensor_over_the_same_storage_and_strides():
    x = torch.zeros(1, 6, 4)
    out = torch.arange(24.0).reshape(6, 4).unsqueeze(0).as_strided((1, 6, 4), (4, 4, 1)).as_subclass(Sub)
    got = gguf_cast.as_input_class(out, x)
    assert type(got) is torch.Tensor
    assert got.data_ptr() == out.data_ptr() and got.stride() == (4, 4, 1) and torch.equal(got, torch.Tensor(out))


def test_an_output_in_its_inputs_class_or_not_a_tensor_is_left_as_it_is():
    plain, sub = torch.zeros(2), torch.zeros(2).as_subclass(Sub)
    assert gguf_cast.as_input_class(plain, plain) is plain
    assert gguf_cast.as_input_class(sub, sub) is sub  # the input is the subclass itself: nothing to match
    pair = (plain, plain)
    assert gguf_cast.as_input_class(pair, plain) is pair


def test_layers_that_are_not_comfyui_ggufs_get_no_plain_cast():
    assert gguf_cast.cast_for(torch.nn.Linear(2, 2)) is None

    class LooksLikeGGUF(torch.nn.Linear):  # the methods are there, but no ComfyUI-GGUF module holds the functions
        dequant_dtype = patch_dtype = None

        def is_ggml_quantized(self):
            return True

        def cast_bias_weight(self, input=None):
            return self.weight, self.bias
    assert gguf_cast.cast_for(LooksLikeGGUF(2, 2)) is None
    layer = LooksLikeGGUF(2, 2)
    with gguf_cast.plain_casts(torch.nn.Sequential(layer), torch.zeros(1, 2)) as given:
        assert given == 0 and "cast_bias_weight" not in layer.__dict__


def test_each_tensor_holds_a_copy_of_its_lora_list_for_the_call_and_its_own_list_afterwards(monkeypatch):
    """Two layers whose tensors share one list (as ComfyUI-GGUF's loader leaves them), and a weight two layers share:
    inside the call every tensor holds a list of its own with the same items, afterwards the very list it had, also
    when the body fails."""
    monkeypatch.setattr(gguf_cast, "checked_cast", lambda mod, x: lambda s, *a, **k: (s.weight, s.bias))
    shared, lora = [], [("patch", "key")]
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    b.weight = a.weight  # tied: the same tensor in two layers
    a.weight.patches, a.bias.patches, b.bias.patches = lora, shared, shared
    block = torch.nn.Sequential(a, b)
    tensors = [a.weight, a.bias, b.bias]
    before = [t.patches for t in tensors]
    try:
        with gguf_cast.plain_casts(block, torch.zeros(1, 2)) as given:
            assert given == 2
            inside = [t.patches for t in tensors]
            assert all(p is not q and p == q for p, q in zip(inside, before))
            assert a.bias.patches is not b.bias.patches
            raise RuntimeError("the compiled call failed")
    except RuntimeError:
        pass
    assert all(t.patches is p for t, p in zip(tensors, before))
    assert "cast_bias_weight" not in a.__dict__ and "cast_bias_weight" not in b.__dict__
