"""What the kernel packages offer on this machine: import them once, find each registered
kernel's entry point, say why a kernel cannot run, and call it.

The declarations (archs, dtypes, head dims, formulas, runners) live in :mod:`.registry`; this
module only looks at what is installed.  Packages and torch are imported lazily, on the first
:func:`probe`; what the probe finds is kept in :mod:`.state`.  Nothing here decides *whether* to
use a kernel: that is the dispatcher's job.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from typing import Callable

from . import registry
from .registry import KERNELS, install_hint
from .state import STATE

__all__ = [
    "probe", "available", "unavailable_reason", "auto_candidates", "device_cc", "run", "build_identity", "Probe", "entry_point", "install_test_kernel", "out_of_memory_error",
    "device_index", "into_q_module", "run_into_q",
]

log = logging.getLogger("wan_sage")


@dataclass(frozen=True)
class Probe:
    """What is importable: sageattention (version, flavour, entry points) and comfy-kitchen."""

    sage_version: str | None
    sage_flavour: str | None  # "sage1" / "sage2" / None
    sage_error: str | None
    sage_functions: frozenset  # registered kernel names whose sageattention entry point exists
    sm90_binding_broken: bool
    ck_available: bool
    ck_version: str | None
    ck_error: str | None


def _version(dists) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _sm90_binding_broken(mod) -> bool:
    """SageAttention 2.2.0 builds of 2025-10-08..2025-12-22 bind the sm90 op to its fake impl.

    In fixed builds the attribute is a torch custom-op object; in broken ones it is the plain
    Python fake function, which never launches the kernel.  Builds without ``sm90_compile``
    predate the bug.  The numerical self-test in :mod:`.selftest` is the authority; this is the
    early, structural signal.
    """
    try:
        sc = importlib.import_module(mod.__name__ + ".sm90_compile")
    except ImportError:
        return False
    op = getattr(sc, "qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf", None)
    if op is None:
        return False
    import types
    return isinstance(op, types.FunctionType)


def _import(package: str):
    """(module, None) or (None, "ExceptionType: message"); the message is what the UI and the
    log show as the reason the package's kernels are unavailable."""
    try:
        return importlib.import_module(registry.PACKAGES[package].module), None
    except Exception as e:  # ImportError, or a broken extension raising anything at import
        return None, f"{type(e).__name__}: {e}"


def probe(refresh: bool = False) -> Probe:
    """Import the kernel packages once and find every registered kernel's entry point."""
    found_probe = STATE.probe
    if found_probe is not None and not refresh:
        return found_probe
    fns: dict[str, Callable] = {}
    sage, sage_error = _import("sageattention")
    sage_version = sage_flavour = None
    broken = False
    if sage is not None:
        sage_version = _version(registry.PACKAGES["sageattention"].dists) or getattr(sage, "__version__", None) \
            or "unknown"
        found = {k.name: getattr(sage, k.entry) for k in KERNELS.values()
                 if k.package == "sageattention" and k.flavour == "sage2" and callable(getattr(sage, k.entry, None))}
        if found:
            sage_flavour = "sage2"
            broken = "sage2_sm90" in found and _sm90_binding_broken(sage)
        elif callable(getattr(sage, KERNELS["sage1"].entry, None)):
            sage_flavour = "sage1"
            found = {"sage1": getattr(sage, KERNELS["sage1"].entry)}
        else:
            sage_error = "sageattention imported but exposes no known kernel"
        fns.update(found)
    ck, ck_error = _import("comfy_kitchen")
    ck_version = _version(registry.PACKAGES["comfy_kitchen"].dists)
    ck_ok = False
    if ck is not None:
        fn = getattr(ck, KERNELS["ck_int8"].entry, None)
        if callable(fn):
            fns["ck_int8"] = fn
            ck_ok = True
        else:
            ck_error = "comfy_kitchen has no int8_attention"
    found_probe = Probe(sage_version, sage_flavour, sage_error,
                        frozenset(n for n in fns if KERNELS[n].package == "sageattention"), broken,
                        ck_ok, ck_version, ck_error)
    with STATE.lock:
        if STATE.probe is not None and not refresh:
            return STATE.probe
        STATE.entry_points = fns
        STATE.build_ids = {}
        STATE.probe = found_probe
    return found_probe


def build_identity(package: str) -> str:
    """The installed build of a kernel package: its version plus a short hash of its compiled
    extension files (every source build of SageAttention reports the same version)."""
    probe()
    known = STATE.build_ids.get(package)
    if known is not None:
        return known
    spec = registry.PACKAGES[package]
    version = _version(spec.dists) or "none"
    digest = hashlib.blake2b(digest_size=6)
    try:
        mod = importlib.import_module(spec.module)
        roots = list(getattr(mod, "__path__", [])) or [os.path.dirname(getattr(mod, "__file__", "") or ".")]
        files = sorted(os.path.join(d, f) for root in roots for d, _dirs, names in os.walk(root)
                       for f in names if f.endswith((".so", ".pyd", ".dylib")))
        for path in files:
            digest.update(os.path.basename(path).encode())
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(chunk)
        ident = f"{version}+{digest.hexdigest()}" if files else version
    except (ImportError, OSError) as e:
        log.debug("wan-sage: no build identity for %s: %s", package, e)
        ident = version
    with STATE.lock:
        STATE.build_ids[package] = ident
    return ident


def install_test_kernel(name: str, fn: Callable | None) -> None:
    """Replace (or with ``None`` remove) a kernel's entry point.  For tests, the gpu tier's
    broken-build simulation, and ``wan-sage bench``'s overhead measurement, which puts the real entry
    point back when it is done; a patch in ComfyUI never calls this."""
    probe()
    with STATE.lock:
        fns = dict(STATE.entry_points)
        if fn is None:
            fns.pop(name, None)
        else:
            fns[name] = fn
        STATE.entry_points = fns


def entry_point(name: str) -> Callable | None:
    """The installed entry point of kernel ``name`` (None when it is not installed)."""
    probe()
    return STATE.entry_points.get(name)


def any_kernel_importable() -> bool:
    p = probe()
    return bool(p.sage_functions) or p.ck_available


def device_cc(device) -> int:
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def device_index(device) -> int:
    """One normalised index per device: CUDA's current device when the index is unset."""
    if device.index is not None:
        return device.index
    if device.type == "cuda":
        import torch
        return torch.cuda.current_device()
    return 0


def out_of_memory_error() -> type:
    """torch's out-of-memory exception (``torch.OutOfMemoryError`` exists from torch 2.5)."""
    import torch
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def unavailable_reason(name: str, cc: int | None = None) -> str | None:
    """None if ``name`` can run (on ``cc`` when given), else a sentence saying why not."""
    k = KERNELS.get(name)
    if k is None:
        return f"unknown kernel {name!r}; choose one of: auto, {', '.join(KERNELS)}"
    p = probe()
    if name not in STATE.entry_points:
        if k.package == "sageattention":
            if p.sage_flavour is None:
                return f"sageattention is not importable ({p.sage_error}). {install_hint()}"
            if p.sage_flavour == "sage1" and k.flavour == "sage2":
                return (f"sageattention {p.sage_version} is the 1.x Triton release; {name} needs a "
                        f"2.x build. {install_hint()}")
            if p.sage_flavour == "sage2" and k.flavour == "sage1":
                return f"sageattention {p.sage_version} is 2.x; the 1.0.6 kernel is not installed"
            return f"sageattention {p.sage_version} was built without {name}"
        return f"comfy-kitchen int8_attention is not importable ({p.ck_error})"
    if name == "sage2_sm90" and p.sm90_binding_broken:
        return (f"sageattention {p.sage_version} is a broken 2.2.0 build (Oct-Dec 2025): its sm90 op "
                f"never launches and returns uninitialised memory. Rebuild from main at or after ff71e1e.")
    if cc is not None and not k.runs_on(cc):
        return f"{name} does not support compute capability {cc // 10}.{cc % 10}"
    if cc is not None and k.package == "comfy_kitchen":
        import comfy_kitchen
        check = getattr(comfy_kitchen, "int8_attention_is_available", None)
        try:
            usable = check is None or check()
        except Exception as e:  # a broken extension must not break the dispatcher: it is reported instead
            return f"comfy-kitchen's availability check failed: {type(e).__name__}: {e}"
        if not usable:
            return "comfy-kitchen's CUDA extension is not available on this GPU"
    return None


def available(name: str, cc: int | None = None) -> bool:
    return unavailable_reason(name, cc) is None


def auto_candidates(cc: int) -> tuple:
    """Available kernels for this architecture, in the registry's auto order."""
    return tuple(n for n in registry.auto_order(cc) if available(n, cc))


def run(name: str, q, k, v, layout: str, sm_scale: float | None, cc: int):
    """Call kernel ``name`` on q, k, v in ``layout`` ("NHD" [B,N,H,D] or "HND" [B,H,N,D]);
    returns the output in the same layout."""
    return KERNELS[name].run(STATE.entry_points[name], q, k, v, layout, sm_scale, cc)


def into_q_module(name: str):
    """The module that provides kernel ``name``'s write-into-q pieces (None: not installed, or the
    kernel has no such path).  Imported once; a build that lacks a piece has no such path."""
    spec = KERNELS[name]
    if not spec.into_q_module or name not in STATE.entry_points:
        return None
    found = STATE.into_q_modules.get(name, False)
    if found is False:
        try:
            found = importlib.import_module(spec.into_q_module)
            if not all(callable(getattr(found, attr, None)) for attr in ("per_thread_int8_triton", "per_channel_fp8")) \
                    or not callable(getattr(getattr(found, "sm90_compile", None),
                                            "qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf", None)):
                found = None
        except Exception as e:  # a broken build: the ordinary path stays
            log.debug("wan-sage: %s has no write-into-q path: %s", name, e)
            found = None
        with STATE.lock:
            STATE.into_q_modules[name] = found
    return found


def into_q_shared(name: str, k4):
    """What every head group of one write-into-q call of kernel ``name`` shares, computed once from k4
    ([B, N, H, D]); None where the kernel shares nothing."""
    shared = KERNELS[name].into_q_shared
    return None if shared is None else shared(k4)


def run_into_q(name: str, q4, k4, v4, sm_scale, h0: int, h1: int, shared=None) -> None:
    """Kernel ``name``'s write-into-q path on heads ``h0:h1`` of q4/k4/v4 ([B, N, H, D]), with the call's
    :func:`into_q_shared`."""
    KERNELS[name].call_into_q(into_q_module(name), q4, k4, v4, sm_scale, h0, h1, shared)
