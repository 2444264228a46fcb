"""Unload a model without copying its weights back to the host.

When ComfyUI unloads a model to make room for another (the next Wan 2.2 expert, the VAE, the text
encoder), ``ModelPatcher.unpatch_model`` moves every weight on the GPU back with
``model.to(offload_device)``: a pageable copy into newly allocated host memory.  For a GGUF Wan 2.2 A14B
expert (9.3 GiB) that takes 6-8 s on an H200, once per expert switch.  The host tensors the weights were
loaded from hold the same bytes, but ComfyUI lets them go once the load has copied them.

For a model that passed through the Working-Memory Estimator this module keeps them:

* :func:`note`, before each load (the patcher's ``load``, which :func:`install` wraps, with
  ``unpatch_model``, on the patcher and on every clone made from it), notes each weight that lies on the
  offload device;
* :func:`settle`, after the load, keeps those that now lie on the load device, unchanged in size and
  dtype (a weight that stayed on the host, because it streams, needs nothing kept);
* :func:`release`, when the model is unloaded (its ``unpatch_model``), puts the noted host tensor back in
  place of each loaded weight, so ``model.to(offload_device)`` finds it there and copies nothing;
* when ComfyUI frees only part of the model for another one (its ``partially_unload``: the next expert where
  both do not fit), each module it moves gets its weights' host tensors back the same way; where the load
  replaced a weight's object with one that carries more (ComfyUI-GGUF's LoRA), a twin on the host storage
  carrying it.

A weight gets its host tensor back only where that is the weight the model would get from the copy:

* it is the very tensor the load left on the device (the same object, device and data pointer),
* ComfyUI holds no backup for it (a LoRA-patched full-precision weight: ComfyUI restores the backup,
  which already lies on the host), and
* no hook patch has been applied to the model (ComfyUI writes a hooked weight's backup into the loaded
  tensor during the unload).

Every other weight is copied back by ComfyUI as before.  The host memory kept is that of the weights
loaded on the device, and only while they are loaded: never more than the model held on the host before
ComfyUI first loaded it.  Not installed where ComfyUI manages residency itself (dynamic VRAM) or where
the load and offload devices are the same.

The host tensors kept are those the model was loaded from; a ComfyUI-GGUF model's lie on the file's memory
map, so its model stays on that map while loaded and after an unload.  ComfyUI-GGUF's first partial load
copies each module left streaming to the GPU and back (``mmap_released``) to take it off the map: on this
clone that frees nothing and costs the first prompt about 1 s per GiB streamed (H200), so
:func:`skip_unmapping` skips it where ComfyUI pins no streamed weights (ComfyUI-GGUF copies a weight off the map
before ComfyUI pins it).  After each load, :mod:`.pinned_host` copies the modules left streaming off the map into
page-locked memory, on a CUDA device and within its host memory ceiling.

The host copies kept for the loaded weights are page-locked too, beside the sampling (:func:`pin_kept`, on
:mod:`.pinned_host`'s worker): each module's kept tensors are copied into one page-locked buffer and the kept entry
(and the host object, where the load replaced it) is pointed at it, so the next load of the model copies from
page-locked memory.  A module whose weights were unloaded or changed meanwhile keeps its pageable copy.
"""
from __future__ import annotations

import logging
import threading
from contextlib import nullcontext
import time
import types
import weakref
from dataclasses import dataclass

import torch

from . import pinned_host
from .comfy_bridge import same_device as _same
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

CLONE_KEY = "wan_sage_host_copy"
ON_CLONE = "on_clone"  # comfy.patcher_extension.CallbacksMP.ON_CLONE in ComfyUI 0.3.64 and later

__all__ = ["install", "installed", "note", "settle", "release", "kept_bytes", "skip_unmapping", "pin_kept"]


@dataclass
class _Kept:
    host: torch.Tensor  # the parameter object the model held on the offload device before the load
    data: torch.Tensor  # its storage, as found before the load (the load may move the object itself)
    loaded: weakref.ref | None = None  # the tensor the load left on the device (weak: never keeps VRAM)
    device: torch.device | None = None
    ptr: int = 0


# BaseModel -> {parameter name: _Kept}.  Weak: a model ComfyUI drops takes its host tensors with it.
_KEPT: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, _Kept]]" = weakref.WeakKeyDictionary()
# Held wherever a kept entry is read or changed, so that the page-locking worker (:func:`pin_kept`) never points an
# entry at new bytes while a load or an unload of its model reads it.
_entries = threading.RLock()


def _guarded(fn):
    def run(*args, **kwargs):
        with _entries:
            return fn(*args, **kwargs)
    run.__name__, run.__qualname__, run.__doc__, run.__wrapped__ = fn.__name__, fn.__qualname__, fn.__doc__, fn
    return run


def _eligible(patcher) -> bool:
    load, offload = getattr(patcher, "load_device", None), getattr(patcher, "offload_device", None)
    if load is None or offload is None or _same(torch.device(load), offload):
        return False
    dynamic = getattr(patcher, "is_dynamic", None)
    try:
        return not (callable(dynamic) and dynamic())
    except Exception as e:  # a newer ComfyUI's check failing: keep ComfyUI's own unload
        warn_once(("host-copy-dynamic", type(e).__name__), "wan-sage: asking the model whether dynamic VRAM is "
                  "on failed (%s); its weights are unloaded as ComfyUI does.", reason(e))
        return False


def _param(base: torch.nn.Module, key: str):
    """(module, name, tensor) of a parameter or buffer by its dotted name."""
    path, _, name = key.rpartition(".")
    module = base.get_submodule(path) if path else base
    if name in module._parameters:
        return module, name, module._parameters[name]
    return module, name, module._buffers.get(name)


def _put(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    if name in module._buffers:
        module._buffers[name] = tensor
    else:
        setattr(module, name, tensor)


def _tensors(base: torch.nn.Module):
    yield from base.named_parameters()
    yield from base.named_buffers()


def _unpatch_model(self, *args, **kwargs):
    """The patcher's ``unpatch_model``: gives loaded weights their host tensors back, then runs the
    class's own (which restores backups and moves whatever is left)."""
    device_to = args[0] if args else kwargs.get("device_to")
    unpatch_weights = args[1] if len(args) > 1 else kwargs.get("unpatch_weights", True)
    if unpatch_weights and device_to is not None:
        try:
            release(self, device_to)
        except Exception as e:  # never fail an unload over this: ComfyUI copies what is left
            _failed(self, "giving the weights their host copies back", e)
    return type(self).unpatch_model(self, *args, **kwargs)


def _partially_unload(self, *args, **kwargs):
    """The patcher's ``partially_unload`` (ComfyUI freeing part of a loaded model for another one): each module
    it moves to the offload device first gets back the host tensors its loaded weights came from, so its
    ``module.to`` copies nothing, and ComfyUI then marks it streamed as it does after a copy.  A weight whose
    object the load replaced gets its host object back where that object carries nothing the host one lacks,
    and otherwise a twin of it on the host storage with the loaded object's attributes (a ComfyUI-GGUF LoRA
    rides on the loaded tensor: :func:`_host_twin`); patched weights are restored from ComfyUI's backups first,
    as before."""
    device_to = args[0] if args else kwargs.get("device_to")
    moves: list = []
    try:
        _module_moves(self, device_to, moves)
    except Exception as e:  # never fail an unload over this: ComfyUI copies what it moves
        _failed(self, "giving partly unloaded weights their host copies back", e)
    try:
        return type(self).partially_unload(self, *args, **kwargs)
    finally:
        for module in moves:
            module.__dict__.pop("to", None)


def _module_moves(patcher, device_to, moves: list) -> None:
    """Give each module of ``patcher`` holding kept weights an instance ``to`` that gives them back before the
    module's own ``to``; each module is appended to ``moves`` as it is set, for the caller to restore."""
    base = getattr(patcher, "model", None)
    kept = _KEPT.get(base)
    if not kept or device_to is None or getattr(patcher, "hook_backup", None):
        return
    by_module: dict = {}
    for key, k in kept.items():
        if k.loaded is not None:
            path, _, _name = key.rpartition(".")
            by_module.setdefault(path, []).append(key)
    for path, keys in by_module.items():
        module = base.get_submodule(path) if path else base
        if "to" in module.__dict__:
            continue
        moves.append(module)
        module.__dict__["to"] = types.MethodType(_module_to(patcher, keys, device_to), module)


def _module_to(patcher, keys: list, device_to):
    def to(module, *args, **kwargs):
        dev = args[0] if args else kwargs.get("device")
        try:
            if isinstance(dev, (torch.device, str)) and _same(torch.device(dev), device_to):
                with _entries:
                    kept = _KEPT.get(patcher.model) or {}
                    backup = getattr(patcher, "backup", None) or {}
                    for key in keys:
                        if key in kept:
                            _give_back(patcher.model, kept, key, backup, device_to, same_object=True)
        except Exception as e:  # never fail the unload: the module's own ``to`` copies what is left
            _failed(patcher, "giving partly unloaded weights their host copies back", e)
        return type(module).to(module, *args, **kwargs)
    return to


def _failed(patcher, what: str, e: Exception) -> None:
    """Forget the model's host copies (ComfyUI's own copy then moves every weight) and say so once."""
    base = getattr(patcher, "model", None)
    if isinstance(base, torch.nn.Module):
        _KEPT.pop(base, None)
    warn_once(("host-copy", what, type(e).__name__), "wan-sage: %s failed (%s); ComfyUI copies the weights back "
              "when it unloads this model.", what, reason(e))


def _load(self, *args, **kwargs):
    """The patcher's ``load`` (every load: ``patch_model``, ``partially_load``): notes the host tensors
    before the class's own load and keeps those it put on the device after it; then page-locks the weights it
    left streaming where ComfyUI does not (:mod:`.pinned_host`).  Never fails a load."""
    try:
        note(self)
    except Exception as e:
        _failed(self, "noting the weights' host copies", e)
    skip_unmapping(self)
    try:
        return type(self).load(self, *args, **kwargs)
    finally:
        try:
            settle(self)
        except Exception as e:
            _failed(self, "keeping the weights' host copies", e)
        if not comfy_pins_streamed_weights(self):
            pinned_host.pin_streamed(self)
            _pin_kept_later(self)


def comfy_pins_streamed_weights(patcher) -> bool:
    """Whether ComfyUI pins the weights a partial load leaves streaming: its patcher classes (not ComfyUI-GGUF's,
    the class that holds ``mmap_released``) define ``pin_weight_to_device`` where it does."""
    return any("pin_weight_to_device" in vars(c) for c in type(patcher).__mro__ if "mmap_released" not in vars(c))


def skip_unmapping(patcher) -> bool:
    """Before a load of a model whose host tensors are kept: mark a ComfyUI-GGUF patcher's file map released
    (``mmap_released``), so that its first partial load does not copy each streamed module to the device and
    back; the kept host tensors of its loaded weights stay on that map in any case.  Not where ComfyUI pins
    streamed weights, nor once the copy was made.  True where this load skips it."""
    if getattr(patcher, "mmap_released", None) is not False or not installed(patcher):
        return False
    try:
        if comfy_pins_streamed_weights(patcher):
            return False
        patcher.mmap_released = True
    except Exception as e:  # ComfyUI-GGUF's copy stays
        warn_once(("host-copy-unmap", type(e).__name__), "wan-sage: leaving the GGUF weights on their file map "
                  "failed (%s); ComfyUI-GGUF copies the streamed ones off it on the first load.", reason(e))
        return False
    log.debug("wan-sage: GGUF weights left streaming stay on the file's memory map (no copy to the GPU and back)")
    return True


def _bind(patcher) -> None:
    # Instance attributes: scoped to this patcher; copy.deepcopy rebinds a bound method to the copy.
    patcher.load = types.MethodType(_load, patcher)
    patcher.unpatch_model = types.MethodType(_unpatch_model, patcher)
    patcher.partially_unload = types.MethodType(_partially_unload, patcher)


def _on_clone(src, clone) -> None:
    if _eligible(clone):
        _bind(clone)


def install(patcher) -> bool:
    """Wrap ``patcher.load``, ``patcher.unpatch_model`` and ``patcher.partially_unload`` (and those of every clone
    made from it) so that an unload gives loaded weights their host tensors back; False where this does not
    apply."""
    if not _eligible(patcher) or not isinstance(getattr(patcher, "model", None), torch.nn.Module):
        return False
    _bind(patcher)
    if hasattr(patcher, "remove_callbacks_with_key"):
        patcher.remove_callbacks_with_key(ON_CLONE, CLONE_KEY)
        patcher.add_callback_with_key(ON_CLONE, CLONE_KEY, _on_clone)
    return True


def installed(patcher) -> bool:
    d = getattr(patcher, "__dict__", {})
    return all(isinstance(d.get(name), types.MethodType) and d[name].__func__ is fn
               for name, fn in (("load", _load), ("unpatch_model", _unpatch_model),
                                ("partially_unload", _partially_unload)))


@_guarded
def note(patcher) -> int:
    """Before a load: note every parameter and buffer on the offload device.  Returns how many are noted."""
    if not installed(patcher) or not _eligible(patcher):
        return 0
    base = patcher.model
    offload = torch.device(patcher.offload_device)
    kept = _KEPT.setdefault(base, {})
    for key, p in _tensors(base):
        if _same(p.device, offload):
            kept[key] = _Kept(host=p, data=p.data)
        elif key in kept and not _is_loaded(kept[key], p):
            del kept[key]  # on the device, but not the tensor a noted load left there
    return len(kept)


def _nbytes(k: _Kept) -> int:
    return k.data.numel() * k.data.element_size()


def _same_layout(k: _Kept, cur) -> bool:
    # size(), not shape: a GGUF tensor's shape is its logical one, its size() that of its bytes
    return cur.size() == k.data.size() and cur.dtype == k.data.dtype


def _is_loaded(k: _Kept, cur) -> bool:
    return (k.loaded is not None and k.loaded() is cur and cur is not None and _same(cur.device, k.device)
            and cur.data_ptr() == k.ptr)


@_guarded
def settle(patcher) -> int:
    """After a load: keep the noted host tensor of each weight the load put on the device, unchanged in
    shape and dtype; forget the rest.  Returns the bytes kept."""
    kept = _KEPT.get(getattr(patcher, "model", None))
    if not kept:
        return 0
    base = patcher.model
    offload = torch.device(patcher.offload_device)
    backup = getattr(patcher, "backup", None) or {}
    for key in list(kept):
        k = kept[key]
        if k.loaded is not None:
            continue  # loaded earlier and still kept (note checked it)
        try:
            _, _, cur = _param(base, key)
        except AttributeError:
            cur = None
        if (cur is None or key in backup or _same(cur.device, offload) or not _same_layout(k, cur)
                or not _same(k.data.device, offload)):
            del kept[key]
            continue
        k.loaded, k.device, k.ptr = weakref.ref(cur), cur.device, cur.data_ptr()
    return kept_bytes(patcher)


def kept_bytes(patcher) -> int:
    kept = _KEPT.get(getattr(patcher, "model", None)) or {}
    return sum(_nbytes(k) for k in kept.values() if k.loaded is not None)


@_guarded
def release(patcher, device_to) -> int:
    """During an unload to ``device_to``: put each kept host tensor back in place of the weight loaded from
    it.  Returns the bytes that will not be copied.  The rest is left to ComfyUI's copy."""
    base = getattr(patcher, "model", None)
    kept = _KEPT.get(base)
    if not kept:
        return 0
    if getattr(patcher, "hook_backup", None):
        _KEPT.pop(base, None)  # ComfyUI writes hooked weights back into the loaded tensors
        return 0
    backup = getattr(patcher, "backup", None) or {}
    freed = sum(_give_back(base, kept, key, backup, device_to) for key in list(kept))
    if freed:
        log.debug("wan-sage: unloading kept %.2f GiB of weights' host copies: not copied back", freed / 2**30)
    return freed


def _interchangeable(cur, host) -> bool:
    """Whether the loaded object ``cur`` carries nothing its host object ``host`` lacks: the same type and the
    same instance attributes (ComfyUI-GGUF hangs a LoRA on the loaded tensor's ``patches``; the host tensor has
    none, so giving it back would drop the LoRA from a module left streamed)."""
    a, b = getattr(cur, "__dict__", {}), getattr(host, "__dict__", {})
    if type(cur) is not type(host) or a.keys() != b.keys():
        return False
    try:
        return all(a[n] is b[n] or bool(a[n] == b[n]) for n in a)
    except Exception:  # attributes that do not compare (tensors): not the same
        return False


def _host_twin(cur, host):
    """A new tensor object on ``host``'s storage that carries the instance attributes of the loaded object ``cur``,
    as the copy ComfyUI-GGUF's ``GGMLTensor.to`` makes would carry them (its LoRA ``patches``, a list copied, and its
    quantization fields); None where the two are not one tensor subclass with attributes of its own, or where an
    attribute holds a tensor off the host (the copy would keep that, but it is not this module's to keep)."""
    if type(cur) is not type(host) or type(cur) in (torch.Tensor, torch.nn.Parameter):
        return None
    attrs = getattr(cur, "__dict__", None)
    if not attrs or any(
            isinstance(v, torch.Tensor) and v.device.type != host.device.type for v in attrs.values()):
        return None
    twin = torch.Tensor.as_subclass(host, type(host))  # a new object on the same storage
    for n, v in attrs.items():
        setattr(twin, n, list(v) if isinstance(v, list) else v)
    return twin


def _give_back(base: torch.nn.Module, kept: dict, key: str, backup: dict, device_to, same_object: bool = False) -> int:
    """Put the kept host tensor of ``key`` back in place of the weight loaded from it; the bytes not copied.
    0, and the key forgotten, where that is not the weight the copy would give (:func:`release`);
    ``same_object``: for a module left streamed rather than reloaded, a replaced object is given back where it
    carries nothing the host one lacks (:func:`_interchangeable`), else as a twin carrying its attributes
    (:func:`_host_twin`)."""
    k = kept[key]
    try:
        module, name, cur = _param(base, key)
    except AttributeError:
        cur = None
    ok = (cur is not None and _is_loaded(k, cur) and key not in backup and _same(k.data.device, device_to)
          and _same_layout(k, cur))
    k.loaded, k.device, k.ptr = None, None, 0
    if ok and cur is k.host:  # the load moved the object's storage: give it its host storage back
        cur.data = k.data
    elif (ok and _same(k.host.device, device_to)  # the load replaced the object
          and (not same_object or _interchangeable(cur, k.host))):
        _put(module, name, k.host)
    elif ok and same_object and _same(k.host.device, device_to) and (twin := _host_twin(cur, k.host)) is not None:
        _put(module, name, twin)  # a module left streamed keeps what rides on the loaded object (a GGUF LoRA)
    else:
        del kept[key]
        return 0
    return _nbytes(k)


def _pin_kept_later(patcher, locker=None) -> bool:
    """After a load: give :func:`pin_kept` for ``patcher``'s model to the page-locking worker, where its load device
    is a CUDA device and host copies are kept for it (the worker passes over those already page-locked); True where
    it was given."""
    try:
        locker = locker or pinned_host.CudaLocker()
        load = torch.device(getattr(patcher, "load_device", "cpu"))
        offload = torch.device(getattr(patcher, "offload_device", "cpu"))
        base = getattr(patcher, "model", None)
        if offload.type != "cpu" or not locker.usable(load) or not _KEPT.get(base):
            return False
        pinned_host.later(pin_kept, weakref.ref(base), load, locker)
        return True
    except Exception as e:  # the kept copies stay pageable
        warn_once(("pin-kept-plan", type(e).__name__), "wan-sage: page-locking the weights' host copies failed (%s); "
                  "a reload copies them from pageable memory.", reason(e))
        return False


@_guarded
def _unpinned(base) -> list[list[tuple[str, _Kept, torch.Tensor]]]:
    """Per module (and within it, inference tensors apart from others), in the model's order: (name, entry, its host
    bytes) of each kept entry of a loaded weight whose host bytes are contiguous and not page-locked yet."""
    kept = _KEPT.get(base) if isinstance(base, torch.nn.Module) else None
    if not kept:
        return []
    groups: dict = {}
    for key, k in kept.items():
        if (k.loaded is None or not k.data.is_contiguous() or not _nbytes(k) or pinned_host.is_pinned(k.data)
                or pinned_host.gave_room(k.data)):
            continue
        # inference tensors (made under ComfyUI's inference mode) and others apart: a tensor's ``data`` takes
        # only its own kind
        groups.setdefault((key.rpartition(".")[0], k.data.is_inference()), []).append((key, k, k.data))
    return list(groups.values())


@_guarded
def _repoint(base, group, targets) -> int:
    """Point each entry of ``group`` still kept as it was found (its weight loaded, its host bytes the same tensor)
    at its page-locked copy in ``targets``, and the host object with it where the load replaced that object; the
    bytes pointed."""
    kept = _KEPT.get(base) or {}
    moved = 0
    for (key, k, data), dst in zip(group, targets):
        if (kept.get(key) is not k or k.loaded is None or k.data is not data
                or dst.is_inference() != data.is_inference()):
            continue
        host = k.host
        if host is not k.loaded() and _same(host.device, data.device):  # the load replaced the object
            if host.data_ptr() != data.data_ptr():
                continue
            host.data = dst
        k.data = dst  # a plain tensor of the same bytes, size and dtype: what the unload's ``data`` assignment takes
        moved += _nbytes(k)
    return moved


def pin_kept(base_ref, load, locker=None, total: int | None = None, available=None) -> int:
    """Page-lock the kept host copies of ``base_ref()``'s loaded weights (:mod:`.pinned_host`'s worker runs it after
    each load): one buffer per module, within :func:`pinned_host.room_for`; the bytes now page-locked.  A module
    unloaded or changed meanwhile keeps its pageable copy; its buffer is let go."""
    locker = locker or pinned_host.CudaLocker()
    base = base_ref()
    if base is None:
        return 0
    done = skipped = modules = 0
    times, t0 = [0.0, 0.0], time.perf_counter()
    room = {} if available is None else {"available": available}
    on_device = torch.cuda.device(load) if load.type == "cuda" and torch.cuda.is_available() else nullcontext()
    groups = _unpinned(base)
    groups.reverse()
    with on_device:  # the worker thread registers for the model's device
        while groups:
            group = groups.pop()  # let go of each module's pageable copies once pointed (memory not on a file map)
            need = pinned_host.layout_bytes([data for _, _, data in group])
            if not pinned_host.room_for(need, total, **room):
                skipped += need
                continue
            if not any(k.loaded is not None for _, k, _ in group):
                continue
            targets = pinned_host.pinned_copies([data for _, _, data in group], locker, times)
            moved = _repoint(base, group, targets)
            done += moved
            modules += bool(moved)
            del group, targets
    if done or skipped:
        log.info("wan-sage: page-locked %.2f GiB of the weights' host copies beside the sampling in %.2f s (%d "
                 "modules; copies %.2f s, registering %.2f s)%s", done / 2**30, time.perf_counter() - t0, modules,
                 times[0], times[1],
                 f"; {skipped / 2**30:.2f} GiB left pageable (host memory ceiling)" if skipped else "")
    return done

