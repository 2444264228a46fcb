"""fp8 weights multiplied in fp8 (UNETLoader's ``fp8_e4m3fn_fast``): the node recognises ComfyUI's fp8 matmul
Linear classes (stand-ins written after comfy/ops.py@a125cd84: ``fp8_ops.Linear`` calls ``fp8_linear``, and the
scaled-fp8 class calls it behind its ``fp8_matrix_mult`` switch), and the estimate counts the fp8 copy of each
layer's input that such a matmul makes, where the ordinary fp8 path casts the weight instead."""
import torch

from wan_sage.memory import activation_model
from wan_sage.memory.activation_model import PRESETS, WeightSetup, weight_transient
from wan_sage.memory.estimate import Setup, attention_plan, plan
from wan_sage.memory.weights import weights_for_key
from wan_sage.nodes import comfy_bridge

A14B = PRESETS["wan2.2-a14b"]


def fp8_linear(self, input):  # the name ComfyUI's fp8 matmul layers call
    return None


class CastLinear(torch.nn.Linear):
    """``manual_cast.Linear``: casts its weight per call."""

    def forward_comfy_cast_weights(self, input):
        return torch.nn.functional.linear(input, self.weight.to(input.dtype))


class Fp8Linear(CastLinear):
    """``fp8_ops.Linear``."""

    def forward_comfy_cast_weights(self, input):
        out = fp8_linear(self, input)
        return out if out is not None else super().forward_comfy_cast_weights(input)


class GatedFp8Linear(CastLinear):
    """``fp8_ops.Linear`` of ComfyUI 0.3.64: ``fp8_linear`` only for a layer in eval mode."""

    def forward_comfy_cast_weights(self, input):
        if not self.training:
            out = fp8_linear(self, input)
            if out is not None:
                return out
        return super().forward_comfy_cast_weights(input)


def scaled_fp8_ops(fp8_matrix_mult):
    class Linear(CastLinear):
        def forward_comfy_cast_weights(self, input):
            if fp8_matrix_mult:
                out = fp8_linear(self, input)
                if out is not None:
                    return out
            return super().forward_comfy_cast_weights(input)
    return Linear


class Base(torch.nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.diffusion_model = torch.nn.Sequential(torch.nn.Conv3d(2, 2, 1), linear(4, 4))


def test_the_fp8_matmul_classes_are_recognised():
    assert comfy_bridge.fp8_matmul(Base(Fp8Linear))
    assert comfy_bridge.fp8_matmul(Base(scaled_fp8_ops(True)))
    assert not comfy_bridge.fp8_matmul(Base(scaled_fp8_ops(False)))
    assert not comfy_bridge.fp8_matmul(Base(CastLinear))
    assert not comfy_bridge.fp8_matmul(Base(torch.nn.Linear))


def test_a_layer_in_training_mode_skips_the_fp8_matmul_where_the_class_checks_it():
    base = Base(GatedFp8Linear)                       # a module is in training mode until told otherwise
    assert comfy_bridge.fp8_matmul_skipped(base) and not comfy_bridge.fp8_matmul(base)
    base.eval()
    assert not comfy_bridge.fp8_matmul_skipped(base) and comfy_bridge.fp8_matmul(base)
    # classes that do not read the flag multiply in fp8 in either mode; classes without fp8 matmuls skip nothing
    for cls in (Fp8Linear, scaled_fp8_ops(True)):
        assert comfy_bridge.fp8_matmul(Base(cls)) and not comfy_bridge.fp8_matmul_skipped(Base(cls))
    for cls in (CastLinear, torch.nn.Linear, scaled_fp8_ops(False)):
        assert not comfy_bridge.fp8_matmul_skipped(Base(cls))


def test_the_input_copy_is_counted_where_the_cast_path_counts_the_weight():
    tokens = 75600  # A14B 1280x720x81
    cast = weight_transient(A14B, WeightSetup("fp8"), "fp16", tokens)
    fast = weight_transient(A14B, WeightSetup("fp8", fp8_matmul=True), "fp16", tokens)
    assert fast == tokens * A14B.ffn_dim > cast  # 1.04 GB of fp8 input against a 141 MB fp16 weight
    streamed = weight_transient(A14B, WeightSetup("fp8", fp8_matmul=True, streamed=True), "fp16", tokens)
    assert streamed - fast == A14B.dim * A14B.ffn_dim  # the stored fp8 bytes of the streamed layer


def test_fp8_fast_weights_plan_the_fp8_matmul_only_with_fp8_compute():
    hopper = weights_for_key(A14B, "fp8_fast", False, cc=90)
    ampere = weights_for_key(A14B, "fp8_fast", False, cc=86, vram_bytes=24 << 30)
    assert hopper.setup.fp8_matmul
    assert not ampere.setup.fp8_matmul
    latent = activation_model.latent_shape(A14B, 1280, 720, 81)
    est = {w.setup.fp8_matmul: plan(Setup(dims=A14B, latent=latent, dtype="fp16", attention=attention_plan("sdpa", 90),
                                          weights=w.setup, weights_bytes=w.nbytes))
           for w in (hopper, weights_for_key(A14B, "fp8", False, cc=90))}
    assert est[True].reservation_resident > est[False].reservation_resident
    assert any("fp8_e4m3fn_fast" in n for n in est[True].notes) and not any("fp8_e4m3fn_fast" in n for n in est[False].notes)


def test_the_route_and_the_cli_take_fp8_fast():
    from wan_sage.memory import request
    built = request.build({"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81, "weights": "fp8_fast",
                           "arch": "sm90"}, request.Env())
    assert built.weights.setup.fp8_matmul and built.setup.weights.fp8_matmul
    assert any("fp8_e4m3fn_fast" in n for n in plan(built.setup).notes)
