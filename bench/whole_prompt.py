"""Whole prompts on the user's clock: each configuration run as fresh ComfyUI processes, one after another.

    python -m bench.whole_prompt --runs SPECS --caches none|kept DIR|pack DIR [--processes N] [--bench-first]
        [--out FILE] [--log FILE] [--skip-done FILES] [--t0 EPOCH] [--budget-s S] [--process-s S]
        BENCH.E2E OPTIONS (--models-dir ..., --workflow FILE)

For each spec of ``--runs`` (``bench.e2e`` run specs, with ``:Nsteps``, ``:cfgX``, ``:nolora``,
``:decode`` / ``:nodecode``), N processes of ``python -m bench.e2e --whole-prompt --runs SPEC``, each a
fresh interpreter with no warm-up that runs the first prompt and then a repeat prompt with a new seed, and
prints one record (``wan-sage-whole-prompt/1``: bench/README.md lists its fields).  Every option this tool
does not know is passed to each process (``--models-dir``, ``--scale``, ``--weights``, ``--av-stub``, ...).

A saved workflow: ``--workflow FILE`` (passed to each process) makes ``--runs`` that workflow's variants,
``{template|comfy|compilenode}@{GB|full}[:WxHxF][:Nsteps]`` (``bench.workflow_variants``), each a configuration
of its own, e.g. the pack's 5B template at 24 GiB as saved, as stock ComfyUI and with Wan Compile Blocks::

    python -m bench.whole_prompt --runs template@24,comfy@24,compilenode@24 --caches none \
        --workflow "example_workflows/Wan 2.2 5B text to video 704p.json" --models-dir DIR

Caches (``--caches``), the pack's timing cache (``WAN_SAGE_CACHE_DIR``), TorchInductor's and Triton's:

* ``none``: every process starts with fresh empty folders (made and removed by the process): each record is
  the very first prompt after installing.  Default: one process per configuration.
* ``kept DIR``: the folders ``DIR/<weights>-<spec>/{wan-sage,torchinductor,triton}``, one set per
  configuration, kept from one process to the next.  Default: two processes per configuration: process 1
  fills them (its record says what it found: ``caches.filled_at_start``), process 2 is the first prompt after
  a restart with the caches the pack and torch kept.  A configuration's folders are its own, so the order of
  the specs and ``--skip-done`` change nothing in what a process finds.
* ``pack DIR``: only the pack's folder ``DIR/<weights>-<spec>/wan-sage`` is kept (its timing cache and the
  torch.compile files it keeps); inductor's and Triton's start empty in every process at the same path, as
  after a reboot empties the temporary folder torch keeps them in (``bench.e2e.PACK_TEMP``).  Default: two
  processes per configuration.

``--bench-first`` (with ``kept`` or ``pack``): before a configuration's first process, ``wan-sage bench`` runs once
for the A14B expert's attention calls at the spec's size (``--preset wan2.2-a14b``, the fp16 ComfyUI runs Wan in)
into the pack's folder, as a user who runs it once after installing: its timings and its self-test pass.  It runs
only where that folder holds no timing cache yet; every record of the configuration says what it did
(``bench_first``: seconds, exit status, command).

Page cache: before the first process the tool reads the shared libraries of torch and of its CUDA
packages (``torch/lib``, ``nvidia/*/lib``) once, so that whichever configuration runs first does not pay
alone for reading from disk what every configuration loads (cuDNN's engines, loaded on the first attention
or convolution call: about 0.9 s on an H200 host, ``bench.first_call``'s ``sdpa_first``).  The libraries
only one configuration loads (SageAttention's) are not read.  Each record says so under ``page_cache``.

Budget: with ``--budget-s`` (seconds counted from ``--t0``, epoch seconds; default the tool's start), a
configuration starts only when all its processes, at ``--process-s`` each, can end within it, and a process
still running at the end is stopped (its line says ``timeout``).  ``--skip-done`` passes over a
configuration whose last process already has a completed or out-of-memory record in those files (same run,
weights and caches mode).  Each record is printed and appended to ``--out`` as soon as its process ends; the
processes' stderr goes to ``--log`` (appended), their progress lines (``e2e ...``) to stderr, and the end of
a failed process's stderr into its line (``status: error``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import _host, e2e
from ._paths import machine_free

DEFAULT_PROCESSES = {"none": 1, "kept": 2, "pack": 2}
PROGRESS = re.compile(r"^e2e ")      # the processes' progress lines; everything else goes to --log only


def caches_slug(weights: str, spec) -> str:
    """The folder name of a configuration's kept caches: its weights and name (a saved workflow's spec: the
    workflow's file name and the spec), filename-safe."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"{weights}-{spec.name}").strip("-")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.whole_prompt", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False,
                                 epilog="Every other option goes to each bench.e2e process.")
    ap.add_argument("--runs", required=True, help="comma list of bench.e2e run specs, one configuration each")
    ap.add_argument("--caches", nargs="+", required=True, metavar=("none|kept|pack", "DIR"),
                    help="none: fresh empty cache folders in every process; kept DIR: one set of folders per "
                         "configuration under DIR, kept from one process to the next; pack DIR: only the pack's "
                         "folder kept, inductor's and Triton's fresh in every process")
    ap.add_argument("--processes", type=int, default=None,
                    help="processes per configuration (default: 1 with none, 2 with kept or pack)")
    ap.add_argument("--bench-first", action="store_true",
                    help="with kept or pack caches: run wan-sage bench at the spec's size into the pack's folder "
                         "before a configuration's first process, where it holds no timing cache yet")
    ap.add_argument("--out", default=None, help="append the records to this file too")
    ap.add_argument("--log", default=None, help="append the processes' stderr to this file")
    ap.add_argument("--skip-done", default=None, metavar="JSONL[,JSONL]",
                    help="pass over configurations whose last process has a completed or out-of-memory record there")
    ap.add_argument("--t0", type=float, default=None, help="epoch seconds the budget counts from (default: now)")
    ap.add_argument("--budget-s", type=float, default=None, help="end every process within this many seconds of --t0")
    ap.add_argument("--process-s", type=float, default=200.0,
                    help="the longest a process is expected to take, for --budget-s (default 200)")
    a, rest = ap.parse_known_args(argv)
    if a.caches[0] not in DEFAULT_PROCESSES or len(a.caches) != (1 if a.caches[0] == "none" else 2):
        ap.error("--caches takes 'none', 'kept DIR' or 'pack DIR'")
    if a.bench_first and a.caches[0] == "none":
        ap.error("--bench-first fills the pack's kept folder: use it with --caches kept DIR or pack DIR")
    a.processes = a.processes or DEFAULT_PROCESSES[a.caches[0]]
    if a.processes < 1:
        ap.error("--processes must be at least 1")
    texts = [s.strip() for s in a.runs.split(",") if s.strip()]
    if not texts:
        ap.error("--runs names no spec")
    if "--out" in rest or any(x.startswith("--out=") for x in rest):
        ap.error("--out is this tool's: the processes' records come back through it")
    # the processes' options, checked once here so that a typo stops the tool before any process starts
    e2e_args = e2e.parse_args([*rest, "--whole-prompt", "--runs", texts[0], "--caches", "none"])
    a.specs = [e2e.whole_spec(s, e2e_args.workflow) for s in texts]
    if a.bench_first and e2e_args.workflow:
        ap.error("--bench-first runs wan-sage bench for the built-in A14B graph: leave it out with --workflow")
    a.rest, a.weights = rest, e2e.files_weights(e2e_args)
    return a


def done(paths: str | None, spec: e2e.RunSpec, weights: str, mode: str, count: int) -> bool:
    """Whether the configuration's last process (index ``count``) already has a completed or out-of-memory
    record with a faithful budget in those files."""
    for r in _host.jsonl_records(paths):
        if (r.get("schema") == e2e.WHOLE_SCHEMA and r.get("run") == spec.name and r.get("prompts")
                and e2e.model_files((r.get("config") or {}).get("weights")) == weights
                and (r.get("caches") or {}).get("mode") == mode
                and (r.get("process") or {}).get("index") == count and r.get("status") in ("ok", "oom")
                and e2e.faithful(r)):
            return True
    return False


class Clock:
    """Seconds since ``t0`` (epoch) and what is left of the budget."""

    def __init__(self, t0: float | None, budget_s: float | None):
        self.t0 = time.time() if t0 is None else t0
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float | None:
        return None if self.budget_s is None else self.budget_s - self.elapsed()

    def fits(self, seconds: float) -> bool:
        return self.budget_s is None or self.elapsed() + seconds <= self.budget_s


def _pump(stream, sink, echo: bool, log):
    for line in stream:
        sink.append(line)
        if log is not None:  # the log is kept with the records: no absolute path of this machine in it
            log.write(machine_free(line))
            log.flush()
        if echo and PROGRESS.search(line):
            sys.stderr.write(line)
            sys.stderr.flush()


def shared_libraries() -> list:
    """The shared library files of torch and of its CUDA packages (nvidia-*), found without importing them."""
    import importlib.util
    dirs = []
    for name in ("torch", "nvidia"):
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec else []:
            dirs += [Path(root) / "lib"] if name == "torch" else list(Path(root).glob("*/lib"))
    return sorted(p for d in dirs if d.is_dir() for p in d.iterdir() if p.is_file() and ".so" in p.name)


def prime_page_cache() -> dict:
    """Read :func:`shared_libraries` once (the page cache keeps them for every process after)."""
    t, size = time.time(), 0
    for path in shared_libraries():
        try:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    size += len(chunk)
        except OSError:
            continue
    return {"primed": True, "bytes": size, "s": round(time.time() - t, 2)}


def run_process(cmd: list[str], timeout: float | None, log) -> tuple[int | None, list[str], list[str]]:
    """Run one process (its own process group, so that a stop at the budget reaches its children too);
    returns (exit status or None when it was stopped, stdout lines, stderr lines)."""
    out, err = [], []
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(_host.ROOT),
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    threads = [threading.Thread(target=_pump, args=(p.stdout, out, False, None), daemon=True),
               threading.Thread(target=_pump, args=(p.stderr, err, True, log), daemon=True)]
    for t in threads:
        t.start()
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
    for t in threads:
        t.join(timeout=30)
    return rc, out, err


def caches_dir(a, spec: e2e.RunSpec) -> Path:
    """A configuration's folder of kept caches (``kept`` or ``pack``)."""
    return Path(a.caches[1]).resolve() / caches_slug(a.weights, spec)


def bench_command(a, spec: e2e.RunSpec) -> list[str]:
    """``wan-sage bench`` for the A14B expert's attention calls at the spec's size, into its pack folder (the
    ``wan-sage`` folder the process reads as ``WAN_SAGE_CACHE_DIR``)."""
    width, height, frames = spec.res
    return [sys.executable, "-m", "bench.wan_sage_cli", "bench", "--preset", "wan2.2-a14b", "--width", str(width),
            "--height", str(height), "--frames", str(frames), "--no-accuracy",
            "--cache-dir", str(caches_dir(a, spec) / "wan-sage")]


def bench_first(a, spec: e2e.RunSpec, timeout: float | None, log) -> dict | None:
    """Run :func:`bench_command` where the configuration's pack folder holds no timing cache yet; what it did
    (None where it did not run)."""
    _host.load_pack()
    from wan_sage.attention import timing
    if (caches_dir(a, spec) / "wan-sage" / timing.FILE_NAME).exists():
        return None
    cmd = bench_command(a, spec)
    t = time.time()
    rc, out, _err = run_process(cmd, timeout, log)
    if log is not None:  # its table, beside its stderr
        log.write("".join(machine_free(line) for line in out))
        log.flush()
    shown = ["wan-sage", *cmd[cmd.index("bench"):cmd.index("--cache-dir")]]
    return {"s": round(time.time() - t, 2), "rc": rc, "command": " ".join(shown)}


def process_command(a, spec: e2e.RunSpec, index: int) -> list[str]:
    caches = ["none"] if a.caches[0] == "none" else [a.caches[0], str(caches_dir(a, spec))]
    return [sys.executable, "-m", "bench.e2e", *a.rest, "--whole-prompt", "--runs", spec.label, "--caches", *caches,
            "--process-index", str(index), "--process-count", str(a.processes)]


def main(argv=None) -> int:
    a = parse_args(argv)
    clock = Clock(a.t0 if a.t0 is not None else (float(os.environ["E2E_T0"]) if os.environ.get("E2E_T0") else None),
                  a.budget_s)
    emit = _host.JsonLines(a.out)
    log = open(a.log, "a") if a.log else None
    mode = a.caches[0]
    page_cache = prime_page_cache()
    print(f"e2e whole: read {page_cache['bytes'] / 2**30:.2f} GiB of torch's and CUDA's libraries in "
          f"{page_cache['s']:.1f} s (page cache)", file=sys.stderr, flush=True)

    def line(spec, index, status, error):
        emit({"schema": e2e.WHOLE_SCHEMA, "run": spec.name, "status": status, "error": error,
              "config": {"weights": a.weights}, "caches": {"mode": mode},
              "process": {"index": index, "count": a.processes}})
    try:
        for n, spec in enumerate(a.specs, 1):
            name = f"{spec.name} ({a.weights}, caches {mode})"
            if a.skip_done and done(a.skip_done, spec, a.weights, mode, a.processes):
                print(f"e2e whole {n}/{len(a.specs)}: {name} already recorded, skipped", file=sys.stderr, flush=True)
                continue
            if not clock.fits(a.processes * a.process_s):
                print(f"e2e whole {n}/{len(a.specs)}: {name} skipped: {a.processes} x {a.process_s:g} s do not fit in "
                      f"the {clock.left():.0f} s left", file=sys.stderr, flush=True)
                line(spec, 1, "skipped", f"budget: {clock.left():.0f} s left, {a.processes * a.process_s:g} s needed")
                continue
            bench = bench_first(a, spec, clock.left(), log) if a.bench_first else None
            if bench is not None:
                print(f"e2e whole: {bench['command']} took {bench['s']:.0f} s (exit status {bench['rc']})",
                      file=sys.stderr, flush=True)
            for index in range(1, a.processes + 1):
                if (index > 1 or bench is not None) and not clock.fits(a.process_s):
                    line(spec, index, "skipped", f"budget: {clock.left():.0f} s left")
                    break
                print(f"e2e whole {n}/{len(a.specs)}: {name}, process {index}/{a.processes} at "
                      f"{clock.elapsed():.0f} s", file=sys.stderr, flush=True)
                t = time.time()
                rc, out, err = run_process(process_command(a, spec, index), clock.left(), log)
                records = [json.loads(x) for x in out if x.startswith("{")]
                if records:
                    for r in records:
                        emit(dict(r, page_cache=page_cache, **({"bench_first": bench} if bench else {})))
                    print(f"e2e whole: process {index} ended {records[-1].get('status')} after {time.time() - t:.0f} s",
                          file=sys.stderr, flush=True)
                else:
                    tail = "".join(err[-20:])[-1500:]
                    line(spec, index, "timeout" if rc is None else "error",
                         f"stopped at the budget after {time.time() - t:.0f} s" if rc is None
                         else f"exit status {rc}, no record: {tail}")
                    break      # a later process of this configuration would not find what this one left
    finally:
        emit.close()
        if log:
            log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
