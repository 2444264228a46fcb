"""gpu tier: Wan Compile Blocks' fp8 matmuls (nodes/fp8_matmul.py) on the GPU.

* A real Wan A14B block (dim 5120, ffn 13824, random weights, ComfyUI's ops) at 1280x720x81 (75,600 tokens),
  compiled with the node's arguments, with and without the fp8 mode: the block's update (its output less its
  input) within the bound the pack holds Sage's kernels to, with an outlier channel in the input too; its peak
  above the block's input within the bf16 graph's peak plus what the estimator adds for the fp8 copies; and the
  per-call times, printed (a benchmark's figure, not asserted here).
* A partly loaded ComfyUI-GGUF expert with its LoRA under the node with ``fp8_matmuls``: its streamed blocks lifted
  into the one graph, in fp8, near the node's bf16 sampling, no recompile on the second sampling.
Skips, with its reason, without fp8 tensor cores, ComfyUI or ComfyUI-GGUF."""
import gc
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
    pytest.skip(f"gpu tier fp8 matmuls: {comfy_env.skip_reason()}", allow_module_level=True)

from wan_sage.attention import accuracy  # noqa: E402
from wan_sage.memory import activation_model  # noqa: E402
from wan_sage.nodes import compile_blocks, fp8_matmul  # noqa: E402

OK, WHY = fp8_matmul.available(torch.device("cuda", torch.cuda.current_device()))
LATENT_720P81 = (1, 16, 21, 90, 160)  # 1280x720, 81 frames -> 21 x 45 x 80 = 75,600 tokens


def test_a_gpu_with_fp8_tensor_cores_runs_them_and_one_without_says_why():
    cap = torch.cuda.get_device_capability()
    if cap >= fp8_matmul.MIN_CAPABILITY:
        assert OK, WHY
    else:
        assert not OK and "fp8 tensor cores" in WHY


@pytest.fixture(scope="module")
def comfy():
    from bench import _host
    _host.ensure_av(allow_stub=True)  # ComfyUI 0.3.64's nodes import PyAV; no video I/O here
    return comfy_env.boot(cpu=False, attention="pytorch")


def _update_error(out, ref, x):
    """(relative L2, cosine) of the block's update ``out - x`` against ``ref - x``."""
    a, b = (out.float() - x.float()).flatten(), (ref.float() - x.float()).flatten()
    rel = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return rel, cos


def _peak_and_ms(fn):
    """(the call's output, its peak allocation above what was allocated before it, its median time in ms)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return out, peak, sorted(times)[1]


@pytest.mark.skipif(not OK, reason=f"no fp8 matmuls on this GPU: {WHY}")
def test_a_compiled_a14b_block_at_720p81_multiplies_in_fp8_within_the_bound_and_the_plan(comfy):
    torch._dynamo.reset()
    model, block, args, kwargs = comfy_env.a14b_block_and_inputs(comfy, LATENT_720P81)
    kw = compile_blocks.compile_kwargs()
    compiled = torch.compile(block, **kw)
    x = args[0]
    tokens = x.shape[0] * x.shape[1]
    results = {}
    try:
        with torch.no_grad():
            for name, outlier in (("plain", False), ("outlier", True)):
                if outlier:  # a few channels 50x the rest, as Wan's activations have
                    x2 = x.clone()
                    x2[..., ::640] *= 50
                    args = (x2,) + tuple(args[1:])
                xin = args[0]
                compiled(*args, **kwargs)  # compiles (the first time) and settles
                with fp8_matmul.Fp8Linears():
                    compiled(*args, **kwargs)
                ref, peak_bf16, ms_bf16 = _peak_and_ms(lambda: compiled(*args, **kwargs))

                def fp8_call():
                    with fp8_matmul.Fp8Linears():
                        return compiled(*args, **kwargs)
                got, peak_fp8, ms_fp8 = _peak_and_ms(fp8_call)
                rel, cos = _update_error(got, ref, xin)
                results[name] = dict(rel=rel, cos=cos, peak_bf16=peak_bf16, peak_fp8=peak_fp8, ms_bf16=ms_bf16,
                                     ms_fp8=ms_fp8, finite=bool(torch.isfinite(got).all()))
                del ref, got
    finally:
        del model, block, args, kwargs, compiled
        gc.collect()
        torch.cuda.empty_cache()
        torch._dynamo.reset()
    dims = activation_model.PRESETS["wan2.2-a14b"]
    term = (activation_model.weight_transient(dims, activation_model.WeightSetup(rowwise_fp8=True), "bf16", tokens)
            - activation_model.weight_transient(dims, activation_model.WeightSetup(), "bf16", tokens))
    for name, r in results.items():
        print(f"\nA14B block 1280x720x81, {name} input: update rel-L2 {r['rel']:.4f} cos {r['cos']:.5f}; peak above "
              f"the input bf16 {r['peak_bf16'] / 2**30:.2f} GiB, fp8 {r['peak_fp8'] / 2**30:.2f} GiB (planned "
              f"+{term / 2**30:.2f}); per call bf16 {r['ms_bf16']:.1f} ms, fp8 {r['ms_fp8']:.1f} ms "
              f"({r['ms_bf16'] / r['ms_fp8']:.2f}x)")
        assert r["finite"]
        assert r["rel"] <= accuracy.MAX_REL_L2 and r["cos"] >= accuracy.MIN_COSINE, r
        assert r["peak_fp8"] <= r["peak_bf16"] + term, r


@pytest.fixture
def partial_load(comfy, monkeypatch):
    """ComfyUI's model load with the budget at a quarter of the model's size (its lowvram path streams the rest)."""
    mm = comfy.model_management
    load = mm.LoadedModel.model_load

    def quarter(self, lowvram_model_memory=0, force_patch_weights=False):
        return load(self, max(1, self.model.model_size() // 4), force_patch_weights)
    monkeypatch.setattr(mm.LoadedModel, "model_load", quarter)


@pytest.mark.skipif(not OK, reason=f"no fp8 matmuls on this GPU: {WHY}")
def test_a_partly_loaded_gguf_expert_samples_in_fp8_through_the_node(comfy, tmp_path, partial_load, monkeypatch):
    from torch._dynamo.utils import counters
    from wan_sage.nodes import comfy_bridge, streamed_record
    reason = workflow_check.gguf_skip_reason()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("gguf", reason="the gguf package (ComfyUI-GGUF's dependency) is not installed")
    monkeypatch.setenv(comfy_bridge.CACHE_ENV, str(tmp_path / "pack-cache"))
    monkeypatch.setattr(streamed_record, "_read", {})
    mm = comfy.model_management
    out = {}
    with torch.inference_mode():
        base = comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tmp_path)
        for fp8 in (False, True):
            mm.unload_all_models()
            torch._dynamo.reset()
            counters.clear()
            c, text = compile_blocks.apply_compile_blocks(base, "inductor", "default", fp8)
            first = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
            graphs = counters["stats"].get("unique_graphs", 0)
            second = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
            recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
            out[fp8] = dict(first=first, second=second, graphs=graphs, recompiles=recompiles,
                            ran=compile_blocks.blocks_ran(c), lowvram=bool(c.model.model_lowvram))
        mm.unload_all_models()
    bf16, f8 = out[False], out[True]
    assert f8["lowvram"] and f8["ran"].blocks["eager"] == 0 and f8["ran"].blocks["lifted"] >= 1, f8["ran"]
    assert f8["graphs"] == bf16["graphs"] == 1 and f8["recompiles"] == 0
    a, b = bf16["first"].float(), f8["first"].float()
    rel = float((b - a).norm() / a.norm())
    print(f"\ntiny GGUF expert, 2 steps: fp8 latent against bf16 rel-L2 {rel:.4f}")
    assert torch.isfinite(b).all() and not torch.equal(a, b) and rel < 0.1
    torch.testing.assert_close(f8["second"], f8["first"])
