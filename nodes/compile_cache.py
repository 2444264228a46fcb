"""torch.compile's caches for a compiled Wan model, kept next to the kernel timing cache across ComfyUI starts.

TorchInductor keeps what it compiled in a temporary folder (``/tmp/torchinductor_<user>`` on Linux, the
user's temp folder on Windows), which a reboot or a temp clean-up empties; the first compiled prompt after
that compiles every graph again.  On the H200, A14B blocks compiled one by one spent 22.7 s compiling on
the first prompt of a process with empty caches and 7.4 s with them kept (docs/benchmarks.md, "Whole
generation").

Around each sampling run of a model that torch.compile runs (:func:`comfy_bridge.compile_scope`), the Sage
patch's ``OUTER_SAMPLE`` wrapper:

* before the run, once per process and folder: hot-loads every artifact file of this torch build and GPU
  (``torch.compiler.load_cache_artifacts``), which writes them into inductor's own caches, so the compile
  finds them there; for a model Wan Compile Blocks compiles, on that node's worker thread, beside the model's
  load, which its blocks' first compiled call waits for (:mod:`.compile_import`);
* after the run: writes what this process compiled or found in those caches
  (``torch.compiler.save_cache_artifacts``: the graphs, their Triton kernels, their autotuning) to the file of
  this model's size and compile scope, when that is more bytes than the file holds (a run that found the file's
  graphs and compiled nothing new writes nothing).

The files are ``<cache folder>/compile/<torch build>-<GPU>-<key>.bin``; torch checks every artifact against its
own version and the graph it is for, so a file from another ComfyUI or pack version is read and then not used.
A failure to read or write one is logged once and never fails the sampling.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import threading

from ..attention import kernels
from ..attention.file_lock import replace_atomically
from . import comfy_bridge, compile_import
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

SUBDIR = "compile"
SUFFIX = ".bin"

_lock = threading.Lock()
_loaded: set = set()       # (folder, prefix) pairs whose files this process has hot-loaded
_written: dict = {}        # file path -> the size this process last wrote to it


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def build_prefix(torch_mod, device) -> str:
    """The part of a file name that says which torch build and GPU its artifacts were compiled with."""
    gpu = "cpu"
    if getattr(device, "type", str(device)) == "cuda" and torch_mod.cuda.is_available():
        idx = kernels.device_index(device)
        gpu = f"{torch_mod.cuda.get_device_name(idx)}-sm{kernels.device_cc(idx)}"
    return _slug(f"torch-{torch_mod.__version__}-{gpu}")


def run_key(latent_shape, dims, scope) -> str:
    """What one file is for: the model's dims, the latent's shape and the compile scope, hashed short."""
    text = repr((tuple(int(x) for x in latent_shape), dims, tuple(scope)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _files(folder: str, prefix: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    return [os.path.join(folder, n) for n in names if n.startswith(prefix + "-") and n.endswith(SUFFIX)]


def load(folder: str, prefix: str, torch_mod) -> int | None:
    """Hot-load every artifact file of ``prefix`` in ``folder``, once per process; the number of files read
    (None where this process already did)."""
    with _lock:
        if (folder, prefix) in _loaded:
            return None
        _loaded.add((folder, prefix))
    read = 0
    compile_import.wait()  # after the worker's imports (returns at once on the worker itself)
    for path in _files(folder, prefix):
        try:
            with open(path, "rb") as f:
                data = f.read()
            if torch_mod.compiler.load_cache_artifacts(data) is None:  # torch logs why, and loads nothing
                raise ValueError("torch found no compile artifacts in it")
            read += 1
            with _lock:
                _written.setdefault(path, len(data))
        except Exception as e:  # an unreadable or foreign file: compiled again, as without it, and written afresh
            warn_once(("compile-cache-load", path), "wan-sage: the compile cache %s could not be read (%s); the "
                      "graphs it held are compiled again.", path, reason(e))
    if read:
        log.info("wan-sage: hot-loaded %d torch.compile cache file(s) from %s", read, folder)
    return read


def save(path: str, torch_mod) -> bool:
    """Write what this process compiled or found in the caches to ``path`` (atomically), where that is more bytes
    than the file held when this process read or last wrote it; True where the file was written."""
    found = torch_mod.compiler.save_cache_artifacts()
    if not found:
        return False
    data = found[0]
    with _lock:
        if len(data) <= _written.get(path, 0):
            return False
        _written[path] = len(data)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        replace_atomically(path, data, ".partial-", mode=0o644)  # readable as a plain write would leave it
    except BaseException:
        with _lock:
            _written.pop(path, None)
        raise
    log.info("wan-sage: torch.compile cache written to %s (%.1f MiB)", path, len(data) / 2**20)
    return True


def _plan(patcher, model_options, latent_shape):
    """(folder, prefix, file path) for a sampling run of ``patcher`` on ``latent_shape``, or None where the
    model runs eagerly or there is no cache folder (outside ComfyUI without ``WAN_SAGE_CACHE_DIR``)."""
    scope = comfy_bridge.compile_scope(patcher, model_options)
    base = comfy_bridge.cache_dir()
    if scope is None or base is None or len(latent_shape) != 5:
        return None
    import torch
    if not all(hasattr(getattr(torch, "compiler", None), f) for f in ("save_cache_artifacts", "load_cache_artifacts")):
        warn_once(("compile-cache-api",), "wan-sage: torch %s has no compile cache artifacts (torch 2.7 and later "
                  "have them); the compiled graphs stay in torch's own cache folder only.", torch.__version__,
                  level=logging.INFO)
        return None
    folder = os.path.join(base, SUBDIR)
    prefix = build_prefix(torch, comfy_bridge.device_of(patcher))
    key = run_key(latent_shape, comfy_bridge.wan_dims(patcher), scope)
    return folder, prefix, os.path.join(folder, f"{prefix}-{key}{SUFFIX}")


def before_sampling(patcher, model_options, latent_shape):
    """Hot-load the compile caches for this run; returns the file to write after it (None: nothing to do).
    Never raises."""
    try:
        found = _plan(patcher, model_options, tuple(latent_shape))
        if found is None:
            return None
        import torch
        # Wan Compile Blocks makes its blocks at their first call, after the worker's jobs: the hot-load runs there,
        # beside the model's load; a compile the node did not make may start before it, so it loads here
        on_worker = (comfy_bridge.compile_blocks_node(patcher, model_options)
                     and compile_import.later(load, found[0], found[1], torch))
        if not on_worker:
            load(found[0], found[1], torch)
        return found[2]
    except Exception as e:
        warn_once(("compile-cache-plan", type(e).__name__), "wan-sage: the torch.compile cache is not used for "
                  "this run (%s).", reason(e))
        return None


def kept(path) -> bool:
    """Whether the compile file of a run (from :func:`before_sampling`) is on disk, for the next start to hot-load:
    written by this run or an earlier one.  Never raises."""
    try:
        return path is not None and os.path.isfile(path)
    except (OSError, TypeError, ValueError):
        return False


def after_sampling(path) -> None:
    """Keep what the run compiled in ``path`` (from :func:`before_sampling`).  Never raises."""
    if path is None:
        return
    try:
        import torch
        compile_import.wait()  # a hot-load given to the worker is done before what the process holds is saved
        save(path, torch)
    except Exception as e:
        warn_once(("compile-cache-save", type(e).__name__), "wan-sage: the torch.compile cache could not be "
                  "written to %s (%s); the next start compiles again.", path, reason(e))
