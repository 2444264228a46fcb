"""Host tier: the forward-peak tool (``python -m bench.forward_peaks``) on the CPU through real ComfyUI
with the tiny Wan model: eager and per-block compiled rows carry what the prediction needs."""
import pytest

from bench import _host

comfy_env = _host.comfy_env()
if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)


def _run(args, tmp_path, timeout=600):
    p, rows = _host.run_tool("forward_peaks", ["--cpu", "--models", "tiny", "--dtypes", "bf16", "--size", "64x64x5", *args],
                             timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return [r for r in rows if "model" in r], p.stdout


def test_eager_and_compiled_rows_carry_what_the_prediction_needs(tmp_path):
    out = tmp_path / "rows.jsonl"
    eager, text = _run(["--attn", "sdpa,sage", "--out", str(out)], tmp_path)
    assert "# estimate total" in text
    compiled, _ = _run(["--attn", "sdpa,sage", "--memory-modes", "fastest", "--compile", "--backend", "eager",
                        "--out", str(out), "--skip-done", str(out)], tmp_path)
    again, _ = _run(["--attn", "sdpa", "--out", str(out), "--skip-done", str(out)], tmp_path)
    assert again == []                                   # already recorded: skipped
    assert len(out.read_text().splitlines()) == 4
    for r in eager + compiled:
        # the fields of the fitted table, unchanged
        assert {"model", "dtype", "attn", "width", "height", "frames", "tokens", "ok", "measured", "predicted",
                "phase", "model_no_slack", "comfy", "sec", "sage"} <= set(r)
        assert r["ok"] and r["measured"] is None and r["predicted"] > 0 and r["tokens"] == 32
        assert r["dims"]["dim"] == 256 and r["latent"] == [1, 16, 2, 8, 8] and r["vae_stride"] == [4, 8, 8]
        assert r["self_attn_path"] == "sdpa" and r["cross_attn_path"] == "sdpa"   # the CPU: no Sage call
        assert r["sizeset"] == "custom" and r["weights_bytes"] > 0
    assert [(r["attn"], r["memory_mode"], r["compiled"]) for r in eager] == [("sdpa", None, False), ("sage", None, False)]
    assert [(r["attn"], r["memory_mode"], r["compiled"]) for r in compiled] == [("sdpa", None, True), ("sage", "fastest", True)]
    for r in compiled:
        assert r["compile"]["blocks"] == 2 and r["error"] is None
        # the first run compiles, the measured one reuses the graphs
        assert r["dynamo"]["compile"]["unique_graphs"] >= 1 and r["dynamo"]["measure"]["unique_graphs"] == 0
    assert compiled[1]["sage"]["reasons"] == {}  # static CPU declines are part of the compiled graph, not counted
