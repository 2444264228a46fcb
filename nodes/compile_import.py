"""A process's first ``torch.compile`` imports, and the hot-load of the pack's compile files, made beside the
prompt's other work.

The first ``torch.compile`` call of a process imports TorchInductor's ``compile_fx`` and dynamo's debug backends,
and with them Triton, sympy and Jinja templates: hundreds of modules, read from disk and executed.  On the CPU of
the development machine that took 0.9-3.7 s (more where the files were not in the page cache), and Wan Compile
Blocks made its compiled blocks inside its node, so a fresh process spent that time in the node itself, before
its text encoder or its model were even loaded.  The Sage patch's hot-load of the pack's compile files
(:mod:`.compile_cache`) then ran before the sampling loaded the model.

Here the node starts those imports on one daemon worker thread (:func:`start`) and makes each block's compiled
callable at the block's first call (:class:`LazyCompile`), which first waits for every job given to the worker
(:func:`wait`).  The hot-load of a model that Wan Compile Blocks compiles is given to the same worker
(:func:`later`), after the imports.  Between the node's run and the first compiled call the prompt loads its text
encoder and its model, copies that spend their time outside the interpreter lock, so the imports and the hot-load
take little or none of the prompt's time.  One worker runs the jobs one after another, and the pack's other
TorchInductor calls (a hot-load outside the worker, the save after a sampling, the compile itself) wait for it
first; Python's per-module import locks order what another thread imports meanwhile.  A
failed job is not fatal: the first compiled call makes the same ``torch.compile`` call on the sampling thread,
where a failure shows as it would without this module, and the hot-load logs its own failures.
"""
from __future__ import annotations

import threading

import torch

from .worker import Worker

__all__ = ["start", "later", "wait", "LazyCompile"]

_lock = threading.Lock()
# no on_error: each job's failure shows where its work is needed (the module's docstring)
_worker = Worker("wan-sage-compile-imports")


def _imports(kwargs: dict) -> None:
    torch.compile(torch.nn.Identity(), **kwargs)  # builds nothing: only what a torch.compile call imports


def start(kwargs: dict) -> bool:
    """Start, once per process, the worker with the imports ``torch.compile(module, **kwargs)`` makes as its first
    job; True where this call started it."""
    with _lock:
        if _worker.thread is not None:
            return False
        _worker.put(_imports, dict(kwargs))
        return _worker.start()


def later(fn, *args) -> bool:
    """Give ``fn(*args)`` to the worker, after the jobs before it; False (nothing given) where no worker runs."""
    with _lock:
        if _worker.thread is None:
            return False
        _worker.put(fn, *args)
        return True


def wait() -> None:
    """Return once every job given to the worker so far is done (at once where none was, or on the worker)."""
    _worker.wait()


class LazyCompile:
    """``torch.compile(module, **kwargs)``, made at its first call, after :func:`wait`.  Dynamo keys what it
    compiles on the module's code, so blocks of one class still share their graphs."""

    __slots__ = ("module", "kwargs", "fn")

    def __init__(self, module: torch.nn.Module, kwargs: dict):
        self.module = module
        self.kwargs = dict(kwargs)
        self.fn = None

    def __call__(self, *args, **kwargs):
        fn = self.fn
        if fn is None:
            wait()
            fn = self.fn = torch.compile(self.module, **self.kwargs)
        return fn(*args, **kwargs)
