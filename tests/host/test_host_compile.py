"""Host tier: the Sage patch under torch.compile in a real ComfyUI 0.3.64 on the CPU (a real tiny
WanAttentionBlock with fullgraph, ComfyUI's optimized_attention, and the TorchCompileModel
path for the whole model and per block).  The checks run in a fresh process: see compile_check.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import comfy_env

if comfy_env.skip_reason():
    pytest.skip(f"host tier: {comfy_env.skip_reason()}", allow_module_level=True)

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    env = dict(os.environ, COMFYUI_PATH=comfy_env.comfy_path(),
               WAN_SAGE_CACHE_DIR=str(tmp_path_factory.mktemp("wan-sage-cache")))  # the pack's files, this run's own
    p = subprocess.run([sys.executable, str(HERE / "compile_check.py")], capture_output=True, text=True, env=env,
                       timeout=900, check=False)
    lines = [line for line in p.stdout.splitlines() if line.startswith("REPORT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_wan_binds_sdpa_as_on_cuda(report):
    assert report["wan_attention"] == "attention_pytorch"


def test_a_real_wan_block_compiles_with_fullgraph_and_no_graph_break(report):
    block = report["block"]
    assert "error" not in block, block
    assert block["explain_graph_breaks"] == 0 and block["explain_graphs"] == 1, block["explain_reasons"]
    assert block["op_in_graph"]
    assert block["eager"]["sage_calls"] == 2 and block["eager"]["equal"]  # self- and cross-attention on the kernel
    assert block["inductor"]["sage_calls"] == 2 and block["inductor"]["max_abs_diff"] < 0.1  # bf16, fused differently


def test_comfyuis_optimized_attention_compiles_with_fullgraph(report):
    r = report["optimized_attention"]
    assert "error" not in r, r
    assert r["explain_graph_breaks"] == 0 and r["sage_calls"] == 2 and r["equal"]


@pytest.mark.parametrize("which", ["compile_model_whole", "compile_model_per_block"])
def test_torch_compile_model_path_samples_like_eager_without_graph_breaks(report, which):
    r = report[which]
    assert "error" not in r, r
    assert r["graph_breaks"] == 0, r["graph_break_reasons"]
    assert r["sage_calls"] == 8 and r["sdpa_calls"] == 0  # 2 steps x 2 blocks x (self + cross)
    assert r["equal"]


def test_the_second_expert_reuses_the_first_experts_compiled_graph(report):
    """Two Wan 2.2 experts, each patched by its own node: one compile, not one per expert (a patch id
    in the graph made the second expert recompile: 10 s per-block, minutes whole-model, on A14B)."""
    r = report["two_experts_per_block"]
    assert "error" not in r, r
    assert r["high"]["graphs"] >= 1 and r["low"]["graphs"] == r["high"]["graphs"], r
    assert r["high"]["graph_key"] == r["low"]["graph_key"]
    for e in ("high", "low"):  # 2 steps x 2 blocks x 2, on the kernel but SDPA's turns in a new shape's timing
        assert r[e]["sage_calls"] + r[e]["timing"] == r[e]["sage_calls"] + r[e]["sdpa_calls"] == 8, r
    assert r["low"]["finite"]


@pytest.mark.parametrize("which", ["two_experts_streamed_lora_part", "two_experts_streamed_lora_all"])
def test_the_second_expert_reuses_the_graphs_with_a_lora_and_streamed_weights(report, which):
    """As in the H200 end-to-end runs: a LoRA on each expert, weights partly or wholly streamed,
    the estimator and the patch on each, inference mode.  ComfyUI's LowVramPatch is guarded on by its
    weight key, so every block with a streamed LoRA module has a graph of its own; the second expert
    has the same keys and must compile nothing."""
    r = report[which]
    assert "error" not in r, r
    for e in ("high", "low"):
        assert r[e]["lowvram"] and r[e]["streamed_modules"] > 0 and r[e]["finite"], r
        assert r[e]["sage_calls"] + r[e]["timing"] == 12, r  # 2 steps x 3 blocks x (self + cross)
    assert r["high"]["graphs"] == r["blocks"], r
    assert r["low"]["graphs"] == 0, r


def test_wan_compile_blocks_runs_streamed_blocks_staged_in_one_graph_for_both_experts(report):
    """The pack's Wan Compile Blocks on two partly streamed experts with a LoRA each: ComfyUI's per-block compile
    gives every block with a streamed LoRA module a graph of its own (above); ComfyUI streams part of every block.
    Here every block runs the one staged graph (its Linears' weights, the LoRA patched in by ComfyUI's cast, handed
    to the graph as plain tensors; its streamed norms lifted): one graph for both experts, no recompile, eager's
    latent within bf16's fusion rounding."""
    r = report["compile_blocks_streamed"]
    assert "error" not in r, r
    for e in ("high", "low"):
        assert r[e]["lowvram"] and r[e]["streamed_blocks"] == r["blocks"], r
        assert r[e]["staged_blocks"] == r["blocks"] and r[e]["resident_blocks"] == 0, r
        assert r[e]["finite"] and 0 < r[e]["max_abs_diff"] <= 0.05 * max(1.0, r[e]["eager_max_abs"]), r
        assert r[e]["scope"] == ["blocks", "Wan Compile Blocks, streamed blocks staged"], r
        assert r[e]["recompiles"] == 0, r
        # the node's count of the sampling, and its log line: every block ran the staged graph, none eagerly
        assert r[e]["ran"] == {"resident": 0, "lifted": 0, "staged": r["blocks"], "eager": 0}, r
        assert r[e]["ran_calls"]["staged"] >= 2 * r["blocks"], r
        assert r[e]["ran_logged"] == [f"wan-sage: Wan Compile Blocks: {r['blocks']} of {r['blocks']} blocks ran "
                                      f"compiled (0 resident, {r['blocks']} streamed, staged)"], r
        # so the estimator plans this model's next sampling as the compiled forward with a staged block's weights
        assert r[e]["streamed_ran"] == r[e]["planned_ran"] == "staged" and r[e]["planned_staged_block"] > 0, r
        # and so does the first prompt after a restart, from the pack's file, saying so
        assert r[e]["restart_planned_ran"] == "staged", r
        assert len(r[e]["restart_notes"]) == 1 and "in an earlier sampling" in r[e]["restart_notes"][0], r
    assert r["high"]["graphs"] == 1 and r["low"]["graphs"] == 0, r


def test_wan_compile_blocks_compiles_one_graph_for_both_resident_experts(report):
    r = report["compile_blocks_resident"]
    assert "error" not in r, r
    for e in ("high", "low"):
        assert not r[e]["lowvram"] and r[e]["streamed_blocks"] == 0, r
        assert r[e]["finite"] and r[e]["max_abs_diff"] <= 0.05 * max(1.0, r[e]["eager_max_abs"]), r
        assert r[e]["recompiles"] == 0, r
        assert r[e]["ran"] == {"resident": r["blocks"], "lifted": 0, "staged": 0, "eager": 0}, r
        # the node's run compiles no block (torch.compile's imports run on their own thread); the sampling does
        assert r[e]["compiled_by_node"] == 0 and r[e]["compiled_by_sampling"] == r["blocks"], r
        assert r[e]["streamed_ran"] == r[e]["planned_ran"] == "", r  # nothing streamed: the first plan stands
        assert r[e]["restart_planned_ran"] == "" and r[e]["restart_notes"] == [], r  # and nothing was kept
    assert r["high"]["graphs"] == 1 and r["low"]["graphs"] == 0, r


def test_wan_compile_blocks_runs_the_first_prompts_graph_after_a_partial_unload_and_reload(report):
    """A Wan 2.2 repeat prompt: the other expert's load unloaded part of this one, and its reload left ComfyUI's
    cast flag in the modules' ``__dict__`` (with their class's value).  The repeat runs the first prompt's graph:
    on the H200 those flags made the repeat compile 3 graphs, 13-16 s.  They are taken off for each compiled call
    only, and are back in the shared modules after it."""
    r = report["compile_blocks_reloaded"]
    assert "error" not in r, r
    assert r["unloaded_bytes"] > 0 and r["flags_after_unload"] > 0, r
    assert r["first"]["graphs"] == 1 and r["first"]["finite"], r
    assert r["repeat"]["graphs"] == 0 and r["repeat"]["recompiles"] == 0 and r["repeat"]["finite"], r
    assert r["repeat"]["flags_in_dict"] == r["flags_after_unload"], r


@pytest.mark.parametrize("order", ["estimator_first", "compile_first"])
def test_wan_compile_blocks_keeps_cond_and_uncond_apart_where_its_first_step_ran_them_apart(report, order):
    """ComfyUI's batching test finds no room on the first step and room on the next ones.  Eagerly the model then
    sees 2 rows from the second step; under Wan Compile Blocks (with the estimator's batching wrapper outside or
    inside its own) every forward keeps the 1 row the blocks were compiled for, on the repeat prompt too, and
    nothing recompiles: on an H100 the TI2V-5B template's second step recompiled every block for 2 rows (8.5 s)."""
    r = report[f"compile_blocks_cond_rows_{order}"]
    assert "error" not in r, r
    assert r["eager"]["rows"] == [1, 1, 2, 2], r  # 3 steps: the flip the compiled model is held against
    for prompt in ("compiled", "compiled_repeat"):
        assert r[prompt]["rows"] == [1, 1, 1, 1, 1, 1] and r[prompt]["finite"], r
        assert r[prompt]["recompiles"] == 0, r
    assert r["compiled"]["graphs"] == 1 and r["compiled_repeat"]["graphs"] == 0, r
