"""memory/weights.py: the compute dtype and weight storage ComfyUI 0.3.64 picks for a Wan model on an
NVIDIA GPU, and the cast terms that follow (none where no cast happens)."""
import pytest

from wan_sage import cli
from wan_sage.memory import activation_model
from wan_sage.memory.estimate import GiB
from setups import estimate
from wan_sage.memory.weights import weights_for_file, weights_for_key

A14B = activation_model.PRESETS["wan2.2-a14b"]
SMALL = activation_model.PRESETS["wan2.1-1.3b"]


@pytest.mark.parametrize("key,held,nbytes_per_param", [("bf16", "fp16", 2), ("fp16", "fp16", 2), ("fp32", "fp16", 2)])
def test_float_weights_compute_in_fp16_and_are_converted_at_load(key, held, nbytes_per_param):
    plan = weights_for_key(A14B, key, lora=False)
    assert plan.compute == "fp16" and plan.held == held
    assert plan.nbytes == A14B.params() * nbytes_per_param
    assert not plan.setup.casts_to(plan.compute)


def test_fp8_keeps_fp8_and_casts_where_comfyui_does():
    on_h200 = weights_for_key(A14B, "fp8", lora=False, cc=90, vram_bytes=24 * GiB)
    assert (on_h200.held, on_h200.compute, on_h200.nbytes) == ("fp8", "fp16", A14B.params())
    assert on_h200.setup.casts_to("fp16")
    # sm86 has no fp8 compute: unet_dtype keeps fp8 only when fp16 weights would not fit
    big = weights_for_key(A14B, "fp8", lora=False, cc=86, vram_bytes=24 * GiB)
    assert big.held == "fp8"
    small = weights_for_key(SMALL, "fp8", lora=False, cc=86, vram_bytes=24 * GiB)
    assert (small.held, small.nbytes) == ("fp16", SMALL.params() * 2) and not small.setup.casts_to("fp16")
    # ComfyUI's rule reads the card, not the room the activations leave: the note says so, and how to keep fp8
    assert "whether or not they then stream" in small.notes[-1] and "weight_dtype fp8_e4m3fn" in small.notes[-1]


def test_gguf_dequantises_to_fp16():
    plan = weights_for_key(A14B, "q4_k_m", lora=True)
    assert plan.compute == "fp16" and plan.setup.gguf and plan.setup.lora


def test_an_explicit_compute_dtype_converts_float_weights_to_it():
    plan = weights_for_key(A14B, "fp16", lora=False, compute="bf16")
    assert (plan.compute, plan.held) == ("bf16", "bf16") and not plan.setup.casts_to("bf16")
    assert weights_for_key(A14B, "fp8", lora=False, compute="bf16", cc=86, vram_bytes=80 * GiB).held == "fp8"


def _reservation(key, dtype=None):
    plan = weights_for_key(SMALL, key, lora=False, compute=dtype)
    return estimate(SMALL, 1280, 720, 81, dtype=plan.compute, weights=plan.setup,
                    weights_bytes=plan.nbytes).reservation_resident


def test_fp16_weights_get_no_cast_fragmentation():
    # 1.3B at 720p81: fp16 weights are the compute dtype, so no per-call cast is counted (a cast to bf16 would
    # make it 6.10 GiB)
    assert _reservation("fp16") == _reservation("fp16", "fp16") == _reservation("bf16")
    assert _reservation("fp16") / GiB == pytest.approx(3.31, abs=0.01)
    assert _reservation("fp8") > _reservation("fp16") + 2 * GiB  # fp8 casts: the cast term applies


def test_cli_weights_fp16_gives_the_fp16_figure(capsys):
    args = ["plan", "--preset", "wan2.1-1.3b", "--width", "1280", "--height", "720", "--frames", "81", "--vram", "24",
            "--json"]
    import json
    assert cli.main(args + ["--weights", "fp16"]) == 0
    by_weights = json.loads(capsys.readouterr().out)["estimate"]
    assert cli.main(args + ["--dtype", "fp16"]) == 0
    by_dtype = json.loads(capsys.readouterr().out)["estimate"]
    assert by_weights["request"]["dtype"] == "fp16" == by_dtype["request"]["dtype"]
    assert by_weights["reservation_resident"] == by_dtype["reservation_resident"]
    assert by_weights["resident"]["fragmentation"] == 0


class _Info:
    def __init__(self, fmt, main, nbytes, params, scaled=False):
        self.format, self.main_dtype, self.weights_bytes, self.scaled_fp8 = fmt, main, nbytes, scaled
        self.params, self.bytes_per_param = params, nbytes / params


def test_file_weights():
    n = SMALL.params()
    assert weights_for_file(_Info("safetensors", "BF16", 2 * n, n), False).held == "fp16"
    scaled = weights_for_file(_Info("safetensors", "F8_E4M3", n, n, scaled=True), False, cc=86, vram_bytes=80 * GiB)
    assert scaled.held == "fp8" and scaled.setup.casts_to("fp16")
    assert weights_for_file(_Info("safetensors", "BF16", 2 * n, n), False, loader_dtype="fp8").held == "fp8"
    gguf_bf16 = weights_for_file(_Info("gguf", "BF16", 2 * n, n), False)
    assert gguf_bf16.held == "bf16" and gguf_bf16.setup.casts_to("fp16")   # ComfyUI-GGUF casts per call
    assert not weights_for_file(_Info("gguf", "F16", 2 * n, n), False).setup.casts_to("fp16")
    assert weights_for_file(_Info("gguf", "Q4_K", n // 2, n), False).setup.gguf
    with pytest.raises(ValueError, match="I8"):
        weights_for_file(_Info("safetensors", "I8", n, n), False)
