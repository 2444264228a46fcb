"""gpu tier: a real Wan block at real dims (A14B: dim 5120, 40 heads, ffn 13824; 480p81, 32,760
tokens) built by ComfyUI, compiled with ``fullgraph=True`` with the Sage patch active: no graph
break, the custom op in the graph, compiled against eager numerics, and the memory mode's grouped
run against the ungrouped one.  Needs ``COMFYUI_PATH`` (a ComfyUI 0.3.64 tree); skips without it."""
import gc
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("gpu tier: no CUDA device (run on the GPU machine)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "host"))
import comfy_env  # noqa: E402

if comfy_env.skip_reason():
    pytest.skip(f"gpu tier compile: {comfy_env.skip_reason()} (a ComfyUI 0.3.64 tree builds the Wan block)",
                allow_module_level=True)

from wan_sage.attention import kernels, stats  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride  # noqa: E402
from wan_sage.attention.state import STATE  # noqa: E402
from wan_sage.cli.bench_kernels import peak_extra  # noqa: E402
from wan_sage.nodes.handover import Container  # noqa: E402  (0.38's AttentionTensorContainer protocol)

CC = kernels.device_cc(torch.device("cuda"))
AUTO = kernels.auto_candidates(CC)
if not AUTO:
    pytest.skip("no SageAttention / comfy-kitchen kernel for this GPU in the auto order", allow_module_level=True)
KERNEL = AUTO[0]
LATENT_480P81 = (1, 16, 21, 60, 104)  # 832x480, 81 frames -> 21 x 30 x 52 = 32,760 tokens


def _stub_pyav_if_missing():
    """ComfyUI 0.3.64's ``nodes`` imports PyAV for its video types; the H200 image has none, and this test
    does no video I/O.  The benchmark harness's stub (classes that raise when used) stands in for it."""
    from bench import _host
    _host.ensure_av(allow_stub=True)


@pytest.fixture(scope="module")
def wan_block():
    """The first block of a one-block Wan A14B (random weights, bf16, on the GPU) and the exact
    inputs a real forward gives it."""
    _stub_pyav_if_missing()
    comfy = comfy_env.boot(cpu=False, attention="pytorch")
    model, block, args, kwargs = comfy_env.a14b_block_and_inputs(comfy, LATENT_480P81)
    yield comfy, block, args, kwargs
    del model, block, args, kwargs
    gc.collect()
    torch.cuda.empty_cache()


def run_block(block, args, kwargs, override):
    options = dict(kwargs.get("transformer_options") or {})
    options["optimized_attention_override"] = override
    return block(*args, **{**kwargs, "transformer_options": options})


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(autouse=True)
def fresh():
    STATE.reset()
    torch._dynamo.reset()
    yield
    STATE.reset()
    torch._dynamo.reset()


def test_fullgraph_compile_of_a_real_wan_block_has_no_graph_break(wan_block, tmp_path):
    comfy, block, args, kwargs = wan_block
    override = SageAttentionOverride(PatchConfig(cache_dir=str(tmp_path)),
                                     sdpa=comfy.attention.attention_pytorch.__wrapped__)
    with torch.no_grad():
        run_block(block, args, kwargs, override)  # the first calls time and settle both shapes
        for _ in range(31):
            if not STATE.trials:
                break
            run_block(block, args, kwargs, override)
        eager = run_block(block, args, kwargs, override)
        explained = torch._dynamo.explain(run_block)(block, args, kwargs, override)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
        assert any("wan_sage.attention" in g.code for g in explained.graphs)
        torch._dynamo.reset()
        compiled = torch.compile(run_block, fullgraph=True, backend="inductor")
        stats.begin_run(override.patch_id)
        got = compiled(block, args, kwargs, override)
        got_again = compiled(block, args, kwargs, override)
        s = stats.end_run(override.patch_id)
    assert s["by_kernel"].get(KERNEL, 0) >= 2, s  # self-attention on Sage in both compiled runs
    assert rel_l2(got_again, got) < 1e-3  # settled: the second compiled run does what the first did
    assert torch.isfinite(got).all()
    err = rel_l2(got, eager)
    print(f"\ncompiled vs eager block output: rel-L2 {err:.2e}; stats {s}")
    assert err < 1e-2


def test_grouped_and_ungrouped_blocks_agree_compiled_and_eager(wan_block, tmp_path):
    comfy, block, args, kwargs = wan_block
    raw = comfy.attention.attention_pytorch.__wrapped__
    grouped = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=str(tmp_path)), sdpa=raw)
    ungrouped = SageAttentionOverride(PatchConfig(calibrate=False, memory_mode="fastest", cache_dir=str(tmp_path)),
                                      sdpa=raw)
    with torch.no_grad():
        q = torch.empty(1, 32760, 5120, device="cuda", dtype=torch.bfloat16)
        assert grouped.plan(q, q, q, 40).groups > 1 and ungrouped.plan(q, q, q, 40).groups == 1
        del q
        outs = {}
        for name, override in (("grouped", grouped), ("ungrouped", ungrouped)):
            outs[name] = run_block(block, args, kwargs, override)
            torch._dynamo.reset()
            outs[name + "_compiled"] = torch.compile(run_block, fullgraph=True, backend="inductor")(
                block, args, kwargs, override)
    if KERNEL == "sage2_sm90":
        assert torch.equal(outs["grouped"], outs["ungrouped"])  # per-head kernel: bit-identical split
    else:
        assert rel_l2(outs["grouped"], outs["ungrouped"]) < 1e-3
    assert rel_l2(outs["grouped_compiled"], outs["ungrouped_compiled"]) < 1e-3
    assert rel_l2(outs["grouped_compiled"], outs["grouped"]) < 1e-2


def test_the_patched_block_matches_sdpa(wan_block, tmp_path):
    comfy, block, args, kwargs = wan_block
    override = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=str(tmp_path)),
                                     sdpa=comfy.attention.attention_pytorch.__wrapped__)
    with torch.no_grad():
        sage = run_block(block, args, kwargs, override).float()
        sdpa = block(*args, **kwargs).float()
    cos = F.cosine_similarity(sage.flatten(), sdpa.flatten(), dim=0).item()
    print(f"\npatched block vs SDPA block: cos {cos:.5f}")
    assert cos > 0.99


def containers_forward(self, x, freqs, transformer_options={}):
    """0.38's ``WanSelfAttention.forward`` (comfy/ldm/wan/model.py at 0c9a69ae) on 0.3.64's module, without
    ``attn1_patch``: the roped q and k and v viewed into containers that replace them, handed to the override's
    ``container_function`` as 0.38's ``wrap_attn`` hands them."""
    from comfy.ldm.flux.math import apply_rope1
    b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
    q = apply_rope1(self.norm_q(self.q(x)).view(b, s, n, d), freqs)
    k = apply_rope1(self.norm_k(self.k(x)).view(b, s, n, d), freqs)
    q = Container(q.view(b, s, n * d))
    k = Container(k.view(b, s, n * d))
    v = Container(self.v(x).view(b, s, n * d))
    override = transformer_options["optimized_attention_override"]
    x = override.container_function(q, k, v, heads=self.num_heads, transformer_options=transformer_options,
                                    _inside_attn_wrapper=True)
    return self.o(x)


def test_compiled_block_with_the_hand_over_forward_peaks_at_or_below_compiled_sdpa(wan_block, tmp_path):
    """Never bigger, compiled: the patch's own self-attention forward (nodes/handover.py, ComfyUI 0.3.64) and
    0.38's container call site (:func:`containers_forward`) put the write-into-q op in the graph, and inductor
    reinplaces it on q's buffer, so the compiled block's peak above its inputs is at or below the compiled SDPA
    block's.  The compiled ordinary op (no hand-over) is printed beside them."""
    import types

    from wan_sage.attention import kernels as kernels_, op
    from wan_sage.nodes import handover
    if op.INTO_Q_OP is None or kernels_.into_q_module(KERNEL) is None:
        pytest.skip(f"{KERNEL} has no write-into-q pieces here, or torch has no custom_op")
    comfy, block, args, kwargs = wan_block
    raw = comfy.attention.attention_pytorch.__wrapped__
    override = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir=str(tmp_path)), sdpa=raw)
    peaks, outs = {}, {}
    with torch.no_grad():
        for name in ("sdpa", "sage_ordinary", "sage_hand_over", "sage_containers"):
            torch._dynamo.reset()
            if name == "sage_hand_over":
                block.self_attn.forward = types.MethodType(handover.hand_over_forward, block.self_attn)
            elif name == "sage_containers":
                block.self_attn.forward = types.MethodType(containers_forward, block.self_attn)
            try:
                if name == "sdpa":
                    fn = torch.compile(lambda: block(*args, **kwargs), fullgraph=True, backend="inductor")
                else:
                    fn = torch.compile(lambda: run_block(block, args, kwargs, override), fullgraph=True,
                                       backend="inductor")
                fn()  # compiles (and settles the shapes)
                outs[name], peaks[name] = peak_extra(fn)
            finally:
                block.self_attn.__dict__.pop("forward", None)
    torch._dynamo.reset()
    mib = {n: p / 2**20 for n, p in peaks.items()}
    err = rel_l2(outs["sage_hand_over"], outs["sage_ordinary"])
    err_c = rel_l2(outs["sage_containers"], outs["sage_ordinary"])
    print(f"\ncompiled A14B block 480p81, peak above the inputs: SDPA {mib['sdpa']:.1f} MiB, Sage ordinary op "
          f"{mib['sage_ordinary']:.1f} MiB, Sage write-into-q op {mib['sage_hand_over']:.1f} MiB (0.3.64 hand-over), "
          f"{mib['sage_containers']:.1f} MiB (0.38 containers); rel-L2 write-into-q vs ordinary {err:.2e}, "
          f"containers {err_c:.2e}")
    assert err < 1e-2 and err_c < 1e-2
    assert peaks["sage_hand_over"] <= peaks["sdpa"], mib
    assert peaks["sage_containers"] <= peaks["sdpa"], mib
