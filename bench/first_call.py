"""What the first SageAttention call of a ComfyUI process costs, part by part, on the GPU it runs on.

    python -m bench.first_call [--kernel sage2_sm90] [--json FILE]

Two fresh processes run the same sequence, each part timed on the wall clock with the device
synchronised: the first with empty caches (Triton's kernel cache and the pack's timing cache in new
folders: the first prompt after installing), the second with the folders the first one filled (the
first prompt after a restart).  The parts, in order:

* ``cuda_init``: the CUDA context (stock ComfyUI pays it too);
* ``import``: importing SageAttention (its extension modules) and finding its entry points;
* ``build_identity``: the hash of its compiled files that keys the timing cache;
* ``self_test``: the patch's numerical self-test of the kernel (its first launch, and the first
  compile of SageAttention's Triton quantisation kernels);
* per shape (Wan A14B self-attention at 480p81 and 720p81, bf16): ``sdpa_first`` / ``sdpa_again``
  (PyTorch SDPA's first and second call), ``kernel_first`` / ``kernel_again`` (the kernel's);
* per shape, the patch's own calls with the kernel already loaded: ``patch_first``, the first call;
  ``patch_timing_calls``, how many calls the shape was timed on (one when the timing cache has it);
  ``patch_timing_extra``, what those calls took beyond as many settled calls; ``patch_again``, a
  settled call.

It prints a table and writes one JSON line per process to ``--json``."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

SHAPES = {"a14b_480p81_self": (1, 40, 32760, 128), "a14b_720p81_self": (1, 40, 75600, 128)}


def _measure(kernel: str) -> dict:
    t0 = time.perf_counter()
    import torch
    parts = {}

    def timed(name, fn):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        parts[name] = round(time.perf_counter() - t, 4)
        return out

    timed("cuda_init", lambda: torch.empty(1, device="cuda"))
    from bench import _host
    _host.load_pack()
    from wan_sage.attention import kernels, registry, selftest
    from wan_sage.attention.config import PatchConfig
    from wan_sage.attention.override import SageAttentionOverride
    from wan_sage.attention.sdpa import attention_sdpa
    from wan_sage.attention.state import STATE
    dev = torch.device("cuda")
    cc = kernels.device_cc(dev)
    timed("import", lambda: kernels.probe(refresh=True))  # imports the kernel packages, finds their entry points
    timed("build_identity", lambda: kernels.build_identity(registry.KERNELS[kernel].package))
    verdict = timed("self_test", lambda: selftest.self_test(kernel, dev, torch.bfloat16, cc))
    for name, (B, H, N, D) in SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(1)
        q, k, v = (torch.randn(B, N, H * D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        nhd = [t.view(B, N, H, D) for t in (q, k, v)]
        timed(f"{name}.sdpa_first", lambda: attention_sdpa(q, k, v, H))
        timed(f"{name}.sdpa_again", lambda: attention_sdpa(q, k, v, H))
        timed(f"{name}.kernel_first", lambda: kernels.run(kernel, *nhd, "NHD", None, cc))
        timed(f"{name}.kernel_again", lambda: kernels.run(kernel, *nhd, "NHD", None, cc))
        del nhd, q, k, v
    STATE.reset()
    patch = SageAttentionOverride(PatchConfig(kernel="auto", cache_dir=os.environ["WAN_SAGE_CACHE_DIR"]),
                                  sdpa=attention_sdpa)
    for name, (B, H, N, D) in SHAPES.items():
        gen = torch.Generator(device=dev).manual_seed(2)
        q, k, v = (torch.randn(B, N, H * D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))

        def call():
            return patch(attention_sdpa, q, k, v, heads=H, transformer_options={}, _inside_attn_wrapper=True)
        timed(f"{name}.patch_first", call)
        calls, spent = 1, parts[f"{name}.patch_first"]
        while STATE.trials and calls < 64:  # the rest of the calls that time the shape
            timed(f"{name}._call", call)
            calls, spent = calls + 1, spent + parts.pop(f"{name}._call")
        timed(f"{name}.patch_again", call)
        parts[f"{name}.patch_timing_calls"] = calls
        parts[f"{name}.patch_timing_extra"] = round(spent - calls * parts[f"{name}.patch_again"], 4)
        parts[f"{name}.served"] = patch.plan(q, k, v, H).kernel or "sdpa"
        del q, k, v
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "sageattention": kernels.probe().sage_version, "kernel": kernel, "self_test": verdict,
            "process_s": round(time.perf_counter() - t0, 3), "parts": parts}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.first_call", description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="sage2_sm90", help="the kernel to load and time (default sage2_sm90)")
    ap.add_argument("--json", help="append one JSON line per process to this file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_measure(a.kernel)))
        return 0
    root = tempfile.mkdtemp(prefix="wan-sage-first-call-")
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(root, "triton"),
               WAN_SAGE_CACHE_DIR=os.path.join(root, "wan_sage"))
    rows = []
    for caches in ("empty", "kept"):
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "bench.first_call", "--kernel", a.kernel, "--child"], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row.update(caches=caches, wall_s=round(time.perf_counter() - t, 3))
        rows.append(row)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    names = list(rows[0]["parts"])
    print(f"{rows[0]['gpu']}, torch {rows[0]['torch']}, sageattention {rows[0]['sageattention']}, {a.kernel}")
    print(f"{'part':<34} {'caches empty':>12} {'caches kept':>12}")
    for n in names:
        cells = [r["parts"].get(n) for r in rows]
        print(f"{n:<34} " + " ".join(f"{c:>12}" if not isinstance(c, float) else f"{c:>11.3f}s" for c in cells))
    print(f"{'process (after the interpreter)':<34} " + " ".join(f"{r['process_s']:>11.3f}s" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
