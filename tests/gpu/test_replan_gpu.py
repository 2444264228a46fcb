"""gpu tier: the reservation planned again between model calls (nodes/replan.py) on a real ComfyUI 0.3.64 patcher
loading onto the GPU: ComfyUI's VRAM state there lets weights move, a lowered plan whose whole room would set a
module on the device to stream keeps it (its LoRA applied once), a room for every weight loads them all, and what a
call held in PyTorch's real pool lowers a plan that keeps more (``replan.measured_reservation``)."""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
import comfy_env  # noqa: E402

if comfy_env.skip_reason():
    pytest.skip(f"gpu tier re-plan: {comfy_env.skip_reason()}", allow_module_level=True)

UNIT = comfy_env.GAP_UNIT
SHAPE = [1, 16, 2, 8, 8]


@pytest.fixture(scope="module")
def comfy():
    from bench import _host
    _host.ensure_av(allow_stub=True)  # ComfyUI 0.3.64's nodes import PyAV; no video I/O here
    return comfy_env.boot(cpu=False, attention="pytorch")


def _gap_filled(comfy, monkeypatch, budget):
    """comfy_env.gap_filled_patcher's three Linears loaded onto the GPU for 11 units (the 6 and the 4 on the device,
    the 5 streaming); the free memory read as if load_models_gpu would load ``budget`` bytes of it for a plan of
    0."""
    from wan_sage.nodes import comfy_bridge, replan
    monkeypatch.setattr(replan, "MIN_MOVE_BYTES", 1)
    p, patched = comfy_env.gap_filled_patcher(comfy.model_management.get_torch_device())
    assert p.model.c.weight.is_cuda
    monkeypatch.setattr(comfy_bridge, "extra_reserved", lambda: 0)
    monkeypatch.setattr(comfy_bridge, "free_memory",
                        lambda dev: int(comfy.model_management.minimum_inference_memory()) + budget - p.loaded_size())
    return p, patched


def _lora_applied_once(p, patched):
    """The 4's output against its weight with the LoRA once, through the same matmul (TF32 or not); twice would be
    off by about the size of the output itself."""
    x = torch.randn(3, 64, device="cuda")
    with torch.inference_mode():
        return torch.allclose(p.model.c(x), torch.nn.functional.linear(x, patched), rtol=1e-3, atol=1e-3)


def test_comfyuis_state_on_the_gpu_lets_weights_move(comfy, monkeypatch):
    from wan_sage.nodes import replan
    p, _ = _gap_filled(comfy, monkeypatch, 13 * UNIT)
    assert replan._placed_in_part(p)


def test_a_lower_plan_keeps_the_module_that_filled_the_gap_on_the_device(comfy, monkeypatch):
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch, 13 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: 0, 1 << 30)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 0
    assert p.model.c.weight.is_cuda and p.loaded_size() == 10 * UNIT and _lora_applied_once(p, patched)
    replan.end(p.model)


def test_a_lower_plan_with_room_for_every_weight_loads_them_all_onto_the_gpu(comfy, monkeypatch):
    from wan_sage.nodes import replan
    p, patched = _gap_filled(comfy, monkeypatch, 16 * UNIT)
    replan.begin(p, SHAPE, lambda patcher, shape: 0, 1 << 30)
    replan.before_call(p.model)
    assert replan.before_call(p.model) == 5 * UNIT
    assert not p.model.model_lowvram and p.model.b.weight.is_cuda and _lora_applied_once(p, patched)
    replan.end(p.model)


def test_what_a_call_held_in_the_real_pool_lowers_a_plan_that_keeps_more(comfy, monkeypatch):
    """The measured figure read from PyTorch's real pool: a first call that held a 64 MiB block (freed, and kept by
    the pool) against a plan of 4 GiB, whose room loads nothing: the figure places the weights for what the call
    held, and the room it frees loads the rest of them."""
    from wan_sage.nodes import comfy_bridge, replan
    plan = 4 << 30
    p, patched = _gap_filled(comfy, monkeypatch, 0)
    # load_models_gpu's room for the plan is what is loaded now: the plan alone moves nothing
    monkeypatch.setattr(comfy_bridge, "free_memory", lambda dev: plan + 10 * UNIT - p.loaded_size())
    replan.begin(p, SHAPE, lambda patcher, shape: plan, plan)
    replan.before_call(p.model)
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # the call's working memory
    del block
    assert replan.before_call(p.model) == 5 * UNIT
    (move,) = replan.moves(p.model)
    assert (64 << 20) + replan.MEASURED_FLOOR <= move[2] < plan
    assert replan.lowered_by_measure(p.model) and not p.model.model_lowvram and _lora_applied_once(p, patched)
    replan.end(p.model)
