"""Wan's elementwise kernels on ComfyUI 0.38 (comfy-kitchen), with stand-ins written after the real code:
comfy/ldm/flux/math.py at 980c56cec0e39405669b6b5b3256bced817951c4 (``apply_rope1`` through
``comfy.quant_ops.ck.apply_rope1`` outside training) and comfy/ldm/wan/model.py at
0c9a69aefdb1fcf6b9c60478aa9e511b01f8e96f (``modulate`` through ``comfy.quant_ops.ck.adaln``,
``WanFeedForward`` through ``comfy.ops.linear_input_act(..., "gelu_tanh")``), beside 0.3.64's eager
``apply_rope1``.  The activation model is parametrised by the set; the node detects it, the route and
``wan-sage plan`` take it as a field and a flag, and the report says which and what is not measured."""
import sys
import types

import pytest

from setups import setup
from wan_sage.memory import activation_model, report, request
from wan_sage.memory.activation_model import KERNEL_SETS, PRESETS, Workload, phase_peaks
from wan_sage.memory.errors import RequestError
from wan_sage.memory.estimate import plan
from wan_sage.nodes import comfy_bridge

A14B, TI2V = PRESETS["wan2.2-a14b"], PRESETS["wan2.2-ti2v-5b"]


# ------------------------------------------------------------------ stand-ins of the two Wan code versions

def apply_rope1_0364(x, freqs_cis):
    """0.3.64: fp32 temporaries, then type_as."""
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0]
    x_out.addcmul_(freqs_cis[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def apply_rope1_038(x, freqs_cis):
    """flux/math.py@980c56ce: comfy-kitchen's fused kernel outside training."""
    if comfy.model_management.in_training:  # noqa: F821  (names only: the code is read, not run)
        return _apply_rope1(x, freqs_cis)  # noqa: F821
    return comfy.quant_ops.ck.apply_rope1(x, freqs_cis)  # noqa: F821


def modulate_038(x, norm, shift, scale):
    """wan/model.py@0c9a69ae: addcmul below 16M elements or off CUDA, else comfy-kitchen's adaln."""
    if comfy.model_management.in_training or not x.is_cuda or x.numel() < 16 * 1024 * 1024:  # noqa: F821
        return torch.addcmul(shift, norm(x), 1 + scale)  # noqa: F821
    return comfy.quant_ops.ck.adaln(x, scale, shift, norm.eps)  # noqa: F821


def _comfy(monkeypatch, rope, modulate=None):
    for name in ("comfy", "comfy.ldm", "comfy.ldm.flux", "comfy.ldm.wan"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    math_mod = types.ModuleType("comfy.ldm.flux.math")
    math_mod.apply_rope1 = rope
    monkeypatch.setitem(sys.modules, "comfy.ldm.flux.math", math_mod)
    wan = types.ModuleType("comfy.ldm.wan.model")
    if modulate is not None:
        wan.modulate = modulate
    monkeypatch.setitem(sys.modules, "comfy.ldm.wan.model", wan)


def test_the_node_detects_comfy_kitchen_in_comfyuis_wan_code(monkeypatch):
    assert comfy_bridge.kernel_set() == "comfy-0.3.64"           # no ComfyUI: the measured set
    _comfy(monkeypatch, apply_rope1_0364)
    assert comfy_bridge.kernel_set() == "comfy-0.3.64"
    _comfy(monkeypatch, apply_rope1_038, modulate_038)
    assert comfy_bridge.kernel_set() == "comfy-kitchen"
    _comfy(monkeypatch, apply_rope1_0364, modulate_038)           # either call into comfy-kitchen is enough
    assert comfy_bridge.kernel_set() == "comfy-kitchen"


# ------------------------------------------------------------------ the activation model per set

def test_comfy_kitchen_phases_follow_the_fused_kernels_structure():
    w = Workload(L=75_600)
    old, new = phase_peaks(A14B, w), phase_peaks(A14B, Workload(L=75_600, kernels="comfy-kitchen"))
    e, d, f, T = 2, A14B.dim, A14B.ffn_dim, 75_600
    assert old["rope"] == 5 * e * d * T + 8 * d * T and new["rope"] == 5 * e * d * T   # no fp32 temporaries
    assert new["modulation"] == 2 * e * d * T < old["modulation"]
    assert new["ffn"] == 4 * e * d * T + 2 * e * f * T            # eager GELU, the FFN input still alive
    rot = phase_peaks(A14B, Workload(L=75_600, kernels="comfy-kitchen", int8_ffn="int8 convrot"))
    assert rot["ffn"] == 4 * e * d * T + e * f * T                 # GELU folded into the int8 quantiser
    int8 = phase_peaks(A14B, Workload(L=75_600, kernels="comfy-kitchen", int8_ffn="int8"))
    assert int8["ffn"] == new["ffn"]                               # the GELU's output written first
    with pytest.raises(ValueError, match="int8_ffn must be one of"):
        phase_peaks(A14B, Workload(L=100, kernels="comfy-kitchen", int8_ffn=True))
    for phase in ("embed", "attn", "cross"):
        assert new[phase] == old[phase]                            # 0.3.64's figure
    with pytest.raises(ValueError, match="kernels must be one of"):
        phase_peaks(A14B, Workload(L=100, kernels="comfy-0.38"))


def test_compiled_blocks_keep_the_compiled_figure_under_either_set():
    a = phase_peaks(TI2V, Workload(L=30_000, compiled=True))
    b = phase_peaks(TI2V, Workload(L=30_000, compiled=True, kernels="comfy-kitchen"))
    assert a["rope"] == b["rope"] and a["ffn"] == b["ffn"]


def test_the_report_says_which_set_and_what_is_not_measured():
    old = plan(setup(A14B, 1280, 720, 81))
    new = plan(setup(A14B, 1280, 720, 81, kernel_set="comfy-kitchen"))
    assert report.KERNEL_LINES["comfy-0.3.64"] in report.report(old)
    text = report.report(new)
    assert "kernels: comfy-kitchen's fused RoPE and adaln" in text
    assert "the FFN modelled from its structure, not measured, except its int8 kernel" in text
    assert report.summary(new)["kernel_set"] == "comfy-kitchen" and new.as_dict()["request"]["kernel_set"] == "comfy-kitchen"
    # A14B: the FFN (the input kept alive) now decides the peak, above 0.3.64's RoPE phase.
    assert old.resident["dominant_phase"] == "rope" and new.resident["dominant_phase"] == "ffn"
    with pytest.raises(ValueError, match="kernel_set must be one of"):
        plan(setup(A14B, 1280, 720, 81, kernel_set="0.38"))


def test_the_route_field_and_the_cli_flag_take_the_set():
    body = {"preset": "wan2.2-a14b", "width": 1280, "height": 720, "frames": 81}
    assert request.build(body).setup.kernel_set == "comfy-0.3.64"
    assert request.build(body, request.Env(kernel_set="comfy-kitchen")).setup.kernel_set == "comfy-kitchen"
    assert request.build({**body, "kernel_set": "comfy-kitchen"}).setup.kernel_set == "comfy-kitchen"
    with pytest.raises(RequestError) as e:
        request.build({**body, "kernel_set": "kitchen"})
    assert e.value.field == "kernel_set" and "comfy-0.3.64, comfy-kitchen" in str(e.value)
    import argparse
    from wan_sage.cli import plan as cli_plan
    ap = argparse.ArgumentParser()
    cli_plan.add_parser(ap.add_subparsers())
    a = ap.parse_args(["plan", "--preset", "wan2.2-a14b", "--kernel-set", "comfy-kitchen", "--vram", "80"])
    assert a.kernel_set == "comfy-kitchen" and cli_plan.FLAGS["kernel_set"] == "--kernel-set"
    assert activation_model.KERNEL_SETS == KERNEL_SETS == ("comfy-0.3.64", "comfy-kitchen")
