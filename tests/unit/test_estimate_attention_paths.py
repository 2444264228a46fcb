"""The working-memory estimate counts attention as the dispatcher runs it: cross-attention on SDPA, self-attention on the
first kernel of the arch's auto order in the registry, SDPA where no kernel runs."""
import pytest

from wan_sage.attention import registry
from wan_sage.memory import activation_model
from wan_sage.memory.estimate import AttentionPlan, attention_plan
from setups import estimate

A14B = activation_model.PRESETS["wan2.2-a14b"]


@pytest.mark.parametrize("cc,kernel", [(90, "sage2_sm90"), (89, "sage2_fp8_cuda"), (120, "sage2_fp8_cuda"),
                                       (75, "ck_int8"), (100, "ck_int8"), (70, None)])
def test_sage_auto_uses_the_registry_order_of_each_arch(cc, kernel):
    a = attention_plan("sage-auto", cc)
    assert a.kernel == kernel and a.cross_path == "sdpa"
    if kernel is None:
        assert a.self_path == "sdpa" and a.note == "no kernel runs on sm70: attention stays on SDPA"
    else:
        assert a.self_path == registry.memory_path(kernel, cc) and a.note is None


def test_a_kernel_that_does_not_run_on_the_arch_leaves_sdpa():
    a = attention_plan("sage2_sm90", 89)
    assert (a.self_path, a.cross_path, a.kernel) == ("sdpa", "sdpa", None) and "does not run on sm89" in a.note


def _phases(attention, cc):
    e = estimate(A14B, 1280, 720, 81, attention=attention, cc=cc)
    w = activation_model.Workload(L=e.tokens, self_attn=attention_plan(attention, cc).self_path,
                                  cross_attn=attention_plan(attention, cc).cross_path)
    return e, activation_model.phase_peaks(A14B, w)


def test_cross_attention_is_counted_on_sdpa():
    _e, sdpa = _phases("sdpa", 90)
    _e, sage = _phases("sage-auto", 90)
    assert sage["cross"] == sdpa["cross"] and sage["attn"] > sdpa["attn"]


def test_arch_changes_the_attention_phase():
    _e, sdpa = _phases("sdpa", 90)
    _e, sm90 = _phases("sage-auto", 90)
    _e, sm75 = _phases("sage-auto", 75)
    sm70, at70 = _phases("sage-auto", 70)
    assert sm90["attn"] > sm75["attn"] > sdpa["attn"] == at70["attn"]
    assert sm70.resident["sage_extra"] == 0
    assert "no kernel runs on sm70: attention stays on SDPA" in sm70.notes


def test_the_node_counts_cross_attention_on_sdpa(monkeypatch):
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    from wan_sage.nodes import comfy_bridge, estimator
    monkeypatch.setattr(estimator.kernels, "auto_candidates", lambda cc: ())
    mo = {"transformer_options": {comfy_bridge.OVERRIDE_KEY: SageAttentionOverride(PatchConfig())}}
    for cc, kernel in ((90, "sage2_sm90"), (75, "ck_int8"), (100, "ck_int8")):
        monkeypatch.setattr(estimator, "_cc", lambda dev, cc=cc: cc)
        assert estimator.attention_for(mo, estimator.Settings(), None) == AttentionPlan(
            registry.memory_path(kernel, cc), "sdpa", kernel)
    monkeypatch.setattr(estimator, "_cc", lambda dev: 70)
    assert estimator.attention_for(mo, estimator.Settings(), None).self_path == "sdpa"
    forced = {"transformer_options": {comfy_bridge.OVERRIDE_KEY: SageAttentionOverride(PatchConfig(kernel="sage2_sm90"))}}
    monkeypatch.setattr(estimator, "_cc", lambda dev: 89)
    assert estimator.attention_for(forced, estimator.Settings(), None).self_path == "sdpa"


def test_the_dispatcher_and_the_estimate_share_one_rule_for_unmeasured_calls(monkeypatch):
    """Were the registry's rule to put cross-attention on Sage, the dispatcher's default choice,
    the CLI's estimate and the node's estimate would all follow it: no second copy of the rule."""
    from wan_sage.attention import planning
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    from wan_sage.nodes import comfy_bridge, estimator
    groups = {"sage2_sm90": 1}
    assert planning.default_choice(("sage2_sm90",), True, groups).kernel is None
    monkeypatch.setattr(registry, "unmeasured_kernel", lambda names, cross: names[0] if names else None)
    assert planning.default_choice(("sage2_sm90",), True, groups).kernel == "sage2_sm90"
    sm90 = registry.memory_path("sage2_sm90", 90)
    assert attention_plan("sage-auto", 90) == AttentionPlan(sm90, sm90, "sage2_sm90")
    monkeypatch.setattr(estimator.kernels, "auto_candidates", lambda cc: ())
    monkeypatch.setattr(estimator, "_cc", lambda dev: 90)
    mo = {"transformer_options": {comfy_bridge.OVERRIDE_KEY: SageAttentionOverride(PatchConfig())}}
    assert estimator.attention_for(mo, estimator.Settings(), None) == AttentionPlan(sm90, sm90, "sage2_sm90")
    _e, sage = _phases("sage-auto", 90)
    _e, sdpa = _phases("sdpa", 90)
    assert sage["cross"] > sdpa["cross"]


def test_the_cli_and_the_node_take_their_candidate_kernels_from_one_registry_rule(monkeypatch):
    """Which kernels a patch would use on an arch (the auto order, or the named kernel where it runs)
    is decided once, in the registry: changing it changes the CLI's plan and the node's count alike."""
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    from wan_sage.nodes import comfy_bridge, estimator
    assert registry.planned_candidates("auto", 70) == ((), "no kernel runs on sm70")
    assert registry.planned_candidates("sage2_sm90", 89) == ((), "sage2_sm90 does not run on sm89")
    assert registry.planned_candidates("sage2_sm90", 90) == (("sage2_sm90",), None)
    with pytest.raises(ValueError, match="kernel must be auto or one of"):
        registry.planned_candidates("flash", 90)
    mo = {"transformer_options": {comfy_bridge.OVERRIDE_KEY: SageAttentionOverride(PatchConfig(kernel="sage2_sm90"))}}
    monkeypatch.setattr(estimator, "_cc", lambda dev: 89)
    assert estimator.attention_for(mo, estimator.Settings(), None) == AttentionPlan(
        note="sage2_sm90 does not run on sm89: attention stays on SDPA")
    monkeypatch.setattr(registry, "planned_candidates", lambda kernel, cc, tokens=None: (("sage2_sm90",), None))
    sm90 = registry.memory_path("sage2_sm90", 89)
    assert attention_plan("sage2_sm90", 89) == AttentionPlan(sm90, "sdpa", "sage2_sm90")
    assert estimator.attention_for(mo, estimator.Settings(), None) == AttentionPlan(sm90, "sdpa", "sage2_sm90")


def test_the_estimate_follows_the_registry_token_limit_of_sm120(monkeypatch):
    """Above the FP8-PV kernel's token limit on sm120 the dispatcher takes the fp16-PV kernel; the route's,
    the CLI's and the node's estimates plan with the same kernel (one rule, the registry's)."""
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    from wan_sage.memory import request
    from wan_sage.nodes import comfy_bridge, estimator
    limit = registry.KERNELS["sage2_fp8_cuda"].token_limits[120]
    short = {"preset": "wan2.2-a14b", "width": 832, "height": 480, "frames": 81, "attention": "sage-auto", "arch": "sm120"}
    long = {**short, "width": 1920, "height": 1088, "frames": 121}
    lengths = {name: estimate(A14B, b["width"], b["height"], b["frames"]).tokens for name, b in (("short", short),
                                                                                                ("long", long))}
    assert lengths["short"] <= limit < lengths["long"]
    assert request.build(short).setup.attention.kernel == "sage2_fp8_cuda"
    assert request.build(long).setup.attention.kernel == "sage2_fp16_cuda"
    monkeypatch.setattr(estimator.kernels, "auto_candidates", lambda cc: ("sage2_fp8_cuda", "sage2_fp16_cuda"))
    monkeypatch.setattr(estimator, "_cc", lambda dev: 120)
    mo = {"transformer_options": {comfy_bridge.OVERRIDE_KEY: SageAttentionOverride(PatchConfig())}}
    assert estimator.attention_for(mo, estimator.Settings(), None, lengths["short"]).kernel == "sage2_fp8_cuda"
    assert estimator.attention_for(mo, estimator.Settings(), None, lengths["long"]).kernel == "sage2_fp16_cuda"


@pytest.mark.parametrize("attention, head_dim, kernel", [
    ("sage2_sm90", 192, None), ("sage-auto", 256, "ck_int8"), ("sage-auto", 128, "sage2_sm90"),
    ("sage1", 96, "sage1"), ("sage1", 80, None)])
def test_kernels_that_do_not_run_the_models_head_dim_are_left_out(attention, head_dim, kernel):
    """The dispatcher runs a head dim a kernel does not take on SDPA (or auto's next kernel that takes it): the
    estimate plans it so, with the reason, instead of failing on the kernel's byte formula."""
    a = attention_plan(attention, 90, 32_760, head_dim=head_dim)
    assert a.kernel == kernel
    if kernel is None:
        assert a.self_path == "sdpa" and a.note == f"{attention} does not run head dim {head_dim}: attention stays on SDPA"


def test_the_route_answers_a_model_with_wide_heads_instead_of_failing():
    from wan_sage.memory.answer import estimate_answer
    body = {"width": 832, "height": 480, "frames": 81, "attention": "sage2_sm90",
            "model": {"dim": 1536, "ffn_dim": 8960, "num_heads": 8}}
    answer = estimate_answer(body, text=True)
    assert "sage2_sm90 does not run head dim 192: attention stays on SDPA" in answer["estimate"]["notes"]
