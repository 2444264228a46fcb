"""Host tier: the compile table (``python -m bench.compile_table``) on the CPU through real ComfyUI, with the
tiny Wan model and dynamo's eager backend: an eager and a compiled configuration, and fullgraph."""
import json

import pytest

from bench import _host

comfy_env = _host.comfy_env()
if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)


def _run(args, tmp_path, timeout=600):
    return _host.run_tool("compile_table", ["--cpu", "--model", "tiny", "--size", "64x64x5", "--backend", "eager", *args],
                          timeout)


def _has_memory_mode():
    return _host.has_memory_mode()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile_table")
    out = tmp / "table.jsonl"
    p, rows = _run(["--configs", "eager-sdpa,compile-sage-ungrouped,compile-sdpa-fullgraph", "--out", str(out)], tmp)
    assert p.returncode == 0, p.stderr[-4000:]
    return rows, out, tmp, p.stderr


def test_eager_and_compiled_rows(table):
    rows, out, _, _ = table
    assert [r["config"] for r in rows] == ["eager-sdpa", "compile-sage-ungrouped", "compile-sdpa-fullgraph"]
    assert [json.loads(x)["config"] for x in out.read_text().splitlines()] == [r["config"] for r in rows]
    for r in rows:
        assert r["schema"] == "wan-sage-compile/1" and r["ok"], r["error"]
        assert (r["model"], r["size"], r["tokens"], r["steps"], r["repeats"]) == ("tiny", "64x64x5", 32, 2, 2)
        assert r["s_per_forward"] > 0 and r["peak_gib"] is None            # the CPU: no memory readings
        assert len(r["runs"]) == 2 and all(len(run["forwards"]) == 2 for run in r["runs"])
        assert r["env"]["optimized_attention"] == "attention_pytorch"       # sub-quadratic attention is not traceable
    eager, sage, full = rows
    assert not eager["compiled"] and eager["compile"] is None and eager["x_eager_sdpa"] == 1.0
    assert eager["dynamo"]["unique_graphs"] == 0 and eager["sage"] is None
    # compiled per block through ComfyUI's wrapper; the first forward compiles, later ones reuse the graphs
    assert sage["compiled"] and sage["compile"]["blocks"] == 2 and sage["compile"]["backend"] == "eager"
    assert sage["memory_mode"] == "fastest" and sage["attention"] == "sage"
    assert sage["dynamo"]["unique_graphs"] >= 1 and sage["runs"][0]["forwards"][0]["graphs_compiled"] >= 1
    assert all(f["graphs_compiled"] == 0 for f in sage["runs"][1]["forwards"])
    # on the CPU the patch hands every call to SDPA statically; compiled, those calls are part of the
    # graph and are not counted (only calls that reach the custom op are)
    assert sage["sage"]["sage_calls"] == 0 and sage["sage"]["sdpa_calls"] == 0 and sage["sage"]["reasons"] == {}
    assert sage["x_eager_sdpa"] > 0 and sage["compile_s_wall"] is not None
    assert full["fullgraph"] and full["dynamo"]["graph_breaks"] == 0 and full["dynamo"]["unique_graphs"] >= 1


def test_skip_done_and_a_fullgraph_failure_is_a_record(table):
    _, out, tmp, _ = table
    p, rows = _run(["--configs", "eager-sdpa,compile-sage-fullgraph", "--skip-done", str(out)], tmp)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "eager-sdpa already recorded, skipped" in p.stderr
    (r,) = rows
    assert r["config"] == "compile-sage-fullgraph" and r["memory_mode"] is None
    if not r["ok"]:            # the patch breaks the graph (today's dispatch): the error is recorded, nothing raised
        assert r["error"].startswith(("Unsupported", "UserError", "torch._dynamo")), r["error"]


def test_deadline_starts_no_configuration_that_could_end_after_it(table):
    _, _, tmp, _ = table
    p, rows = _run(["--configs", "eager-sdpa,compile-sdpa", "--deadline-s", "0"], tmp)
    assert p.returncode == 0, p.stderr[-4000:]
    assert [(r["config"], r["ok"], r.get("skipped")) for r in rows] == [("eager-sdpa", False, True),
                                                                        ("compile-sdpa", False, True)]


def test_grouped_mode_needs_the_memory_mode_field(table):
    _, _, tmp, _ = table
    p, rows = _run(["--configs", "eager-sage-grouped"], tmp)
    if _has_memory_mode():
        assert p.returncode == 0 and rows[0]["ok"] and rows[0]["memory_mode"] == "sdpa", p.stderr[-2000:]
    else:
        assert p.returncode != 0 and not rows
        assert "no memory_mode field" in p.stderr and "sdpa" in p.stderr
