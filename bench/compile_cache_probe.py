"""What a compile file the pack keeps (``torch.compiler.save_cache_artifacts``, nodes/compile_cache.py) brings back to a
fresh process: one Wan A14B block compiled in four processes, each with inductor's and Triton's folders as a ComfyUI
start would find them.

1. ``empty``: both folders empty; the block is compiled, and what the process compiled is saved as the pack saves it.
2. ``pack's file``: both folders empty again, the file hot-loaded first (``torch.compiler.load_cache_artifacts``), as
   after a reboot with the pack's folder kept.
3. ``pack's file, Triton kept``: inductor's folder empty, Triton's that of process 1, the file hot-loaded.
4. ``all kept``: both folders those of process 1, no file: a restart without a reboot.

Per process: the first call (the compile) and a later one, in seconds; inductor's counters (FX graph cache hits,
kernels compiled); how each Triton kernel found its launch configuration (``autotune_cache_state``: ``hit`` from the
autotune cache, ``miss`` benchmarked, ``only 1 config``; per kernel with a choice, whether its autotune cache file
exists and matches one configuration); the seconds dynamo's phases took (autotuning is
``CachingAutotuner.benchmark_all_configs``); and, for the saved file, the artifacts it holds by kind.  On the H200 a
process that hot-loaded the file still spent 2.6 s autotuning in the 20-step prompt's first step (docs/benchmarks.md,
"Whole generation"); this says which kernels came back and which did not.

    COMFYUI_PATH=... python -m bench.compile_cache_probe --out $OUT/compile-cache-probe.jsonl [--size 1280x720x81]

``--device cpu --dims 1536x8960 --size 512x512x17`` runs the same on the host (C++ kernels: no Triton autotuning).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (name, inductor folder of its own or process 1's, Triton folder of its own or process 1's, hot-load the file).
# Process 1's folders stay on disk throughout: a graph a later process finds brings its kernels under process 1's
# paths, and torch reads their saved autotuning there, as a user's unchanged cache path gives it.
PROCESSES = (("empty", "own", "own", False), ("pack's file", "own", "own", True),
             ("pack's file, Triton kept", "own", "first", True), ("all kept", "first", "first", False))


def folders(work: Path, index: int, inductor: str, triton: str) -> dict:
    """The cache folders of process ``index`` (1-based): its own, or process 1's where the table says ``first``."""
    def one(kind: str, which: str) -> str:
        return str(work / f"{kind}-{1 if which == 'first' else index}")
    return {"TORCHINDUCTOR_CACHE_DIR": one("torchinductor", inductor), "TRITON_CACHE_DIR": one("triton", triton)}


def _autotuners():
    """Every Triton kernel (``CachingAutotuner``) of the modules inductor loaded in this process, as each module
    holds it; none without Triton (C++ kernels only)."""
    from torch._inductor.codecache import PyCodeCache
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return
    for m in list(PyCodeCache.modules):
        for v in vars(m).values():
            if isinstance(v, CachingAutotuner):
                yield v


def autotune_states(torch) -> dict:
    """How each Triton kernel loaded in this process found its configuration: count by ``autotune_cache_state``."""
    return dict(Counter((getattr(v, "autotune_cache_info", None) or {}).get("autotune_cache_state", "none")
                        for v in _autotuners()))


def autotune_kernels(torch) -> list:
    """Each Triton kernel loaded in this process that had configurations to choose from: its name, heuristic, how
    many configurations it had and has left, its autotune cache state, whether its kernel file lies under this
    process's inductor folder, and whether the autotune cache file its key names exists there (with how many of its
    configurations match the choice written in it: torch reads the choice back only where exactly one does)."""
    try:
        from torch._inductor.runtime.autotune_cache import AutotuneCache
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        from torch._inductor.runtime.triton_heuristics import hash_configs
    except ImportError:  # no Triton: C++ kernels only
        return []
    rows, seen = [], set()
    for v in _autotuners():
        if id(v) in seen:
            continue
        seen.add(id(v))
        # a kernel compiled in this process drops its list once compiled: its compiled configs stand for it
        configs = list(getattr(v, "configs", None) or [])
        listed = bool(configs)
        configs = configs or [r.config for r in (getattr(v, "compile_results", None) or []) if hasattr(r, "config")]
        info = getattr(v, "autotune_cache_info", None) or {}
        if len(configs) < 2 and info.get("autotune_cache_state") != "miss":
            continue
        name = getattr(getattr(v, "fn", None), "__name__", None) or str(getattr(v, "filename", "?"))
        row = {"kernel": name, "heuristic": str(getattr(v, "heuristic_type", "")), "configs": len(configs),
               "configs_from": "list" if listed else "compiled",
               "launchers": len(getattr(v, "launchers", None) or []), "state": info.get("autotune_cache_state"),
               "file_in_cache_dir": str(getattr(v, "filename", "")).startswith(str(cache_dir()))}
        try:
            configs_hash = hash_configs(configs)
            cache = AutotuneCache.create(v.inductor_meta, v.filename, configs_hash)
            local = cache.local_cache if cache is not None else None
            path = local[1] if local else None
            row["best_config_file"] = bool(path) and os.path.isfile(path)
            if row["best_config_file"]:
                best = json.loads(Path(path).read_text())
                row["best_configs_hash_matches"] = best.get("configs_hash") == configs_hash
                row["best"] = {k: v for k, v in best.items() if k not in ("configs_hash", "found_by_coordesc")}
                row["matching_configs"] = sum(
                    1 for c in configs
                    if all(best.get(k) == val for k, val in c.kwargs.items())
                    and c.num_warps == best.get("num_warps") and c.num_stages == best.get("num_stages"))
        except Exception as e:  # torch's private API moved: say so in the row
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def _child(a) -> int:
    """One process of the table: compile the block, time two calls, say what the caches gave, save or load the file."""
    sys.path.insert(0, str(ROOT / "tests" / "host"))
    import comfy_env

    from bench import _host
    from bench.streamed_block_peak import _block_and_inputs
    _host.ensure_av(allow_stub=True)
    comfy = comfy_env.boot(cpu=a.device == "cpu", attention="pytorch")
    import torch
    import torch._dynamo.utils as dyn_utils
    width, height, frames = (int(v) for v in a.size.split("x"))
    block, args, kwargs = _block_and_inputs(comfy, torch, width, height, frames, a.device,
                                            tuple(int(v) for v in a.dims.split("x")))
    loaded = None
    if a.load:
        info = torch.compiler.load_cache_artifacts(Path(a.load).read_bytes())
        loaded = {k: len(v) for k, v in getattr(info, "artifacts", {}).items()} if info is not None else None

    def sync():
        if a.device == "cuda":
            torch.cuda.synchronize()
    _host.load_pack()
    from wan_sage.nodes.compile_blocks import compile_kwargs
    compiled = torch.compile(block, **({"backend": "inductor"} if a.torch_defaults else compile_kwargs("inductor")))
    times = []
    with torch.inference_mode():
        for _ in range(2):
            sync()
            t0 = time.perf_counter()
            compiled(*args, **kwargs)
            sync()
            times.append(round(time.perf_counter() - t0, 3))
    row = {"process": a.name, "first_call_s": times[0], "later_call_s": times[1], "loaded_artifacts": loaded,
           "inductor": {k: v for k, v in dyn_utils.counters["inductor"].items()},
           "autotune": autotune_states(torch),
           "autotune_kernels": autotune_kernels(torch),
           "phases_s": {k: round(sum(v), 3) for k, v in sorted(dyn_utils.compilation_time_metrics.items())},
           "folders": {k: Path(os.environ[k]).name for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}}
    if a.save:
        found = torch.compiler.save_cache_artifacts()
        if found is not None:
            Path(a.save).write_bytes(found[0])
            row["saved_artifacts"] = {k: len(v) for k, v in found[1].artifacts.items()}
            row["saved_bytes"] = len(found[0])
    print("ROW " + json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1280x720x81")
    ap.add_argument("--dims", default="5120x13824", help="dim x ffn_dim of the block (A14B's by default)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--out", help="JSON lines, one per process")
    ap.add_argument("--timeout", type=int, default=300, help="seconds each process may take")
    ap.add_argument("--torch-defaults", action="store_true",
                    help="compile with torch's inductor defaults instead of Wan Compile Blocks' options")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--name", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("--load", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(a)
    if not a.out:
        ap.error("--out is required")
    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-cache-probe-") as tmp:
        work, file = Path(tmp), Path(tmp) / "pack-file.bin"
        for i, (name, inductor, triton, load) in enumerate(PROCESSES, start=1):
            env = dict(os.environ, **folders(work, i, inductor, triton))
            cmd = [sys.executable, "-m", "bench.compile_cache_probe", "--child", "--name", name, "--size", a.size,
                   "--dims", a.dims, "--device", a.device]
            cmd += ["--save", str(file)] if i == 1 else (["--load", str(file)] if load else [])
            cmd += ["--torch-defaults"] if a.torch_defaults else []
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout, check=False)
            found = [line[4:] for line in p.stdout.splitlines() if line.startswith("ROW ")]
            row = json.loads(found[-1]) if p.returncode == 0 and found else {
                "process": name, "error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
            row.update(size=a.size, dims=a.dims, device=a.device)
            row["options"] = "torch defaults" if a.torch_defaults else "Wan Compile Blocks"
            print(json.dumps(row), flush=True)
            rows.append(row)
            with open(a.out, "a" if i > 1 else "w") as f:  # row by row: a killed run keeps what it measured
                f.write(json.dumps(row) + "\n")
            if i == 1 and not file.exists():
                break  # nothing was saved: the other processes would measure nothing
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
