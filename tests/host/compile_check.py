"""The Sage patch under torch.compile inside a real ComfyUI, on the CPU: run in a fresh process by
``test_host_compile.py`` (dynamo and ComfyUI's attention choice are process-wide), it prints one
JSON report.

ComfyUI is booted with ``--use-pytorch-cross-attention`` (on the CPU it would pick sub-quadratic
attention, which dynamo cannot trace), so Wan's ``optimized_attention`` is SDPA as on CUDA.  The
pack runs with a stand-in kernel installed under ``sage2_sm90`` through
``kernels.install_test_kernel`` (SDPA in fp32 behind the real registry runner), CPU tensors made
eligible, and the device facts, free memory, self-test and timer replaced, so every eligible call
goes through the custom op onto the "kernel".

    COMFYUI_PATH=... python3 tests/host/compile_check.py
"""
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import comfy_env  # noqa: E402
import fake_device  # noqa: E402

comfy = comfy_env.boot(cpu=True, attention="pytorch")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

spec = importlib.util.spec_from_file_location("wan_sage", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
pack = importlib.util.module_from_spec(spec)
sys.modules["wan_sage"] = pack
spec.loader.exec_module(pack)

from wan_sage.attention import stats, timing  # noqa: E402
from wan_sage.attention.config import PatchConfig  # noqa: E402
from wan_sage.attention.override import SageAttentionOverride  # noqa: E402
from wan_sage.attention.state import STATE  # noqa: E402

from comfy_api.torch_helpers import set_torch_compile_wrapper  # noqa: E402

KERNEL_CALLS = []


def stand_in_sm90(q, k, v, tensor_layout="HND", sm_scale=None, **options):
    """What SageAttention's sm90 entry point computes, in fp32 SDPA, in its NHD/HND layouts."""
    KERNEL_CALLS.append(tuple(q.shape))
    if tensor_layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=sm_scale).to(q.dtype)
    return out.transpose(1, 2).contiguous() if tensor_layout == "NHD" else out


class FakeTimer:
    """The stand-in kernel takes 7 ms a call, SDPA 10 ms."""

    def __init__(self):
        self.before, self.value = len(KERNEL_CALLS), None

    def stop(self):
        self.value = 7.0 if len(KERNEL_CALLS) > self.before else 10.0

    def ms(self):
        return self.value


fake_device.install({"sage2_sm90": stand_in_sm90}, build="stand-in")
timing.timer = FakeTimer
torch._dynamo.config.cache_size_limit = 64

CACHE = tempfile.mkdtemp(prefix="wan-sage-compile-")
report = {}


def patched(model, node_id=None):
    m = model.clone()
    override = SageAttentionOverride(PatchConfig(min_tokens=0, cache_dir=CACHE, node_id=node_id,
                                                 label=f"Wan Sage patch #{node_id}" if node_id else ""),
                                     sdpa=comfy.attention.attention_pytorch.__wrapped__)
    m.model_options["transformer_options"]["optimized_attention_override"] = override
    return m, override


def settle(run):
    """Run ``run()`` until no shape is being timed on its first calls (they alternate the kernel and
    SDPA), so that what follows runs each shape as settled."""
    run()
    for _ in range(16):
        if not STATE.trials:
            return
        run()
    raise AssertionError(f"shapes still timed after 17 runs: {list(STATE.trials)}")


def breaks() -> dict:
    return {str(k)[:160]: v for k, v in counters["graph_break"].items()}


def check(name, fn):
    try:
        report[name] = fn()
    except Exception as e:  # reported to the test, which names the failing check
        report[name] = {"error": f"{type(e).__name__}: {e}"[:1500]}


# bf16 weights computed in bf16, as on a GPU (on the CPU ComfyUI would cast to fp32, which Sage
# does not take).
base = comfy_env.tiny_wan_patcher(num_layers=2, dtype=torch.bfloat16)
base.model.manual_cast_dtype = None
report["wan_attention"] = comfy.wan_model.optimized_attention.__name__


def block_fullgraph():
    """A real WanAttentionBlock with the inputs of a real forward, compiled with fullgraph."""
    m, override = patched(base)
    block = m.model.diffusion_model.blocks[0]
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("args", args)
        captured.setdefault("kwargs", kwargs)
    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        eager_latent = comfy_env.sample_tiny(m, steps=1, cfg=1.0)
    finally:
        handle.remove()
    args, kwargs = captured["args"], captured["kwargs"]
    out = {"latent_finite": bool(torch.isfinite(eager_latent).all())}
    with torch.no_grad():
        settle(lambda: block(*args, **kwargs))
        expect = block(*args, **kwargs)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(*args, **kwargs)
        out["explain_graph_breaks"] = explained.graph_break_count
        out["explain_graphs"] = explained.graph_count
        out["explain_reasons"] = [str(r.reason)[:300] for r in explained.break_reasons]
        out["op_in_graph"] = any("wan_sage.attention" in g.code for g in explained.graphs)
        for backend in ("eager", "inductor"):
            torch._dynamo.reset()
            stats.begin_run(override.patch_id)
            got = torch.compile(block, fullgraph=True, backend=backend)(*args, **kwargs)
            s = stats.end_run(override.patch_id)
            out[backend] = {"sage_calls": s["sage_calls"], "sdpa_calls": s["sdpa_calls"],
                            "max_abs_diff": float((got.float() - expect.float()).abs().max()),
                            "equal": bool(torch.equal(got, expect))}
    return out


def optimized_attention_fullgraph():
    """ComfyUI's optimized_attention (its wrapper and the override) compiled with fullgraph."""
    m, override = patched(base)
    options = m.model_options["transformer_options"]
    attention = comfy.attention.optimized_attention
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 300, 256, generator=g).bfloat16() for _ in range(3))
    ctx = torch.randn(1, 512, 256, generator=g).bfloat16()

    def call(q, k, v, ctx):
        a = attention(q, k, v, heads=2, transformer_options=options)
        return attention(a, ctx, ctx, heads=2, transformer_options=options)
    with torch.no_grad():
        settle(lambda: call(q, k, v, ctx))
        expect = call(q, k, v, ctx)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(call)(q, k, v, ctx)
        torch._dynamo.reset()
        stats.begin_run(override.patch_id)
        got = torch.compile(call, fullgraph=True, backend="eager")(q, k, v, ctx)
        s = stats.end_run(override.patch_id)
    return {"explain_graph_breaks": explained.graph_break_count, "explain_graphs": explained.graph_count,
            "sage_calls": s["sage_calls"], "equal": bool(torch.equal(got, expect))}


def torch_compile_model(keys):
    """ComfyUI's TorchCompileModel path (set_torch_compile_wrapper), sampling the tiny model."""
    m, override = patched(base)
    settle(lambda: comfy_env.sample_tiny(m, steps=2, cfg=5.0))
    stats.begin_run(override.patch_id)
    expect = comfy_env.sample_tiny(m, steps=2, cfg=5.0)
    stats.end_run(override.patch_id)
    torch._dynamo.reset()
    counters.clear()
    set_torch_compile_wrapper(m, backend="eager", fullgraph=True, keys=keys)
    stats.begin_run(override.patch_id)
    got = comfy_env.sample_tiny(m, steps=2, cfg=5.0)
    s = stats.end_run(override.patch_id)
    graph_breaks = breaks()
    return {"sage_calls": s["sage_calls"], "sdpa_calls": s["sdpa_calls"], "equal": bool(torch.equal(got, expect)),
            "graph_breaks": sum(graph_breaks.values()), "graph_break_reasons": graph_breaks,
            "pack_graph_breaks": sum(v for k, v in graph_breaks.items() if "wan_sage" in k or "attention/" in k)}


def two_experts_per_block():
    """Wan 2.2's two experts, each its own model patched by its own node and compiled per block
    through set_torch_compile_wrapper: the second expert reuses the first one's graph, and each
    expert's window counts its own calls."""
    second = comfy_env.tiny_wan_patcher(num_layers=2, dtype=torch.bfloat16, seed=1)
    second.model.manual_cast_dtype = None
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward
    torch._dynamo.reset()
    out = {}
    for name, model, node_id in (("high", base, "11"), ("low", second, "12")):
        m, override = patched(model, node_id)
        set_torch_compile_wrapper(m, backend=counting, fullgraph=True,
                                  keys=[f"diffusion_model.blocks.{i}" for i in range(len(model.model.diffusion_model.blocks))])
        stats.begin_run(override.patch_id)
        latent = comfy_env.sample_tiny(m, steps=2, cfg=1.0)
        s = stats.end_run(override.patch_id)
        out[name] = {"graphs": len(graphs), "sage_calls": s["sage_calls"], "sdpa_calls": s["sdpa_calls"],
                     "timing": s["reasons"].get("timing", 0), "finite": bool(torch.isfinite(latent).all()), "graph_key": override.graph_key}
    return out


def _with_lora(patcher, seed):
    """The patcher with a rank-4 LoRA on every block Linear, loaded as LoraLoaderModelOnly does."""
    import comfy.lora
    import comfy.sd
    import comfy.utils
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for lora_key, weight_key in comfy.lora.model_lora_keys_unet(patcher.model, {}).items():
        if not (isinstance(weight_key, str) and lora_key.startswith("diffusion_model.blocks.")):
            continue
        w = comfy.utils.get_attr(patcher.model, weight_key)
        if w.ndim == 2:
            sd[lora_key + ".lora_up.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.01
            sd[lora_key + ".lora_down.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.01
    return comfy.sd.load_lora_for_models(patcher, None, sd, 1.0, 0)[0]


def _partial_load(budget_fraction):
    """ComfyUI's model load with the budget set to ``budget_fraction`` of the model's size (its lowvram path
    streams the modules past it); put in place of ``LoadedModel.model_load``, which the caller restores."""
    import comfy.model_management as mm
    load = mm.LoadedModel.model_load

    def partial_load(self, lowvram_model_memory=0, force_patch_weights=False):
        return load(self, max(1, int(self.model.model_size() * budget_fraction)), force_patch_weights)
    return partial_load


def _expert(layers, seed, node_id):
    """A tiny Wan expert with a LoRA, the Working-Memory Estimator and the Sage patch on it: (model, override)."""
    from wan_sage.nodes.estimator import Settings, apply_estimator
    expert = comfy_env.tiny_wan_patcher(num_layers=layers, ffn_dim=512, dtype=torch.bfloat16, seed=seed)
    expert.model.manual_cast_dtype = None
    m, _, _ = apply_estimator(_with_lora(expert, seed + 100), Settings(), [1, 16, 2, 8, 8])
    return patched(m, node_id)


def two_experts_streamed_lora(budget_fraction):
    """As the H200 end-to-end runs do it: two experts with a LoRA each, loaded partially (ComfyUI's
    lowvram path streams the modules past the budget and patches the LoRA in as they are cast, each
    with a LowVramPatch that dynamo guards on by its weight key), the Working-Memory Estimator and the
    Sage patch on each, compiled per block, sampled under inference mode.  The second expert must
    reuse the first one's graphs: a new graph in it would mean something of the pack's is guarded on
    per expert."""
    import comfy.model_management as mm

    layers = 3
    load = mm.LoadedModel.model_load
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward
    torch._dynamo.reset()
    mm.LoadedModel.model_load = _partial_load(budget_fraction)
    out = {}
    try:
        for name, seed, node_id in (("high", 0, "21"), ("low", 1, "22")):
            with torch.inference_mode():
                m, override = _expert(layers, seed, node_id)
                set_torch_compile_wrapper(m, backend=counting, keys=[f"diffusion_model.blocks.{i}" for i in range(layers)])
                before = len(graphs)
                stats.begin_run(override.patch_id)
                latent = comfy_env.sample_tiny(m, steps=2, cfg=1.0)
                s = stats.end_run(override.patch_id)
            blocks = m.model.diffusion_model.blocks
            out[name] = {"graphs": len(graphs) - before, "sage_calls": s["sage_calls"],
                         "timing": s["reasons"].get("timing", 0), "finite": bool(torch.isfinite(latent).all()),
                         "lowvram": bool(getattr(m.model, "model_lowvram", False)),
                         "streamed_modules": sum(1 for b in blocks for mod in b.modules()
                                                 if getattr(mod, "comfy_cast_weights", False) and getattr(mod, "weight_function", None))}
            mm.unload_all_models()
    finally:
        mm.LoadedModel.model_load = load
    out["blocks"] = layers
    return out


def _dynamo_totals(dyn) -> tuple[int, int]:
    """(unique graphs, recompiles) dynamo has counted since its counters were last cleared."""
    return dyn["stats"].get("unique_graphs", 0), (sum(dyn["recompiles"].values()) if "recompiles" in dyn else 0)


def compile_blocks_streamed(budget_fraction):
    """The pack's Wan Compile Blocks on two experts with a LoRA each, loaded whole (``budget_fraction`` None) or
    partly streamed as in ``two_experts_streamed_lora``: blocks whose Linears stream run the staged graph, the
    resident ones the block graph, each shared by both experts, and nothing recompiles.  ComfyUI's lowvram load takes the largest
    modules of every block first, so a partial load streams part of every block.  On the CPU a streamed module's
    weights stay on the compute device, so the node's test for "weights off the input's device" is stood in for
    by ComfyUI's own mark of a streamed module (``prev_comfy_cast_weights``, set by its lowvram load)."""
    import comfy.model_management as mm
    from torch._dynamo.utils import counters as dyn
    from wan_sage.memory.estimate import plan
    from wan_sage.nodes import comfy_bridge, compile_blocks, estimator, streamed_record

    layers = 3
    load = mm.LoadedModel.model_load
    resident = compile_blocks.block_resident

    def not_streamed(block, device):
        return not any("prev_comfy_cast_weights" in mod.__dict__ for mod in block.modules())
    torch._dynamo.reset()
    dyn.clear()
    if budget_fraction is not None:
        mm.LoadedModel.model_load = _partial_load(budget_fraction)
    compile_blocks.block_resident = not_streamed
    out = {"blocks": layers}
    cache_env = os.environ.get(comfy_bridge.CACHE_ENV)
    own = tempfile.mkdtemp(prefix="streamed-record-", dir=cache_env)  # its own kept streamed path
    os.environ[comfy_bridge.CACHE_ENV] = own
    try:
        for name, seed, node_id in (("high", 0, "31"), ("low", 1, "32")):
            with torch.inference_mode():
                m, _override = _expert(layers, seed, node_id)
                eager = comfy_env.sample_tiny(m, steps=2, cfg=1.0)
                mm.unload_all_models()
                c, text = compile_blocks.apply_compile_blocks(m, "inductor", "default")
                made_by_node = sum(s.compiled.fn is not None for s in compile_blocks.stand_ins(c))
                graphs_before, _ = _dynamo_totals(dyn)
                with _pack_log() as lines:
                    latent = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
            blocks = c.model.diffusion_model.blocks
            graphs, recompiles = _dynamo_totals(dyn)
            counted = compile_blocks.count_compiled_blocks(c)
            ran = compile_blocks.blocks_ran(c)
            # what the estimator plans the next sampling of this model with (memory.estimate.Setup.streamed_blocks_ran)
            planned = estimator.setup_for(c, tuple(latent.shape), c.model_options, estimator.Settings())
            # and the same model after a ComfyUI restart: new stand-ins, the pack's file read afresh
            streamed_record._file.read.clear()
            restarted, _ = compile_blocks.apply_compile_blocks(m, "inductor", "default")
            again = estimator.setup_for(restarted, tuple(latent.shape), restarted.model_options, estimator.Settings())
            out[name] = {"graphs": graphs - graphs_before,
                         "compiled_by_node": made_by_node,  # torch.compile made in the node's own run
                         "compiled_by_sampling": sum(s.compiled.fn is not None for s in compile_blocks.stand_ins(c)),
                         "streamed_ran": compile_blocks.streamed_blocks_ran(c),
                         "planned_ran": planned.streamed_blocks_ran,
                         "restart_planned_ran": again.streamed_blocks_ran,
                         "restart_notes": [n for n in again.notes if n.startswith("Wan Compile Blocks:")],
                         "planned_staged_block": plan(planned).partial["staged_block"],
                         "recompiles": recompiles,
                         "streamed_blocks": sum(1 for b in blocks if not not_streamed(b, None)),
                         "staged_blocks": counted[1], "resident_blocks": counted[0],
                         "lowvram": bool(getattr(c.model, "model_lowvram", False)),
                         "finite": bool(torch.isfinite(latent).all()),
                         "max_abs_diff": float((latent.float() - eager.float()).abs().max()),
                         "eager_max_abs": float(eager.float().abs().max()),
                         "scope": list(comfy_bridge.compile_scope(c)), "status": text,
                         "ran": ran.blocks, "ran_calls": ran.calls,
                         "ran_logged": [x for x in lines if x.startswith("wan-sage: Wan Compile Blocks:")]}
            mm.unload_all_models()
    finally:
        mm.LoadedModel.model_load = load
        compile_blocks.block_resident = resident
        if cache_env is None:
            os.environ.pop(comfy_bridge.CACHE_ENV, None)
        else:
            os.environ[comfy_bridge.CACHE_ENV] = cache_env
        shutil.rmtree(own, ignore_errors=True)
    return out


@contextlib.contextmanager
def _pack_log():
    """The pack's log lines (INFO and up) while the body runs."""
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
    log, handler = logging.getLogger("wan_sage"), Keep(logging.INFO)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _own_attr_count(blocks, name: str) -> int:
    """The modules of ``blocks`` that hold ``name`` as an attribute of their own (in their ``__dict__``)."""
    return sum(1 for b in blocks for mod in b.modules() if name in mod.__dict__)


def compile_blocks_reloaded():
    """The pack's Wan Compile Blocks over two prompts of one resident expert with a partial unload between them,
    as a Wan 2.2 prompt does it: loading the other expert (or the VAE) unloads part of this one, and the next
    prompt loads it whole again.  ComfyUI's partial unload sets its cast flag on the modules it moves, and the
    reload puts the flag back as an attribute of each module (``comfy_cast_weights`` in the module's
    ``__dict__``, equal to its class's value), where the first prompt's modules had none.  The repeat prompt must
    run the first prompt's graph: no new graph, no recompile."""
    import comfy.model_management as mm
    from torch._dynamo.utils import counters as dyn
    from wan_sage.nodes import compile_blocks

    torch._dynamo.reset()
    dyn.clear()
    out = {}
    with torch.inference_mode():
        m, _override = _expert(3, 0, "34")
        c, _text = compile_blocks.apply_compile_blocks(m, "inductor", "default")
        for prompt in ("first", "repeat"):
            graphs_before, recompiles_before = _dynamo_totals(dyn)
            latent = comfy_env.sample_tiny(c, steps=2, cfg=1.0)
            blocks = c.model.diffusion_model.blocks
            graphs, recompiles = _dynamo_totals(dyn)
            out[prompt] = {"graphs": graphs - graphs_before, "recompiles": recompiles - recompiles_before,
                           "finite": bool(torch.isfinite(latent).all()),
                           "flags_in_dict": _own_attr_count(blocks, "comfy_cast_weights")}
            if prompt == "first":
                unloaded = c.partially_unload(c.offload_device, c.model_size() // 2)
                out["unloaded_bytes"] = int(unloaded)
                out["flags_after_unload"] = _own_attr_count(blocks, "prev_comfy_cast_weights")
        mm.unload_all_models()
    return out


def compile_blocks_cond_rows(order):
    """ComfyUI's cond/uncond batching when the free memory it reads changes between steps, as at a budget near its
    line: the first step's test finds too little and runs cond and uncond apart, the next ones find room.  The eager
    model then batches from the second step (the rows the model sees); under Wan Compile Blocks the forwards keep the
    rows the blocks were compiled for, and nothing recompiles.  ``order``: "estimator-first" (the estimator's
    batching wrapper outside the node's) or "compile-first"."""
    import comfy.model_management as mm
    from torch._dynamo.utils import counters as dyn
    from wan_sage.nodes import compile_blocks, cond_rows
    from wan_sage.nodes.estimator import Settings, apply_estimator

    real_free = mm.get_free_memory

    def free(*args, **kwargs):  # ComfyUI's batching test alone: none on its first call, plenty later
        if sys._getframe(1).f_code.co_name != "_calc_cond_batch":
            return real_free(*args, **kwargs)
        free.asked += 1
        return 0 if free.asked == 1 else 1 << 50

    def run(model):
        rows = []
        dm = model.model.diffusion_model
        hook = dm.register_forward_pre_hook(lambda mod, args: rows.append(int(args[0].shape[0])))
        free.asked = 0
        graphs_before, recompiles_before = _dynamo_totals(dyn)
        try:
            with torch.inference_mode():
                latent = comfy_env.sample_tiny(model, steps=3, cfg=2.0)
        finally:
            hook.remove()
            mm.unload_all_models()
        graphs, recompiles = _dynamo_totals(dyn)
        return {"rows": rows, "graphs": graphs - graphs_before, "recompiles": recompiles - recompiles_before,
                "finite": bool(torch.isfinite(latent).all())}

    torch._dynamo.reset()
    dyn.clear()
    cond_rows.forget()
    mm.get_free_memory = free
    out = {}
    try:
        expert = comfy_env.tiny_wan_patcher(num_layers=2, ffn_dim=512, dtype=torch.bfloat16, seed=5)
        expert.model.manual_cast_dtype = None
        if order == "estimator-first":
            m, _, _ = apply_estimator(expert, Settings(), [1, 16, 2, 8, 8])
            c, _text = compile_blocks.apply_compile_blocks(m, "inductor", "default")
        else:
            c, _text = compile_blocks.apply_compile_blocks(expert, "inductor", "default")
            m = expert
            c, _, _ = apply_estimator(c, Settings(), [1, 16, 2, 8, 8])
        out["eager"] = run(m)
        for prompt in ("compiled", "compiled_repeat"):
            out[prompt] = run(c)
    finally:
        mm.get_free_memory = real_free
    return out


check("compile_blocks_cond_rows_estimator_first", lambda: compile_blocks_cond_rows("estimator-first"))
check("compile_blocks_cond_rows_compile_first", lambda: compile_blocks_cond_rows("compile-first"))
check("block", block_fullgraph)
check("compile_blocks_streamed", lambda: compile_blocks_streamed(0.4))
check("compile_blocks_resident", lambda: compile_blocks_streamed(None))
check("compile_blocks_reloaded", compile_blocks_reloaded)
check("two_experts_per_block", two_experts_per_block)
check("two_experts_streamed_lora_part", lambda: two_experts_streamed_lora(0.4))
check("two_experts_streamed_lora_all", lambda: two_experts_streamed_lora(0.0))
check("optimized_attention", optimized_attention_fullgraph)
check("compile_model_whole", lambda: torch_compile_model(["diffusion_model"]))
check("compile_model_per_block", lambda: torch_compile_model(
    [f"diffusion_model.blocks.{i}" for i in range(len(base.model.diffusion_model.blocks))]))
print("REPORT " + json.dumps(report), flush=True)
