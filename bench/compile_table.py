"""The compile table: one real ComfyUI Wan forward, eager or compiled, with SDPA or the
Sage patch, per configuration: seconds per forward, activation peak, graph breaks, graphs,
recompiles, Sage call counts and compile time.

The model is built through ComfyUI's own model config at real dims (``--model``, default A14B) with
random weights in ``--dtype``, fully resident.  Per configuration it runs ``comfy.sample.sample``
(``--steps`` steps, cfg 1.0, so one forward per step) ``--repeats`` times; the first run compiles,
the last is the one reported.  Compile is per transformer block, inductor by default: ComfyUI's
``set_torch_compile_wrapper`` with keys ``diffusion_model.blocks.N`` (``bench._compile``), after a
``torch._dynamo.reset()`` so every configuration compiles as a fresh process would.  Around every
diffusion-model forward a DIFFUSION_MODEL wrapper reads the seconds, the activation peak
(``max_memory_allocated`` during the forward minus what was allocated before it), the reserved peak
likewise, and the frames dynamo compiled during it.

Configurations, ``{eager|compile}-{sdpa|sage[-grouped|-ungrouped]}[-fullgraph]``:

* ``sage-grouped``: the patch with ``memory_mode="sdpa"`` (Sage calls split into head groups so that
  they need no more memory than SDPA); ``sage-ungrouped``: ``memory_mode="fastest"``; plain ``sage``:
  PatchConfig's default.  The mode goes straight into ``PatchConfig``; a checkout whose PatchConfig
  lacks the field runs ``sdpa`` and ``sage-ungrouped`` (what it does without it) and stops at once, with a
  message, when a grouped configuration is asked for.  The record has the mode asked for
  (``memory_mode``) and the one the override's PatchConfig holds (``memory_mode_in_force``; None
  without the field).
* ``-fullgraph``: compile with ``fullgraph=True`` (an error is recorded when dynamo must break the graph).

One JSON line per configuration on stdout and appended to ``--out`` as soon as it is measured;
``--skip-done`` skips configurations already recorded; ``--deadline-s`` starts no configuration that
could end after it (each is estimated from the configurations measured before it).

    COMFYUI_PATH=... python -m bench.compile_table --size 1280x720x81 --out table.jsonl
    COMFYUI_PATH=... python -m bench.compile_table --cpu --model tiny --size 64x64x5 --backend eager \\
        --configs eager-sdpa,compile-sage-ungrouped        # CPU smoke run, no memory readings
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from . import _compile, _host

SCHEMA = "wan-sage-compile/1"
GiB = 1 << 30
# In priority order: eager and per-block compile with SDPA and the patch grouped and ungrouped, then fullgraph
# (SDPA's last: it has no graph break to find).
ALL_CONFIGS = ("eager-sdpa", "eager-sage-grouped", "eager-sage-ungrouped", "compile-sdpa", "compile-sage-grouped",
               "compile-sage-ungrouped", "compile-sage-grouped-fullgraph", "compile-sage-ungrouped-fullgraph",
               "compile-sdpa-fullgraph")
DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Config:
    name: str
    compiled: bool
    attention: str             # sdpa | sage
    memory_mode: str | None    # PatchConfig.memory_mode; None: its default
    fullgraph: bool

    @classmethod
    def parse(cls, name: str) -> "Config":
        parts = name.split("-")
        full = parts[-1] == "fullgraph"
        if full:
            parts = parts[:-1]
        ok = len(parts) in (2, 3) and parts[0] in ("eager", "compile") and parts[1] in ("sdpa", "sage")
        if len(parts) == 3:
            ok = ok and parts[1] == "sage" and parts[2] in _host.MEMORY_MODES
        if not ok or (full and parts[0] == "eager"):
            raise SystemExit(f"bad configuration {name!r}: expected {{eager|compile}}-{{sdpa|sage[-grouped|-ungrouped]}}"
                             "[-fullgraph] (fullgraph with compile only)")
        mode = _host.MEMORY_MODES[parts[2]] if len(parts) == 3 else None
        return cls(name, parts[0] == "compile", parts[1], mode, full)


def estimate_s(cfg: Config, done: list, compile_allowance_s: float) -> float | None:
    """Seconds the configuration may take, from those measured before it: the longest of its kind
    (eager / compiled) plus 10 %; a first compiled one, the longest eager one plus the compile
    allowance.  None when nothing is known yet."""
    same = [s for c, s in done if c.compiled == cfg.compiled]
    if same:
        return 1.1 * max(same)
    eager = [s for c, s in done if not c.compiled]
    if cfg.compiled and eager:
        return 1.1 * max(eager) + compile_allowance_s
    return None


def done_configs(paths: str | None, key: dict) -> set:
    """Names of the configurations with an ``ok`` record of the same model, size, dtype, steps and backend."""
    return {r["config"] for r in _host.jsonl_records(paths)
            if r.get("schema") == SCHEMA and r.get("ok") and all(r.get(k) == v for k, v in key.items())}


class ForwardProbe:
    """DIFFUSION_MODEL wrapper: per forward, seconds, activation and reserved peaks above what was
    allocated / reserved before it (GiB; None on the CPU), and the frames and graphs dynamo compiled
    during it."""

    KEY = "wan_sage_compile_table"

    def __init__(self, torch, cuda: bool, watch: _compile.DynamoWatch):
        self.torch, self.cuda, self.watch = torch, cuda, watch
        self.rows: list[dict] = []

    def __call__(self, executor, *args, **kwargs):
        cuda = self.torch.cuda if self.cuda else None
        if cuda:
            cuda.synchronize()
            base, base_res = cuda.memory_allocated(), cuda.memory_reserved()
            cuda.reset_peak_memory_stats()
        frames, graphs = self.watch.frames(), self.watch.graphs()
        t = time.perf_counter()
        out = executor(*args, **kwargs)
        if cuda:
            cuda.synchronize()
        row = {"s": time.perf_counter() - t, "frames_compiled": self.watch.frames() - frames,
               "graphs_compiled": self.watch.graphs() - graphs, "peak_gib": None, "reserved_peak_gib": None}
        if cuda:
            row["peak_gib"] = (cuda.max_memory_allocated() - base) / GiB
            row["reserved_peak_gib"] = (cuda.max_memory_reserved() - base_res) / GiB
        self.rows.append(row)
        return out


def _r(x, n=3):
    """Floats rounded for the record; anything else as it is."""
    return round(x, n) if isinstance(x, float) else x


def environment(torch, cuda: bool) -> dict:
    from wan_sage.attention import kernels
    from comfy.ldm.modules import attention as comfy_attention
    probe = kernels.probe()
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import comfyui_version
        comfy_version = comfyui_version.__version__
    except ImportError:
        comfy_version = None
    return {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "allocator": torch.cuda.memory.get_allocator_backend() if cuda else None, "comfyui": comfy_version,
            "optimized_attention": comfy_attention.optimized_attention.__name__,
            "sageattention": probe.sage_version, "sage_flavour": probe.sage_flavour,
            "sageattention_commit": os.environ.get("SAGEATTENTION_COMMIT"),
            "wan_sage_commit": _host.git_head(), "memory_mode_field": _host.has_memory_mode()}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.compile_table", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(_host.WAN_CONFIGS), default="a14b")
    ap.add_argument("--size", default="1280x720x81", help="WxHxF")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help="comma list, in the order to run")
    ap.add_argument("--steps", type=int, default=2, help="sampling steps per run (one forward each, cfg 1.0)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per configuration; the first compiles, the last is reported")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: CPU smoke runs)")
    ap.add_argument("--recompile-limit", type=int, default=_compile.BLOCK_RECOMPILE_LIMIT,
                    help="dynamo's recompile limit (cache_size_limit)")
    ap.add_argument("--allocator", choices=["async", "native"], default="async")
    ap.add_argument("--cache-dir", default=None, help="the Sage patch's timing cache (default: a folder in the temp dir)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no configuration that could end after this many seconds from the start")
    ap.add_argument("--compile-allowance-s", type=float, default=60.0,
                    help="compile time assumed for the first compiled configuration's estimate")
    ap.add_argument("--skip-done", default=None, metavar="JSONL[,JSONL]",
                    help="skip configurations with an ok record of the same model, size, dtype, steps and backend")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--cpu", action="store_true", help="smoke-run on the CPU (no memory readings)")
    a = ap.parse_args(argv)
    try:
        a.width, a.height, a.frames = (int(x) for x in a.size.lower().split("x"))
    except ValueError:
        ap.error(f"--size wants WxHxF, got {a.size!r}")
    a.configs = [Config.parse(c.strip()) for c in a.configs.split(",") if c.strip()]
    if a.repeats < 1 or a.steps < 1:
        ap.error("--repeats and --steps must be >= 1")
    return a


def main(argv=None):
    t_start = time.perf_counter()
    a = parse_args(argv)
    _host.set_allocator(a.allocator)
    _host.boot_comfy(cpu=a.cpu, pytorch_attention=a.cpu)
    _host.load_pack()
    _host.check_memory_modes(c.memory_mode for c in a.configs if c.attention == "sage")
    import tempfile
    import torch
    import comfy.model_management as mm
    import comfy.patcher_extension as patcher_extension
    import comfy.sample
    from wan_sage.attention import stats
    from wan_sage.memory import activation_model

    cuda = torch.cuda.is_available() and not a.cpu
    dev = mm.get_torch_device()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    cache_dir = a.cache_dir or os.path.join(tempfile.gettempdir(), "wan_sage_compile_table")
    limit = _compile.set_recompile_limit(torch, a.recompile_limit)
    env = environment(torch, cuda)
    dims = _host.wan_dims(a.model)
    latent = activation_model.latent_shape(dims, a.width, a.height, a.frames, 1)
    tokens = activation_model.tokens(dims, *latent[2:])
    key = {"model": a.model, "size": f"{a.width}x{a.height}x{a.frames}", "dtype": a.dtype, "steps": a.steps,
           "backend": a.backend}
    done = done_configs(a.skip_done, key)
    emit = _host.JsonLines(a.out)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    todo = [c for c in a.configs if c.name not in done]
    for c in a.configs:
        if c.name in done:
            log(f"compile_table: {c.name} already recorded, skipped")
    if not todo:
        return 0
    t0 = time.perf_counter()
    patcher = _host.build_wan(a.model, dtype, dev)
    mm.load_models_gpu([patcher])
    log(f"compile_table: built {a.model} {a.dtype} in {time.perf_counter() - t0:.1f} s "
        f"({patcher.model_size() / GiB:.2f} GiB), {a.width}x{a.height}x{a.frames} = {tokens} tokens")
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(latent, generator=generator)
    context = torch.randn(1, 512, 4096, generator=generator) * 0.1
    positive = [[context, {}]]
    watch = _compile.DynamoWatch(torch)
    measured: list = []            # (config, seconds) for the deadline's estimates
    eager_sdpa_s = None
    for cfg in todo:
        elapsed = time.perf_counter() - t_start
        need = estimate_s(cfg, measured, a.compile_allowance_s)
        if a.deadline_s is not None and (elapsed >= a.deadline_s or (need is not None and elapsed + need > a.deadline_s)):
            emit({"schema": SCHEMA, "config": cfg.name, **key, "ok": False, "skipped": True,
                  "error": f"deadline {a.deadline_s:g} s: {elapsed:.0f} s spent, about {need or 0:.0f} s needed"})
            continue
        t_cfg = time.perf_counter()
        watch.reset()
        model = patcher.clone()
        probe = ForwardProbe(torch, cuda, watch)
        model.add_wrapper_with_key(patcher_extension.WrappersMP.DIFFUSION_MODEL, ForwardProbe.KEY, probe)
        override = None
        if cfg.attention == "sage":
            override = _host.sage_override(cfg.memory_mode, cache_dir=cache_dir, label=f"compile table {cfg.name}")
            model.model_options["transformer_options"]["optimized_attention_override"] = override
        settings = _compile.compile_blocks(model, a.backend, fullgraph=cfg.fullgraph) if cfg.compiled else None
        row = {"schema": SCHEMA, "config": cfg.name, **key, "width": a.width, "height": a.height, "frames": a.frames,
               "tokens": tokens, "repeats": a.repeats, "compiled": cfg.compiled, "attention": cfg.attention,
               "memory_mode": cfg.memory_mode, "memory_mode_in_force": getattr(override and override.config, "memory_mode", None),
               "fullgraph": cfg.fullgraph, "compile": settings,
               "recompile_limit": limit if cfg.compiled else None, "ok": True, "error": None}
        runs = []
        try:
            for rep in range(a.repeats):
                probe.rows.clear()
                before = watch.reading()
                if override is not None:
                    stats.begin_run(override.patch_id)
                t = time.perf_counter()
                try:
                    with torch.inference_mode():      # as ComfyUI's PromptExecutor runs every node
                        comfy.sample.sample(model, noise, a.steps, 1.0, "euler", "simple", positive, positive,
                                            torch.zeros(latent), seed=0, disable_pbar=True)
                finally:
                    wall = time.perf_counter() - t
                    sage = stats.end_run(override.patch_id) if override is not None else None
                    runs.append({"wall_s": _r(wall), "forwards": [{k: _r(v) for k, v in f.items()} for f in probe.rows],
                                 "dynamo": watch.delta(watch.reading(), before),
                                 "sage": {k: sage.get(k) for k in ("sage_calls", "sdpa_calls", "by_kernel", "reasons",
                                                                   "fallbacks", "head_split_calls", "calibration_ms")}
                                 if sage else None})
        except Exception as e:   # recorded; the next configuration still runs
            row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"[:800]
            if isinstance(e, torch.OutOfMemoryError):
                e.__traceback__ = None
        last = runs[-1] if runs and row["ok"] else None
        if last:
            fwd = last["forwards"]
            row["s_per_forward"] = _r(sum(f["s"] for f in fwd) / len(fwd)) if fwd else None
            peaks = [f["peak_gib"] for f in fwd if f["peak_gib"] is not None]
            reserved = [f["reserved_peak_gib"] for f in fwd if f["reserved_peak_gib"] is not None]
            row["peak_gib"] = max(peaks) if peaks else None
            row["reserved_peak_gib"] = max(reserved) if reserved else None
            row["sage"] = last["sage"]
            if cfg.name == "eager-sdpa":
                eager_sdpa_s = row["s_per_forward"]
            row["x_eager_sdpa"] = _r(eager_sdpa_s / row["s_per_forward"]) if eager_sdpa_s and row["s_per_forward"] else None
        total = watch.reading()
        first = runs[0]["forwards"][0] if runs and runs[0]["forwards"] else {"frames_compiled": 0, "graphs_compiled": 0}
        row["dynamo"] = {"graph_breaks": total["graph_breaks"], "graph_break_reasons": watch.break_reasons(),
                         "unique_graphs": total["unique_graphs"], "frames_compiled": total["frames"],
                         # compiled after the first forward: recompiles or late graphs (0 when decisions are stable)
                         "frames_after_first_forward": total["frames"] - first["frames_compiled"],
                         "graphs_after_first_forward": total["unique_graphs"] - first["graphs_compiled"],
                         "recompiles": total["recompiles"], "recompile_reasons": watch.recompile_reasons(),
                         "compile_s": total["compile_s"]}
        if cfg.compiled and len(runs) >= 2 and row["ok"]:
            row["compile_s_wall"] = _r(runs[0]["wall_s"] - runs[-1]["wall_s"])
        row["runs"] = runs
        row["config_s"] = _r(time.perf_counter() - t_cfg)
        row["env"] = env
        emit(row)
        measured.append((cfg, time.perf_counter() - t_cfg))
        log(f"compile_table: {cfg.name}: " + (f"{row.get('s_per_forward')} s/forward, peak {_r(row.get('peak_gib'))} GiB, "
                                              f"{row['dynamo']['graph_breaks']} graph breaks, x{row.get('x_eager_sdpa')}"
                                              if row["ok"] else f"FAILED {row['error'].splitlines()[0][:200]}") +
            f" ({row['config_s']} s)")
        if override is not None:
            model.model_options["transformer_options"].pop("optimized_attention_override", None)
        del model, probe
        if cuda:
            torch.cuda.empty_cache()
    watch.close()
    emit.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
