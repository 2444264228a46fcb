"""The imports of a process's first ``torch.compile``, made beside the prompt's other work.

The first ``torch.compile`` call of a process imports TorchInductor's ``compile_fx`` and dynamo's debug backends,
and with them Triton, sympy and Jinja templates: hundreds of modules, read from disk and executed.  On the CPU of
the development machine that took 0.9-3.7 s (more where the files were not in the page cache), and Wan Compile
Blocks made its compiled blocks inside its node, so a fresh process spent that time in the node itself, before
its text encoder or its model were even loaded.

Here the node starts those imports on a daemon thread (:func:`start`) and makes each block's compiled callable at
the block's first call (:class:`LazyCompile`), which first waits for the thread (:func:`wait`).  Between the two
the prompt loads its text encoder and its model, copies that spend their time outside the interpreter lock, so
the imports take little or none of the prompt's time.  Anything else that imports TorchInductor while sampling
(the compile cache's hot-load, :mod:`.compile_cache`) waits for the thread first, so no module is imported from
two threads at once.  A failed import is not fatal: the first compiled call makes the same call on the sampling
thread, where the failure shows as it would without this module.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["start", "wait", "LazyCompile"]

_lock = threading.Lock()
_thread: threading.Thread | None = None


def _imports(kwargs: dict) -> None:
    try:
        torch.compile(torch.nn.Identity(), **kwargs)  # builds nothing: only what a torch.compile call imports
    except Exception:
        pass  # the sampling thread makes the same call and meets the same failure there


def start(kwargs: dict) -> bool:
    """Start, once per process, the imports ``torch.compile(module, **kwargs)`` makes, on a daemon thread; True
    where this call started it."""
    global _thread
    with _lock:
        if _thread is not None:
            return False
        _thread = threading.Thread(target=_imports, args=(dict(kwargs),), name="wan-sage-compile-imports",
                                   daemon=True)
        _thread.start()
        return True


def wait() -> None:
    """Return once the imports :func:`start` began are done (at once where none were started)."""
    with _lock:
        t = _thread
    if t is not None and t is not threading.current_thread():
        t.join()


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
