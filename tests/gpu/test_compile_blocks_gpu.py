"""gpu tier: Wan Compile Blocks on experts that ComfyUI 0.3.64 loads in part onto the GPU, where a block's weights
really sit on the host.  A ComfyUI-GGUF expert with its LoRA: every block runs the resident block's graph (its streamed
quantized layers and its own ``modulation`` lifted onto the GPU for the call), one graph in all.  A bf16 expert with a
LoRA on every Linear (ComfyUI patches a streamed one at each call): its streamed blocks run the staged graph.  Both
sample as eagerly within inductor's rounding, a second sampling compiles nothing, and the model after a restart
plans its streamed blocks from the path the pack kept.  Each skips, with its reason,
without ComfyUI-GGUF."""
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
import comfy_env  # noqa: E402
import workflow_check  # noqa: E402

if comfy_env.skip_reason():
    pytest.skip(f"gpu tier compile blocks: {comfy_env.skip_reason()}", allow_module_level=True)


@pytest.fixture(scope="module")
def comfy():
    from bench import _host
    _host.ensure_av(allow_stub=True)  # ComfyUI 0.3.64's nodes import PyAV; no video I/O here
    return comfy_env.boot(cpu=False, attention="pytorch")


def _expert(comfy, kind, tmp_path):
    if kind == "gguf":
        reason = workflow_check.gguf_skip_reason()
        if reason:
            pytest.skip(reason)
        pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
        return comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path)
    base = comfy_env.tiny_wan_patcher(dim=512, ffn_dim=1024, num_layers=2, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    patches = {}
    for key, w in base.model.state_dict().items():
        if key.startswith("diffusion_model.blocks.") and key.endswith(".weight") and w.ndim == 2:
            patches[key] = ("diff", ((torch.randn(w.shape, generator=g) * 0.01).to(w.dtype),))
    base.add_patches(patches, 1.0)
    return base


@pytest.fixture
def partial_load(comfy, monkeypatch):
    """ComfyUI's model load with the budget at a quarter of the model's size: its lowvram path streams the modules
    past it, as at a small budget on a real card."""
    mm = comfy.model_management
    load = mm.LoadedModel.model_load

    def quarter(self, lowvram_model_memory=0, force_patch_weights=False):
        return load(self, max(1, self.model.model_size() // 4), force_patch_weights)
    monkeypatch.setattr(mm.LoadedModel, "model_load", quarter)


@pytest.mark.parametrize("kind", ["gguf", "lora"])
def test_a_partly_loaded_expert_runs_its_streamed_blocks_compiled_without_recompiling(comfy, kind, tmp_path,
                                                                                    partial_load, monkeypatch):
    from torch._dynamo.utils import counters
    from wan_sage.nodes import comfy_bridge, compile_blocks, streamed_record
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path / "pack-cache"))
    monkeypatch.setattr(streamed_record._file, "read", {})
    mm = comfy.model_management
    with torch.inference_mode():
        base = _expert(comfy, kind, tmp_path)
        mm.unload_all_models()
        eager = comfy_env.sample_tiny(base, steps=2, cfg=1.0)
        mm.unload_all_models()
        c, _text = compile_blocks.apply_compile_blocks(base, "inductor", "default")
        torch._dynamo.reset()
        counters.clear()
        first = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
        assert c.model.model_lowvram
        blocks = c.model.diffusion_model.blocks
        device = torch.device(c.load_device)
        streamed = sum(1 for b in blocks if not compile_blocks.block_resident(b, device))
        resident_graph, staged, total = compile_blocks.count_compiled_blocks(c)
        graphs = counters["stats"].get("unique_graphs", 0)
        second = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
        recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        graphs_after = counters["stats"].get("unique_graphs", 0)
        ran = compile_blocks.blocks_ran(c)  # how the second sampling's blocks ran, as the node counted them
        mm.unload_all_models()
        # a ComfyUI restart: new stand-ins over the model as loaded from its file, the kept path read afresh
        streamed_record._file.read.clear()
        restarted, _text = compile_blocks.apply_compile_blocks(base, "inductor", "default")
        kept = compile_blocks.streamed_path(restarted)
    assert streamed >= 1, "nothing streamed: the test would not test streaming"
    assert ran.blocks["eager"] == 0 and ran.why == {}, ran
    assert kept == ("lifted" if kind == "gguf" else "staged", True), kept
    if kind == "gguf":
        assert (resident_graph, staged) == (total, 0)
        assert ran.blocks["lifted"] == streamed and ran.blocks["staged"] == 0, ran
        assert graphs == 1
    else:
        assert staged >= 1 and resident_graph + staged == total
        assert ran.blocks["staged"] == staged, ran
        assert 1 <= graphs <= 2
    assert graphs_after == graphs and recompiles == 0
    scale = max(1.0, float(eager.float().abs().max()))
    assert torch.isfinite(first).all() and float((first.float() - eager.float()).abs().max()) <= 0.05 * scale
    torch.testing.assert_close(second, first)
