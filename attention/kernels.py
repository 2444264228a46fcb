"""Registry of quantised attention kernels: what each needs, and how to call it.

Modelled on a backend registry with declared constraints: every :class:`Kernel` states the
architectures, dtypes and head dims it supports, whether it takes a mask, and which memory
formula in :mod:`.memory` describes it.  Packages are imported lazily and probed once.
Nothing here decides *whether* to use a kernel; that is :mod:`.policy` and :mod:`.dispatch`.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import threading
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "Kernel", "KERNELS", "AUTO_ORDER", "probe", "available", "unavailable_reason",
    "auto_candidates", "device_cc", "install_hint",
]

INSTALL_HINT = (
    "Install SageAttention 2.x from source (a build of thu-ml/SageAttention main at or after "
    "commit ff71e1e; `pip install --no-build-isolation .` in its checkout, with nvcc >= 12.3 for "
    "Hopper), or `pip install sageattention==1.0.6` (Triton only; slower than PyTorch SDPA on "
    "Hopper, so wan-sage will mostly keep SDPA there)."
)


def install_hint() -> str:
    return INSTALL_HINT


@dataclass(frozen=True)
class Kernel:
    """One attention kernel and its declared constraints."""

    name: str
    label: str
    package: str  # "sageattention" or "comfy_kitchen"
    flavour: str  # "sage1", "sage2" or "ck"
    min_cc: int  # lowest compute capability, as major*10+minor
    archs: frozenset | None  # exact archs the kernel targets (None: any >= min_cc)
    head_dims: tuple  # (lowest, highest) or an explicit tuple of allowed sizes
    explicit_head_dims: bool
    supports_fp32: bool
    mutates_k: bool
    layouts: tuple  # "NHD" and/or "HND" accepted natively

    def memory_path(self, cc: int) -> str:
        if self.name == "sage2_fp8_cuda" and cc >= 120:
            return "sage2_fp8_cuda_perwarp"
        return self.name

    def head_dim_ok(self, d: int) -> bool:
        if self.explicit_head_dims:
            return d in self.head_dims
        lo, hi = self.head_dims
        return lo <= d <= hi

    def arch_ok(self, cc: int) -> bool:
        if cc < self.min_cc:
            return False
        return self.archs is None or cc in self.archs


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("sage2_sm90", "SageAttention 2 INT8-QK/FP8-PV (sm90 wgmma)", "sageattention", "sage2",
           90, frozenset({90}), (1, 128), False, False, False, ("NHD", "HND")),
    Kernel("sage2_fp8_cuda", "SageAttention 2 INT8-QK/FP8-PV (sm89/sm120)", "sageattention", "sage2",
           89, frozenset({89, 90, 120, 121}), (1, 128), False, False, False, ("NHD", "HND")),
    Kernel("sage2_fp16_cuda", "SageAttention 2 INT8-QK/FP16-PV CUDA (sm80+)", "sageattention", "sage2",
           80, None, (1, 128), False, False, False, ("NHD", "HND")),
    Kernel("sage2_fp16_triton", "SageAttention 2 INT8-QK/FP16-PV Triton", "sageattention", "sage2",
           80, None, (1, 128), False, False, False, ("NHD", "HND")),
    Kernel("sage1", "SageAttention 1.0.6 (Triton)", "sageattention", "sage1",
           80, None, (64, 96, 128), True, True, True, ("NHD", "HND")),
    Kernel("ck_int8", "comfy-kitchen int8_attention", "comfy_kitchen", "ck",
           75, None, (1, 256), False, False, False, ("HND",)),
)}

# The preferred order per architecture for "auto".  Calibration, not this order, decides
# which of the available candidates (or SDPA) serves a given shape; the first available one
# is used when calibration is off or over budget.
AUTO_ORDER = {
    90: ("sage2_sm90", "ck_int8", "sage1"),
    89: ("sage2_fp8_cuda", "ck_int8", "sage2_fp16_cuda", "sage1"),
    120: ("sage2_fp8_cuda", "ck_int8", "sage1"),
    121: ("sage2_fp8_cuda", "ck_int8", "sage1"),
    80: ("sage2_fp16_cuda", "ck_int8", "sage1"),
    86: ("sage2_fp16_triton", "ck_int8", "sage1"),
    87: ("sage2_fp16_triton", "ck_int8", "sage1"),
}
_AUTO_DEFAULT = ("ck_int8",)


@dataclass(frozen=True)
class Probe:
    """What is importable: sageattention (version, flavour, functions) and comfy-kitchen."""

    sage_version: str | None
    sage_flavour: str | None  # "sage1" / "sage2" / None
    sage_error: str | None
    sage_functions: frozenset
    sm90_binding_broken: bool
    ck_available: bool
    ck_version: str | None
    ck_error: str | None


_lock = threading.Lock()
_probe: Probe | None = None
_fns: dict[str, Callable] = {}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
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
    except Exception:
        return False
    op = getattr(sc, "qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf", None)
    if op is None:
        return False
    import types
    return isinstance(op, types.FunctionType)


def probe(refresh: bool = False) -> Probe:
    """Import sageattention and comfy_kitchen once and describe what they offer."""
    global _probe
    with _lock:
        if _probe is not None and not refresh:
            return _probe
        _fns.clear()
        sage_version = sage_flavour = sage_error = None
        fns: set[str] = set()
        broken = False
        try:
            mod = importlib.import_module("sageattention")
            sage_version = _version("sageattention") or getattr(mod, "__version__", None) or "unknown"
            explicit = {
                "sage2_sm90": "sageattn_qk_int8_pv_fp8_cuda_sm90",
                "sage2_fp8_cuda": "sageattn_qk_int8_pv_fp8_cuda",
                "sage2_fp16_cuda": "sageattn_qk_int8_pv_fp16_cuda",
                "sage2_fp16_triton": "sageattn_qk_int8_pv_fp16_triton",
            }
            found = {k: getattr(mod, v) for k, v in explicit.items() if callable(getattr(mod, v, None))}
            if found:
                sage_flavour = "sage2"
                _fns.update(found)
                fns.update(found)
                broken = "sage2_sm90" in found and _sm90_binding_broken(mod)
            elif callable(getattr(mod, "sageattn", None)):
                sage_flavour = "sage1"
                _fns["sage1"] = mod.sageattn
                fns.add("sage1")
            else:
                sage_error = "sageattention imported but exposes no known kernel"
        except Exception as e:  # ImportError, or a broken extension raising at import
            sage_error = f"{type(e).__name__}: {e}"
        ck_ok, ck_error = False, None
        ck_version = _version("comfy-kitchen") or _version("comfy_kitchen")
        try:
            ck = importlib.import_module("comfy_kitchen")
            fn = getattr(ck, "int8_attention", None)
            if callable(fn):
                _fns["ck_int8"] = fn
                ck_ok = True
            else:
                ck_error = "comfy_kitchen has no int8_attention"
        except Exception as e:
            ck_error = f"{type(e).__name__}: {e}"
        _probe = Probe(sage_version, sage_flavour, sage_error, frozenset(fns), broken,
                       ck_ok, ck_version, ck_error)
        return _probe


def install_test_kernel(name: str, fn: Callable | None) -> None:
    """Replace (or with ``None`` remove) a kernel's callable.  For tests and the gpu tier's
    broken-build simulation only; production code never calls this."""
    probe()
    with _lock:
        if fn is None:
            _fns.pop(name, None)
        else:
            _fns[name] = fn


def any_kernel_importable() -> bool:
    p = probe()
    return bool(p.sage_functions) or p.ck_available


def device_cc(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def unavailable_reason(name: str, cc: int | None = None) -> str | None:
    """None if ``name`` can run (on ``cc`` when given), else a sentence saying why not."""
    k = KERNELS.get(name)
    if k is None:
        return f"unknown kernel {name!r}; choose one of: auto, {', '.join(KERNELS)}"
    p = probe()
    if name not in _fns:
        if k.package == "sageattention":
            if p.sage_flavour is None:
                return f"sageattention is not importable ({p.sage_error}). {INSTALL_HINT}"
            if p.sage_flavour == "sage1" and k.flavour == "sage2":
                return (f"sageattention {p.sage_version} is the 1.x Triton release; {name} needs a "
                        f"2.x build. {INSTALL_HINT}")
            if p.sage_flavour == "sage2" and k.flavour == "sage1":
                return f"sageattention {p.sage_version} is 2.x; the 1.0.6 kernel is not installed"
            return f"sageattention {p.sage_version} was built without {name}"
        return f"comfy-kitchen int8_attention is not importable ({p.ck_error})"
    if name == "sage2_sm90" and p.sm90_binding_broken:
        return (f"sageattention {p.sage_version} is a broken 2.2.0 build (Oct-Dec 2025): its sm90 op "
                f"never launches and returns uninitialised memory. Rebuild from main at or after ff71e1e.")
    if cc is not None and not k.arch_ok(cc):
        return f"{name} does not support compute capability {cc // 10}.{cc % 10}"
    if cc is not None and name == "ck_int8":
        try:
            import comfy_kitchen
            if not comfy_kitchen.int8_attention_is_available():
                return "comfy-kitchen's CUDA extension is not available on this GPU"
        except Exception as e:
            return f"comfy-kitchen availability check failed: {e}"
    return None


def available(name: str, cc: int | None = None) -> bool:
    return unavailable_reason(name, cc) is None


def auto_candidates(cc: int) -> tuple:
    """Available kernels for this architecture, in preference order."""
    return tuple(n for n in AUTO_ORDER.get(cc, _AUTO_DEFAULT) if available(n, cc))


def run(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str,
        sm_scale: float | None, cc: int) -> torch.Tensor:
    """Call kernel ``name`` on q, k, v in ``layout`` ("NHD" [B,N,H,D] or "HND" [B,H,N,D]).

    Returns the output in the same layout.  Every option is passed by keyword, because
    ``sageattn``-style entry points silently drop unknown kwargs.
    """
    fn = _fns[name]
    if name == "sage2_sm90":
        return fn(q, k, v, tensor_layout=layout, is_causal=False, qk_quant_gran="per_thread",
                  sm_scale=sm_scale, pv_accum_dtype="fp32+fp32", smooth_k=True, return_lse=False)
    if name == "sage2_fp8_cuda":
        gran = "per_warp" if cc >= 120 else "per_thread"
        return fn(q, k, v, tensor_layout=layout, is_causal=False, qk_quant_gran=gran,
                  sm_scale=sm_scale, pv_accum_dtype="fp32+fp16", smooth_k=True, return_lse=False)
    if name == "sage2_fp16_cuda":
        return fn(q, k, v, tensor_layout=layout, is_causal=False, qk_quant_gran="per_thread",
                  sm_scale=sm_scale, pv_accum_dtype="fp32", smooth_k=True, return_lse=False)
    if name == "sage2_fp16_triton":
        return fn(q, k, v, tensor_layout=layout, quantization_backend="triton", is_causal=False,
                  sm_scale=sm_scale, smooth_k=True, return_lse=False)
    if name == "sage1":
        # 1.0.6 subtracts the K mean from its argument in place: give it a private copy.
        return fn(q, k.clone(), v, tensor_layout=layout, is_causal=False, sm_scale=sm_scale,
                  smooth_k=True)
    if name == "ck_int8":
        if layout == "NHD":
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return fn(q, k, v, scale=sm_scale).transpose(1, 2)
        return fn(q, k, v, scale=sm_scale)
    raise KeyError(name)
