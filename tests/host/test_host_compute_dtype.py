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


def _partly_loaded_block(compute):
    """A block of a tiny real Wan model (fp32 weights) loaded in part on the CPU, ComfyUI's ModelComputeDtype set
    to ``compute`` where given (its patcher then marks every module to cast at each call)."""
    p = comfy_env.tiny_wan_patcher(num_layers=2, ffn_dim=256, seed=0)
    if compute is not None:
        p = p.clone()
        p.set_model_compute_dtype(compute)
    p.patch_model(torch.device("cpu"), lowvram_model_memory=p.model_size() // 2)
    return p, p.model.diffusion_model.blocks[0]


def test_a_block_computed_in_another_dtype_than_it_holds_runs_eagerly_under_wan_compile_blocks(comfy, monkeypatch):
    """With ModelComputeDtype bf16 over fp32 weights ComfyUI marks every Linear to cast at each call.  Lifted, the
    marks taken off, a ComfyUI Linear would run its fp32 weights as stored against bf16 input, and where an earlier
    model's check had passed for that class the compiled block raised.  Such a block now runs eagerly, as ComfyUI
    runs it; a model computing in the dtype it holds still lifts its streamed Linears."""
    from wan_sage.nodes import staged_blocks
    monkeypatch.setattr(staged_blocks, "_agreed", {})
    p, block = _partly_loaded_block(None)
    actions, why = staged_blocks.plan_why(block, torch.device("cpu"), torch.float32)
    assert why is None and any(isinstance(a[1], torch.nn.Linear) for a in actions if a[0] == "lift")
    p.detach()
    p, block = _partly_loaded_block(torch.bfloat16)
    assert all(getattr(m, "comfy_cast_weights", False) for m in block.modules() if isinstance(m, torch.nn.Linear))
    actions, why = staged_blocks.plan_why(block, torch.device("cpu"), torch.bfloat16)
    assert actions is None and why == "float32 weights cast to bfloat16 at each call"
    linear = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    staged_blocks._agreed[type(linear)] = True  # an earlier model's first check passed for this class
    x = torch.randn(2, linear.in_features, dtype=torch.bfloat16)
    with staged_blocks.staged(block, x) as staging:
        assert not staging and staging.why == why
        assert linear(x).dtype == torch.bfloat16  # its own forward, marks in place: it casts for the input
    p.detach()
