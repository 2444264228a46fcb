"""Unit tier: the pure parts of the compile table and the forward-peak tool (no ComfyUI): configuration
names, the deadline's estimates, resuming from records, the held-out size set, the memory mode passed to
PatchConfig, and what dynamo's messages become in a record."""
import dataclasses
import json

import pytest

from bench import _compile, _host, compile_table


def test_configuration_names():
    parse = compile_table.Config.parse
    assert parse("eager-sdpa") == compile_table.Config("eager-sdpa", False, "sdpa", None, False)
    assert parse("compile-sage-grouped") == compile_table.Config("compile-sage-grouped", True, "sage", "sdpa", False)
    assert parse("compile-sage-ungrouped-fullgraph").memory_mode == "fastest"
    assert parse("compile-sage-ungrouped-fullgraph").fullgraph
    assert parse("eager-sage").memory_mode is None
    for bad in ("eager-sdpa-fullgraph", "compile-sdpa-grouped", "compile-sage-halved", "jit-sdpa", "sdpa"):
        with pytest.raises(SystemExit):
            parse(bad)
    assert len({parse(c) for c in compile_table.ALL_CONFIGS}) == 9


def test_the_deadline_estimates_from_what_was_measured():
    parse = compile_table.Config.parse
    eager, comp = parse("eager-sdpa"), parse("compile-sdpa")
    assert compile_table.estimate_s(eager, [], 60) is None
    assert compile_table.estimate_s(comp, [(eager, 50.0)], 60) == pytest.approx(115.0)
    assert compile_table.estimate_s(comp, [(eager, 50.0), (comp, 70.0)], 60) == pytest.approx(77.0)
    assert compile_table.estimate_s(parse("eager-sage-grouped"), [(eager, 50.0), (comp, 90.0)], 60) == pytest.approx(55.0)


def test_done_configs_match_model_size_dtype_steps_and_backend(tmp_path):
    key = {"model": "a14b", "size": "1280x720x81", "dtype": "bf16", "steps": 2, "backend": "inductor"}
    rows = [dict(key, schema=compile_table.SCHEMA, config="eager-sdpa", ok=True),
            dict(key, schema=compile_table.SCHEMA, config="compile-sdpa", ok=False),
            dict(key, schema=compile_table.SCHEMA, config="compile-sage-grouped", ok=True, size="832x480x81"),
            dict(key, schema="other", config="eager-sage-grouped", ok=True)]
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    assert compile_table.done_configs(str(p), key) == {"eager-sdpa"}
    assert compile_table.done_configs(f"{p},{tmp_path / 'missing.jsonl'}", key) == {"eager-sdpa"}


def test_memory_mode_goes_straight_into_patch_config(monkeypatch):
    config_class, _ = _host.patch_classes()
    fields = {f.name for f in dataclasses.fields(config_class)}
    # PatchConfig's default, and "fastest" (today's behaviour) always run
    assert _host.patch_config(None, calibrate=False).calibrate is False
    _host.check_memory_modes([None, "fastest"])
    if "memory_mode" in fields:
        assert _host.patch_config("sdpa").memory_mode == "sdpa"
        assert _host.patch_config("fastest").memory_mode == "fastest"
    else:
        with pytest.raises(SystemExit, match="no memory_mode field"):
            _host.check_memory_modes(["sdpa"])
        with pytest.raises(SystemExit, match="no memory_mode field"):
            _host.patch_config("sdpa")

    @dataclasses.dataclass(frozen=True)
    class WithMode:                     # a dispatch that has the field
        memory_mode: str = "sdpa"
        calibrate: bool = True
    monkeypatch.setattr(_host, "patch_classes", lambda: (WithMode, object))
    assert _host.patch_config("fastest", calibrate=False) == WithMode("fastest", False)
    assert _host.patch_config(None) == WithMode()
    _host.check_memory_modes(["sdpa", "fastest"])


def test_heldout_sizes_are_sizes_the_fit_never_saw():
    from bench import forward_peaks
    from wan_sage.memory import activation_model
    for model, sizes in forward_peaks.HELDOUT.items():
        fit = set(forward_peaks.SIZES[model])
        dims = _host.wan_dims(model)
        cell = dims.vae_stride[1] * dims.patch_size[1]           # pixels per token side: 16, or 32 for TI2V-5B
        assert sizes and not fit & set(sizes), model
        for w, h, f in sizes:
            assert w % cell == 0 and h % cell == 0 and (f - 1) % 4 == 0, (model, w, h, f)
        assert any(h > w for w, h, _ in sizes), f"{model}: no portrait size"
        assert any(w == h for w, h, _ in sizes), f"{model}: no square size"
        assert any(abs(w / h - 16 / 9) < 0.01 and (w, h) not in {(1280, 720), (1280, 704)} for w, h, _ in sizes)
        frames = {f for _, _, f in sizes}
        assert {25, 65, 97} <= frames and max(frames) >= 161, model
        fit_tokens = {activation_model.tokens(dims, *activation_model.latent_shape(dims, *s)[2:]) for s in fit}
        new_tokens = {activation_model.tokens(dims, *activation_model.latent_shape(dims, *s)[2:]) for s in sizes}
        assert len(new_tokens - fit_tokens) >= len(sizes) - 3, model      # mostly token counts the fit never saw


def test_heldout_pass_is_estimated_under_five_minutes_from_the_fitted_table(capsys):
    from bench import forward_peaks
    fits = forward_peaks.forward_cost_model()
    assert {("a14b", "sdpa"), ("a14b", "sage"), ("1.3b", "sdpa"), ("ti2v5b", "sage")} <= set(fits)
    plan = forward_peaks.plan_rows(["a14b", "ti2v5b", "1.3b"], ["bf16"], ["sdpa", "sage"], [None],
                                 lambda m: forward_peaks.HELDOUT[m])
    assert len(plan) == 2 * sum(len(s) for s in forward_peaks.HELDOUT.values())
    total = forward_peaks.print_estimate(plan, fits, False, print)
    assert 60 < total < 300
    assert "estimate total" in capsys.readouterr().out
    # a compiled run costs two forwards and the compile allowance
    row = plan[0]
    assert forward_peaks.run_estimate_s(row, fits, True) == pytest.approx(
        2 * forward_peaks.run_estimate_s(row, fits, False) + forward_peaks.COMPILE_ALLOWANCE_S)


def test_forward_peak_rows_resume_by_model_dtype_attention_mode_compiled_and_size(tmp_path):
    from bench import forward_peaks
    base = {"model": "a14b", "dtype": "bf16", "attn": "sage", "width": 832, "height": 480, "frames": 81, "ok": True}
    rows = [base, dict(base, memory_mode="sdpa"), dict(base, compiled=True, memory_mode="fastest"),
            dict(base, frames=49, ok=False), {"gpu": "H200"}]
    p = tmp_path / "rows.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n# built a14b\n")
    assert forward_peaks.done_rows(str(p)) == {("a14b", "bf16", "sage", None, False, 832, 480, 81),
                                             ("a14b", "bf16", "sage", "sdpa", False, 832, 480, 81),
                                             ("a14b", "bf16", "sage", "fastest", True, 832, 480, 81)}


def test_grouped_mode_runs_the_formula_leaves_ungrouped_are_covered_by_the_fastest_run():
    from bench import forward_peaks
    plan = forward_peaks.plan_rows(["a14b", "1.3b"], ["bf16"], ["sage"], ["sdpa", "fastest"],
                                 lambda m: [(832, 480, 17), (1280, 720, 81)])
    kept, dropped = forward_peaks.same_as_ungrouped(plan, 90)
    # sm90 at 832x480x17: one group for both models; at 720p81 A14B splits into 7 groups, 1.3B into 2
    assert {(r["model"], r["size"]) for r in dropped} == {("a14b", (832, 480, 17)), ("1.3b", (832, 480, 17))}
    assert all(r["memory_mode"] == "sdpa" for r in dropped) and len(kept) == len(plan) - 2
    # without the fastest run of the same size, the grouped-mode run stays
    only_sdpa = [r for r in plan if r["memory_mode"] == "sdpa"]
    assert forward_peaks.same_as_ungrouped(only_sdpa, 90) == (only_sdpa, [])
    # an arch no kernel runs on: nothing is dropped
    assert forward_peaks.same_as_ungrouped(plan, 70) == (plan, [])


def test_dynamo_reasons_name_files_without_the_machines_part():
    """Recompile and graph-break reasons go into committed records: an absolute path in dynamo's message
    is cut to the part a reader can find (from ComfyUI's package, site-packages or this checkout), and a
    relative path or a guard such as ``0/0`` stays as it is."""
    from bench import _compile
    from bench._paths import ROOT
    msg = (f"Recompiling function forward in /srv/x/.host/ComfyUI/comfy/ldm/wan/model.py:211\n"
           f"triggered by /venv/lib/python3.12/site-packages/torch/_dynamo/guards.py and {ROOT}/attention/op.py; "
           "0/0: comfy/ldm/wan/model.py")
    assert _compile._short(msg, 400) == ("Recompiling function forward in comfy/ldm/wan/model.py:211 | triggered by "
                                         "torch/_dynamo/guards.py and attention/op.py; 0/0: comfy/ldm/wan/model.py")
    for kept in ("see https://pytorch.org/docs/stable/torch.compiler_troubleshooting.html", "file:///tmp/a/b.py",
                 "Eq((s0 + 1)//2, 45)", "x.size()[0]/s0/s1", "x // 2", "GiB/s", "[0/1] guard"):
        assert _compile._short(kept, 400) == kept


def _recompile_message(*failures):
    head = "Recompiling function forward in comfy/ldm/wan/model.py:211\n    triggered by the following guard failure(s):\n"
    stack = ("    - User stack trace:\n    -   File \"comfy/ldm/wan/model.py\", line 244, in forward\n"
             "    -     y = self.ffn(torch.addcmul(repeat_e(e[3], x), self.norm2(x), 1 + repeat_e(e[4], x)))\n")
    return head + "".join(f"    - 0/{i}: {f}  # out = comfy.lora.calculate_weight(...)\n" + stack
                          for i, f in enumerate(failures))


def test_guard_causes_leave_out_the_entries_of_other_blocks_and_fold_block_numbers():
    """A block's first compile fails only on other blocks' LoRA keys; a block whose own earlier graph
    missed shows why, once per recompile, whatever the block number."""
    from bench import _compile

    class Watch(_compile.DynamoWatch):
        def __init__(self, messages):
            self.recompiles = list(messages)
    key = "self._modules['ffn']._modules['2'].weight_function[0].key == 'diffusion_model.blocks.{}.ffn.2.weight'"
    own = "___check_obj_id(self._modules['ffn']._modules['2'].weight_function[0].patches, {})"
    first = [_recompile_message(key.format(0)), _recompile_message(key.format(0), key.format(1))]
    second = [_recompile_message(key.format(0), key.format(1), own.format(11)),
              _recompile_message(own.format(12), key.format(1), own.format(13))]
    w = Watch(first + second)
    assert w.guard_causes(0, 2) == {"first graph of this block": 2}
    folded = "___check_obj_id(self._modules['ffn']._modules['2'].weight_function[i].patches, 11)"
    assert w.guard_causes(2) == {folded: 1, folded.replace("11", "12"): 1, folded.replace("11", "13"): 1}
    assert w.guard_causes() == {"first graph of this block": 2, **w.guard_causes(2)}
    assert _compile.fold_guard("0/3: len(self._modules['ffn']._modules['0'].weight_function) == 1  # has_function") == \
        "len(self._modules['ffn']._modules['0'].weight_function) == 1"
    assert _compile.fold_guard("0/3: x.key == 'diffusion_model.blocks.7.ffn.0.weight'") == \
        "x.key == 'diffusion_model.blocks.N.ffn.0.weight'"


def test_the_dynamo_delta_subtracts_phase_seconds_and_cache_counts_key_by_key():
    before = {"compile_s": 1.0, "recompiles": 0, "phases": {"s:a": 1.0, "n:inductor.fxgraph_cache_hit": 2.0}}
    after = {"compile_s": 4.5, "recompiles": 1, "phases": {"s:a": 3.25, "s:b": 0.5, "n:inductor.fxgraph_cache_hit": 2.0,
                                                            "n:inductor.fxgraph_cache_miss": 1.0}}
    assert _compile.DynamoWatch.delta(after, before) == {
        "compile_s": 3.5, "recompiles": 1,
        "phases": {"s:a": 2.25, "s:b": 0.5, "n:inductor.fxgraph_cache_miss": 1.0}}  # unchanged keys left out


def test_the_phases_name_dynamos_timers_and_the_compile_caches_counters():
    import torch
    import torch._dynamo
    torch._dynamo.reset()
    watch = _compile.DynamoWatch(torch)
    try:
        before = watch.reading()
        torch.compile(lambda x: torch.sin(x) * 2, backend="eager")(torch.ones(3))
        got = watch.delta(watch.reading(), before)["phases"]
    finally:
        watch.close()
        torch._dynamo.reset()
    assert got.get("s:_compile.compile_inner", 0) > 0
    assert all(k.startswith(("s:", "n:")) for k in got)
