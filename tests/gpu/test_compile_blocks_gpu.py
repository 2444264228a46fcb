"""gpu tier: Wan Compile Blocks on a model ComfyUI 0.3.64 loads in part onto the GPU, so that every block streams
some of its weights from the host.  With streamed blocks compiled around their eager layers (the node's default)
the latent is eager's within compile's rounding, the blocks of the model share the graphs, and a second prompt
compiles nothing; with streamed blocks eager nothing is compiled at all.  A bf16 model with a LoRA, and a GGUF one
with its LoRA (ComfyUI-GGUF in COMFYUI_GGUF_PATH); each skips, with its reason, without what it needs."""
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

LAYERS = 3


@pytest.fixture(scope="module")
def comfy():
    from bench import _host
    _host.ensure_av(allow_stub=True)  # ComfyUI 0.3.64's nodes import PyAV; no video I/O here
    return comfy_env.boot(cpu=False, attention="pytorch")


def _model(comfy, kind, tmp_path):
    if kind == "gguf":
        reason = workflow_check.gguf_skip_reason()
        if reason:
            pytest.skip(reason)
        pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
        return comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path)
    base = comfy_env.tiny_wan_patcher(dim=512, ffn_dim=1024, num_layers=LAYERS, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    patches = {}
    for k, w in base.model.named_parameters():
        if k.startswith("diffusion_model.blocks.") and w.ndim == 2:
            patches[k] = ("diff", (0.01 * torch.randn(w.shape, generator=g, dtype=w.dtype),))
    base.add_patches(patches, 1.0)
    return base


@pytest.fixture
def part_loaded(comfy, monkeypatch):
    """ComfyUI's model load with the budget at a third of the model's size: its lowvram path streams the rest."""
    mm = comfy.model_management
    load = mm.LoadedModel.model_load

    def partial_load(self, lowvram_model_memory=0, force_patch_weights=False):
        return load(self, max(1, self.model.model_size() // 3), force_patch_weights)
    monkeypatch.setattr(mm.LoadedModel, "model_load", partial_load)
    yield mm
    mm.unload_all_models()


def _counts():
    from torch._dynamo.utils import counters
    return (counters["stats"].get("unique_graphs", 0), sum(counters["recompiles"].values()),
            sum(counters["graph_break"].values()))


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("kind", ["bf16", "gguf"])
def test_streamed_blocks_compiled_around_their_layers_sample_as_eager_and_share_their_graphs(comfy, part_loaded,
                                                                                             kind, tmp_path):
    from torch._dynamo.utils import counters
    from wan_sage.nodes import compile_blocks
    mm = part_loaded
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        base = _model(comfy, kind, tmp_path)
        eager = comfy_env.sample_tiny(base, steps=2, seed=0)
        mm.unload_all_models()
        c, text = compile_blocks.apply_compile_blocks(base)
        first = comfy_env.sample_tiny(c, steps=2, seed=0)
        resident, blocks = compile_blocks.count_resident_blocks(c)
        graphs, recompiles, breaks = _counts()
        again = comfy_env.sample_tiny(c, steps=2, seed=1)
        graphs_again, recompiles_again, _ = _counts()
    assert c.model.model_lowvram and resident < blocks and blocks >= 2, (resident, blocks)
    assert "the layers run eagerly" in text
    assert torch.isfinite(first).all() and torch.isfinite(again).all()
    assert rel_l2(first, eager) <= 0.02, rel_l2(first, eager)
    # the graphs between the layers: compiled once for every block (a block that traced differently would
    # recompile the block's code); the second prompt compiles nothing
    assert graphs >= 1 and breaks > 0 and recompiles == 0, (graphs, recompiles, breaks)
    assert (graphs_again, recompiles_again) == (graphs, 0)


def test_streamed_blocks_eager_compile_nothing(comfy, part_loaded, tmp_path):
    from torch._dynamo.utils import counters
    from wan_sage.nodes import compile_blocks
    mm = part_loaded
    torch._dynamo.reset()
    counters.clear()
    with torch.inference_mode():
        base = _model(comfy, "bf16", tmp_path)
        eager = comfy_env.sample_tiny(base, steps=2, seed=0)
        mm.unload_all_models()
        c, _text = compile_blocks.apply_compile_blocks(base, streamed=compile_blocks.STREAMED_EAGER)
        latent = comfy_env.sample_tiny(c, steps=2, seed=0)
    assert c.model.model_lowvram and _counts()[0] == 0
    assert torch.equal(latent, eager)
