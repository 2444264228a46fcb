"""Host tier: the Sage patch inside a real ComfyUI 0.3.64, sampling a tiny real WanModel on CPU."""
from pathlib import Path

import pytest
import torch

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 2
STEPS = 2


class Spy:
    """An override installed *before* ours: it must receive every call we decline."""

    def __init__(self):
        self.calls = []

    def __deepcopy__(self, memo):
        return self

    def __call__(self, func, q, k, v, *args, **kwargs):
        self.calls.append((tuple(q.shape), tuple(k.shape), kwargs.get("heads")))
        return func(q, k, v, *args, **kwargs)


def test_pack_registers_its_nodes_with_comfyui(comfy):
    comfy_env.load_custom_node(ROOT)
    assert "WanSageAttentionPatch" in comfy.nodes.NODE_CLASS_MAPPINGS
    assert "WanWorkingMemoryEstimator" in comfy.nodes.NODE_CLASS_MAPPINGS
    assert comfy.nodes.NODE_DISPLAY_NAME_MAPPINGS["WanSageAttentionPatch"] == "Wan 2.1/2.2 Sage Attention Patch"


@pytest.mark.needs_sage
@pytest.mark.parametrize("model_type,per_block", [("t2v", 2), ("i2v", 3)])
def test_override_reaches_every_wan_call_site_and_cpu_goes_to_sdpa(comfy, model_type, per_block, caplog):
    from wan_sage.attention import stats
    from wan_sage.nodes.sage_patch import apply_patch, find_override
    base = comfy_env.tiny_wan_patcher(num_layers=LAYERS, model_type=model_type)
    spy = Spy()
    m0 = base.clone()
    m0.model_options["transformer_options"]["optimized_attention_override"] = spy
    import logging
    from wan_sage.nodes import log_once
    log_once.warned.discard(("displacing", "Spy"))
    with caplog.at_level(logging.WARNING, logger="wan_sage"):
        m, status = apply_patch(m0)
    assert m is not m0 and status.startswith("patched")
    assert sum("already has an attention override" in r.getMessage() for r in caplog.records) == 1
    ov = find_override(m.model_options["transformer_options"])
    assert ov is not None and ov.prev is spy
    clip = torch.randn(1, 257, 1280) if model_type == "i2v" else None
    comfy_env.sample_tiny(m, steps=STEPS, cfg=1.0, clip_fea=clip)
    summary = stats.last_runs()[ov.patch_id]
    expected = STEPS * LAYERS * per_block
    assert summary["sdpa_calls"] == expected and summary["reasons"] == {"cpu": expected}
    assert summary["sage_calls"] == 0
    assert len(spy.calls) == expected  # every declined call went on to the previous override
    kinds = {k[1] for _, k, _ in spy.calls}
    assert 512 in kinds  # text cross-attention
    if model_type == "i2v":
        assert 257 in kinds  # CLIP image cross-attention
    assert any(q[1] == k[1] for q, k, _ in spy.calls)  # self-attention


def test_unpatched_model_stays_bit_identical(comfy):
    from wan_sage.nodes.sage_patch import apply_patch
    base = comfy_env.tiny_wan_patcher(num_layers=LAYERS)
    before = comfy_env.sample_tiny(base, steps=STEPS, cfg=5.0)
    patched, _ = apply_patch(base)
    comfy_env.sample_tiny(patched, steps=STEPS, cfg=5.0)
    after = comfy_env.sample_tiny(base, steps=STEPS, cfg=5.0)
    fresh = comfy_env.sample_tiny(comfy_env.tiny_wan_patcher(num_layers=LAYERS), steps=STEPS, cfg=5.0)
    assert torch.equal(before, after) and torch.equal(before, fresh)
    assert "optimized_attention_override" not in base.model_options["transformer_options"]


@pytest.mark.needs_sage
def test_patched_model_samples_like_sdpa_on_cpu(comfy):
    from wan_sage.nodes.sage_patch import apply_patch
    base = comfy_env.tiny_wan_patcher(num_layers=LAYERS)
    m, _ = apply_patch(base)
    out = comfy_env.sample_tiny(m, steps=STEPS, cfg=5.0)
    ref = base.clone()
    ref.model_options["transformer_options"]["optimized_attention_override"] = (
        lambda func, *a, **k: comfy.attention.attention_pytorch(*a, **k))
    expect = comfy_env.sample_tiny(ref, steps=STEPS, cfg=5.0)
    assert torch.equal(out, expect)


@pytest.mark.needs_sage
def test_repatching_replaces_instead_of_stacking_and_survives_clones(comfy):
    from wan_sage.nodes.sage_patch import apply_patch, find_override
    base = comfy_env.tiny_wan_patcher(num_layers=LAYERS)
    m1, _ = apply_patch(base)
    m2, _ = apply_patch(m1, kernel="sage1")
    ov2 = find_override(m2.model_options["transformer_options"])
    assert ov2.prev is None and ov2.config.kernel == "sage1"
    lora_like = m2.clone()  # what LoRA loaders and ModelSampling nodes do downstream
    assert find_override(lora_like.model_options["transformer_options"]) is ov2


def test_non_wan_model_passes_through(comfy):
    from wan_sage.nodes.estimator import Settings, apply_estimator
    from wan_sage.nodes.sage_patch import apply_patch
    other = comfy.model_patcher.ModelPatcher(torch.nn.Linear(4, 4), load_device=torch.device("cpu"),
                                            offload_device=torch.device("cpu"))
    m, text = apply_patch(other)
    assert m is other and "not a Wan model" in text
    m, nums, text = apply_estimator(other, Settings(), [1, 16, 21, 90, 160])
    assert m is other and nums is None and "not a Wan model" in text


@pytest.mark.needs_sage
def test_node_schemas_execute(comfy):
    from wan_sage.nodes.schemas import WanSageAttentionPatch, WanWorkingMemoryEstimator
    base = comfy_env.tiny_wan_patcher(num_layers=LAYERS)
    out = WanSageAttentionPatch.execute(model=base, kernel="auto", min_tokens=1024, calibrate=True,
                                        memory_margin_mb=256, check_finite=True)
    assert out.result[0] is not base and "patched" in out.result[1]
    out = WanWorkingMemoryEstimator.execute(model=base, width=1280, height=720, frames=81, batch_size=1, cfg=1.0,
                                            policy="wan-sage estimate", margin_gib=0.0, fixed_gib=10.0,
                                            count_sage_extra="auto-detect")
    m, tokens, act, sage, res, report = out.result
    assert tokens == 75600 and act > 0 and "verdict:" in report
    assert WanWorkingMemoryEstimator.validate_inputs(width=-16, height=720, frames=81, batch_size=1) != True  # noqa: E712
    out = WanWorkingMemoryEstimator.execute(model=base, width=1283, height=720, frames=80, batch_size=1, cfg=1.0,
                                            policy="wan-sage estimate", margin_gib=0.0, fixed_gib=10.0,
                                            count_sage_extra="auto-detect")
    report = out.result[5]
    assert "4n+1" in report and "multiple of 8" in report and out.result[1] == 20 * 45 * 80


def test_memory_mode_labels_and_the_ids_of_saved_workflows(comfy):
    from wan_sage.nodes.sage_patch import MEMORY_MODE_LABELS
    from wan_sage.nodes.schemas import WanSageAttentionPatch
    schema = WanSageAttentionPatch.define_schema()
    combo = next(i for i in schema.inputs if getattr(i, "id", None) == "memory_mode")
    assert list(combo.options) == list(MEMORY_MODE_LABELS) and schema.display_name == "Wan 2.1/2.2 Sage Attention Patch"
    for value in (*MEMORY_MODE_LABELS, "sdpa", "fastest"):  # the labels, and the ids earlier workflows saved
        assert WanSageAttentionPatch.validate_inputs(memory_mode=value) is True
    bad = WanSageAttentionPatch.validate_inputs(memory_mode="smallest")
    assert isinstance(bad, str) and "memory_mode" in bad and "within SDPA's memory" in bad


@pytest.mark.needs_sage
def test_the_patch_hands_q_over_through_its_own_forward_on_0_3_64(comfy):
    """0.3.64 has no attention containers: the patch object-patches every block's self-attention forward
    (it mirrors 0.3.64's, nodes/handover.py), says nothing of a bypass for it, samples exactly like SDPA on
    the CPU, and leaves the unpatched model's blocks as they were."""
    from wan_sage.nodes import comfy_bridge, handover
    from wan_sage.nodes.sage_patch import apply_patch, bypass_text
    assert not comfy_bridge.has_attention_containers()
    base = comfy_env.tiny_wan_patcher(num_layers=LAYERS)
    m, _ = apply_patch(base)
    assert handover.installed_blocks(m) == LAYERS and handover.installed_blocks(base) == 0
    assert comfy_bridge.self_attention_patch(m) is None and bypass_text(m) is None
    assert comfy_bridge.q_handed_over(m)
    out = comfy_env.sample_tiny(m, steps=STEPS, cfg=5.0)
    ref = base.clone()
    ref.model_options["transformer_options"]["optimized_attention_override"] = (
        lambda func, *a, **k: comfy.attention.attention_pytorch(*a, **k))
    assert torch.equal(out, comfy_env.sample_tiny(ref, steps=STEPS, cfg=5.0))
    assert not any(handover.is_hand_over(b.self_attn.forward) for b in base.model.diffusion_model.blocks)
