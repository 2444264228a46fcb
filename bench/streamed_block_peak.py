"""What one Wan A14B block holds on the GPU while its Linear weights stream from the host, eagerly and compiled
with the streamed layers left out of the graphs: the allocated peak above the block's input, per mode, at a real
size.  Why Wan Compile Blocks runs a streamed block eagerly (docs/attention.md, "Wan Compile Blocks"), and what
copying a streamed block's weights onto the GPU before its compiled call (:func:`staged`) and page-locked host
memory for the streamed weights would give.

"Wan Compile Blocks" is the pack's node's own path for the block (``nodes.compile_blocks.BlockStandIn``): its streamed
Linears, which carry no LoRA here, lifted onto the GPU for the call, the block run in the resident block's graph.

"Compiled around eager layers" is the block compiled with torch.compile while each of its Linear layers stands
behind a ``torch.compiler.disable``d module (:func:`around_eager_layers`): the weight casts run eagerly and dynamo
compiles the work between the layers, at one graph break per layer.

The block is ComfyUI 0.3.64's ``WanAttentionBlock`` at A14B's dims (bf16, random weights), its inputs those of a
real forward of a one-block model.  "Streamed" is ComfyUI's lowvram state of a layer: the cast flag set and the
weight on the host, so the layer's forward copies it onto the GPU at each call; "pinned" keeps that host copy in
page-locked memory.  Each mode runs the block three times (the first compiles) and reports the peak and the
seconds of the last.  Each compiled mode starts from a reset dynamo with a block compiled for it alone: dynamo keeps
its compiled code per code object, so a mode run after "compiled around eager layers" otherwise entered that mode's
first graph (its guards read no layer's type) and ran with its graph breaks.

``--device cpu`` runs the same modes on the host (the peak from the profiler's record of the CPU allocator; a
streamed layer's weight is already on the compute device there, so staging copies nothing), at dims and sizes a
CPU runs (``--dims 1536x8960 --size 512x512x17``): what each mode's graph holds, not the H200's figures.

    COMFYUI_PATH=... python -m bench.streamed_block_peak --out $OUT/streamed-block-peak.jsonl [--size 1280x720x81]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

GiB = 1 << 30


def _block_and_inputs(comfy, torch, width: int, height: int, frames: int, device: str = "cuda",
                      dims: tuple = (5120, 13824)):
    """The block of a one-block A14B (or of ``dims``, dim x ffn_dim) on ``device`` and its inputs
    (``comfy_env.a14b_block_and_inputs``); only the block is kept there."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "host"))
    import comfy_env
    latent = (1, 16, (frames - 1) // 4 + 1, height // 8, width // 8)
    model, block, args, kwargs = comfy_env.a14b_block_and_inputs(comfy, latent, device=device, dim=dims[0],
                                                                 ffn_dim=dims[1])
    del model.blocks  # the block alone stays on the GPU
    return block, args, kwargs


def _stream(torch, block, pinned: bool = False):
    """ComfyUI's lowvram state for every Linear of ``block``: the cast flag on, the weight on the host (in page-locked
    memory where ``pinned``)."""
    for m in block.modules():
        if isinstance(m, torch.nn.Linear):
            if "prev_comfy_cast_weights" not in m.__dict__:
                m.prev_comfy_cast_weights = m.comfy_cast_weights
            m.comfy_cast_weights = True
            m.to("cpu")
            if pinned:
                for p in m.parameters(recurse=False):
                    if not p.data.is_pinned():
                        p.data = p.data.pin_memory()


def _linears_replaced(torch, block, stand_in, call):
    """``call()`` with every Linear of ``block`` replaced by ``stand_in(layer)``, the layers put back afterwards (also
    when the call fails)."""
    swapped = [(parent, name, child) for parent in block.modules() for name, child in parent._modules.items()
               if isinstance(child, torch.nn.Linear)]
    try:
        for parent, name, child in swapped:
            parent._modules[name] = stand_in(child)
        return call()
    finally:
        for parent, name, child in swapped:
            parent._modules[name] = child


_STAND_INS: dict = {}


def _stand_ins(torch):
    """The stand-in class for an eager layer, made once per process: a class made anew at each call would fail
    dynamo's guard on the module's type, and every call would compile again."""
    if not _STAND_INS:
        class EagerLayer(torch.nn.Module):
            def __init__(self, layer):
                super().__init__()
                object.__setattr__(self, "layer", layer)

            @torch.compiler.disable
            def forward(self, *a, **k):
                return self.layer(*a, **k)

        _STAND_INS.update(eager=EagerLayer)
    return _STAND_INS["eager"]


def around_eager_layers(torch, block, compiled, *args, **kwargs):
    """``compiled(*args, **kwargs)`` with every Linear of ``block`` behind a stand-in that dynamo does not trace,
    the layers put back afterwards (also when the call fails)."""
    eager_layer = _stand_ins(torch)
    return _linears_replaced(torch, block, eager_layer, lambda: compiled(*args, **kwargs))


def staged(torch, cast, block, compiled, *args, **kwargs):
    """``compiled(*args, **kwargs)`` with every Linear of ``block`` replaced, for the call, by a plain layer whose
    weight and bias ``cast(layer, x)`` put on the input's device beforehand (ComfyUI's ``cast_bias_weight``, as
    the layer's own forward casts them): the block's streamed weights copied onto the GPU at once, then the
    compiled block, whose graph sees plain GPU weights.  The plain layer is Wan Compile Blocks' own
    (``nodes.staged_blocks.StagedLinear``).  The layers are put back afterwards."""
    from wan_sage.nodes.staged_blocks import StagedLinear
    x = args[0] if args else kwargs["x"]
    return _linears_replaced(torch, block, lambda layer: StagedLinear(*cast(layer, x)),
                             lambda: compiled(*args, **kwargs))


def _cpu_peak(torch, fn, runs: int = 3) -> tuple[float, float]:
    """:func:`_peak` on the host: the CPU allocator's peak above the start of the last run, from the profiler's
    memory events."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(runs - 1):
        out = fn()
        del out
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        del out
    import os
    import tempfile
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    events.sort(key=lambda e: e["ts"])
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"] if events else 0
    peak = max((e["args"]["Total Allocated"] - start for e in events), default=0)
    return peak / GiB, dt


def _peak(torch, fn, runs: int = 3, snapshot: str | None = None) -> tuple[float, float]:
    """(allocated peak above the start of the last run, seconds of the last run); ``snapshot``: a file to dump
    the allocator's history of the last run into (torch.cuda.memory._dump_snapshot)."""
    for i in range(runs):
        if snapshot and i == runs - 1:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del out
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    return (torch.cuda.max_memory_allocated() - base) / GiB, dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1280x720x81")
    ap.add_argument("--out", required=True)
    ap.add_argument("--snapshots", default=None, help="a folder for the allocator history of the streamed modes")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--one-compile", action="store_true",
                    help="one compiled block for every mode, dynamo never reset (how the probe ran before: each "
                         "mode then runs in the graphs of the modes before it)")
    ap.add_argument("--dims", default="5120x13824", help="dim x ffn_dim of the block (A14B's by default)")
    ap.add_argument("--copy-staged", action="store_true",
                    help="staged weights are copies even where the cast had nothing to do (on the CPU, where a "
                         "streamed weight is already on the compute device: what staging holds on a GPU)")
    a = ap.parse_args(argv)
    width, height, frames = (int(v) for v in a.size.split("x"))
    dims = tuple(int(v) for v in a.dims.split("x"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "host"))
    import comfy_env
    from bench import _host
    _host.ensure_av(allow_stub=True)
    cpu = a.device == "cpu"
    comfy = comfy_env.boot(cpu=cpu, attention="pytorch")
    import torch
    import torch._dynamo
    block, args, kwargs = _block_and_inputs(comfy, torch, width, height, frames, a.device, dims)
    rows = []
    compiled = None

    class Fresh:
        """The block compiled anew, from a reset dynamo, at the first call of each mode (module docstring)."""

        def __call__(self, *args, **kwargs):
            return compiled(*args, **kwargs)
    _host.load_pack()
    from wan_sage.nodes import compile_blocks
    with torch.inference_mode():
        fresh = Fresh()
        node_block = compile_blocks.BlockStandIn(block, fresh)  # the node's own path: lifting, the resident graph
        cast = comfy.ops.cast_bias_weight
        if a.copy_staged:
            def cast(layer, x, own=cast):
                return tuple(None if t is None else t.clone() for t in own(layer, x))
        modes = [("eager, resident", lambda: block(*args, **kwargs), "resident"),
                 ("compiled, resident", lambda: fresh(*args, **kwargs), "resident"),
                 ("eager, streamed", lambda: block(*args, **kwargs), "streamed"),
                 ("compiled around eager layers, streamed",
                  lambda: around_eager_layers(torch, block, fresh, *args, **kwargs), "streamed"),
                 ("compiled with the block's weights staged, streamed",
                  lambda: staged(torch, cast, block, fresh, *args, **kwargs), "streamed"),
                 ("Wan Compile Blocks (streamed Linears lifted), streamed",
                  lambda: node_block(*args, **kwargs), "streamed"),
                 ("eager, streamed from pinned memory", lambda: block(*args, **kwargs), "pinned"),
                 ("Wan Compile Blocks (streamed Linears lifted), streamed from pinned memory",
                  lambda: node_block(*args, **kwargs), "pinned"),
                 ("compiled with the block's weights staged, streamed from pinned memory",
                  lambda: staged(torch, cast, block, fresh, *args, **kwargs), "pinned")]
        for name, fn, state in modes:
            if cpu and state == "pinned":  # page-locked memory needs a GPU
                continue
            streamed = state != "resident"
            if streamed:
                _stream(torch, block, pinned=state == "pinned")
            snap = None
            if a.snapshots and streamed:
                Path(a.snapshots).mkdir(parents=True, exist_ok=True)
                snap = str(Path(a.snapshots) / (name.replace(",", "").replace("'", "").replace(" ", "-") + ".pickle"))
            if compiled is None or not a.one_compile:
                torch._dynamo.reset()
                compiled = torch.compile(block, backend="inductor")
            peak, secs = _cpu_peak(torch, fn) if cpu else _peak(torch, fn, snapshot=snap)
            row = {"mode": name, "size": a.size, "peak_above_input_gib": round(peak, 3), "s": round(secs, 3),
                   "device": a.device, "dims": a.dims, "one_compile": a.one_compile,
                   "copy_staged": a.copy_staged}
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "torch": torch.__version__}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
