"""Forward-peak records: the real activation peak of ComfyUI's Wan forward on this GPU, beside the
working-memory model's prediction for it.

For each model (A14B dim 5120, TI2V-5B dim 3072, 1.3B dim 1536) built with random weights at its
real dims through ComfyUI's own model config, each dtype and attention (SDPA, or the wan-sage
override in each ``--memory-modes`` mode), and each size of the size set, it runs one real sampling
step (comfy.sample.sample) and measures ``torch.cuda.max_memory_allocated`` around the
diffusion-model forward through a DIFFUSION_MODEL wrapper.  It prints one JSON line per run with
the wan-sage prediction and ComfyUI's own estimate beside the measurement, and everything needed to
recompute the prediction later (dims, latent, attention paths, compiled, and the Sage patch's memory
mode: ``memory_mode`` as asked, None for PatchConfig's default, and ``memory_mode_in_force`` as its
config holds it, None where PatchConfig has no such field).

Size sets: ``fit`` (the sizes the memory model was fitted on, ``bench/records/forward-peaks/fit.jsonl``)
and ``heldout`` (sizes the fit never saw: other aspect ratios, portrait, longer clips, other frame
counts).  ``--compile`` compiles every transformer block (ComfyUI's ``set_torch_compile_wrapper``,
keys ``diffusion_model.blocks.N``, inductor) after a ``torch._dynamo.reset()``, runs the step once
to compile and measures the second run.  Before the runs it prints the estimated time of the plan
from the per-forward seconds measured in the fitted table; ``--deadline-s`` starts no run (and
builds no model) that could end after it, and ``--skip-done`` skips runs already recorded.

    COMFYUI_PATH=... python -m bench.forward_peaks --allocator async --out table.jsonl
    COMFYUI_PATH=... python -m bench.forward_peaks --sizeset heldout --out heldout.jsonl
    COMFYUI_PATH=... python -m bench.forward_peaks --compile --models a14b --memory-modes sdpa,fastest --out compiled.jsonl
    python -m bench.forward_peaks --sizeset heldout --estimate-only       # the plan's time, no GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from . import _compile, _host

SIZES = {
    "a14b": [(832, 480, 17), (832, 480, 49), (1280, 720, 33), (832, 480, 81), (1280, 720, 57), (1280, 720, 81)],
    "1.3b": [(832, 480, 17), (832, 480, 49), (1280, 720, 33), (832, 480, 81), (1280, 720, 57), (1280, 720, 81)],
    "ti2v5b": [(832, 480, 41), (832, 480, 81), (1280, 704, 41), (1280, 720, 81), (1280, 704, 121), (1280, 720, 121)],
}
# Sizes the fit never saw, per model: other aspect ratios (16:9 at 1024x576, square), portrait (same
# and other token counts than a fitted size), other frame counts (25, 65, 97) and longer clips (121, 161
# frames at 480p).  Width and height are multiples of 16 (32 for TI2V-5B's 16x VAE), so no pixel is
# dropped.  A14B keeps its two square / 720p-portrait sizes at 49 frames: its cost per forward grows with
# the square of the tokens, and the whole set stays under five minutes on an H200 (--estimate-only).
HELDOUT = {
    "a14b": [(1024, 576, 81), (960, 960, 49), (480, 832, 81), (720, 1280, 49), (832, 480, 25), (832, 480, 65),
             (832, 480, 97), (832, 480, 121), (832, 480, 161), (1024, 576, 121)],
    "1.3b": [(1024, 576, 81), (960, 960, 81), (480, 832, 81), (720, 1280, 65), (832, 480, 25), (832, 480, 65),
             (832, 480, 97), (832, 480, 121), (832, 480, 161)],
    "ti2v5b": [(1024, 576, 81), (960, 960, 81), (480, 832, 81), (704, 1280, 121), (832, 480, 25), (832, 480, 65),
               (1280, 704, 97), (832, 480, 161), (1280, 704, 161)],
}
SIZESETS = {"fit": SIZES, "heldout": HELDOUT}
FITTED_TABLE = _host.ROOT / "bench" / "records" / "forward-peaks" / "fit.jsonl"

# The plan's time estimate, besides the forwards themselves (seconds; guesses, shown with the estimate):
ROW_OVERHEAD_S = 0.5        # one comfy.sample.sample call around the forward: sampler set-up, noise, copies
BUILD_S = {"a14b": 25.0, "ti2v5b": 10.0, "1.3b": 5.0, "tiny": 1.0}   # random weights on the GPU + loading
BOOT_S = 20.0               # process start, ComfyUI and the pack imported
COMPILE_ALLOWANCE_S = 20.0  # per compiled run: per-block inductor compile (15-23 s measured on the H200 at A14B)


def forward_cost_model(path: Path = FITTED_TABLE) -> dict:
    """Seconds of one forward as ``a * L + b * L**2`` per (model, attn), least squares over the fitted
    table's measured ``sec`` (each dtype; the first row measured for a model and dtype is left out: it
    carries the process's first-forward set-up)."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []
    groups: dict = {}
    seen = set()
    for r in rows:
        first = (r["model"], r["dtype"]) not in seen
        seen.add((r["model"], r["dtype"]))
        if first or not r.get("sec"):
            continue
        groups.setdefault((r["model"], r["attn"]), []).append((r["tokens"], r["sec"]))
    fits = {}
    for key, pts in groups.items():
        # normal equations of sec = a L + b L^2
        s11 = sum(L * L for L, _ in pts)
        s12 = sum(L ** 3 for L, _ in pts)
        s22 = sum(L ** 4 for L, _ in pts)
        y1 = sum(L * s for L, s in pts)
        y2 = sum(L * L * s for L, s in pts)
        det = s11 * s22 - s12 * s12
        if det <= 0:
            continue
        a = (y1 * s22 - y2 * s12) / det
        b = (s11 * y2 - s12 * y1) / det
        fits[key] = (max(a, 0.0), max(b, 0.0))
    return fits


def forward_s(fits: dict, model: str, attn: str, tokens: int) -> float:
    """Estimated seconds of one forward; a model or attention the table lacks costs as A14B SDPA."""
    a, b = fits.get((model, attn)) or fits.get((model, "sdpa")) or fits.get(("a14b", "sdpa"), (1e-4, 2e-9))
    return a * tokens + b * tokens * tokens


def plan_rows(models, dtypes, attns, modes, sizes_of) -> list[dict]:
    """The runs in order: model, dtype, attention (and for Sage each memory mode), size."""
    out = []
    for m in models:
        for d in dtypes:
            for at in attns:
                for mode in (modes if at == "sage" else [None]):
                    for size in sizes_of(m):
                        out.append({"model": m, "dtype": d, "attn": at, "memory_mode": mode, "size": size})
    return out


def same_as_ungrouped(plan: list[dict], cc: int = 90) -> tuple[list[dict], list[dict]]:
    """(kept, dropped): a Sage run in the "sdpa" memory mode whose call the head-group formula leaves
    ungrouped on ``cc`` runs exactly the "fastest" run of the same size, so it is dropped when that
    run is in the plan (the "fastest" row stands for both)."""
    from wan_sage.attention import registry
    from wan_sage.memory import activation_model
    from wan_sage.memory.estimate import sage_groups
    order = registry.auto_order(cc)
    if not order:
        return plan, []
    path = registry.memory_path(order[0], cc)
    fastest = {(r["model"], r["dtype"], r["size"]) for r in plan if r["attn"] == "sage" and r["memory_mode"] == "fastest"}
    kept, dropped = [], []
    for r in plan:
        if r["attn"] == "sage" and r["memory_mode"] == "sdpa" and (r["model"], r["dtype"], r["size"]) in fastest:
            dims = _host.wan_dims(r["model"])
            L = activation_model.tokens(dims, *activation_model.latent_shape(dims, *r["size"], 1)[2:])
            if sage_groups(dims, path, 1, L, r["dtype"]) == 1:
                dropped.append(r)
                continue
        kept.append(r)
    return kept, dropped


def run_estimate_s(row: dict, fits: dict, compiled: bool) -> float:
    w, h, f = row["size"]
    dims = _host.wan_dims(row["model"])
    from wan_sage.memory import activation_model
    lat = activation_model.latent_shape(dims, w, h, f, 1)
    tokens = activation_model.tokens(dims, *lat[2:])
    one = forward_s(fits, row["model"], row["attn"], tokens) + ROW_OVERHEAD_S
    return 2 * one + COMPILE_ALLOWANCE_S if compiled else one


def print_estimate(plan: list[dict], fits: dict, compiled: bool, log) -> float:
    """Log the plan's estimated seconds per model and in total; returns the total."""
    total = BOOT_S
    by_model: dict = {}
    for r in plan:
        by_model.setdefault(r["model"], []).append(run_estimate_s(r, fits, compiled))
    for m, secs in by_model.items():
        total += BUILD_S.get(m, 20.0) * len({r["dtype"] for r in plan if r["model"] == m}) + sum(secs)
        log(f"# estimate {m}: {len(secs)} runs, {sum(secs):.0f} s of forwards"
            f"{' (each compiled: 2 forwards + ' + format(COMPILE_ALLOWANCE_S, 'g') + ' s)' if compiled else ''}"
            f" + {BUILD_S.get(m, 20.0):g} s per build")
    log(f"# estimate total: {total:.0f} s ({total / 60:.1f} min) including {BOOT_S:g} s start; "
        f"per-forward seconds from {FITTED_TABLE.name} (a L + b L^2 per model and attention)")
    return total


def row_key(r: dict) -> tuple:
    """What makes two forward-peak runs the same run (for --skip-done)."""
    return (r["model"], r["dtype"], r["attn"], r.get("memory_mode"), bool(r.get("compiled")),
            r["width"], r["height"], r["frames"])


def done_rows(paths: str | None) -> set:
    return {row_key(r) for r in _host.jsonl_records(paths) if r.get("ok") and "model" in r and "width" in r}


def summary_line(r: dict) -> str:
    """One readable line per row, after its JSON line (``# row ...``)."""
    gib = 1 << 30
    what = f"{r['model']} {r['dtype']} {r['attn']}" + (f"/{r['memory_mode']}" if r.get("memory_mode") else "") + \
        (" compiled" if r.get("compiled") else "") + f" {r['width']}x{r['height']}x{r['frames']} ({r['tokens']} tokens)"
    if not r["ok"]:
        return f"# row {what}: FAILED {(r.get('error') or 'out of memory').splitlines()[0][:160]}"
    measured = "-" if r["measured"] is None else f"{r['measured'] / gib:.3f}"
    err = "" if r.get("err") is None else f" ({r['err']:+.1%})"
    sec = "-" if r.get("sec") is None else f"{r['sec']:.2f}"
    return f"# row {what}: measured {measured} GiB, predicted {r['predicted'] / gib:.3f} GiB{err}, {sec} s/forward"


def _sizes(text: str) -> list[tuple]:
    return [tuple(int(x) for x in s.lower().split("x")) for s in text.split(",") if s.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.forward_peaks", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="a14b,ti2v5b,1.3b")
    ap.add_argument("--dtypes", default=None, help="default: bf16,fp16 for the fit set, bf16 for the held-out set "
                                                   "and for compiled rows")
    ap.add_argument("--attn", default="sdpa,sage")
    ap.add_argument("--memory-modes", default="default",
                    help="the Sage patch's memory modes, comma list: default (PatchConfig's own), sdpa (grouped), "
                         "fastest (ungrouped); passed straight into PatchConfig")
    ap.add_argument("--sizeset", choices=sorted(SIZESETS), default="fit")
    ap.add_argument("--compile", action="store_true", help="per-block torch.compile; the measured run is the second")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend with --compile (eager: CPU smoke runs)")
    ap.add_argument("--allocator", choices=["async", "native"], default="async")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sizes", default=None, help="limit to the first N sizes")
    ap.add_argument("--size", default=None, help="sizes WxHxF[,WxHxF...] instead of the size set (smoke runs)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no run, and build no model, that could end after this many seconds from the start")
    ap.add_argument("--skip-done", default=None, metavar="JSONL[,JSONL]", help="skip runs with an ok row there")
    ap.add_argument("--estimate-only", action="store_true", help="print the plan's estimated time and exit")
    ap.add_argument("--cpu", action="store_true", help="smoke-run the harness on the CPU (no peaks)")
    a = ap.parse_args(argv)
    a.dtypes = a.dtypes or ("bf16,fp16" if a.sizeset == "fit" and not a.compile else "bf16")
    a.modes = [None if m.strip() == "default" else m.strip() for m in a.memory_modes.split(",") if m.strip()]
    bad = [m for m in a.modes if m not in (None, *_host.MEMORY_MODES.values())]
    if bad:
        ap.error(f"--memory-modes: unknown {', '.join(bad)}; choose from default, {', '.join(_host.MEMORY_MODES.values())}")
    return a


def main(argv=None):
    t_start = time.perf_counter()
    a = parse_args(argv)
    _host.set_allocator(a.allocator)        # before anything imports torch
    commit = _host.git_head()               # once: each row names the same checkout

    def log(msg):
        print(msg, flush=True)

    models = a.models.split(",")

    unknown = [m for m in models if m not in SIZESETS[a.sizeset]]
    if unknown and not a.size:
        raise SystemExit(f"no {a.sizeset} sizes for {', '.join(unknown)}: pass --size WxHxF[,...]")

    def sizes_of(m):
        if a.size:
            return _sizes(a.size)
        s = SIZESETS[a.sizeset][m]
        return s[: int(a.sizes)] if a.sizes else s

    def sizeset_of(m, size):
        """The set a size belongs to ("custom" when --size named one outside it)."""
        return a.sizeset if size in SIZESETS[a.sizeset].get(m, []) else "custom"
    plan = plan_rows(models, a.dtypes.split(","), a.attn.split(","), a.modes, sizes_of)
    _host.load_pack()
    plan, dropped = same_as_ungrouped(plan)
    if dropped:
        log(f"# {len(dropped)} sdpa-mode Sage runs left out: one head group on sm90, the fastest run of the same size "
            "stands for them (" + ", ".join(f"{r['model']} {'x'.join(map(str, r['size']))}" for r in dropped) + ")")
    fits = forward_cost_model()
    print_estimate(plan, fits, a.compile, log)
    if a.estimate_only:
        return 0
    _host.check_memory_modes(a.modes if "sage" in a.attn.split(",") else [])
    _host.boot_comfy(cpu=a.cpu, pytorch_attention=a.cpu and a.compile)
    import torch
    import comfy.model_management as mm
    import comfy.patcher_extension as pe
    import comfy.sample
    from wan_sage.attention import stats
    from wan_sage.memory import activation_model
    from wan_sage.memory.estimate import activation_bytes, attention_plan
    from wan_sage.attention import kernels

    dev = mm.get_torch_device()
    cc = kernels.device_cc(dev) if dev.type == "cuda" else None
    emit = _host.JsonLines(a.out)
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    cache_dir = os.path.join(tempfile.gettempdir(), "wan_sage_calib")
    gpu = torch.cuda.get_device_name() if cc else "cpu"
    mode_field = _host.has_memory_mode()     # False: "fastest" runs as a dispatch without the field does
    print(json.dumps({"gpu": gpu, "torch": torch.__version__,
                      "allocator": a.allocator,
                      "alloc_backend": torch.cuda.memory.get_allocator_backend() if cc else None,
                      "sageattention": kernels.probe().sage_version, "sizeset": a.sizeset, "compiled": a.compile,
                      "memory_mode_field": mode_field}), flush=True)
    watch = _compile.DynamoWatch(torch) if a.compile else None
    if a.compile:
        _compile.set_recompile_limit(torch, _compile.BLOCK_RECOMPILE_LIMIT)
    done = done_rows(a.skip_done)
    # measured / estimated seconds of the runs so far: the estimates follow this machine, down to half
    # of them (the compile allowance is a first-run guess; later compiles of a model take less)
    slow = [1.0]

    def fits_in(seconds):
        if a.deadline_s is None:
            return True
        return time.perf_counter() - t_start + seconds * max(0.5, statistics.median(slow)) <= a.deadline_s

    for mname in models:
        for dname in a.dtypes.split(","):
            mine = [r for r in plan if (r["model"], r["dtype"]) == (mname, dname)]
            todo = [r for r in mine if (mname, dname, r["attn"], r["memory_mode"], a.compile, *r["size"]) not in done]
            if not todo:
                continue
            if not fits_in(BUILD_S.get(mname, 20.0) + run_estimate_s(todo[0], fits, a.compile)):
                log(f"# deadline: {mname} {dname} not built, {len(todo)} runs left out")
                continue
            t0 = time.time()
            patcher = _host.build_wan(mname, dts[dname], dev)
            mm.load_models_gpu([patcher])
            dims = _host.wan_dims(mname)
            print(f"# built {mname} {dname} in {time.time() - t0:.1f}s; weights {patcher.model_size() / 2**30:.2f} GiB", flush=True)
            for attn in a.attn.split(","):
                for mode in (a.modes if attn == "sage" else [None]):
                    runs = [r for r in todo if (r["attn"], r["memory_mode"]) == (attn, mode)]
                    if not runs:
                        continue
                    m = patcher.clone()
                    rec = {}

                    def wrapper(executor, *args, **kwargs):
                        cuda = dev.type == "cuda"
                        if cuda:
                            torch.cuda.synchronize()
                            base = torch.cuda.memory_allocated()
                            base_reserved = torch.cuda.memory_reserved()
                            torch.cuda.reset_peak_memory_stats()
                        s = time.perf_counter()
                        r = executor(*args, **kwargs)
                        if cuda:
                            torch.cuda.synchronize()
                            rec["peak"] = torch.cuda.max_memory_allocated() - base
                            rec["peak_reserved"] = torch.cuda.max_memory_reserved() - base_reserved
                        rec["sec"] = time.perf_counter() - s
                        return r
                    m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "calib", wrapper)
                    ov = None
                    if attn == "sage":
                        ov = _host.sage_override(mode, calibrate=False, cache_dir=cache_dir)
                        m.model_options["transformer_options"]["optimized_attention_override"] = ov
                    settings = _compile.compile_blocks(m, a.backend) if a.compile else None
                    for r in runs:
                        (w, h, f) = r["size"]
                        need = run_estimate_s(r, fits, a.compile)
                        if not fits_in(need):
                            log(f"# deadline: {mname} {dname} {attn} {mode or ''} {w}x{h}x{f} left out")
                            continue
                        t_row = time.perf_counter()
                        lat = activation_model.latent_shape(dims, w, h, f, 1)
                        L = activation_model.tokens(dims, *lat[2:])
                        g = torch.Generator().manual_seed(0)
                        noise = torch.randn(lat, generator=g)
                        ctx = torch.randn(1, 512, 4096, generator=g) * 0.1
                        pos = [[ctx, {}]]
                        dynamo = None
                        error = None
                        ok = True
                        st = {}
                        for attempt in ("compile", "measure") if a.compile else ("measure",):
                            rec.clear()
                            if attempt == "compile":
                                watch.reset()
                            before = watch.reading() if watch else None
                            if ov is not None:
                                stats.begin_run(ov.patch_id)
                            try:
                                with torch.inference_mode():   # as ComfyUI's PromptExecutor runs every node
                                    comfy.sample.sample(m, noise, 1, 1.0, "euler", "simple", pos, pos, torch.zeros(lat),
                                                        seed=0, disable_pbar=True)
                            except torch.OutOfMemoryError:
                                ok = False
                            except Exception as e:  # a compile failure: recorded, the next run goes on
                                if not a.compile:
                                    raise
                                ok, error = False, f"{type(e).__name__}: {e}"[:600]
                            st = stats.end_run(ov.patch_id) if ov is not None else {}
                            if watch:
                                step = watch.delta(watch.reading(), before)
                                dynamo = dynamo or {}
                                dynamo[attempt] = step
                            if not ok:
                                break
                        paths = attention_plan("sdpa" if attn == "sdpa" else "sage-auto", cc)
                        self_p, cross_p = paths.self_path, paths.cross_path
                        if st and not st.get("sage_calls"):
                            self_p = "sdpa"
                        wl = activation_model.Workload(L=L, rows=1, dtype=dname, self_attn=self_p, cross_attn=cross_p,
                                        latent_elems_per_row=activation_model.latent_elems(lat))
                        pred = activation_bytes(dims, wl)
                        row = {"model": mname, "dtype": dname, "attn": attn, "width": w, "height": h, "frames": f,
                               "tokens": L, "ok": ok, "measured": rec.get("peak") if ok else None, "predicted": pred["total"],
                               "phase": pred["dominant_phase"], "model_no_slack": pred["total"] - pred["slack"],
                               "comfy": int(patcher.model.memory_required(list(lat))), "sec": rec.get("sec") if ok else None,
                               "sage": {k: st.get(k) for k in ("sage_calls", "sdpa_calls", "reasons", "by_kernel",
                                                               "head_split_calls", "fallbacks")} if st else None}
                        if ok and rec.get("peak"):
                            row["err"] = (pred["total"] - rec["peak"]) / rec["peak"]
                        # what the prediction needs, to be recomputed by a later model
                        row.update({"sizeset": sizeset_of(mname, (w, h, f)), "preset": _host.presets().get(mname),
                                    "dims": {k: getattr(dims, k) for k in ("dim", "ffn_dim", "num_heads", "num_layers",
                                                                          "in_dim", "out_dim", "latent_channels")},
                                    "vae_stride": list(dims.vae_stride), "latent": list(lat),
                                    "self_attn_path": self_p, "cross_attn_path": cross_p, "memory_mode": mode,
                                    "memory_mode_field": mode_field,
                                    "memory_mode_in_force": getattr(ov and ov.config, "memory_mode", None),
                                    "compiled": a.compile, "compile": settings,
                                    "measured_reserved": rec.get("peak_reserved") if ok else None,
                                    "weights_bytes": int(patcher.model_size()), "gpu": gpu,
                                    "predicted_by": {"wan_sage_commit": commit,
                                                     "note": "the eager phase model of this checkout"}})
                        if a.compile:
                            row["dynamo"] = dynamo
                            row["graph_break_reasons"] = watch.break_reasons(5)
                            row["error"] = error
                        emit(row)
                        log(summary_line(row))
                        slow.append((time.perf_counter() - t_row) / max(need, 1e-3))
                    del m
            mm.unload_all_models()
            del patcher
            if cc:
                torch.cuda.empty_cache()
    if watch:
        watch.close()
    emit.close()


if __name__ == "__main__":
    main()
