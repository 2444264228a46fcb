"""What a compiled ComfyUI-GGUF Linear with a LoRA holds for its weight while it runs, read from the code inductor
writes: the buffers of each weight chain (dequantization, the LoRA's ``up @ down`` product, the cast) alive at once,
in units of the Linear's ``d x f`` elements.

Eagerly (``memory.activation_model.weight_transient``) ComfyUI-GGUF materialises the block-dequantisation
intermediate and the dequantised weight in the compute dtype, and ComfyUI's ``calculate_weight`` the weight upcast
to fp32 and the fp32 ``up @ down`` product: 2 x 2 + 2 x 4 = 12 bytes per element in bf16.  Under Wan Compile Blocks
the chain is in the block's graph, and inductor fuses what is pointwise into one kernel: what stays is what an
extern matmul needs as an input or writes as an output.

The block is the first of the miniature A14B expert (Q4_K and Q6_K weights as the real file's, a LoRA of
``--lora-rank``) in a real ComfyUI 0.3.64 with ComfyUI-GGUF, on the CPU, compiled with Wan Compile Blocks' arguments
through its plain-tensor GGUF cast.  Inductor's scheduler decides the fusions for either device; the kernels it
writes differ.  Each chain's peak is the sum of the weight-shaped buffers (``d x f`` or ``f x d``) alive at the same
line of the wrapper code (the quantized pieces it copies are a few per cent of that, and not counted).

    COMFYUI_PATH=... COMFYUI_GGUF_PATH=... python -m bench.compiled_weight_chain --out FILE
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPE_BYTES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.float16": 2, "torch.uint8": 1, "torch.int8": 1,
               "torch.int16": 2, "torch.int32": 4, "torch.int64": 8, "torch.bool": 1}
_ALLOC = re.compile(r"^\s+(buf\d+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)")
_REUSE = re.compile(r"^\s+(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*; del (buf\d+)\s+# reuse")
_DEL = re.compile(r"\bdel (buf\d+)")
_MM = re.compile(r"extern_kernels\.(?:mm|addmm)\(")


def live_buffers(code: str):
    """Yield (line number, line, {buffer: (bytes, shape, dtype)}) after each line of inductor's wrapper code: the
    buffers it allocated and has not deleted.  A buffer reused under a new name keeps its bytes."""
    live: dict = {}
    for i, line in enumerate(code.splitlines(), start=1):
        m = _ALLOC.match(line)
        if m:
            shape = tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x)
            live[m.group(1)] = (math.prod(shape) * DTYPE_BYTES.get(m.group(3), 4), shape, m.group(3))
        elif (m := _REUSE.match(line)) is not None:
            live[m.group(1)] = live.pop(m.group(3), (0, (), "view"))
        else:
            for name in _DEL.findall(line):
                live.pop(name, None)
        yield i, line, dict(live)


def weight_chains(code: str, d: int, f: int) -> list:
    """Per matmul whose weight is ``d x f`` or ``f x d`` (the FFN's two Linears): the most bytes of weight-shaped
    buffers alive at once before it, in units of ``d * f`` elements, with the buffers at that point."""
    shapes = {(d, f), (f, d)}
    chains, best = [], (0, None)
    for i, line, live in live_buffers(code):
        held = {k: v for k, v in live.items() if v[1] in shapes}
        total = sum(v[0] for v in held.values())
        if total > best[0]:
            best = (total, held)
        if _MM.search(line) and any(f"reinterpret_tensor({k}, " in line for k in held if held[k][2] != "torch.float32"):
            chains.append({"line": i, "units": round(best[0] / (d * f), 3),
                           "buffers": [{"shape": list(v[1]), "dtype": v[2].replace("torch.", ""),
                                        "units": round(v[0] / (d * f), 3)} for v in best[1].values()]})
            best = (0, None)
    return chains


def _compiled_code(lora_rank: int) -> tuple:
    """(inductor's wrapper code for the first block of the miniature GGUF expert, dim, ffn_dim)."""
    sys.path.insert(0, str(ROOT / "tests" / "host"))
    import comfy_env
    import workflow_check

    from bench import _host
    _host.ensure_av(allow_stub=True)
    _host.load_pack()
    comfy_env.boot(cpu=True, attention="pytorch")
    import torch
    from torch._inductor.utils import run_and_get_code

    from wan_sage.nodes import compile_blocks, gguf_cast
    with torch.inference_mode():
        m = comfy_env.tiny_gguf_expert(workflow_check.gguf_path(), tempfile.mkdtemp(prefix="weight-chain-"),
                                       lora_rank=lora_rank)
        m.model.manual_cast_dtype = torch.bfloat16  # computing in bf16, as on the GPU
        blocks = m.model.diffusion_model.blocks
        got = {}
        hook = blocks[0].register_forward_pre_hook(lambda mod, a, k: got.setdefault("call", (a, dict(k))),
                                                   with_kwargs=True)
        try:
            comfy_env.sample_tiny(m, steps=1, cfg=1.0)
        finally:
            hook.remove()
        import comfy.model_management as mm
        mm.load_models_gpu([m])  # loaded again: the LoRA stays hung on the weights
        args, kwargs = got["call"]
        block = blocks[0]
        compiled = torch.compile(block, **compile_blocks.compile_kwargs("inductor"))
        with gguf_cast.plain_casts(block, args[0]):
            _out, codes = run_and_get_code(lambda: compile_blocks.BlockStandIn(block, compiled)(*args, **kwargs))
    ffn = block.ffn[0]
    return codes[-1], int(ffn.in_features), int(ffn.out_features)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--out", help="append the JSON line here")
    ap.add_argument("--code", help="also write inductor's wrapper code here")
    a = ap.parse_args(argv)
    code, d, f = _compiled_code(a.lora_rank)
    if a.code:
        Path(a.code).write_text(code)
    row = {"schema": "wan-sage-compiled-weight-chain/1", "device": "cpu", "lora_rank": a.lora_rank, "dim": d,
           "ffn_dim": f, "eager_units_bf16": 12, "chains": weight_chains(code, d, f)}
    print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return 0 if row["chains"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
