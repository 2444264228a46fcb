"""Host tier: the estimator's wrappers inside a real ComfyUI 0.3.64 (CPU)."""
import pytest
import torch

import comfy_env

GiB = 1 << 30

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)


@pytest.fixture
def record_loads(comfy, monkeypatch):
    mm = comfy.model_management
    real = mm.load_models_gpu
    calls = []

    def spy(models, memory_required=0, force_patch_weights=False, minimum_memory_required=None, **kw):
        calls.append((memory_required, minimum_memory_required))
        return real(models, memory_required=memory_required, force_patch_weights=force_patch_weights,
                    minimum_memory_required=minimum_memory_required, **kw)
    monkeypatch.setattr(mm, "load_models_gpu", spy)
    return calls


def test_reservation_changes_what_load_models_gpu_receives_and_is_restored(comfy, record_loads):
    from wan_sage.nodes.estimator import MemoryRequired, Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    comfy_env.sample_tiny(base, steps=1, cfg=5.0)
    stock = record_loads[-1]
    m, nums, _ = apply_estimator(base, Settings(margin_gib=0.5), [1, 16, 2, 8, 8])
    seen = []

    def look(executor, *a, **k):  # runs inside CALC_COND_BATCH: our estimate must be in place
        seen.append(m.model.__dict__.get("memory_required"))
        return executor(*a, **k)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "t", look)
    comfy_env.sample_tiny(m, steps=1, cfg=5.0)
    ours = record_loads[-1]
    assert ours != stock
    fn = seen[0]
    assert isinstance(fn, MemoryRequired)
    latent = [1, 16, 2, 8, 8]
    assert ours == (fn([2] + latent[1:]), fn(latent))  # batch-2 (cond+uncond) and batch-1 estimates
    assert fn(latent) >= 0.5 * (1 << 30)
    assert "memory_required" not in m.model.__dict__ and "memory_required" not in base.model.__dict__
    comfy_env.sample_tiny(base, steps=1, cfg=5.0)
    assert record_loads[-1] == stock


def test_restored_when_sampling_raises(comfy, record_loads):
    from wan_sage.nodes.estimator import Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, _, _ = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])

    def boom(executor, *a, **k):
        raise RuntimeError("boom inside the forward")
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "boom", boom)
    with pytest.raises(RuntimeError, match="boom"):
        comfy_env.sample_tiny(m, steps=1, cfg=5.0)
    assert "memory_required" not in base.model.__dict__


def test_restored_when_loading_raises(comfy, monkeypatch):
    from wan_sage.nodes.estimator import Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, _, _ = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])

    def fail(*a, **k):
        raise torch.OutOfMemoryError("simulated")
    monkeypatch.setattr(comfy.model_management, "load_models_gpu", fail)
    with pytest.raises(torch.OutOfMemoryError):
        comfy_env.sample_tiny(m, steps=1, cfg=1.0)
    assert "memory_required" not in base.model.__dict__


def test_pool_is_trimmed_after_loading_on_cuda_only(comfy, monkeypatch):
    # The trim must come after load_models_gpu (the holes it returns are the load's) and before the
    # first step; on a CPU device there is nothing to trim.
    from wan_sage.nodes import estimator
    from wan_sage.nodes.estimator import Settings, apply_estimator
    events = []
    mm = comfy.model_management
    real_load = mm.load_models_gpu
    monkeypatch.setattr(mm, "load_models_gpu", lambda *a, **k: (events.append("load"), real_load(*a, **k))[1])
    monkeypatch.setattr(mm, "soft_empty_cache", lambda *a, **k: events.append("trim"))
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, _, _ = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])

    def step(executor, *a, **k):
        events.append("step")
        return executor(*a, **k)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "step", step)
    comfy_env.sample_tiny(m, steps=1, cfg=1.0)
    assert "trim" not in events and "load" in events          # CPU: no trim
    events.clear()
    real_trim = estimator._trim_after_load
    monkeypatch.setattr(estimator, "_trim_after_load", lambda dev: real_trim(torch.device("cuda", 0)))
    comfy_env.sample_tiny(m, steps=1, cfg=1.0)
    assert events.index("load") < events.index("trim") < events.index("step"), events


@pytest.mark.needs_sage
def test_policies_and_sage_detection(comfy, record_loads):
    from wan_sage.nodes.estimator import POLICIES, Settings, apply_estimator, attention_for
    from wan_sage.nodes.sage_patch import apply_patch
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, _, _ = apply_estimator(base, Settings(policy=POLICIES[2], fixed_gib=3.0), [1, 16, 2, 8, 8])
    comfy_env.sample_tiny(m, steps=1, cfg=5.0)
    assert record_loads[-1] == (2 * 3 * (1 << 30), 3 * (1 << 30))
    m, _, _ = apply_estimator(base, Settings(policy=POLICIES[1]), [1, 16, 2, 8, 8])
    comfy_env.sample_tiny(m, steps=1, cfg=5.0)
    stock = base.model.memory_required([1, 16, 2, 8, 8])
    assert record_loads[-1][1] >= stock
    patched, _ = apply_patch(base)
    assert attention_for(patched.model_options, Settings(), torch.device("cpu")).kernel is not None
    assert attention_for(base.model_options, Settings(), torch.device("cpu")).kernel is None
    assert attention_for(patched.model_options, Settings(count_sage="never"), torch.device("cpu")).kernel is None


def test_report_shows_tokens_peak_weights_and_verdict(comfy):
    from wan_sage.nodes.estimator import Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    _, est, text = apply_estimator(base, Settings(), [1, 16, 21, 90, 160])
    assert est.tokens == 75600
    for word in ("tokens", "activation peak", "Sage extra", "weights", "verdict"):
        assert word in text


@pytest.mark.needs_sage
def test_report_says_a_sage_patch_after_the_node_is_counted_at_sampling(comfy):
    # The H200 end-to-end graph puts the estimator before the patch: its node-time report read
    # "Sage extra: +0.00 GiB (sdpa)" although sampling reserved Sage's bytes.
    import re
    from wan_sage.nodes.estimator import Settings, apply_estimator
    from wan_sage.nodes.sage_patch import apply_patch
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    _, _, text = apply_estimator(base, Settings(), [1, 16, 21, 90, 160])
    note = re.search(r"Sage patch: none on the model here; .* reservation \+([0-9.]+) GiB\)", text)
    assert note and float(note.group(1)) > 0, text
    _, _, text = apply_estimator(base, Settings(count_sage="never"), [1, 16, 21, 90, 160])
    assert "Sage patch:" not in text
    patched, status = apply_patch(base)
    assert "patched" in status, status
    _, _, text = apply_estimator(patched, Settings(), [1, 16, 21, 90, 160])   # the patch is upstream: no note
    assert "Sage patch:" not in text and "for self-attention" in text


def _compile_blocks(model, backend="inductor"):
    """``model`` cloned with each transformer block compiled through ComfyUI's own compile wrapper, as the
    per-block compile nodes do."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    m = model.clone()
    n = len(m.get_model_object("diffusion_model").blocks)
    set_torch_compile_wrapper(m, backend=backend, keys=[f"diffusion_model.blocks.{i}" for i in range(n)])
    return m


def test_the_report_says_what_a_compile_node_after_it_changes(comfy):
    # On the model as it comes in (not compiled) the report names a per-block compile node's effect, a
    # lower reservation at a size where RoPE/FFN decide the eager peak; after per-block compile the
    # blocks are seen as compiled and the report says so instead.  ComfyUI's TorchCompileModel compiles
    # the whole model as one graph, which is reserved for as eager, and the report says that.
    import re
    from wan_sage.nodes.estimator import WHOLE_MODEL_COMPILE_NOTE, Settings, apply_estimator
    from comfy_extras.nodes_torch_compile import TorchCompileModel
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    shape = [1, 16, 21, 90, 160]
    _, est, text = apply_estimator(base, Settings(), shape)
    line = next(x for x in text.splitlines() if x.startswith("note: torch.compile:"))
    change = float(re.search(r"reservation ([+-]\d+\.\d+) GiB", line).group(1))
    assert change < 0, line
    _, est_c, text_c = apply_estimator(_compile_blocks(base), Settings(), shape)
    assert "torch.compile, blocks" in text_c and "torch.compile:" not in text_c
    assert WHOLE_MODEL_COMPILE_NOTE not in text_c
    assert est_c.reservation / GiB == pytest.approx(est.reservation / GiB + change, abs=0.01)
    whole = TorchCompileModel.execute(model=base, backend="inductor")[0]
    _, est_w, text_w = apply_estimator(whole, Settings(), shape)
    assert "torch.compile, whole model" in text_w and WHOLE_MODEL_COMPILE_NOTE in text_w
    assert est_w.reservation == est.reservation


def test_cond_batching_reads_the_compiled_estimate_of_a_compiled_model(comfy):
    # Inside CALC_COND_BATCH (where ComfyUI decides whether cond and uncond run batched) the estimate in
    # place is the compiled one when the model carries ComfyUI's compile wrapper over its blocks.
    from wan_sage.nodes.estimator import MemoryRequired, Settings, apply_estimator
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    m, _, _ = apply_estimator(base, Settings(), [1, 16, 2, 8, 8])
    m = _compile_blocks(m, backend="eager")
    seen = []

    def look(executor, *a, **k):
        seen.append(m.model.__dict__.get("memory_required"))
        return executor(*a, **k)
    m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "t", look)
    torch._dynamo.reset()
    try:
        comfy_env.sample_tiny(m, steps=1, cfg=5.0)
    finally:
        torch._dynamo.reset()
    assert seen and all(isinstance(fn, MemoryRequired) and fn.setup.compiled for fn in seen)


def test_old_saved_widget_values_still_validate_and_the_latent_channels_are_checked(comfy):
    """validate_inputs checks the widgets by the estimate's one validator, so the policy name earlier
    workflows saved passes; a latent whose channels the model does not take is a problem in the report."""
    from wan_sage.nodes.schemas import WanWorkingMemoryEstimator as Node
    ok = dict(width=1280, height=720, frames=81, batch_size=1, cfg=1.0, margin_gib=0.0, fixed_gib=10.0,
              count_sage_extra="auto-detect")
    assert Node.validate_inputs(policy="fixed GB per row", **ok) is True
    assert "width must be between" in Node.validate_inputs(policy="wan-sage estimate", **{**ok, "width": 99999})
    assert "count_sage_extra" in Node.validate_inputs(**{**ok, "count_sage_extra": "sometimes"})
    base = comfy_env.tiny_wan_patcher(num_layers=2)  # a 16-channel Wan 2.1-style model
    wrong = {"samples": torch.zeros(1, 48, 2, 8, 8)}
    out = Node.execute(model=base, policy="wan-sage estimate", latent=wrong, **ok)
    report = out.result[5]
    assert "problem: the latent has 48 channels but" in report and "takes 16" in report
    right = Node.execute(model=base, policy="fixed GB per row", latent={"samples": torch.zeros(1, 16, 2, 8, 8)}, **ok)
    assert "problem:" not in right.result[5] and right.result[4] == 10.0


def test_inputs_linked_from_other_nodes_are_checked_when_their_values_come(comfy):
    """ComfyUI validates a prompt with None for every input linked from another node: validation leaves those to
    execute, which checks the values that came by the same validator and names the input; the model is left as
    it was."""
    from wan_sage.nodes.schemas import WanWorkingMemoryEstimator as Node
    ok = dict(width=1280, height=720, frames=81, batch_size=1, cfg=1.0, policy="wan-sage estimate", margin_gib=0.0,
              fixed_gib=10.0, count_sage_extra="auto-detect")
    assert Node.validate_inputs(**{**ok, "width": None, "height": None, "frames": None, "batch_size": None,
                                   "cfg": None, "margin_gib": None}) is True
    assert Node.validate_inputs(**{**ok, "width": None, "margin_gib": -1.0}).startswith("margin_gib must be")
    base = comfy_env.tiny_wan_patcher(num_layers=2)
    before = (dict(base.model_options), dict(base.model_options.get("transformer_options", {})))
    for field, value, needle in (("margin_gib", -1.0, "margin_gib must be"), ("batch_size", 0, "batch_size must be"),
                                 ("cfg", -3.0, "cfg must be"), ("fixed_gib", float("nan"), "fixed_gib must be")):
        with pytest.raises(ValueError, match=needle) as e:
            Node.execute(model=base, **{**ok, field: value})
        assert str(e.value).startswith("Wan Working-Memory Estimator: ") and "\n" not in str(e.value)
    assert (dict(base.model_options), dict(base.model_options.get("transformer_options", {}))) == before


def test_fp8_e4m3fn_fast_is_planned_as_the_ordinary_fp8_path_where_comfyui_skips_its_fp8_matmuls(comfy, monkeypatch):
    # UNETLoader's fp8_e4m3fn_fast builds the Linear layers from fp8_ops where the GPU has fp8 compute (forced
    # here on the CPU); ComfyUI 0.3.64's fp8_ops runs fp8_linear only for a layer in eval mode and loads Wan in
    # training mode, so the layers cast their fp8 weights as on the ordinary fp8 path, and the estimate says so.
    from wan_sage.nodes import comfy_bridge
    from wan_sage.nodes.estimator import FP8_MATMUL_SKIPPED_NOTE, Settings, apply_estimator
    monkeypatch.setattr(comfy.model_management, "supports_fp8_compute", lambda device=None: True)
    fast = comfy_env.tiny_wan_patcher(num_layers=2, dtype=torch.float8_e4m3fn,
                                      model_options={"fp8_optimizations": True})
    linear = fast.model.diffusion_model.blocks[0].self_attn.q
    assert isinstance(linear, comfy.ops.fp8_ops.Linear) and linear.training
    assert comfy_bridge.fp8_matmul_skipped(fast.model) and not comfy_bridge.weight_setup(fast, False).fp8_matmul
    _, est, text = apply_estimator(fast, Settings(), [1, 16, 21, 60, 104])
    assert FP8_MATMUL_SKIPPED_NOTE in text and "fp8 weights multiply in fp8" not in text
    plain = comfy_env.tiny_wan_patcher(num_layers=2, dtype=torch.float8_e4m3fn)
    _, est_plain, text_plain = apply_estimator(plain, Settings(), [1, 16, 21, 60, 104])
    assert est.reservation == est_plain.reservation and FP8_MATMUL_SKIPPED_NOTE not in text_plain
    # in eval mode the same layers multiply in fp8, and the estimate counts their input copies instead
    fast.model.diffusion_model.eval()
    try:
        assert comfy_bridge.weight_setup(fast, False).fp8_matmul
        _, est_eval, text_eval = apply_estimator(fast, Settings(), [1, 16, 21, 60, 104])
        assert "fp8 weights multiply in fp8" in text_eval and FP8_MATMUL_SKIPPED_NOTE not in text_eval
        assert est_eval.reservation != est.reservation
    finally:
        fast.model.diffusion_model.train()
