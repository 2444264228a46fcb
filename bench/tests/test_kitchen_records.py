"""The comfy-kitchen phases of the activation model (memory/activation_model.py, ``KERNEL_SETS``
``comfy-kitchen``) against what the fused kernels allocated on the H200 (``python -m bench.kitchen_kernels``,
``kitchen/kernels.jsonl``; no constant was set from these rows: the phases are structural).

The model's RoPE and modulation phases for the comfy-kitchen set hold no temporaries beside each kernel's
output, and its 0.3.64 RoPE phase holds ``8 d T`` of fp32 temporaries more.  Each record row must say the same,
and a phase the records measure must not be listed as unmeasured."""
import pytest

from bench import _records
from bench import kitchen_kernels
from wan_sage.memory import activation_model

ROWS = _records.rows("kitchen/kernels.jsonl")
ELEMENTWISE = [r for r in ROWS if not r["kernel"].startswith("int8_linear")]
INT8_FFN = [r for r in ROWS if r["kernel"].startswith("int8_linear")]
MIB = 2**20


def test_the_records_cover_every_size_and_kernel_the_tool_measures():
    assert {(r["size"], r["kernel"]) for r in ELEMENTWISE} == {
        (s[0], k) for s in kitchen_kernels.SIZES for k in ("apply_rope1", "adaln_per_sample", "adaln_per_token")}


@pytest.mark.parametrize("row", ELEMENTWISE, ids=lambda r: f"{r['size']}-{r['kernel']}")
def test_a_fused_kernel_allocates_its_output_and_no_more(row):
    assert row["output_bytes"] == row["tokens"] * row["dim"] * 2  # bf16 [1, T, d]
    assert 0 <= row["cuda_peak_bytes"] - row["output_bytes"] <= 1 * MIB
    assert row["rel_l2_vs_eager"] < 1e-2  # the fused kernel computes what the eager one does


@pytest.mark.parametrize("row", [r for r in ROWS if r["kernel"] == "apply_rope1"], ids=lambda r: r["size"])
def test_the_eager_rope_holds_the_fp32_temporaries_the_0_3_64_phase_models(row):
    d, T = row["dim"], row["tokens"]
    w = activation_model.Workload(L=T)
    old = activation_model.phase_peaks(_dims(row), w)["rope"]
    new = activation_model.phase_peaks(_dims(row), activation_model.Workload(L=T, kernels="comfy-kitchen"))["rope"]
    assert old - new == 8 * d * T
    assert abs(row["eager_peak_bytes"] - row["output_bytes"] - 8 * d * T) <= 1 * MIB


@pytest.mark.parametrize("row", INT8_FFN, ids=lambda r: f"{r['size']}-{r['kernel']}")
def test_the_int8_down_projection_holds_what_the_ffn_phase_models_beside_its_input(row):
    """Beside the kept input and the output: the GELU's output in bf16 unless convrot weights fuse it into the
    quantiser, and the int8 copy (the weights' per-layer transient); the model's FFN phase and transient."""
    fmt = "int8 convrot" if row["kernel"].endswith("_convrot") else "int8"
    d, f, T = _dims(row), row["ffn_dim"], row["tokens"]
    w = activation_model.Workload(L=T, kernels="comfy-kitchen", int8_ffn=fmt)
    kept_and_out = 4 * 2 * d.dim * T + 2 * f * T  # the phase's d-wide buffers (output among them) and the kept input
    beside = activation_model.phase_peaks(d, w)["ffn"] - kept_and_out + activation_model.weight_transient(
        d, activation_model.WeightSetup(fmt, quant_format=fmt), "bf16", tokens=T)
    measured = row["cuda_peak_bytes"] - row["output_bytes"]
    assert beside - 1 * MIB <= measured <= beside + 1 * MIB, (measured / MIB, beside / MIB)


def test_the_tool_runs_on_the_cpu_with_the_eager_backend():
    """Its calls as written (shapes, arguments, the row fields), on a tiny size: the GPU figures need the H200."""
    torch = pytest.importorskip("torch")
    ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen is not installed (pip install comfy-kitchen)")
    rows = kitchen_kernels.measure(torch, ck, sizes=(("tiny", 64, 4, 256, 40),), ffn=True, device="cpu",
                                   backends=("eager",))
    assert {r["kernel"] for r in rows} == {"apply_rope1", "adaln_per_sample", "adaln_per_token",
                                           "int8_linear_gelu", "int8_linear_gelu_convrot"}
    assert all(r["output_bytes"] == 40 * 64 * 2 for r in rows)


def test_phases_the_records_measure_are_not_listed_unmeasured():
    assert "rope" not in activation_model.KITCHEN_UNMEASURED
    assert "modulation" not in activation_model.KITCHEN_UNMEASURED


def _dims(row):
    for d in activation_model.PRESETS.values():
        if d.dim == row["dim"] and d.num_heads == row["heads"]:
            return d
    raise AssertionError(f"no preset with dim {row['dim']} and {row['heads']} heads")
