"""Partial-load runs on a simulated smaller card: ComfyUI's own reservation against wan-sage's.

Loads random A14B weights at real size through ComfyUI's own loader
(``comfy.sd.load_diffusion_model_state_dict``), holds a ballast allocation so that
``comfy.model_management.get_free_memory()`` reads exactly ``--budget-gb``, and samples with
``comfy.sample.sample`` (euler, cfg 1.0).  Per configuration it records: completed or out of
memory, weights resident, seconds per step, peak allocated/reserved above the ballast, the
reservation used, and the Sage call counts.  One JSON line per run.

Configurations (comma list): ``comfy`` (ComfyUI's own reservation), ``ours`` (the Wan
Working-Memory Estimator's wiring), ``fixed:R`` (R GiB per row, to locate the edge); each with
``+sage`` for the Sage Attention Patch, e.g. ``comfy,ours,comfy+sage,ours+sage,fixed:8.5``, and ``+castbuf`` for
ComfyUI's weight casts written into one reused buffer (:mod:`bench.cast_buffer`): a row's ``peak_reserved_gib`` less
its ``peak_alloc_gib`` is what the allocator held in holes (``load_peak_*``: the same from the sampling's start to its
first model call, the weights' load; ``step_peak_*``: for each step after it; ``load_end_slack_gib``: reserved less
allocated as the load ends).  Two more extras tell where a process's first run gets its holes: ``+trim`` empties the
allocator's cache between the load and the first forward; ``+warm`` first samples the same clone for one step at a
small latent under the same budget (:func:`warm_sampling`) and unloads it, so that the weights' first load and every
layer's, cast's and kernel's first call at a small size are made before the measured run.

    COMFYUI_PATH=... python -m bench.partial_load --budget-gb 24 --res 1280x720x81 --steps 4 --configs comfy,ours
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time

from . import _host, cast_buffer

GiB = 1 << 30
EXTRAS = {"sage", "castbuf", "trim", "warm"}


def random_lora(model, rank: int, seed: int = 0):
    """A rank-``rank`` LoRA on every Linear of the blocks, in ComfyUI's patch format."""
    import torch
    import comfy.lora
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    sd = model.model.diffusion_model.state_dict()
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for lk, mk in key_map.items():
        if not isinstance(mk, str) or not mk.endswith(".weight") or ".blocks." not in "." + mk:
            continue
        w = sd.get(mk[len("diffusion_model."):]) if mk.startswith("diffusion_model.") else None
        if w is None or w.ndim != 2:
            continue
        out_f, in_f = w.shape
        lora[f"{lk}.lora_up.weight"] = (torch.randn(out_f, rank, generator=g) * 0.01).to(torch.bfloat16)
        lora[f"{lk}.lora_down.weight"] = (torch.randn(rank, in_f, generator=g) * in_f ** -0.5).to(torch.bfloat16)
    patches = comfy.lora.load_lora(lora, key_map, log_missing=False)
    return patches


LOAD_PEAK_KEY = "bench.partial_load.load_peak"
WARM_RES = (320, 192, 5)  # the warm-up's width, height and frames: a few hundred tokens, every layer and cast path run


def add_load_peak(patcher, read) -> list:
    """Split a sampling's first step into its load and its first forward: an ``APPLY_MODEL`` wrapper on ``patcher``
    calls ``read()`` once, at the sampling's first model call, after ComfyUI placed the weights and before the
    forward runs.  ``read`` returns the peaks so far (allocated, reserved) and resets them; the list returned gets
    that one pair."""
    peaks = []

    def first_call(executor, *args, **kwargs):
        if not peaks:
            peaks.append(read())
        return executor(*args, **kwargs)

    import comfy.patcher_extension
    patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, LOAD_PEAK_KEY, first_call)
    return peaks


def warm_sampling(patcher, latent, sample) -> float:
    """Sample ``patcher`` for one step at :data:`WARM_RES` (``latent``: the measured run's latent shape, whose batch
    and channels it keeps), then unload every model and empty the allocator's cache.  ``sample(patcher, shape)`` runs
    one sampling.  Returns its seconds."""
    import comfy.model_management as mm
    t = time.perf_counter()
    w, h, f = WARM_RES
    lat_t, lat_h, lat_w = (f - 1) // 4 + 1, h // 8, w // 8
    sample(patcher, [latent[0], latent[1], lat_t, lat_h, lat_w])
    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache(True)  # torch.cuda.empty_cache() on CUDA
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.partial_load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gb", type=float, default=24.0)
    ap.add_argument("--res", default="1280x720x81")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--weights", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--configs", default="comfy,ours,comfy+sage,ours+sage")
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--model", default="a14b")
    ap.add_argument("--allocator", choices=["async", "native"], default="async")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    configs = [(cfg, *cfg.split("+")) for cfg in a.configs.split(",")]  # (config, kind, extras...)
    for cfg, kind, *extras in configs:
        if not (kind in ("comfy", "ours") or kind.startswith("fixed:")) or set(extras) - EXTRAS:
            ap.error(f"--configs: {cfg!r} is not a config: comfy, ours or fixed:R, then any of +sage, +castbuf, "
                     "+trim, +warm")
    _host.set_allocator(a.allocator)
    _host.boot_comfy(cpu=False)
    _host.load_pack()
    import torch
    import comfy.model_management as mm
    import comfy.sample
    import comfy.sd
    from wan_sage.attention import stats
    from wan_sage.memory import activation_model
    from wan_sage.nodes import estimator
    from wan_sage.nodes.sage_patch import apply_patch, find_override

    dev = mm.get_torch_device()
    w, h, f = (int(x) for x in a.res.split("x"))
    t0 = time.time()
    sd = _host.wan_state_dict(a.model, torch.bfloat16, device="cuda")
    sd = {k: v.cpu() for k, v in sd.items()}
    torch.cuda.empty_cache()
    opts = {"dtype": torch.float8_e4m3fn} if a.weights == "fp8" else {}
    base_patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options=opts)
    del sd
    gc.collect()
    if a.lora_rank:
        base_patcher = base_patcher.clone()
        base_patcher.add_patches(random_lora(base_patcher, a.lora_rank), 1.0)
    dims = activation_model.PRESETS["wan2.2-a14b" if a.model == "a14b" else "wan2.1-1.3b"]
    lat = list(activation_model.latent_shape(dims, w, h, f, 1))
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "allocator": a.allocator,
            "alloc_backend": torch.cuda.memory.get_allocator_backend(), "weights": a.weights,
            "weights_gib": base_patcher.model_size() / GiB, "latent": lat, "budget_gib": a.budget_gb,
            "lora_rank": a.lora_rank, "setup_s": round(time.time() - t0, 1)}
    print(json.dumps(head), flush=True)
    out = open(a.out, "a") if a.out else None
    commit = _host.git_head()
    for cfg, kind, *extras in configs:
        mm.unload_all_models()
        gc.collect()
        mm.soft_empty_cache(True)
        torch.cuda.empty_cache()
        free = mm.get_free_memory(dev)
        ballast = torch.empty(int(free - a.budget_gb * GiB), dtype=torch.uint8, device=dev)
        seen_free = mm.get_free_memory(dev)
        sage = "sage" in extras
        m = base_patcher.clone()
        if sage:
            m, _status = apply_patch(m, calibrate=False)
        reservation = None
        if kind == "ours":
            m, est, report = estimator.apply_estimator(m, estimator.Settings(), lat)
            reservation = est.reservation / GiB if est else None
        elif kind.startswith("fixed:"):
            R = float(kind.split(":")[1])
            m, est, report = estimator.apply_estimator(m, estimator.Settings(policy=estimator.POLICIES[2], fixed_gib=R), lat)
            reservation = R
        else:
            reservation = m.model.memory_required(lat) / GiB
        marks, resident = [], {}
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(lat, generator=g)
        ctx = torch.randn(1, 512, 4096, generator=g) * 0.1

        def sample(patcher, shape, steps=1, callback=None):  # as ComfyUI's KSampler samples, euler at cfg 1.0
            x = noise if list(shape) == lat else torch.randn(shape, generator=torch.Generator().manual_seed(1))
            with torch.inference_mode():
                return comfy.sample.sample(patcher, x, steps, 1.0, "euler", "simple", [[ctx, {}]], [[ctx, {}]],
                                           torch.zeros(shape), seed=0, callback=callback, disable_pbar=True)

        warm_s = round(warm_sampling(m, lat, sample), 2) if "warm" in extras else None

        def read_peaks():  # (allocated, reserved) peak bytes since the last read, the ballast included
            torch.cuda.synchronize()
            peaks = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
            return peaks

        load_slack = []  # reserved less allocated as the load ends; after the cache is emptied, with +trim

        def read_load():
            peaks = read_peaks()
            load_slack.append(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
            if "trim" in extras:
                torch.cuda.empty_cache()
                load_slack.append(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            return peaks

        load_peaks = add_load_peak(m, read_load)  # the load's, before the first forward
        step_peaks = []  # each step's; the first step's from its forward on

        def cb(step, x0, x, total):
            step_peaks.append(read_peaks())
            marks.append(time.perf_counter())
            if not resident:
                resident["bytes"] = m.loaded_size()
        ov = find_override(m.model_options.get("transformer_options", {}))
        torch.cuda.reset_peak_memory_stats()
        retries0 = _host.alloc_retries(torch)
        start = time.perf_counter()
        status = "ok"
        casts = {}
        try:
            with (cast_buffer.buffered_casts(m.model.diffusion_model)
                  if "castbuf" in extras else contextlib.nullcontext((None, []))) as (buf, si):
                try:
                    sample(m, lat, a.steps, cb)
                finally:
                    if buf is not None:
                        casts = {"cast_buffer_gib": buf.nbytes() / GiB, "buffered_layers": len(si),
                                 "buffered_calls": sum(s.calls for s in si)}
        except torch.OutOfMemoryError as e:
            status = "out of memory: " + str(e).split("\n")[0][:200]
        # The patch's own OUTER_SAMPLE wrapper closed the run window; read its summary.
        st = stats.last_runs().get(ov.patch_id) if ov is not None else None
        steps = [b - a_ for a_, b in zip([start] + marks[:-1], marks)]
        read = load_peaks + step_peaks
        peak_alloc = max([torch.cuda.max_memory_allocated()] + [a_ for a_, _r in read]) - ballast.numel()
        peak_reserved = max([torch.cuda.max_memory_reserved()] + [r_ for _a, r_ in read]) - ballast.numel()
        row = {"config": cfg, "status": status, "res": a.res, "weights": a.weights, "lora_rank": a.lora_rank,
               "budget_gib": a.budget_gb, "allocator": a.allocator, "wan_sage_commit": commit,
               "reservation_gib_per_row": reservation,
               "free_seen_gib": seen_free / GiB, "weights_resident_gib": resident.get("bytes", 0) / GiB,
               "weights_total_gib": m.model_size() / GiB, "step_s": [round(s, 3) for s in steps],
               "median_2_4_s": round(statistics.median(steps[1:]), 3) if len(steps) > 1 else None,
               "peak_alloc_gib": peak_alloc / GiB, "peak_reserved_gib": peak_reserved / GiB,
               # the load's peaks, then each step's (the first from its forward on): where a run's holes appear
               "load_peak_alloc_gib": round((load_peaks[0][0] - ballast.numel()) / GiB, 3) if load_peaks else None,
               "load_peak_reserved_gib": round((load_peaks[0][1] - ballast.numel()) / GiB, 3) if load_peaks else None,
               "load_end_slack_gib": round(load_slack[0] / GiB, 3) if load_slack else None,
               "trimmed_slack_gib": round(load_slack[1] / GiB, 3) if len(load_slack) > 1 else None,
               "warm_s": warm_s,
               "step_peak_alloc_gib": [round((a_ - ballast.numel()) / GiB, 3) for a_, _r in step_peaks],
               "step_peak_reserved_gib": [round((r_ - ballast.numel()) / GiB, 3) for _a, r_ in step_peaks],
               "total_s": round(time.perf_counter() - start, 2),
               "alloc_retries": None if retries0 is None else (_host.alloc_retries(torch) or 0) - retries0,
               "cast_path": "buffer" if "castbuf" in extras else "comfy", **casts,
               "gpu": head["gpu"], "torch": head["torch"], "alloc_backend": head["alloc_backend"],
               "sage": {k: st[k] for k in ("sage_calls", "sdpa_calls", "reasons", "fallbacks", "head_split_calls")} if st else None}
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
        del ballast, m
    if out:
        out.close()


if __name__ == "__main__":
    main()
