"""fp8 matmuls for the blocks Wan Compile Blocks runs compiled: each Linear of the block multiplies in
float8_e4m3fn with a scale per input row and per output channel, accumulating in fp32 (``torch._scaled_mm``).

A Wan block's Linears (self- and cross-attention q, k, v, o, the FFN's two) do 28 % of an A14B block's
multiply-adds at 1280x720x81 (self-attention the rest), in bfloat16 where Sage runs attention in int8 and fp8.
ComfyUI 0.3.64's own fp8 path (``fp8_e4m3fn_fast``, ``comfy/ops.py`` ``fp8_linear``) runs for no Wan layer (the
model stays in training mode), and where it runs it clamps each input to +-448 and casts it without a scale.  Here
every row of the input is scaled by its own largest magnitude and every output channel of the weight by its own, so
no value overflows and each keeps e4m3's 3 mantissa bits within its row: the error of a product is about that of
its operands' rounding (2^-4 at most, relative), whatever the activations' range.

:class:`Fp8Linears` is a ``TorchFunctionMode`` entered around the compiled block's call: dynamo traces it, so the
block's one graph holds the fp8 matmuls with the quantisation of the input and the weight fused in front of them.
It takes ``torch.nn.functional.linear`` calls whose input and weight are plain bfloat16 tensors (or parameters) on
one device with both matrix sizes a multiple of 16 (``_scaled_mm``'s rule); every other call runs as it would.  The
weight is quantised at each call from whatever the layer's cast gave (a dequantised GGUF weight with its LoRA, a
cast fp8 or a resident bf16 weight), so nothing is kept and the stored weights are not touched.

:func:`available` says whether a device runs it: a CUDA GPU with fp8 tensor cores (compute capability 8.9 or
more) on which a small ``_scaled_mm`` with row-wise scales runs and agrees with the bf16 matmul, tried once per
device and process.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TINY = 1e-12  # the smallest row scale: an all-zero row quantises to zeros, not NaN
MIN_CAPABILITY = (8, 9)  # Ada and later: fp8 tensor cores
ALIGN = 16  # _scaled_mm: both matrix sizes of the weight a multiple of 16
# The probe's bound on the relative L2 error against the bf16 matmul.  e4m3 keeps 3 mantissa bits: a product of
# two rounded operands is off by 2^-4 relative at most, and about 0.03 in L2 over a random matrix; a kernel that
# gives noise or a wrong scale is off by 1 or more.
PROBE_REL_L2 = 0.08

_probed: dict = {}  # (device type, index) -> (ok, why)
_lock = threading.Lock()


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as an fp8 matmul with a scale per row of ``x`` and per row of ``weight``
    (an output channel), accumulated in fp32, returned in ``x``'s dtype (bfloat16)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    sx = (x2.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=TINY)
    xq = (x2.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    sw = (weight.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=TINY)
    wq = (weight.float() / sw).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


PLAIN = (torch.Tensor, torch.nn.Parameter)  # a tensor subclass (ComfyUI-GGUF's, a QuantizedTensor) is not taken


def takes(x, weight, bias=None) -> bool:
    """Whether :class:`Fp8Linears` runs this ``F.linear`` call in fp8 (the module docstring's rule)."""
    if FP8 is None or type(x) not in PLAIN or type(weight) not in PLAIN:
        return False
    if bias is not None and type(bias) not in PLAIN:
        return False
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or weight.dim() != 2 or x.dim() < 2:
        return False
    n, k = weight.shape
    return (x.shape[-1] == k and k % ALIGN == 0 and n % ALIGN == 0 and x.device == weight.device
            and x.numel() > 0)


class Fp8Linears(TorchFunctionMode):
    """Within it, ``F.linear`` calls that :func:`takes` run as :func:`rowwise_linear`.  It holds no state, so
    dynamo traces a new one in place of the last without a recompile."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if takes(x, weight, bias):
                return rowwise_linear(x, weight, bias)
        return func(*args, **kwargs)


def _probe(device: torch.device) -> tuple[bool, str]:
    """Run a 256x512 by 512x384 fp8 matmul on ``device`` against bf16: (ok, why not)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(256, 512, generator=g).to(device=device, dtype=torch.bfloat16)
    w = (torch.randn(384, 512, generator=g) / 512 ** 0.5).to(device=device, dtype=torch.bfloat16)
    x[:, 7] *= 200  # an outlier channel, as Wan's activations have: the row scales must carry it
    ref = F.linear(x.float(), w.float())
    try:
        with torch.no_grad():
            out = rowwise_linear(x, w).float()
    except Exception as e:  # a torch or GPU without row-wise scaled fp8 matmuls
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return False, f"torch's row-wise scaled fp8 matmul does not run here ({first})"
    if not bool(torch.isfinite(out).all()):
        return False, "torch's row-wise scaled fp8 matmul gave non-finite values"
    rel = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
    if rel > PROBE_REL_L2:
        return False, f"torch's row-wise scaled fp8 matmul is off by {rel:.3f} (relative L2) against fp32"
    return True, ""


def available(device) -> tuple[bool, str]:
    """(whether ``device`` runs the fp8 matmuls, why not in words).  Probed once per device and process."""
    device = torch.device(device)
    if FP8 is None or not hasattr(torch, "_scaled_mm"):
        return False, "this torch has no float8_e4m3fn matmul"
    if device.type != "cuda":
        return False, f"fp8 matmuls run on CUDA GPUs only (the model runs on {device.type})"
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(index)
    except Exception as e:  # no driver, a device index past the last
        return False, f"the GPU's compute capability could not be read ({type(e).__name__})"
    if tuple(cap) < MIN_CAPABILITY:
        return False, (f"this GPU (compute capability {cap[0]}.{cap[1]}) has no fp8 tensor cores; "
                       f"they need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later")
    key = ("cuda", index)
    with _lock:
        if key not in _probed:
            _probed[key] = _probe(torch.device("cuda", index))
        return _probed[key]
