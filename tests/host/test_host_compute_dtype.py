"""Host tier: memory/weights.py's rule against ComfyUI's own ``unet_dtype`` / ``unet_manual_cast``,
run with Wan's supported dtypes on a stand-in NVIDIA GPU of each compute capability."""
from types import SimpleNamespace

import pytest
import torch

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

GiB = 1 << 30
NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8"}
FILE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}


@pytest.fixture
def nvidia(comfy, monkeypatch):
    """ComfyUI's model_management answering as if an NVIDIA GPU of compute capability cc were present."""
    mm = comfy.model_management

    def use(cc: int, vram_bytes: int):
        props = SimpleNamespace(major=cc // 10, minor=cc % 10, name="NVIDIA stand-in", total_memory=vram_bytes)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cc >= 80)
        monkeypatch.setattr(mm, "cpu_state", mm.CPUState.GPU)
        monkeypatch.setattr(mm, "is_nvidia", lambda: True)
        monkeypatch.setattr(mm, "is_amd", lambda: False)
        monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False: vram_bytes)
        return mm
    return use


def comfy_choice(mm, supported, file_dtype, params):
    """(held, compute) as ComfyUI's loader decides them for a Wan file of ``file_dtype``."""
    held = mm.unet_dtype(model_params=params, supported_dtypes=list(supported), weight_dtype=file_dtype)
    cast = mm.unet_manual_cast(held, None, supported)
    return NAMES[held], NAMES[cast or held]


@pytest.mark.parametrize("cc", [70, 75, 80, 86, 89, 90, 100, 120])
@pytest.mark.parametrize("key", ["bf16", "fp16", "fp32", "fp8"])
@pytest.mark.parametrize("preset,vram_gib", [("wan2.2-a14b", 24), ("wan2.1-1.3b", 24), ("wan2.2-a14b", 141)])
def test_the_rule_matches_comfyui(comfy, nvidia, cc, key, preset, vram_gib):
    from comfy.supported_models import WAN21_T2V
    from wan_sage.memory import activation_model
    from wan_sage.memory.weights import weights_for_key
    dims = activation_model.PRESETS[preset]
    mm = nvidia(cc, vram_gib * GiB)
    held, compute = comfy_choice(mm, WAN21_T2V.supported_inference_dtypes, FILE_DTYPES[key], dims.params())
    plan = weights_for_key(dims, key, lora=False, cc=cc, vram_bytes=vram_gib * GiB)
    assert (plan.held, plan.compute) == (held, compute)
