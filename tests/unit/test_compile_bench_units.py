"""Unit tier: the pure parts of the compile harness (no ComfyUI): configuration names, the deadline's
estimates, resuming from records, the held-out size set and the memory mode passed to PatchConfig."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import _host  # noqa: E402
import compile_table  # noqa: E402


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
