"""How ComfyUI holds a Wan model's weights and which dtype it computes in, from a weight type name
(``bf16``, ``fp8``, ``q4_k_m`` ...) or a model file's header.

The rule follows ComfyUI 0.3.64's loader (``comfy/sd.py`` ``load_diffusion_model_state_dict``,
``comfy/model_management.py`` ``unet_dtype`` and ``unet_manual_cast``) on an NVIDIA GPU of sm70
or newer, without ``--fp16-unet``-style overrides:

* Wan lists fp16 first among its supported inference dtypes, and ``should_use_fp16`` holds on
  these GPUs, so Wan **computes in fp16** whatever the file holds.
* bf16, fp16 and fp32 files are **converted to fp16 when loaded**: no per-call cast.
* fp8 files loaded as ``fp8_e4m3fn_fast`` (key ``fp8_fast``) multiply in fp8 on GPUs with fp8 compute:
  the weights stay fp8 and each Linear copies its input to fp8 (``fp8_ops``); elsewhere they load as fp8.
* fp8 files keep fp8 weights and cast them to fp16 at every Linear call (``manual_cast``), on
  GPUs with fp8 compute (sm89 and newer), or when fp16 weights would not fit in
  ``0.88 x VRAM - 1.2 GiB``; otherwise ``unet_dtype`` loads them as fp16.  Scaled fp8 files
  (a ``scaled_fp8`` tensor) always keep fp8.
* GGUF (ComfyUI-GGUF) keeps each tensor as stored and dequantises it to the compute dtype at
  every call; F16 tensors then need no work, BF16/F32 ones are cast.

A compute dtype given explicitly (ComfyUI started with ``--bf16-unet`` and the like) converts the
float files to it at load; fp8 and GGUF weights still cast per call.
"""
from __future__ import annotations

from dataclasses import dataclass

from .activation_model import DTYPE_BYTES, WanDims, WeightSetup

__all__ = ["WEIGHT_BYTES", "HEADER_DTYPES", "COMFY_COMPUTE_DTYPE", "WeightPlan", "weights_for_key", "weights_for_file",
           "fp8_stays_fp8", "FP8_COMPUTE_CC"]

GiB = 1 << 30
MiB = 1 << 20

WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "fp8": 1.0, "fp8_fast": 1.0, "q8_0": 1.0625, "q6_k": 0.8203,
                "q5_k_m": 0.6875, "q4_k_m": 0.5625, "q3_k_m": 0.4297}
FLOAT_WEIGHTS = ("bf16", "fp16", "fp32")
HEADER_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8", "F8_E5M2": "fp8"}

COMFY_COMPUTE_DTYPE = "fp16"
# supports_fp8_compute(): sm89 (Ada) and every newer NVIDIA GPU.
FP8_COMPUTE_CC = 89
# maximum_vram_for_weights(): 0.88 x total VRAM minus minimum_inference_memory() (0.8 GiB plus
# the 400 MiB ComfyUI keeps free on Linux).
_WEIGHT_SHARE = 0.88
_MIN_INFERENCE = int(0.8 * GiB) + 400 * MiB


@dataclass(frozen=True)
class WeightPlan:
    setup: WeightSetup  # how the weights reach the matmuls (held dtype, GGUF, LoRA)
    nbytes: int  # bytes of weights ComfyUI holds for the model
    compute: str  # compute dtype
    held: str  # what the weights are held as on the GPU: fp16, fp8, q4_k ...
    notes: tuple = ()


def fp8_stays_fp8(cc: int | None, params: int, vram_bytes: int | None) -> bool:
    """Whether ComfyUI keeps an fp8 file's weights in fp8 (else it loads them as fp16)."""
    if cc is None or cc >= FP8_COMPUTE_CC or vram_bytes is None:
        return True
    return params * 2 > _WEIGHT_SHARE * vram_bytes - _MIN_INFERENCE


def _plan(params: int, key: str, lora: bool, compute: str | None, cc, vram_bytes, file_bytes: int | None = None,
          keep_fp8: bool = False) -> WeightPlan:
    explicit = compute is not None
    compute = compute or COMFY_COMPUTE_DTYPE
    if key in FLOAT_WEIGHTS:
        note = () if key == compute else (f"{key} weights are converted to {compute} when ComfyUI loads them",)
        return WeightPlan(WeightSetup(compute, lora=lora), params * DTYPE_BYTES[compute], compute, compute, note)
    if key == "fp8_fast" and (cc is None or cc >= FP8_COMPUTE_CC):
        # UNETLoader's fp8_e4m3fn_fast: fp8_ops, picked where the GPU has fp8 compute (comfy/ops.py pick_operations)
        return WeightPlan(WeightSetup("fp8", lora=lora, fp8_matmul=True), file_bytes or params, compute, "fp8")
    if key in ("fp8", "fp8_fast"):  # fp8_fast without fp8 compute: ComfyUI's ordinary fp8 path
        slow = ((f"fp8_e4m3fn_fast multiplies in fp8 only on GPUs with fp8 compute (sm89 and newer); on sm{cc} "
                 "ComfyUI treats them as plain fp8 weights",) if key == "fp8_fast" else ())
        if explicit or keep_fp8 or fp8_stays_fp8(cc, params, vram_bytes):
            nbytes = file_bytes if file_bytes is not None else params
            return WeightPlan(WeightSetup("fp8", lora=lora), nbytes, compute, "fp8",
                              slow + (f"fp8 weights are cast to {compute} at every layer call",))
        return WeightPlan(WeightSetup(compute, lora=lora), params * DTYPE_BYTES[compute], compute, compute,
                          slow + (f"fp8 weights are loaded as {compute}: sm{cc} has no fp8 compute, and ComfyUI "
                                  f"upcasts an fp8 file whose {compute} weights take less than 88 % of the VRAM less "
                                  "1.2 GiB (its unet_dtype rule), whether or not they then stream; UNETLoader's "
                                  f"weight_dtype fp8_e4m3fn keeps them in fp8, cast to {compute} at every layer call",))
    raise ValueError(f"weights must be one of {', '.join(WEIGHT_BYTES)}")


def weights_for_key(dims: WanDims, key: str, lora: bool, compute: str | None = None, cc: int | None = None,
                    vram_bytes: int | None = None) -> WeightPlan:
    """The weights of a preset stored as ``key`` (bf16, fp8, q4_k_m ...); ``compute`` None: ComfyUI's choice."""
    if not isinstance(key, str) or key not in WEIGHT_BYTES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_BYTES)}")
    params = dims.params()
    if key.startswith("q"):
        compute = compute or COMFY_COMPUTE_DTYPE
        setup = WeightSetup("gguf", gguf_bytes_per_param=WEIGHT_BYTES[key], lora=lora)
        return WeightPlan(setup, int(params * WEIGHT_BYTES[key]), compute, key,
                          (f"GGUF {key} weights are dequantised to {compute} at every layer call",))
    return _plan(params, key, lora, compute, cc, vram_bytes)


def weights_for_file(info, lora: bool, compute: str | None = None, cc: int | None = None,
                     vram_bytes: int | None = None, loader_dtype: str | None = None) -> WeightPlan:
    """The weights of a file read by :func:`memory.headers.read_model_file`.  ``loader_dtype``: the
    dtype a safetensors loader was told to store the weights in (UNETLoader's ``weight_dtype``: ``fp8``, or
    ``fp8_fast`` for ``fp8_e4m3fn_fast``)."""
    if info.format == "gguf":
        compute = compute or COMFY_COMPUTE_DTYPE
        float_key = HEADER_DTYPES.get(info.main_dtype)
        if float_key in FLOAT_WEIGHTS:
            note = () if float_key == compute else (f"GGUF {float_key} weights are cast to {compute} at every layer call",)
            return WeightPlan(WeightSetup(float_key, lora=lora), info.weights_bytes, compute, float_key, note)
        held = info.main_dtype.lower()
        return WeightPlan(WeightSetup("gguf", gguf_bytes_per_param=info.bytes_per_param, lora=lora),
                          info.weights_bytes, compute, held,
                          (f"GGUF {held} weights are dequantised to {compute} at every layer call",))
    if loader_dtype in ("fp8", "fp8_fast"):
        return _plan(info.params, loader_dtype, lora, compute, cc, vram_bytes, keep_fp8=True)
    key = HEADER_DTYPES.get(info.main_dtype)
    if key is None:
        raise ValueError(f"its weights are {info.main_dtype}, which ComfyUI does not load as a Wan model")
    return _plan(info.params, key, lora, compute, cc, vram_bytes,
                 file_bytes=info.weights_bytes if key == "fp8" else None, keep_fp8=info.scaled_fp8)
