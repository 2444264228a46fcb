"""QuantizedTensor weights of ComfyUI 0.38, with a stand-in written after the real code: comfy/quant_ops.py at
cd9452e366200c06c3893c06e3d26e64258a7aa1 (``QuantizedTensor`` from comfy-kitchen, its layouts and
``QUANT_ALGOS``) and comfy/ops.py at 5522e4fdda4249ac3b5331e55cc9df6135dcbd83 (``mixed_precision_ops``: each
quantised Linear's weight a ``Parameter`` wrapping a ``QuantizedTensor(qdata, layout_type, params)``; the
model's dtype stays the compute dtype).  The node must not read such a model as bf16 weights."""
from types import SimpleNamespace

import torch

from test_current_comfy_chain import Base, Patcher
from test_current_comfy_memory import comfy  # noqa: F401  (the fixture)
from wan_sage.memory import activation_model, report
from wan_sage.memory.activation_model import PRESETS, WeightSetup, weight_transient
from wan_sage.nodes import comfy_bridge, estimator

A14B = PRESETS["wan2.2-a14b"]
LATENT = [1, 16, 21, 90, 160]


class QuantizedTensor:
    """The attributes of comfy-kitchen's QuantizedTensor the pack may read: ``_qdata``, ``_layout_cls`` (the
    layout's name, as ``weight._layout_cls != "TensorWiseINT8Layout"`` in ops.py compares it) and ``_params``."""

    def __init__(self, qdata, layout_type, params):
        self._qdata, self._layout_cls, self._params = qdata, layout_type, params
        self.dtype = params.orig_dtype  # it reports the dtype it dequantises to

    @property
    def shape(self):
        return self._qdata.shape


class QuantBase(Base):
    def __init__(self, layout, **params):
        super().__init__()
        self.layout, self.params = layout, params

    def parameters(self):
        params = SimpleNamespace(orig_dtype=torch.bfloat16, scale=torch.ones(()), **self.params)
        yield torch.zeros(4, dtype=torch.bfloat16)                           # the patch embedding: not quantised
        for _ in range(3):
            yield QuantizedTensor(torch.zeros(4, 4, dtype=torch.uint8), self.layout, params)


def _patcher(layout, **params):
    p = Patcher()
    p.model = QuantBase(layout, **params)
    return p


def test_quantized_weights_are_recognised_not_read_as_bf16(comfy):
    for layout, fmt in (("TensorCoreNVFP4Layout", "nvfp4"), ("TensorWiseINT8Layout", "int8"),
                        ("TensorCoreMXFP8Layout", "mxfp8"), ("TensorCoreFP8E4M3Layout", "fp8 scaled")):
        ws = comfy_bridge.weight_setup(_patcher(layout), False)
        assert ws.quant_format == fmt and ws.weight_dtype == fmt and ws.casts_to("bf16"), layout
    assert comfy_bridge.weight_setup(Patcher(), False).quant_format is None
    # comfy-kitchen's TensorWiseINT8Layout.Params carries convrot (comfy-kitchen 0.2.40, tensor/int8.py)
    rotated = comfy_bridge.weight_setup(_patcher("TensorWiseINT8Layout", convrot=True, convrot_groupsize=256), False)
    assert rotated.quant_format == "int8 convrot"
    assert comfy_bridge.weight_setup(_patcher("TensorWiseINT8Layout", convrot=False), False).quant_format == "int8"


def test_their_per_layer_transient_is_modelled_and_marked_unmeasured(comfy):
    m, est, text = estimator.apply_estimator(_patcher("TensorCoreNVFP4Layout"), estimator.Settings(), LATENT)
    T, f, P = 75_600, A14B.ffn_dim, A14B.dim * A14B.ffn_dim
    expect = max(2 * P, int((0.5 + 1 / 16) * T * f))                       # the nvfp4 copy of the FFN input
    assert est.resident["weight_transient"] == expect
    assert est.resident["fragmentation"] > 0                                # as fp8 casts
    assert "weights held as nvfp4" in text
    assert "nvfp4 weights (ComfyUI's QuantizedTensor): their per-layer transient is not measured" in text
    assert weight_transient(A14B, WeightSetup("int8", quant_format="int8"), tokens=10) == 2 * P


def test_int8_weights_fold_the_gelu_under_comfy_kitchen(comfy, monkeypatch):
    monkeypatch.setattr(comfy_bridge, "kernel_set", lambda: "comfy-kitchen")
    _m, int8, _ = estimator.apply_estimator(_patcher("TensorWiseINT8Layout"), estimator.Settings(), LATENT)
    _m, nvfp4, _ = estimator.apply_estimator(_patcher("TensorCoreNVFP4Layout"), estimator.Settings(), LATENT)
    assert int8.setup.kernel_set == "comfy-kitchen" and int8.resident["dominant_phase"] == "ffn"
    _m, rot, _ = estimator.apply_estimator(_patcher("TensorWiseINT8Layout", convrot=True), estimator.Settings(), LATENT)
    T, f, e = 75_600, A14B.ffn_dim, 2
    # the GELU's output quantised to int8 beside the kept input (the int8 copy, f T, is the transient): fused into
    # the quantiser with convrot weights, written first without (kitchen/kernels.jsonl: f T and 3 f T beside it)
    assert int8.resident["weight_transient"] == rot.resident["weight_transient"] == f * T
    assert int8.resident["phase_peak"] - rot.resident["phase_peak"] == e * f * T
    assert rot.resident["phase_peak"] < nvfp4.resident["phase_peak"]      # one ffn-wide buffer, not two
    assert activation_model.QUANT_FORMATS.keys() >= set(comfy_bridge.QUANT_LAYOUTS.values())
    assert report.summary(int8)["kernel_set"] == "comfy-kitchen"
