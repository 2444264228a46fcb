"""Page-locked host memory for the weights a partial load leaves streaming, where ComfyUI does not pin them.

ComfyUI 0.3.64 streams the weights a partial load leaves on the host (lowvram) from pageable memory: each layer's
forward copies its weights onto the GPU through the driver's staging buffer.  On the H200 one A14B block at
1280x720x81 ran 0.379 s with its Linears streamed from pageable memory, 0.305 s from page-locked memory and 0.294 s
resident (``python -m bench.streamed_block_peak``); a GGUF A14B expert sampling 720p81 at 12 GiB streams about
5.8 GiB per step, and its later steps went from 11.0-11.3 s to 10.6-10.7 s (docs/memory-model.md, "Unloading a
model at an expert switch").  Newer ComfyUI pins streamed weights itself (``pin_weight_to_device``); there, and wherever the
pack does not keep the model's host copies (:mod:`.host_copy`: dynamic VRAM, one device), this does nothing.

After each load of a model the pack keeps host copies for, :func:`pin_streamed` gives every module left streaming
one new host buffer holding its weights, page-locks it (``cudaHostRegister``) and points the weights at it.  The
weight objects stay the same (a ComfyUI-GGUF LoRA rides on them); only their storage moves, off the file map or
pageable memory they lay on.  The pack page-locks at most :data:`FRACTION` of the machine's RAM in all (ComfyUI's
own ceiling on Windows) and never takes the host's available memory below :data:`KEEP_AVAILABLE`.  A buffer is
unregistered when the last weight on it lets go of it.  A module that cannot be pinned keeps its weights where
they were, and the reason is logged once.

The host copies the pack keeps of a loaded model's weights (:mod:`.host_copy`) are page-locked the same way, one
buffer per module, by one daemon worker beside the sampling (:func:`later`): those copies are what the next load of
the model (the next prompt after the decode's unload, the expert switch of a repeat prompt) copies onto the GPU, at
6.1-9.6 GB/s from pageable memory and 51.6-55.2 GB/s from page-locked memory on the H200 host
(``python -m bench.pin_throughput``).  The worker copies with one thread (``memmove``, outside the interpreter
lock); it takes the bytes left under the same ceiling after the streamed weights.  Those stream at every step and a
kept copy is read once a load, so where the ceiling is reached the streamed weights take the room of kept copies:
a kept copy's buffer is unregistered (:func:`make_room`) and stays where it is, pageable, with its bytes.  The text
encoder's copies, page-locked while it encodes, so never keep the diffusion model's streamed weights pageable.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
import weakref

import torch

from .log_once import reason, warn_once
from .worker import Worker

log = logging.getLogger("wan_sage")

__all__ = ["pin_streamed", "pinned_bytes", "ceiling", "report_note", "new_map", "FRACTION", "KEEP_AVAILABLE",
           "CudaLocker", "room_for", "make_room", "gave_room", "is_pinned", "pinned_copies", "layout_bytes", "later", "wait"]

FRACTION = 0.40          # of the machine's RAM, page-locked by the pack at most
KEEP_AVAILABLE = 4 << 30  # host memory left available after each buffer
ALIGN = 64                # each weight's offset in its module's buffer
# Transparent huge pages for each buffer, asked before its first touch (Linux): on the H200 host, 4.3 GB of
# weights copied into new private maps and registered took 0.41-0.73 s with 4 KiB pages and 0.28-0.29 s with huge
# pages (``python -m bench.pin_throughput``, docs/memory-model.md).
HUGE_PAGES = getattr(mmap, "MADV_HUGEPAGE", None)

_lock = threading.RLock()  # re-entrant: a buffer's finalizer may run on a thread that holds it (a collection)
_buffers: dict = {}  # start address -> size of each buffer the pack holds page-locked
_starts: list = []   # the same start addresses, sorted: a lookup per weight stays cheap with thousands of buffers
_total = 0           # the sum of _buffers' sizes
_yielding: dict = {}  # start address -> locker of each kept-copy buffer, in the order they were made (make_room)
_unlocked: dict = {}  # start address -> size of each kept-copy buffer unregistered early (it gave its room)


def pinned_bytes() -> int:
    """The host memory the pack holds page-locked now."""
    with _lock:
        return _total


def _buffer_of(ptr: int) -> int | None:
    """The start of the pack's buffer that holds address ``ptr``, or None."""
    with _lock:
        i = bisect.bisect_right(_starts, ptr) - 1
        return _starts[i] if i >= 0 and ptr < _starts[i] + _buffers[_starts[i]] else None


def _in_buffer(ptr: int) -> bool:
    return _buffer_of(ptr) is not None


def _keep_locked(t: torch.Tensor) -> None:
    """``t`` streams from a kept copy's buffer (a module unloaded in part goes back to its kept copy): that buffer
    serves the streaming now, and no streamed weight takes its room."""
    start = _buffer_of(_plain(t).data_ptr())
    if start is not None:
        with _lock:
            _yielding.pop(start, None)


def _count(ptr: int, size: int) -> None:
    global _total
    with _lock:
        _buffers[ptr] = size
        bisect.insort(_starts, ptr)
        _total += size


def _uncount(ptr: int) -> None:
    global _total
    with _lock:
        size = _buffers.pop(ptr, None)
        if size is not None:
            del _starts[bisect.bisect_left(_starts, ptr)]
            _total -= size


def _ram_total() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:
        return 0


def _ram_available() -> int | None:
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except Exception:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ceiling(total: int | None = None) -> int:
    """The most host memory the pack page-locks: :data:`FRACTION` of ``total`` (the machine's RAM)."""
    return int((_ram_total() if total is None else total) * FRACTION)


class CudaLocker:
    """Page-locks host memory with the CUDA runtime: ``cudaHostRegister`` and ``cudaHostUnregister``."""

    def usable(self, device) -> bool:
        return getattr(device, "type", None) == "cuda" and torch.cuda.is_available()

    def lock(self, ptr: int, nbytes: int) -> bool:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister returned CUDA error {int(err)}")
        return True

    def unlock(self, ptr: int) -> None:
        torch.cuda.synchronize()  # no copy from the buffer is still in flight
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister returned CUDA error {int(err)}")


def _released(locker, ptr: int, nbytes: int, mapping=None) -> None:
    """The buffer's last weight let go of it: unregister it, count it off, and only then unmap it (``mapping``, held
    by the finalizer until here, so no new buffer can take its address before it is counted off)."""
    try:
        with _lock:
            _uncount(ptr)
            _yielding.pop(ptr, None)
            early = _unlocked.pop(ptr, None) is not None  # a kept copy's buffer that gave its room: unregistered
        if not early:
            locker.unlock(ptr)
    except Exception as e:  # never raise from a finalizer
        warn_once(("pin-unlock", type(e).__name__), "wan-sage: unregistering page-locked host memory failed (%s).",
                  reason(e))
    finally:
        if mapping is not None:
            try:
                mapping.close()
            except (BufferError, ValueError):  # still exported or closed already: unmapped when collected
                pass


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The tensor's own bytes as a plain tensor on the same storage (a GGUF weight's raw blocks)."""
    return t if type(t) is torch.Tensor else torch.Tensor.as_subclass(t, torch.Tensor)


def _streamed_modules(model: torch.nn.Module, offload: torch.device):
    """(module, its weights as [(name, parameter)], the same as plain tensors) for each module that casts its
    weights per call (``comfy_cast_weights``), holds them on the offload device, and has bytes not yet
    page-locked."""
    for module in model.modules():
        if not getattr(module, "comfy_cast_weights", False):
            continue
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
        if not params or any(p.device != offload for _, p in params):
            continue
        plain = [(n, _plain(p)) for n, p in params]
        for _, t in plain:
            _keep_locked(t)
        if (not any(t.numel() for _, t in plain)
                or any(not t.is_contiguous() or is_pinned(t) for _, t in plain)):
            continue
        yield module, params, plain


def _layout(plain) -> tuple[list[int], int]:
    offsets, end = [], 0
    for _, t in plain:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


def new_map(size: int, huge: bool = True) -> mmap.mmap:
    """A new anonymous map of ``size`` bytes, page-aligned and its buffer's alone, with transparent huge pages asked
    before its first touch where ``huge``.  Private where the platform says so: a shared anonymous map (Python's
    default) is shared memory, which the kernel's default setting gives no huge pages."""
    private = getattr(mmap, "MAP_PRIVATE", None)
    mm = mmap.mmap(-1, size) if private is None else mmap.mmap(-1, size, flags=private | mmap.MAP_ANONYMOUS)
    if huge and HUGE_PAGES is not None:
        try:
            mm.madvise(HUGE_PAGES)
        except OSError:  # transparent huge pages off: 4 KiB pages, slower to fault in and to lock
            pass
    return mm


def _copy_torch(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


def _copy_one_thread(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``src``'s bytes into ``dst`` with one thread, outside the interpreter lock: for the worker, which must not
    take the CPU threads of the sampling beside it (torch's own copy runs on its intra-op pool)."""
    n = src.numel() * src.element_size()
    if n:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)


def _new_buffer(plain, layout, locker, times: list | None = None, copy=_copy_torch,
                inference: bool | None = None, yields: bool = False) -> list[torch.Tensor]:
    """One new page-locked buffer laid out as ``layout`` (:func:`_layout`) holding the tensors ``plain``: a view of
    it for each, with its dtype and size.  Counted in :func:`pinned_bytes`, and unregistered when the last view lets
    go of it.  ``times``: [map and copy seconds, registering seconds], added to.  ``inference``: the views made as
    inference tensors or not (a weight's ``data`` only takes a tensor of its own kind); None: as the calling
    thread's mode makes them.  ``yields``: a kept copy's buffer, whose room streamed weights may take
    (:func:`make_room`)."""
    t0 = time.perf_counter()
    offsets, size = layout
    mapping = new_map(size)
    view = memoryview(mapping)  # the storage holds the map through the view
    mode = contextlib.nullcontext() if inference is None else torch.inference_mode(inference)
    targets = []
    with mode:
        base = torch.frombuffer(view, dtype=torch.uint8)
        for t, off in zip(plain, offsets):
            n = t.numel() * t.element_size()
            dst = base[off:off + n].view(t.dtype).view(t.size())
            copy(dst, t)
            targets.append(dst)
    ptr = base.data_ptr()
    t1 = time.perf_counter()
    locker.lock(ptr, size)
    if times is not None:
        times[0] += t1 - t0
        times[1] += time.perf_counter() - t1
    with _lock:
        _count(ptr, size)
        if yields:
            _yielding[ptr] = locker
    weakref.finalize(view, _released, locker, ptr, size, mapping)
    return targets


def _pin_module(params, plain, layout, locker, times: list | None = None) -> int:
    """Copy one module's weights into one new page-locked buffer and point them at it; the bytes pinned."""
    targets = _new_buffer([t for _, t in plain], layout, locker, times)
    for (_, p), dst in zip(params, targets):
        p.data = dst
    return layout[1]


def room_for(need: int, total: int | None = None, available=_ram_available) -> bool:
    """Whether ``need`` more bytes may be page-locked: within :func:`ceiling` of ``total`` with what the pack holds,
    and leaving :data:`KEEP_AVAILABLE` of the host's available memory (``available()``, None where unknown)."""
    free = available() if available is not None else None
    return pinned_bytes() + need <= ceiling(total) and (free is None or free - need >= KEEP_AVAILABLE)


def make_room(need: int, total: int | None = None, available=_ram_available) -> bool:
    """:func:`room_for` ``need`` bytes of streamed weights, unregistering kept copies' buffers, newest first, where
    the ceiling alone stands in the way and their room together would do (their bytes stay where they are,
    pageable).  Returns whether there is room now."""
    if room_for(need, total, available):
        return True
    free = available() if available is not None else None
    if free is not None and free - need < KEEP_AVAILABLE:
        return False  # unregistering frees no host memory
    limit = ceiling(total)
    with _lock:
        if _total - sum(_buffers.get(p, 0) for p in _yielding) + need > limit:
            return False  # every kept copy's room would not do: none is given up
        # Each buffer is unregistered under the lock: its finalizer, on another thread, takes the lock before it
        # unmaps the buffer, so the memory is still mapped while it is unregistered.
        while _total + need > limit and _yielding:
            ptr = next(reversed(_yielding))
            locker = _yielding.pop(ptr)
            _unlocked[ptr] = _buffers.get(ptr, 0)
            _uncount(ptr)
            try:
                locker.unlock(ptr)
            except Exception as e:  # its bytes stay registered with CUDA; the count leaves them out all the same
                warn_once(("pin-yield", type(e).__name__), "wan-sage: unregistering a host copy's page-locked "
                          "memory failed (%s).", reason(e))
    return room_for(need, total, available)


def gave_room(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in a kept copy's buffer that gave its page-locked room to streamed weights: the worker does
    not copy it into a new buffer, which would take that room back."""
    ptr = _plain(t).data_ptr()
    with _lock:
        return any(start <= ptr < start + n for start, n in _unlocked.items())


def is_pinned(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes are page-locked already: in one of the pack's buffers, or pinned by torch or ComfyUI."""
    plain = _plain(t)
    return _in_buffer(plain.data_ptr()) or (plain.device.type == "cpu" and torch.cuda.is_available()
                                             and plain.is_pinned())


def pinned_copies(tensors, locker, times: list | None = None) -> list[torch.Tensor]:
    """Page-locked copies of ``tensors`` (contiguous, on the host; a GGUF weight as its raw bytes; all inference
    tensors or none), in one new buffer, made with one thread: views of the buffer, as plain tensors of each one's
    dtype and size, inference tensors where ``tensors`` are, whatever the calling thread's mode."""
    plain = [_plain(t) for t in tensors]
    kinds = {t.is_inference() for t in plain}
    if len(kinds) > 1:
        raise ValueError("pinned_copies: inference tensors and others go in separate buffers")
    return _new_buffer(plain, _layout([(None, t) for t in plain]), locker, times, copy=_copy_one_thread,
                       inference=kinds.pop() if kinds else None, yields=True)


def layout_bytes(tensors) -> int:
    """The bytes of the one buffer :func:`pinned_copies` would make for ``tensors``."""
    return _layout([(None, _plain(t)) for t in tensors])[1]


def _job_failed(e: BaseException) -> None:
    warn_once(("pin-job", type(e).__name__), "wan-sage: page-locking the weights' host copies failed (%s); a reload "
              "copies them from pageable memory.", reason(e))


_worker = Worker("wan-sage-pin", on_error=_job_failed)


def later(fn, *args) -> None:
    """Run ``fn(*args)`` on the pack's page-locking worker (one daemon thread, jobs one after another)."""
    _worker.start()
    _worker.put(fn, *args)


def wait() -> None:
    """Until every job given to :func:`later` so far has run."""
    _worker.wait()


def report_note(comfy_pins: bool) -> str | None:
    """The estimator report's line on page-locked weights; None where ComfyUI pins them itself (``comfy_pins``)."""
    if comfy_pins:
        return None
    return (f"streaming: the weights a partial load leaves on the host are copied into page-locked memory after each "
            f"load (at most {FRACTION:.0%} of RAM in all, never below {KEEP_AVAILABLE / 2**30:.0f} GiB available), so "
            f"they stream about as fast as resident ones; the first load of each expert pays the copy. The host copies "
            f"of the resident weights are page-locked beside the sampling, within the same ceiling, so the next load "
            f"(a repeat prompt, an expert switch) copies them onto the GPU at page-locked speed")


def pin_streamed(patcher, locker=None, total: int | None = None, available=_ram_available) -> int:
    """After a load of ``patcher``: page-lock the weights of each module left streaming, within the ceiling; the
    bytes pinned.  Never raises."""
    locker = locker or CudaLocker()
    try:
        load = torch.device(getattr(patcher, "load_device", "cpu"))
        offload = torch.device(getattr(patcher, "offload_device", "cpu"))
        model = getattr(patcher, "model", None)
        if not isinstance(model, torch.nn.Module) or offload.type != "cpu" or not locker.usable(load):
            return 0
        done, skipped, modules, times, t0 = 0, 0, 0, [0.0, 0.0], time.perf_counter()
        # listed first: every kept copy's buffer a streamed weight lies in is kept locked before any room is taken
        for module, params, plain in list(_streamed_modules(model, offload)):
            layout = _layout(plain)
            need = layout[1]
            if not make_room(need, total, available):
                skipped += need
                continue
            try:
                done += _pin_module(params, plain, layout, locker, times)
                modules += 1
            except Exception as e:  # this module streams from where it was
                warn_once(("pin", type(e).__name__), "wan-sage: page-locking streamed weights failed (%s); they "
                          "stream from pageable memory.", reason(e))
                break
        if done or skipped:
            log.info("wan-sage: page-locked %.2f GiB of streamed weights in %.2f s (%d modules; copies %.2f s, "
                     "registering %.2f s)%s", done / 2**30, time.perf_counter() - t0, modules, times[0], times[1],
                     f"; {skipped / 2**30:.2f} GiB left pageable (host memory ceiling)" if skipped else "")
        return done
    except Exception as e:
        warn_once(("pin-plan", type(e).__name__), "wan-sage: page-locking streamed weights failed (%s); they "
                  "stream from pageable memory.", reason(e))
        return 0
