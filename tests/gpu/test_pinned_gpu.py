"""gpu tier: the weights a partial load leaves streaming are page-locked for real (``cudaHostRegister``), a layer
streamed from them gives the same output bit for bit, and the Working-Memory Estimator's clone of a Wan model,
partly loaded by ComfyUI 0.3.64, runs the same forward as the stock model partly loaded alike.  Dropping the
weights unregisters their buffers."""
import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
import comfy_env  # noqa: E402

if comfy_env.skip_reason():
    pytest.skip(f"gpu tier pinned weights: {comfy_env.skip_reason()}", allow_module_level=True)

from wan_sage.nodes import pinned_host  # noqa: E402

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture(scope="module")
def comfy():
    from bench import _host
    _host.ensure_av(allow_stub=True)
    return comfy_env.boot(cpu=False, attention="pytorch")


def test_a_streamed_layer_reads_page_locked_weights_and_gives_the_same_output(comfy):
    layer = comfy.ops.disable_weight_init.Linear(2048, 2048, dtype=torch.bfloat16, device=CPU)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.comfy_cast_weights = True
    holder = torch.nn.Sequential(layer)
    x = torch.randn(64, 2048, dtype=torch.bfloat16, device=CUDA)
    pinned_host.wait()
    gc.collect()  # buffers of models earlier tests dropped go now, not while this one counts
    start = pinned_host.pinned_bytes()
    with torch.inference_mode():
        before = layer(x)
        assert not layer.weight.is_pinned()
        done = pinned_host.pin_streamed(SimpleNamespace(model=holder, load_device=CUDA, offload_device=CPU))
        assert done >= 2048 * 2048 * 2 and layer.weight.is_pinned() and layer.bias.is_pinned()
        after = layer(x)
    assert torch.equal(before, after)
    del holder, layer
    gc.collect()
    assert pinned_host.pinned_bytes() == start


def _forward(patcher, x, t, context):
    with torch.inference_mode():
        return patcher.model.diffusion_model(x, t, context, transformer_options={}).float().cpu()


def test_the_estimators_partly_loaded_clone_streams_pinned_and_runs_the_same_forward(comfy):
    from wan_sage.nodes.estimator import Settings, apply_estimator
    comfy.model_management.unload_all_models()
    base = comfy_env.tiny_wan_patcher(dim=512, ffn_dim=1024, num_layers=2, dtype=torch.bfloat16)
    latent = comfy_env.empty_wan_latent(base)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tuple(latent.shape), generator=g).to(CUDA, torch.bfloat16)
    context = (0.1 * torch.randn(1, 512, base.model.diffusion_model.text_dim, generator=g)).to(CUDA, torch.bfloat16)
    t = torch.tensor([500.0], device=CUDA)
    budget = 4 << 20  # a few MiB: most modules stream
    stock = base.clone()
    stock.load(CUDA, lowvram_model_memory=budget)
    want = _forward(stock, x, t, context)
    streamed = [m for m in stock.model.modules() if getattr(m, "comfy_cast_weights", False)]
    assert streamed and not any(p.is_pinned() for m in streamed for p in m.parameters(recurse=False))
    stock.unpatch_model(CPU)
    m, _, text = apply_estimator(base, Settings(), list(latent.shape))
    assert "page-locked memory after each load" in text
    start = pinned_host.pinned_bytes()
    m.load(CUDA, lowvram_model_memory=budget)
    pinned = [m_ for m_ in m.model.modules() if getattr(m_, "comfy_cast_weights", False)
              and all(p.device == CPU for p in m_.parameters(recurse=False))]
    assert pinned and all(p.is_pinned() for mod in pinned for p in mod.parameters(recurse=False))
    assert pinned_host.pinned_bytes() > start
    assert torch.equal(_forward(m, x, t, context), want)
    m.unpatch_model(CPU)
