"""The Wan VAE decode after a sampling: its time against the memory the sampling leaves around it.

A whole prompt ends with ComfyUI's ``VAE.decode`` of the sampled latent.  On the H200 that decode took 4.5-5.2 s
at 1280x720x81 after some samplings and 8.6-18.0 s after others of the same latent (bench/records/whole-prompt/),
with the same GiB free as it began.  This tool takes the sampling away and decodes a random latent through
ComfyUI's own VAE (the random Wan 2.1 VAE file of ``bench.e2e_models``) on a simulated smaller card, with the
device memory arranged as a scenario says before the decode:

* ``room:R``: tensors standing for resident weights (128 MiB each) hold all but R GiB of the budget;
* ``holes:R:H``: as ``room:R``, then H GiB of those tensors, every other one, are freed the way a partial
  unload frees modules: the decode begins with R + H GiB free, H of it in 128 MiB holes in the allocator's pool;
* ``trim:R:H``: as ``holes:R:H``, then ``torch.cuda.empty_cache()`` before the decode;
* ``then:R1:R2``: a first decode at ``room:R1``, then tensors are freed until R2 GiB are free, and a second.

Each scenario runs in a fresh process (what cuDNN picks for a convolution is kept for the process), with the
allocator ComfyUI's main.py selects (``--allocator``), and decodes twice: a first decode and a repeat, as a
first and a repeat prompt.  One JSON line per scenario, printed and appended to ``--out``.

    COMFYUI_PATH=... python -m bench.decode_room --budget-gb 16 --scenarios room:15,room:12.5,holes:12.5:2 \\
        --models-dir .e2e/models --out decode-room.jsonl
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time

from . import _host
from .e2e import GiB, Ballast, _r

MiB = 1 << 20
FILLER = 128 * MiB
SCHEMA = "wan-sage-decode-room/1"


def parse_scenario(text: str) -> dict:
    """``room:R`` | ``holes:R:H`` | ``trim:R:H`` | ``then:R1:R2`` as a dict; ValueError naming the fix."""
    m = re.fullmatch(r"(room):(\d+(?:\.\d+)?)|(holes|trim|then):(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)", text.strip())
    if not m:
        raise ValueError(f"scenario {text!r}: use room:R, holes:R:H, trim:R:H or then:R1:R2 (GiB)")
    if m.group(1):
        return {"kind": "room", "room_gib": float(m.group(2))}
    kind, a, b = m.group(3), float(m.group(4)), float(m.group(5))
    if kind == "then":
        return {"kind": kind, "room_gib": a, "room2_gib": b}
    return {"kind": kind, "room_gib": a, "holes_gib": b}


def one(args) -> dict:
    """Run one scenario in this process and return its record."""
    _host.set_allocator(args.allocator)
    import torch
    sc = parse_scenario(args.one)
    av = _host.ensure_av(True)
    ce = _host.comfy_env()
    ns = ce.boot(cpu=False, quiet=True)
    mm = ns.model_management
    if args.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    import comfy.sd
    import comfy.utils
    from . import e2e_models as EM
    dev = mm.get_torch_device()
    files = EM.ensure_models(args.models_dir, scale="full", only=("vae",), log=lambda *a: None)
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(files["vae"])))
    w, h, f = (int(x) for x in args.res.split("x"))
    latent = torch.randn(1, 16, (f - 1) // 4 + 1, h // 8, w // 8, generator=torch.Generator().manual_seed(0))

    ballast = Ballast(torch, mm, dev, args.budget_gb, log=lambda *a: None)
    base = torch.cuda.memory_allocated()
    filler = []

    def fill_to(room_gib: float):
        while mm.get_free_memory(dev) - FILLER >= room_gib * GiB:
            filler.append(torch.empty(FILLER, dtype=torch.uint8, device=dev))

    def free_to(room_gib: float):
        while filler and mm.get_free_memory(dev) < room_gib * GiB:
            filler.pop()

    def state() -> dict:
        free, _total = torch.cuda.mem_get_info()
        return {"comfy_free_gib": _r(mm.get_free_memory(dev) / GiB), "device_free_gib": _r(free / GiB),
                "allocated_gib": _r((torch.cuda.memory_allocated() - base) / GiB),
                "reserved_gib": _r((torch.cuda.memory_reserved() - ballast.nbytes) / GiB)}

    tiled = []

    class Tiled(logging.Handler):
        def emit(self, record):
            if "tiled" in record.getMessage().lower():
                tiled.append(record.getMessage()[:200])
    logging.getLogger().addHandler(Tiled())

    def decode() -> dict:
        before, n_tiled = state(), len(tiled)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.inference_mode():     # as ComfyUI runs every node
            out = vae.decode(latent)
        torch.cuda.synchronize()
        s = time.perf_counter() - t0
        row = {"s": _r(s), "before": before, "frames": list(out.shape),
               "peak_alloc_gib": _r((torch.cuda.max_memory_allocated() - base) / GiB),
               "peak_reserved_gib": _r((torch.cuda.max_memory_reserved() - ballast.nbytes) / GiB),
               "tiled": tiled[n_tiled:]}
        del out
        mm.unload_all_models()   # the VAE's weights leave; the next decode loads them again, as a prompt does
        return row

    fill_to(sc["room_gib"])
    if sc["kind"] in ("holes", "trim"):
        n = int(sc["holes_gib"] * GiB // FILLER)
        for i in range(min(n, len(filler) // 2)):
            filler[2 * i] = None        # every other tensor: holes between kept ones
        filler[:] = [t for t in filler if t is not None]
        if sc["kind"] == "trim":
            torch.cuda.empty_cache()
    decodes = [decode()]
    if sc["kind"] == "then":
        free_to(sc["room2_gib"])
    decodes.append(decode())
    return {"schema": SCHEMA, "scenario": args.one, **sc, "budget_gib": args.budget_gb, "res": args.res,
            "allocator": args.allocator, "decodes": decodes, "first_s": decodes[0]["s"], "repeat_s": decodes[1]["s"],
            "budget": {"free_seen_gib": _r(None if ballast.free_seen is None else ballast.free_seen / GiB)},
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark), "gpu": torch.cuda.get_device_name(),
            "av": av, "commit": _host.git_head()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decode_room", description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gb", type=float, default=16.0)
    ap.add_argument("--res", default="1280x720x81", help="WxHxF of the decoded video")
    ap.add_argument("--scenarios", default="room:15,room:12.5,holes:12.5:2,trim:12.5:2,then:11:15")
    ap.add_argument("--allocator", choices=["async", "native"], default="async")
    ap.add_argument("--models-dir", default=".e2e/models")
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--cudnn-benchmark", action="store_true",
                    help="cuDNN times its engines for each convolution shape at its first call and keeps the fastest "
                         "(torch.backends.cudnn.benchmark; ComfyUI's default leaves it off)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)), flush=True)
        return 0
    try:
        scenarios = [s for s in args.scenarios.split(",") if s.strip()]
        for s in scenarios:
            parse_scenario(s)
    except ValueError as e:
        print(f"--scenarios: {e}", file=sys.stderr)
        return 2
    rc, emit = 0, _host.JsonLines(args.out)
    for s in scenarios:
        cmd = [sys.executable, "-m", "bench.decode_room", "--one", s, "--budget-gb", str(args.budget_gb),
               "--res", args.res, "--allocator", args.allocator, "--models-dir", args.models_dir]
        cmd += ["--cudnn-benchmark"] if args.cudnn_benchmark else []
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s,
                               cwd=str(_host.ROOT))
            rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
            row = rows[-1] if rows else {"schema": SCHEMA, "scenario": s, "status": "error",
                                         "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
        except subprocess.TimeoutExpired:
            row = {"schema": SCHEMA, "scenario": s, "status": "timeout"}
        row.setdefault("status", "ok")
        row["process_s"] = _r(time.perf_counter() - t0)
        rc = rc or (0 if row["status"] == "ok" else 1)
        print(f"decode-room {s}: first {row.get('first_s')} s, repeat {row.get('repeat_s')} s ({row['status']})",
              file=sys.stderr, flush=True)
        emit(row)
    emit.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
