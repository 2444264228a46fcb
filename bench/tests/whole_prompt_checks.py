"""Checks the host-tier whole-prompt tests share (imported as ``bench.tests.whole_prompt_checks``: bench/tests/
conftest.py loads ``bench`` as a package; pytest collects only ``test_*.py``): the record of a process that ran a
first and a repeat prompt, and the pack's saved templates run in their three variants (``bench.workflow_variants``)
at tiny scale on the CPU."""
import os
from pathlib import Path

import pytest

from bench import _host

ROOT = Path(__file__).resolve().parents[2]
PACK = {"WanTextEncoderHostCopy", "WanWorkingMemoryEstimator", "WanSageAttentionPatch"}
COMPILE_NODE = "WanCompileBlocks"
VARIANTS = ("template", "comfy", "compilenode")
SIZE = "full:64x64x5:2steps"


def prompts_ran(r) -> tuple:
    """(first, repeat) of a whole-prompt record whose two prompts completed, each with its own seed."""
    assert r["schema"] == "wan-sage-whole-prompt/1" and r["status"] == "ok", r.get("error")
    first, repeat = r["prompts"]
    assert (first["prompt"], repeat["prompt"]) == ("first", "repeat")
    assert all(p["status"] == "ok" and p["error"] is None for p in r["prompts"])
    assert first["seed"] != repeat["seed"]
    return first, repeat


def host_gguf_or_skip() -> Path:
    """ComfyUI-GGUF's folder (``COMFYUI_GGUF_PATH``, else beside ComfyUI), skipping the calling module with the
    reason where the host tier, ComfyUI-GGUF or its ``gguf`` package is missing: a whole-prompt process loads
    ComfyUI-GGUF as a custom node."""
    comfy_env = _host.comfy_env()
    if comfy_env.skip_reason():
        pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)
    gguf = Path(os.path.realpath(os.environ.get("COMFYUI_GGUF_PATH")
                                 or os.path.join(comfy_env.comfy_path(), os.pardir, "ComfyUI-GGUF")))
    if not (gguf / "nodes.py").is_file():
        pytest.skip(f"host tier: ComfyUI-GGUF not found at {gguf} (set COMFYUI_GGUF_PATH)", allow_module_level=True)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    return gguf


def saved_workflow_or_skip(name: str) -> tuple:
    """(the saved workflow ``example_workflows/NAME``, ComfyUI-GGUF's folder), skipping the calling module with the
    reason where the host tier or either of them is missing (:func:`host_gguf_or_skip`)."""
    gguf = host_gguf_or_skip()
    template = ROOT / "example_workflows" / name
    if not template.is_file():
        pytest.skip(f"example_workflows/{name} is not in this checkout", allow_module_level=True)
    return template, gguf


def run_variants(tmp: Path, template: Path, gguf: Path, *extra) -> tuple:
    """({variant: record}, the driver's stderr): the template's three variants at :data:`SIZE`, tiny scale, caches
    empty, Wan Compile Blocks on the eager backend, each in a fresh process of ``python -m bench.whole_prompt``."""
    runs = ",".join(f"{v}@{SIZE}" for v in VARIANTS)
    p, rows = _host.run_tool("whole_prompt", ["--runs", runs, "--caches", "none", "--workflow", template,
                                              "--compile-backend", "eager", "--out", tmp / "records.jsonl",
                                              "--log", tmp / "processes.log", "--models-dir", tmp / "models",
                                              "--scale", "tiny", "--quiet", "--av-stub", *extra],
                             1500, COMFYUI_GGUF_PATH=str(gguf))
    assert p.returncode == 0, p.stderr[-4000:]
    return {r["config"]["variant"]: r for r in rows}, p.stderr


def of_type(p, node_type: str) -> str:
    """The id of a prompt's one node of that type."""
    (k,) = [k for k, t in p["node_types"].items() if t == node_type]
    return k


def variant_prompts_ok(r, served: set) -> tuple:
    """(first, repeat) of a saved template's variant at :data:`SIZE`: both prompts decoded finite frames after two
    sampler steps; the repeat (a new seed) was served ``served`` (node types) from ComfyUI's cache, and ran the
    sampler and the decode again."""
    first, repeat = prompts_ran(r)
    for p in r["prompts"]:
        assert p["latent_finite"] is True and p["decoded"] == [5, 64, 64, 3]
        assert p["to_frames_s"] > p["to_latent_s"] > 0
        ks = of_type(p, "KSampler")
        assert set(p["experts"]) == set(p["first_step_s"]) == {ks}
        assert len(p["experts"][ks]["step_s"]) == 2 and all(s > 0 for s in p["experts"][ks]["step_s"])
        # each node that ran has its seconds; the sampler's hold its steps, the nodes lie within the prompt
        assert ks in p["node_s"] and p["node_s"][ks] >= sum(p["experts"][ks]["step_s"]) - 1e-3
        assert set(p["node_s"]) <= set(p["node_types"]) and sum(p["node_s"].values()) <= p["run_s"] + 0.01
    assert first["reused"] == []
    reused = {repeat["node_types"][k] for k in repeat["reused"]}
    assert served <= reused, served - reused
    assert not reused & {"KSampler", "VAEDecode"}
    return first, repeat


def pack_nodes_by_variant(recs, sdpa_calls: int) -> None:
    """The pack's nodes are in the template and in compilenode (with Wan Compile Blocks) and out of stock ComfyUI;
    the Sage patch on the CPU ran its ``sdpa_calls`` calls of the first prompt on SDPA."""
    for variant, want in (("template", PACK), ("comfy", set()), ("compilenode", PACK | {COMPILE_NODE})):
        r = recs[variant]
        assert set(r["config"]["pack_nodes"]) == want
        for p in r["prompts"]:
            assert set(p["node_types"].values()) & (PACK | {COMPILE_NODE}) == want
    assert all(p["experts"][k]["attention"] is None for p in recs["comfy"]["prompts"] for k in p["experts"])
    sage = recs["template"]["prompts"][0]["by_expert"]
    assert [x["sdpa_calls"] for x in sage.values()] == [sdpa_calls]


def compile_blocks_ran_once(recs, err: str) -> None:
    """compilenode: Wan Compile Blocks (eager backend) ran both blocks compiled in each prompt, its model was served
    from the cache on the repeat, which compiled nothing; the harness logged the node's count."""
    r = recs["compilenode"]
    assert r["config"]["compile"]["backend"] == "eager"
    first, repeat = r["prompts"]
    node = of_type(first, COMPILE_NODE)
    assert node in repeat["reused"]
    for p in (first, repeat):
        ran = p["compile"]["blocks_ran"][node]
        assert ran["blocks"]["resident"] == 2 and ran["blocks"]["eager"] == 0 and ran["why"] == {}, ran
    assert first["compile"]["unique_graphs"] >= 1 and repeat["compile"]["unique_graphs"] == 0
    assert repeat["compile"]["recompiles"] == 0
    assert "e2e compile blocks node" in err
