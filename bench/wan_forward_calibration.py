"""Calibrate the working-memory model: the real peak of ComfyUI's Wan forward on this GPU.

For each model (A14B dim 5120, TI2V-5B dim 3072, 1.3B dim 1536) built with random weights at its
real dims through ComfyUI's own model config, each dtype and attention (SDPA, or the wan-sage
override), and each of six or more sizes, it runs one real sampling step (comfy.sample.sample)
and measures ``torch.cuda.max_memory_allocated`` around the diffusion-model forward through a
DIFFUSION_MODEL wrapper.  It prints one JSON line per run with the wan-sage prediction and
ComfyUI's own estimate beside the measurement.

    COMFYUI_PATH=... python bench/wan_forward_calibration.py --allocator async --out table.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _host  # noqa: E402

SIZES = {
    "a14b": [(832, 480, 17), (832, 480, 49), (1280, 720, 33), (832, 480, 81), (1280, 720, 57), (1280, 720, 81)],
    "1.3b": [(832, 480, 17), (832, 480, 49), (1280, 720, 33), (832, 480, 81), (1280, 720, 57), (1280, 720, 81)],
    "ti2v5b": [(832, 480, 41), (832, 480, 81), (1280, 704, 41), (1280, 720, 81), (1280, 704, 121), (1280, 720, 121)],
}
PRESET = {"a14b": "wan2.2-a14b", "1.3b": "wan2.1-1.3b", "ti2v5b": "wan2.2-ti2v-5b"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="a14b,ti2v5b,1.3b")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--attn", default="sdpa,sage")
    ap.add_argument("--allocator", choices=["async", "native"], default="async")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sizes", default=None, help="limit to the first N sizes")
    ap.add_argument("--size", default=None, help="one size WxHxF instead of the table (smoke runs)")
    ap.add_argument("--cpu", action="store_true", help="smoke-run the harness on the CPU (no peaks)")
    a = ap.parse_args()
    _host.set_allocator(a.allocator)
    _host.boot_comfy(cpu=a.cpu)
    _host.load_pack()
    import torch
    import comfy.model_management as mm
    import comfy.patcher_extension as pe
    import comfy.sample
    from comfy.ldm.modules import attention as comfy_attention
    from wan_sage.attention.dispatch import PatchConfig, SageAttentionOverride
    from wan_sage.attention import stats
    from wan_sage.memory import activation_model
    from wan_sage.memory.estimate import activation_bytes, attention_paths
    from wan_sage.attention import kernels

    dev = mm.get_torch_device()
    cc = kernels.device_cc(dev) if dev.type == "cuda" else None
    out = open(a.out, "a") if a.out else None
    dts = {"bf16": torch.bfloat16, "fp16": torch.float16}
    print(json.dumps({"gpu": torch.cuda.get_device_name() if cc else "cpu", "torch": torch.__version__,
                      "allocator": a.allocator,
                      "alloc_backend": torch.cuda.memory.get_allocator_backend() if cc else None,
                      "sageattention": kernels.probe().sage_version}), flush=True)
    for mname in a.models.split(","):
        for dname in a.dtypes.split(","):
            t0 = time.time()
            patcher = _host.build_wan(mname, dts[dname], dev)
            mm.load_models_gpu([patcher])
            dims = activation_model.PRESETS[PRESET[mname]]
            print(f"# built {mname} {dname} in {time.time() - t0:.1f}s; weights {patcher.model_size() / 2**30:.2f} GiB", flush=True)
            for attn in a.attn.split(","):
                m = patcher.clone()
                rec = {}

                def wrapper(executor, *args, **kwargs):
                    cuda = dev.type == "cuda"
                    if cuda:
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()
                        torch.cuda.reset_peak_memory_stats()
                    s = time.perf_counter()
                    r = executor(*args, **kwargs)
                    if cuda:
                        torch.cuda.synchronize()
                        rec["peak"] = torch.cuda.max_memory_allocated() - base
                    rec["sec"] = time.perf_counter() - s
                    return r
                m.add_wrapper_with_key(pe.WrappersMP.DIFFUSION_MODEL, "calib", wrapper)
                ov = None
                if attn == "sage":
                    ov = SageAttentionOverride(PatchConfig(calibrate=False, cache_dir="/tmp/wan_sage_calib"),
                                               sdpa=comfy_attention.attention_pytorch.__wrapped__)
                    m.model_options["transformer_options"]["optimized_attention_override"] = ov
                sizes = SIZES[mname][: int(a.sizes)] if a.sizes else SIZES[mname]
                if a.size:
                    sizes = [tuple(int(x) for x in a.size.split("x"))]
                for (w, h, f) in sizes:
                    lat = activation_model.latent_shape(dims, w, h, f, 1)
                    L = activation_model.tokens(dims, *lat[2:])
                    g = torch.Generator().manual_seed(0)
                    noise = torch.randn(lat, generator=g)
                    ctx = torch.randn(1, 512, 4096, generator=g) * 0.1
                    pos = [[ctx, {}]]
                    if ov is not None:
                        stats.begin_run(ov.patch_id)
                    try:
                        with torch.inference_mode():   # as ComfyUI's PromptExecutor runs every node
                            comfy.sample.sample(m, noise, 1, 1.0, "euler", "simple", pos, pos, torch.zeros(lat),
                                                seed=0, disable_pbar=True)
                        ok = True
                    except torch.OutOfMemoryError:
                        ok = False
                    st = stats.end_run(ov.patch_id) if ov is not None else {}
                    self_p, cross_p = attention_paths("sdpa" if attn == "sdpa" else "sage-auto", cc)
                    if st and not st.get("sage_calls"):
                        self_p = cross_p = "sdpa"
                    wl = activation_model.Workload(L=L, rows=1, dtype=dname, self_attn=self_p, cross_attn="sdpa",
                                    latent_elems_per_row=activation_model.latent_elems(lat))
                    pred = activation_bytes(dims, wl)
                    row = {"model": mname, "dtype": dname, "attn": attn, "width": w, "height": h, "frames": f,
                           "tokens": L, "ok": ok, "measured": rec.get("peak"), "predicted": pred["total"],
                           "phase": pred["dominant_phase"], "model_no_slack": pred["total"] - pred["slack"],
                           "comfy": int(patcher.model.memory_required(list(lat))), "sec": rec.get("sec"),
                           "sage": {k: st.get(k) for k in ("sage_calls", "sdpa_calls", "reasons", "by_kernel")} if st else None}
                    if rec.get("peak"):
                        row["err"] = (pred["total"] - rec["peak"]) / rec["peak"]
                    line = json.dumps(row)
                    print(line, flush=True)
                    if out:
                        out.write(line + "\n")
                        out.flush()
                del m
            mm.unload_all_models()
            del patcher
            if cc:
                torch.cuda.empty_cache()
    if out:
        out.close()


if __name__ == "__main__":
    main()
