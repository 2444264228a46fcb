"""How fast streamed weights are page-locked: the first load's cost of ``nodes/pinned_host.py``, per way of doing it.

On the H200 the estimator's clone page-locked about 2.5 GB/s of streamed weights on a prompt's first load (5.2-5.8 s
per fp8 A14B expert at 12 GiB; bench/records/LOG.md entry 47).  This measures the parts and the alternatives on
``--gib`` GiB of host tensors cut into ``--mib`` MiB weights (default 68: an fp8 A14B FFN weight), each method on
fresh source tensors:

* ``copy``: a new private anonymous map per weight (``pinned_host.new_map`` without huge pages), the weight copied
  into it, the map registered (``cudaHostRegister``);
* ``copy-thp``: the same with ``madvise(MADV_HUGEPAGE)`` on each map before the copy (Linux): what ``pinned_host``
  does, one module at a time;
* ``copy-populate``: the same with the map's pages faulted in by the kernel when it is made (``MAP_POPULATE``, Linux),
  not one fault per page during the copy;
* ``alloc-pinned``: torch's own page-locked allocation per weight (``torch.empty(pin_memory=True)``, the CUDA host
  allocator: allocated and locked at once, so its registration time is counted in the copy), then the copy;
* ``threads-N``: ``copy`` on N weights at once;
* ``in-place``: the source tensors registered where they lie, no copy (newer ComfyUI's way; the pack cannot know
  when a storage it does not own is freed, so it copies).

Per method: seconds and GB/s of the copies, of the registrations and of both; then the host-to-GPU copy of one
weight from pageable and from page-locked memory (GB/s).  One JSON line per method and pass (``--repeats``, ``rep``)
on stdout and in ``--out``.
``--fake-lock`` registers nothing (to run the tool where there is no GPU).  ``--source file`` takes the source
tensors from a fresh read-only map of a file in the page cache, as ComfyUI holds a checkpoint's weights (safetensors
and ComfyUI-GGUF map the file), so each copy also faults the file's pages in; ``memory`` (the default) from
anonymous memory already faulted in.

    python -m bench.pin_throughput --out $OUT/pin-throughput.jsonl [--gib 4] [--mib 68] [--methods copy,...]
"""
from __future__ import annotations

import argparse
import importlib
import json
import mmap
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import _host

GB = 1e9
METHODS = ("copy", "copy-thp", "copy-populate", "alloc-pinned", "threads-4", "in-place")


class FakeLocker:
    def lock(self, ptr, nbytes):
        return True

    def unlock(self, ptr):
        pass


def _sources(torch, gib: float, mib: int, file: str | None = None) -> list:
    """``gib`` GiB of ``mib`` MiB uint8 tensors: in anonymous memory with their pages faulted in, or (``file``) on a
    new read-only map of that file (written here when it is missing or short)."""
    n = max(1, int(gib * 1024 // mib))
    if file is None:
        out = [torch.empty(mib << 20, dtype=torch.uint8) for _ in range(n)]
        for t in out:
            t.fill_(1)  # fault the pages in, as weights loaded into memory are
        return out
    import os
    import warnings

    import numpy as np
    size = n * (mib << 20)
    if not os.path.exists(file) or os.path.getsize(file) < size:
        chunk = np.ones(mib << 20, dtype=np.uint8).tobytes()
        with open(file, "wb") as f:
            for _ in range(n):
                f.write(chunk)
    mapped = np.memmap(file, dtype=np.uint8, mode="r", shape=(size,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only array: the tensors are only read
        whole = torch.from_numpy(mapped)
    return [whole[i * (mib << 20):(i + 1) * (mib << 20)] for i in range(n)]


def _pinned_host():
    """The pack's ``nodes/pinned_host.py`` (the pack loaded from this checkout)."""
    _host.load_pack()
    return importlib.import_module("wan_sage.nodes.pinned_host")


def _copy_one(torch, src, huge: bool, populate: bool = False):
    """One weight copied into a new anonymous map, the pack's own (``pinned_host.new_map``) or, ``populate``, one
    faulted in when it is made; (buffer, its keeper, copy seconds)."""
    new_map = _pinned_host().new_map
    t0 = time.perf_counter()
    if populate and hasattr(mmap, "MAP_POPULATE"):
        mm = mmap.mmap(-1, src.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    else:
        mm = new_map(src.numel(), huge)
    view = memoryview(mm)
    buf = torch.frombuffer(view, dtype=torch.uint8)
    buf.copy_(src)
    return buf, (view, mm), time.perf_counter() - t0


def run_method(torch, method: str, sources: list, locker) -> dict:
    """Copy (where the method copies) and register every source; the seconds of each part, wall clock."""
    nbytes = sum(t.numel() for t in sources)
    kept, registered = [], []
    t0 = time.perf_counter()
    copy_s = 0.0
    if method == "in-place":
        bufs = sources
    elif method == "alloc-pinned":
        bufs = []
        for s in sources:  # without CUDA (--fake-lock) the allocation is plain host memory
            b = torch.empty(s.numel(), dtype=torch.uint8, pin_memory=not isinstance(locker, FakeLocker))
            b.copy_(s)
            bufs.append(b)
        copy_s = time.perf_counter() - t0
    elif method.startswith("threads-"):
        with ThreadPoolExecutor(int(method.split("-")[1])) as pool:
            got = list(pool.map(lambda s: _copy_one(torch, s, False), sources))
        bufs = [b for b, _, _ in got]
        kept = [k for _, k, _ in got]
        copy_s = time.perf_counter() - t0
    else:
        bufs = []
        for s in sources:
            b, k, _ = _copy_one(torch, s, method == "copy-thp", populate=method == "copy-populate")
            bufs.append(b)
            kept.append(k)
        copy_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        for b in ([] if method == "alloc-pinned" else bufs):  # the allocator locked its own
            locker.lock(b.data_ptr(), b.numel())
            registered.append(b.data_ptr())
        lock_s = time.perf_counter() - t1
        row = {"method": method, "gb": round(nbytes / GB, 3), "weights": len(sources),
               "copy_s": round(copy_s, 3), "lock_s": round(lock_s, 3), "total_s": round(copy_s + lock_s, 3),
               "copy_gb_s": round(nbytes / GB / copy_s, 2) if copy_s else None,
               "lock_gb_s": round(nbytes / GB / lock_s, 2) if lock_s else None,
               "total_gb_s": round(nbytes / GB / (copy_s + lock_s), 2) if copy_s + lock_s else None}
        row.update(_h2d(torch, sources[0], bufs[0]))
        return row
    finally:
        for ptr in registered:
            locker.unlock(ptr)
        del bufs, kept


def _h2d(torch, pageable, locked) -> dict:
    """GB/s of one weight's copy onto the GPU from pageable and from page-locked memory (none without CUDA)."""
    if not torch.cuda.is_available():
        return {}
    out = {}
    for name, src in (("h2d_pageable_gb_s", pageable), ("h2d_locked_gb_s", locked)):
        dst = torch.empty_like(src, device="cuda")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = round(3 * src.numel() / GB / (time.perf_counter() - t0), 2)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--mib", type=int, default=68)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeats", type=int, default=2, help="passes over the methods (the first pass also warms the "
                    "host's memory up)")
    ap.add_argument("--fake-lock", action="store_true", help="register nothing (no GPU)")
    ap.add_argument("--source", choices=("memory", "file"), default="memory",
                    help="where the weights lie: anonymous memory, or a map of a file in the page cache")
    ap.add_argument("--file", default=None, help="the file for --source file (default: pin-throughput.bin beside --out)")
    a = ap.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS and not (m.startswith("threads-") and m[8:].isdigit())]
    if bad:
        print(f"--methods: unknown {', '.join(bad)}; choose from {', '.join(METHODS)} or threads-N", file=sys.stderr)
        return 2
    import torch
    if a.fake_lock:
        locker = FakeLocker()
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on the GPU machine, or pass --fake-lock to time the copies alone",
                  file=sys.stderr)
            return 2
        locker = _pinned_host().CudaLocker()
    import os
    src_file = None if a.source == "memory" else (a.file or os.path.join(os.path.dirname(os.path.abspath(a.out)),
                                                                          "pin-throughput.bin"))
    rows = []
    for rep in range(max(1, a.repeats)):
        for m in methods:
            if src_file and m == "in-place":
                continue  # a read-only file map is not the pack's to register
            row = run_method(torch, m, _sources(torch, a.gib, a.mib, src_file), locker)
            row.update(rep=rep, source=a.source, torch=torch.__version__)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
