"""End-to-end benchmark: Wan 2.2 T2V A14B, both experts, through real ComfyUI in-process.

Drives ComfyUI 0.3.64 (``COMFYUI_PATH``) without its HTTP server, through its own node functions,
in the order of a Wan 2.2 A14B text-to-video workflow:

    CLIPLoader (type "wan") -> CLIPTextEncode (positive, negative)        text encoder first
    UnetLoaderGGUF (ComfyUI-GGUF, ``--gguf-path``) x2, or UNETLoader for ``--weights fp8``
    LoraLoaderModelOnly x2 (rank-64 LoRA per expert, standing in for the Lightning LoRAs)
    ModelSamplingSD3 x2 (shift 5, as in the pack's example workflows)
    [Wan Working-Memory Estimator] -> [Wan 2.2 Sage Attention Patch]     per expert, per config
    EmptyHunyuanLatentVideo
    KSamplerAdvanced high-noise expert, steps 0-2, add_noise, return_with_leftover_noise
    KSamplerAdvanced low-noise expert, steps 2-4 (4 steps, euler/simple, cfg 1.0)
    VAELoader + VAEDecode

The pack's two nodes are applied through their wiring (``wan_sage.nodes.estimator.apply_estimator``
with the node's default settings and the empty latent's shape; ``wan_sage.nodes.sage_patch.apply_patch``
with the node's defaults).  ``--workflow FILE`` runs a saved workflow instead (UI or API format,
converted with ``bench.workflow_api`` and run with ``execution.PromptExecutor``), with the
pack loaded as a custom node.  The model files are random-weight stand-ins at real sizes and key
names, written by ``bench.e2e_models`` into ``--models-dir`` when missing.

Measurements, one JSON line per run (``--out`` appends them too): completed / out of memory /
error and where; peak allocated and reserved (above the ballast) for the whole run and for each
expert's sampling; the fraction of each expert's weights resident at its first step
(``ModelPatcher.loaded_size() / model_size()``); seconds per step for each expert (the sampler's
step callback, CUDA-synchronised, chained through a ``SAMPLER_SAMPLE`` wrapper), the
KSamplerAdvanced wall time including model loading, and the total denoise time; the Sage patch's
call counts by kernel and by SDPA reason (``wan_sage.attention.stats.last_runs()`` for the
patch's id, read after the patch's own OUTER_SAMPLE wrapper has closed the run window); and the
working memory the run reserved (``memory_required`` for one row, read in a ``PREPARE_SAMPLING``
wrapper inside the estimator's, so it is wan-sage's figure with the estimator and ComfyUI's own
without) against the measured working memory (peak allocated during sampling minus what was
allocated when sampling started).  Every run executes under ``torch.inference_mode()``, as
ComfyUI's ``PromptExecutor`` runs nodes (outside it, ComfyUI-GGUF's LoRA-patched quantised weights
stayed on the GPU after unloading).  Between runs every model is unloaded and the cache emptied;
what is still allocated then is recorded, and a budget run that starts with more than
``INHERITED_LIMIT_GIB`` of it is marked ``budget.faithful: false``.  ``torch.OutOfMemoryError`` is
recorded as a result, not raised: ``status: "oom"``, the phase, ``oom_where`` (the innermost 16
frames as ``path:lineno function``, outermost first, paths without the machine's part) and
``oom_memory`` (allocated and reserved above the ballast and the device's free memory, GiB, read
where it was caught), ``oom_figures`` (the sizes torch's message gives: the request among them), and a
log line ``e2e OOM in PHASE at FRAME``.

Progress goes to stderr as it happens: a line ``e2e step EXPERT I/N: S s (run T s)`` at the end of
each sampler step (from the same synchronised callback as the step times; in workflow mode EXPERT
is ``node ID``), so a run killed from outside shows how far it got.

``--vram-budget GB`` (CUDA only; a no-op with a message on CPU) holds a ballast allocation so
that ``comfy.model_management.get_free_memory()`` reads GB GiB (checked, corrected to within
1 MiB).  How faithful that is:

* What ComfyUI sees is exact: it decides residency, offloading and batching from
  ``get_free_memory()`` (driver free + PyTorch's reserved-but-unused), which reads the budget.
  ``total_vram`` (logged at start-up, used for a few start-up defaults such as the Windows
  reserve) still reads the real card.
* The CUDA context, cuBLAS/cuDNN workspaces and other processes are outside the budget here,
  as on a real card, where they come out of its nominal size: a 24 GB card (24,564 MiB) has about
  22.5-23.2 GiB free after its context (and the desktop, on Windows).  A budget of 24 is
  therefore about 1 GiB kinder than a real 24 GB card; pass e.g. 22.8 to match one.
* ComfyUI reserves 400 MiB on Linux and 700 MiB on Windows cards over 15 GB
  (``EXTRA_RESERVED_VRAM``); ``--reserve-vram`` sets ComfyUI's own flag to copy Windows.
* The ballast is one allocation in PyTorch's allocator.  With the caching allocator it is a
  segment of its own; with cudaMallocAsync (``--allocator async``, what ComfyUI's ``main.py``
  picks) it lives in the same pool, so fragmentation near the limit can differ slightly from a
  card that is really that small.  Peaks are reported minus the ballast.
* Running out is an exception here (``torch.OutOfMemoryError``), as on Linux.  On Windows the
  NVIDIA driver's "sysmem fallback" instead spills allocations to shared system memory over
  PCIe and carries on, many times slower.  That behaviour
  cannot be reproduced on Linux: where this harness reports out of memory, a Windows card with
  the fallback on would run slowly instead.

Run specs: ``{est|comfy}+{sdpa|sage}[+compile|+compileblocks|+compilenode]@{GB|full}:{WxHxF|720p81|480p81}``, e.g.
``est+sage@24:720p81``, optionally followed by ``:Nsteps``, ``:cfgX``, ``:nolora`` (no LoRA on the experts) and
``:decode`` / ``:nodecode``, which make the run a workflow of its own (``est+sage@24:480p81:20steps:cfg3.5:nolora``
is ComfyUI's 20-step template; without them ``--steps``, ``--cfg`` and ``--decode`` apply); ``:fp8fast`` (with
``--weights fp8``) loads the experts with UNETLoader's ``fp8_e4m3fn_fast`` (fp8 matmuls; ``config.weights``
``fp8_fast``); ``:tecopy`` adds the pack's Wan Text Encoder Host Copy; ``:trimload`` (a probe) empties the
allocator's cache as each expert's load ends.  ``--matrix`` runs the
16 combinations of the benchmark's targets for ``--weights`` in priority order (24 GB 720p81 first);
``--deadline-s`` stops starting runs after that many seconds.  Every record has ``to_latent_s`` and
``to_frames_s``: from the run's first node (the text encode) to the latent and to the decoded frames.

``--whole-prompt --caches none|kept DIR`` runs one spec as the user's clock sees it, in this fresh process and
with no warm-up: the first prompt, then a repeat prompt with a new seed, as queued to a running ComfyUI (one
:class:`PromptSession`: the ballast held throughout, nothing unloaded between the prompts, the nodes whose
inputs did not change served from the first prompt).  ``--caches`` points the pack's timing cache, TorchInductor's
and Triton's caches at fresh empty folders (``none``) or at ``DIR``'s (``kept``) before torch is imported.  One
record (``wan-sage-whole-prompt/1``) per process, with both prompts, the caches, the process's start and
ComfyUI's import apart (``process_start_s``, ``startup``); ``python -m bench.whole_prompt`` drives the processes.
With ``--workflow FILE`` the one spec of ``--runs`` is a variant of that saved workflow,
``{template|comfy|compilenode}@{GB|full}[:WxHxF][:Nsteps]`` (``bench.workflow_variants``: as saved, the pack's nodes
bypassed, Wan Compile Blocks added after the Sage patch), and both prompts run through one
``execution.PromptExecutor`` (:class:`WorkflowRunner`): the repeat prompt changes the samplers' seed only, and
ComfyUI's own node cache serves it the rest.  The model files are those the workflow loads (``bench.e2e_models``:
the TI2V-5B set for the pack's 5B template, the Wan 2.1 I2V 14B set with CLIP vision H for its image-to-video
template), and the start image a LoadImage node reads is written into ComfyUI's input folder of the process
(``--work-dir``'s ``input/``): a deterministic pattern at the video's size, recorded under ``inputs``.

``+compile`` adds ComfyUI's own ``TorchCompileModel`` node (``comfy_extras/nodes_torch_compile.py``)
to each expert after the Sage patch, so the compiled model carries the override.  In ComfyUI 0.3.64
that node clones the model and calls ``set_torch_compile_wrapper(model, backend)`` with its default
keys, ``["diffusion_model"]``: the whole diffusion model is one ``torch.compile`` (fullgraph False,
dynamic None, mode None; backend ``inductor`` or ``cudagraphs``, ``--compile-backend``), swapped in by
an APPLY_MODEL wrapper for each call.  The compile happens in each expert's first step, so that step
carries it (``bench.plot_e2e`` leaves each expert's first step out of its "after the first step"
column for these runs).  Each compiled run starts from ``torch._dynamo.reset()``, as a fresh
ComfyUI process would; its record has ``config.compile`` and, under ``compile``, what dynamo did
(graph breaks and their reasons, graphs, recompiles, compile seconds).

``+compileblocks`` compiles each transformer block on its own instead, as Wan users' per-block compile
nodes do (KJNodes' ``TorchCompileModelWanVideoV2``): ``set_torch_compile_wrapper`` with the keys
``diffusion_model.blocks.N`` and dynamo's recompile limit raised to 64, as those nodes raise it.  The
blocks share one graph, so it compiles in seconds where the whole model takes minutes (A14B, inductor:
360 s for the first expert on the H200).  ``+compilenode`` is the pack's own Wan Compile Blocks node
(``wan_sage.nodes.compile_blocks``): per block as well, streamed blocks compiled with their weights staged.

``--sage-memory-mode`` passes the Sage patch's memory mode (``sdpa``: head groups at SDPA's memory,
``fastest``) to the node's wiring; the run's label then ends in ``/memory-MODE``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import _host
from ._paths import ROOT, short_path  # noqa: F401  (ROOT: this checkout)

GiB = 1 << 30
SCHEMA = "wan-sage-e2e/1"
RES = {"720p81": (1280, 720, 81), "480p81": (832, 480, 81), "tiny": (64, 64, 5)}
PROMPT = ("a cinematic shot of a red fox running through a snowy forest at golden hour, the camera slowly pans "
          "left, detailed fur, soft light, shallow depth of field")
NEGATIVE = "low quality, worst quality, static frame, overexposed, blurred"


COMPILE_SUFFIX = {"model": ["compile"], "blocks": ["compileblocks"], "node": ["compilenode"]}  # RunSpec.compile -> suffix
SPEC_FORM = ("{est|comfy}+{sdpa|sage}[+compile|+compileblocks|+compilenode]@{GB|full}:{WxHxF|720p81|480p81}"
             "[:Nsteps][:cfgX][:nolora][:decode|:nodecode][:fp8fast][:tecopy][:trimload]")


@dataclass(frozen=True)
class RunSpec:
    """One run of the harness: the graph's configuration.  ``steps``, ``cfg`` and ``decode`` left at None
    take the command line's ``--steps``, ``--cfg`` and ``--decode``; a spec that names them (``:20steps``,
    ``:cfg3.5``, ``:nodecode``) is a workflow of its own, so that a long and a short run are one call."""
    estimator: bool
    attention: str            # sdpa | sage
    budget_gib: float | None  # None: the whole card
    res: tuple
    compile: str = ""         # after the Sage patch: "model" (ComfyUI's TorchCompileModel), "blocks" (per block),
    #                           "node" (the pack's Wan Compile Blocks: per block, streamed blocks staged)
    steps: int | None = None  # None: --steps
    cfg: float | None = None  # None: --cfg
    lora: bool = True         # False (":nolora"): no LoRA on the experts, as the 20-step workflows without Lightning
    decode: bool | None = None  # None: --decode
    fp8_fast: bool = False    # ":fp8fast" (with --weights fp8): UNETLoader's weight_dtype fp8_e4m3fn_fast (fp8 matmuls)
    te_copy: bool = False     # ":tecopy": the pack's Wan Text Encoder Host Copy between CLIPLoader and the encodes
    trim_load: bool = False   # ":trimload" (a probe): the allocator's cache emptied as each expert's load ends

    @classmethod
    def parse(cls, s: str) -> "RunSpec":
        try:
            head, *tail = s.split(":")
            if not tail:
                raise ValueError
            res, options = tail[0], tail[1:]
            kind, _, budget = head.partition("@")
            est, att, *extra = kind.split("+")
            if est not in ("est", "comfy") or att not in ("sdpa", "sage") or extra not in ([], *COMPILE_SUFFIX.values()):
                raise ValueError
            b = None if budget in ("", "full") else float(budget)
            r = RES.get(res) or tuple(int(x) for x in res.split("x"))
            if len(r) != 3:
                raise ValueError
            fields = {}
            for opt in options:
                m = re.fullmatch(r"(\d+)steps|cfg(\d+(?:\.\d+)?)|(nolora)|(decode|nodecode)|(fp8fast)|(tecopy)|(trimload)", opt)
                if m is None:
                    raise ValueError
                key = ("steps", "cfg", "lora", "decode", "fp8_fast", "te_copy", "trim_load")[m.lastindex - 1]
                if key in fields:
                    raise ValueError
                fields[key] = (int(m.group(1)) if key == "steps" else float(m.group(2)) if key == "cfg"
                               else False if key == "lora" else True if key in ("fp8_fast", "te_copy", "trim_load")
                               else m.group(4) == "decode")
            if fields.get("steps") is not None and fields["steps"] < 2:
                raise ValueError      # one step per expert at least
            return cls(est == "est", att, b, r, next((k for k, v in COMPILE_SUFFIX.items() if v == extra), ""), **fields)
        except ValueError:
            raise SystemExit(f"bad run spec {s!r}: expected {SPEC_FORM}")

    @property
    def label(self) -> str:
        b = "full" if self.budget_gib is None else f"{self.budget_gib:g}"
        suffix = "".join("+" + x for x in COMPILE_SUFFIX.get(self.compile, []))
        options = ("" if self.steps is None else f":{self.steps}steps") + ("" if self.cfg is None else f":cfg{self.cfg:g}") \
            + ("" if self.lora else ":nolora") + ("" if self.decode is None else (":decode" if self.decode else ":nodecode")) \
            + (":fp8fast" if self.fp8_fast else "") + (":tecopy" if self.te_copy else "") \
            + (":trimload" if self.trim_load else "")
        return (f"{'est' if self.estimator else 'comfy'}+{self.attention}{suffix}"
                f"@{b}:{'x'.join(map(str, self.res))}{options}")

    @property
    def name(self) -> str:
        """The configuration's name in the whole-prompt driver (its records' ``run``, its kept caches' folder)."""
        return self.label

    def steps_of(self, args) -> int:
        return self.steps if self.steps is not None else args.steps

    def cfg_of(self, args) -> float:
        return self.cfg if self.cfg is not None else getattr(args, "cfg", 1.0)


WARMUP_RES = (384, 384, 5)   # 2 x 24 x 24 = 1,152 tokens: above the patch's 1,024-token threshold, a multiple of 16


def warmup_spec(todo: list[RunSpec], scale: str = "full") -> RunSpec:
    """The unrecorded run before the measured ones: it reads the files, releases GGUF's mmap, initialises
    cuBLAS/cuDNN and, when a measured run uses the Sage patch, makes the patch's first Sage calls (self-test,
    Triton compiling SageAttention's quantisation kernels: 3.5 s on a fresh machine, measured on the H200)
    so that no measured run pays them.  Below 1,024 tokens the patch keeps SDPA, so the size is above that."""
    sage = any(s.attention == "sage" for s in todo)
    return RunSpec(False, "sage" if sage else "sdpa", None, RES["tiny"] if scale == "tiny" else WARMUP_RES)


def matrix(budget: float) -> list[RunSpec]:
    """The target matrix in priority order: 24 GB 720p81, full 720p81, 24 GB 480p81, full 480p81."""
    out = []
    for b, res in ((budget, "720p81"), (None, "720p81"), (budget, "480p81"), (None, "480p81")):
        for est, att in ((True, "sdpa"), (True, "sage"), (False, "sdpa"), (False, "sage")):
            out.append(RunSpec(est, att, b, RES[res]))
    return out


# --------------------------------------------------------------------------- measurement helpers

class ComfyTimers:
    """Wall seconds this harness process spends inside ComfyUI's model-memory calls, per call name: how a phase's
    time splits between moving weights (loading, evicting, ComfyUI's garbage collection) and running nodes.  Times
    are inclusive (load_models_gpu contains free_memory, which contains the partial unloads).  Each target is
    wrapped for the harness's process only, and :meth:`close` puts the originals back."""

    def __init__(self, mm, patcher_cls):
        self.totals: dict = {}
        self.counts: dict = {}
        self._undo = []
        targets = [(mm, "load_models_gpu"), (mm, "free_memory"), (mm, "cleanup_models_gc"), (mm, "soft_empty_cache"),
                   (getattr(mm, "LoadedModel", None), "model_unload"),
                   (patcher_cls, "partially_unload"), (patcher_cls, "partially_load"), (patcher_cls, "detach")]
        for owner, name in targets:
            fn = getattr(owner, name, None) if owner is not None else None
            if fn is None:
                continue
            setattr(owner, name, self._timed(fn, name))
            self._undo.append((owner, name, fn))

    def _timed(self, fn, name):
        totals, counts = self.totals, self.counts

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
                counts[name] = counts.get(name, 0) + 1
        timed.__wrapped__ = fn
        return timed

    def snapshot(self) -> tuple:
        return dict(self.totals), dict(self.counts)

    def since(self, before: tuple) -> dict:
        """Seconds per call name since ``before`` (a :meth:`snapshot`), the names that took any time."""
        return {k: round(v - before[0].get(k, 0.0), 3) for k, v in self.totals.items() if v - before[0].get(k, 0.0) > 0}

    def calls_since(self, before: tuple) -> dict:
        """Calls per call name since ``before`` (a :meth:`snapshot`), the names called."""
        return {k: n - before[1].get(k, 0) for k, n in self.counts.items() if n > before[1].get(k, 0)}

    def close(self) -> None:
        for owner, name, fn in reversed(self._undo):
            setattr(owner, name, fn)
        self._undo.clear()


class ConvProbe:
    """Every 2-D and 3-D convolution a block runs, by input and weight shape: how many calls, the device memory
    when the shape was first seen, and on CUDA each call's device milliseconds and the device's free memory as it
    began (``ms``, ``free_gib``: CUDA events around the call, read once the block is over, so the block runs
    unsynchronised).  PyTorch's cuDNN bindings pick a shape's engine at its first call, trying the engines in
    cuDNN's order until one's workspace can be allocated, and keep it; a later call whose workspace cannot be
    allocated picks again, among what fits then, and that engine is kept instead.  A shape whose calls turn slow
    part-way through shows that switch.  It wraps ``torch.nn.functional.conv2d``/``conv3d`` for the block and puts
    them back after it."""

    NAMES = ("conv2d", "conv3d")

    def __init__(self, torch):
        self.torch, self.rows, self._saved, self._events = torch, {}, {}, {}
        self.cuda = bool(torch.cuda.is_available())

    def _reading(self):
        t = self.torch
        if not self.cuda:
            return {}
        free, _ = t.cuda.mem_get_info()
        return {"free_gib": _r(free / GiB), "reserved_gib": _r(t.cuda.memory_reserved() / GiB),
                "alloc_gib": _r(t.cuda.memory_allocated() / GiB)}

    def _wrap(self, fn):
        def conv(x, weight, *args, **kwargs):
            key = (tuple(x.shape), tuple(weight.shape))
            row = self.rows.get(key)
            if row is None:
                row = self.rows[key] = {"input": list(key[0]), "weight": list(key[1]), "order": len(self.rows),
                                        "calls": 0, "first": self._reading()}
            row["calls"] += 1
            if not (self.cuda and x.is_cuda):
                return fn(x, weight, *args, **kwargs)
            free = self.torch.cuda.mem_get_info()[0]
            e0, e1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            e0.record()
            y = fn(x, weight, *args, **kwargs)
            e1.record()
            self._events.setdefault(key, []).append((e0, e1, free))
            return y
        return conv

    def __enter__(self):
        F = self.torch.nn.functional
        for name in self.NAMES:
            self._saved[name] = getattr(F, name)
            setattr(F, name, self._wrap(self._saved[name]))
        return self

    def __exit__(self, *exc):
        F = self.torch.nn.functional
        for name, fn in self._saved.items():
            setattr(F, name, fn)
        self._saved.clear()
        return False

    def table(self, device_ms: dict) -> list[dict]:
        """The rows in first-seen order, each with ``device_ms``: the device time of cuDNN convolutions with
        that input and weight shape (``device_ms`` maps ``(input, weight)`` shape tuples to ms; the input is
        the one the convolution op saw), and on CUDA ``ms`` and ``free_gib`` per call."""
        if self._events:
            self.torch.cuda.synchronize()
        out = []
        for key, row in sorted(self.rows.items(), key=lambda kv: kv[1]["order"]):
            ev = self._events.get(key, [])
            extra = {"ms": [_r(a.elapsed_time(b), 2) for a, b, _f in ev],
                     "free_gib": [_r(f / GiB, 2) for _a, _b, f in ev]} if ev else {}
            out.append(dict(row, device_ms=device_ms.get(key), **extra))
        return out


def _device_us(ev, total: str) -> float:
    """A profiler event's device time in µs: ``total`` is "self" or "" (self or inclusive), read from the
    ``*_device_time_total`` name and, on older torch, the ``*_cuda_time_total`` one."""
    pre = f"{total}_" if total else ""
    t = getattr(ev, f"{pre}device_time_total", None)
    return getattr(ev, f"{pre}cuda_time_total", 0) if t is None else t


def _conv_device_ms(prof) -> dict:
    """Device ms of each convolution op in a profile, by (input shape, weight shape)."""
    out: dict = {}
    for ev in prof.key_averages(group_by_input_shape=True):
        if ev.key not in ("aten::cudnn_convolution", "aten::_convolution"):
            continue
        shapes = getattr(ev, "input_shapes", None) or []
        if len(shapes) < 2 or not shapes[0] or not shapes[1]:
            continue
        t = _device_us(ev, "")
        key = (tuple(shapes[0]), tuple(shapes[1]))
        if ev.key == "aten::cudnn_convolution" or key not in out:
            out[key] = _r(t / 1e3, 1)
    return out


@contextmanager
def profiled(torch, top: int):
    """Profile the block with torch.profiler when ``top`` > 0 and fill the yielded dict with where its time
    went: ``device_s`` (the kernels' own device time, summed), ``kernels`` (how many ran), ``top`` (the
    ``top`` kernels by device time: name, calls, ms) and ``convs`` (:class:`ConvProbe`'s table: each
    convolution shape, its calls, device ms, the memory when it was first seen and each call's ms and free
    memory).  Nothing is profiled (and
    the dict stays empty) when ``top`` is 0; a profiler failure is recorded as ``{"error": ...}`` and never
    fails the run."""
    out: dict = {}
    if top <= 0:
        yield out
        return
    probe = ConvProbe(torch)
    try:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        prof = profile(activities=acts, record_shapes=True)
        prof.__enter__()
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"[:200]
        yield out
        return
    try:
        with probe:
            yield out
    finally:
        try:
            prof.__exit__(None, None, None)
            rows = []
            for ev in prof.key_averages():
                t = _device_us(ev, "self")
                if t and str(getattr(ev, "device_type", "")).endswith("CUDA"):
                    rows.append((t, ev.key, ev.count))
            rows.sort(reverse=True)
            out.update({"device_s": _r(sum(r[0] for r in rows) / 1e6), "kernels": sum(r[2] for r in rows),
                        "top": [{"name": k[:120], "calls": c, "ms": _r(t / 1e3, 1)} for t, k, c in rows[:top]],
                        "convs": probe.table(_conv_device_ms(prof))})
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {e}"[:200]


class Mem:
    """CUDA memory readings above the ballast (all None on CPU).  :meth:`peaks` are the peaks since the last
    :meth:`reset`; :meth:`step_peaks` reads the peaks of a window inside that (one sampling step) without losing
    them for :meth:`peaks`."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda, self.ballast = torch, cuda, 0
        self._carried = (0, 0)  # the largest step peaks read since the last reset, in bytes

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset(self):
        self._carried = (0, 0)
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def _raw_peaks(self):
        t = self.torch.cuda
        return t.max_memory_allocated(), t.max_memory_reserved()

    def step_peaks(self):
        """The peaks since the last reset or step, then a new step; (None, None) on CPU."""
        if not self.cuda:
            return None, None
        pa, pr = self._raw_peaks()
        self._carried = (max(self._carried[0], pa), max(self._carried[1], pr))
        self.torch.cuda.reset_peak_memory_stats()
        return (pa - self.ballast) / GiB, (pr - self.ballast) / GiB

    def alloc(self):
        return (self.torch.cuda.memory_allocated() - self.ballast) / GiB if self.cuda else None

    def empty_cache(self):
        """Give the allocator's unused cached memory back to the device (its pool trimmed, with cudaMallocAsync)."""
        if self.cuda:
            self.torch.cuda.empty_cache()

    def retries(self):
        return _host.alloc_retries(self.torch) if self.cuda else None

    def peaks(self):
        if not self.cuda:
            return None, None
        pa, pr = self._raw_peaks()
        pa, pr = max(pa, self._carried[0]), max(pr, self._carried[1])
        return (pa - self.ballast) / GiB, (pr - self.ballast) / GiB

    def reserved(self):
        return (self.torch.cuda.memory_reserved() - self.ballast) / GiB if self.cuda else None

    def pool(self) -> dict | None:
        """Allocated and reserved (above the ballast) and the device's free memory, in GiB; None on CPU."""
        return self.at_oom()

    def at_oom(self) -> dict | None:
        """Allocated and reserved (above the ballast) and the device's free memory
        (``mem_get_info``), in GiB, for a row that ran out of memory; None on CPU.  Never raises:
        a failed reading is recorded as ``{"error": ...}``."""
        if not self.cuda:
            return None
        try:
            t = self.torch.cuda
            free = t.mem_get_info()[0]
            return {"allocated_gib": _r((t.memory_allocated() - self.ballast) / GiB),
                    "reserved_gib": _r((t.memory_reserved() - self.ballast) / GiB), "free_gib": _r(free / GiB)}
        except Exception as e:
            return {"error": f"{type(e).__name__}: {e}"[:200]}


def plan_inputs(fn) -> dict:
    """What the estimator's sampling-time plan read (its ``MemoryRequired``'s setup): the VRAM it found this
    model could use (free memory plus what unloading the other loaded models frees), the weights, and whether
    it planned them streamed and the blocks compiled; empty for ComfyUI's own figure."""
    s = getattr(fn, "setup", None)
    if s is None:
        return {}
    return {"plan_vram_gib": _r(s.vram_bytes / GiB) if s.vram_bytes is not None else None,
            "plan_weights_gib": _r(s.weights_bytes / GiB) if s.weights_bytes is not None else None,
            "plan_kept_free_gib": _r(s.kept_free / GiB), "plan_streamed": s.streamed, "plan_compiled": s.compiled}


def _estimate_fields(est) -> dict:
    """The estimator's figures a run record keeps (the node's outputs; the record's GiB keys end in _gb)."""
    if est is None:
        return {}
    from wan_sage.memory import report
    s = report.summary(est)
    return {"tokens": s["tokens"], "activation_gb": _r(s["activation_gib"]), "sage_extra_gb": _r(s["sage_extra_gib"]),
            "reservation_gb": _r(s["reservation_gib"])}


def _r(x, n=3):
    return None if x is None else round(float(x), n)


def oom_figures(message: str) -> dict:
    """The sizes torch's out-of-memory message gives, as ``{name: text}``: the native allocator's
    ``Tried to allocate X`` (as ``Requested``) from its first line, and cudaMallocAsync's ``name: size``
    lines after it (currently allocated, requested, device limit, free according to CUDA; a value on a
    line of its own joins the name before it); empty when there are none."""
    lines = str(message).splitlines()
    out = {}
    m = re.search(r"Tried to allocate ([\d.]+ \w+)", lines[0] if lines else "")
    if m:
        out["Requested"] = m.group(1)
    pending = None
    for line in lines[1:12]:
        name, sep, value = line.partition(":")
        name = " ".join(name.split())
        if sep and not name and pending and value.strip():
            out[pending] = value.strip()[:60]
        elif sep and name and value.strip() and len(name) < 60:
            out[name] = value.strip()[:60]
        pending = name if not sep and name else None
    return out


def oom_where(tb, n: int = 16, root: Path | str | None = ROOT) -> list[str]:
    """The innermost ``n`` frames of a traceback (a traceback object or a list of
    ``traceback.FrameSummary``) as ``"path:lineno function"`` with :func:`short_path` names, in
    traceback order: outermost first, the frame that raised last."""
    frames = traceback.extract_tb(tb) if hasattr(tb, "tb_frame") else list(tb or [])
    return [f"{short_path(fr.filename, root)}:{fr.lineno} {fr.name}" for fr in frames[-n:]] if n > 0 else []


def step_line(expert, i: int, n: int, seconds: float, run_s: float | None) -> str:
    """The progress line logged at the end of each sampler step (``i`` counts from 1)."""
    return f"e2e step {expert} {i}/{n}: {seconds:.3f} s" + ("" if run_s is None else f" (run {run_s:.1f} s)")


class Ballast:
    """Hold device memory so that ComfyUI's get_free_memory() reads ``budget_gib``."""

    def __init__(self, torch, mm, dev, budget_gib: float | None, log):
        self.blocks, self.note = [], None
        self.free_before = self.free_seen = None
        if budget_gib is None:
            return
        if dev.type != "cuda":
            self.note = f"--vram-budget {budget_gib:g} ignored: no CUDA device (the budget needs a ballast on a GPU)"
            log(self.note)
            return
        target = int(budget_gib * GiB)
        self.free_before = mm.get_free_memory(dev)
        want = self.free_before - target
        if want <= 0:
            self.note = f"budget {budget_gib:g} GiB is above the free {self.free_before / GiB:.2f} GiB: no ballast"
            log(self.note)
        else:
            self.blocks.append(torch.empty(want, dtype=torch.uint8, device=dev))
            for _ in range(6):           # allocator rounding: top up or trim until within 1 MiB
                diff = mm.get_free_memory(dev) - target
                if abs(diff) <= (1 << 20):
                    break
                if diff > 0:
                    self.blocks.append(torch.empty(diff, dtype=torch.uint8, device=dev))
                else:
                    last = self.blocks.pop()
                    n = last.numel() + diff
                    del last
                    if n > 0:
                        self.blocks.append(torch.empty(n, dtype=torch.uint8, device=dev))
        self.free_seen = mm.get_free_memory(dev)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.blocks)

    def release(self):
        self.blocks.clear()


class ExpertProbe:
    """PREPARE_SAMPLING + SAMPLER_SAMPLE wrappers on one expert: timing, residency, memory, reservation."""

    KEY = "wan_sage_e2e_probe"

    def __init__(self, name: str, mem: Mem, log=None, t_run: float | None = None, trim_load: bool = False):
        self.name, self.mem = name, mem
        self.log = log
        self.trim_load = trim_load  # empty the allocator's cache as the load ends (RunSpec.trim_load)
        self.restart(t_run)

    def restart(self, t_run: float | None = None):
        """Forget the last sampling: the same probe (and the model it wraps) serves the next prompt, as
        ComfyUI's node cache serves the same model object to a prompt queued again."""
        self.t_run = t_run                    # a step_line() per step through log, its run time from t_run
        self.t_call = self.t0 = self.t1 = None
        self.marks = []
        self.step_mem = []                    # (peak allocated, peak reserved) of each step, CUDA only
        self.patcher = None
        self.d = {}

    def install(self, model, W):
        m = model.clone()
        m.add_wrapper_with_key(W.PREPARE_SAMPLING, self.KEY, self._prepare)
        m.add_wrapper_with_key(W.SAMPLER_SAMPLE, self.KEY, self._sampler)
        return m

    def _prepare(self, executor, model, noise_shape, conds, *args, **kwargs):
        base = model.model
        one = [1] + list(noise_shape[1:])
        try:   # inside the estimator's wrapper (added earlier, so outer): its figure when present
            self.d["predicted_working_gib"] = base.memory_required(one) / GiB
            self.d["reservation_source"] = "wan-sage" if "memory_required" in base.__dict__ else "comfyui"
            self.d["comfy_estimate_gib"] = type(base).memory_required(base, one) / GiB
            self.d.update(plan_inputs(base.__dict__.get("memory_required")))
        except Exception as e:  # never disturb the run being measured
            self.d["predicted_error"] = f"{type(e).__name__}: {e}"
        self.patcher = model
        self.d["inference_mode"] = self.mem.torch.is_inference_mode_enabled()
        return executor(model, noise_shape, conds, *args, **kwargs)

    def _sampler(self, executor, model_wrap, sigmas, extra_args, callback, noise, *args, **kwargs):
        mem = self.mem
        mem.sync()
        self.d["load_peak_alloc_gib"], self.d["load_peak_reserved_gib"] = mem.peaks()
        p = self.patcher
        if p is not None:
            self.d["weights_gib"] = p.model_size() / GiB
            self.d["resident_gib"] = p.loaded_size() / GiB
            self.d["lowvram"] = bool(getattr(p.model, "model_lowvram", False))
        self.d["base_alloc_gib"] = mem.alloc()
        self.d["base_reserved_gib"] = mem.reserved()
        if self.trim_load:
            mem.empty_cache()
            self.d["trimmed_reserved_gib"] = mem.reserved()
        mem.reset()
        self.t0 = time.perf_counter()

        def cb(i, denoised, x, total):
            mem.sync()
            t = time.perf_counter()
            self.marks.append(t)
            if mem.cuda:  # each step's own peaks, so a run shows whether the allocator's holes grow from step to step
                self.step_mem.append(mem.step_peaks())
            if self.log is not None:
                prev = self.marks[-2] if len(self.marks) > 1 else self.t0
                self.log(step_line(self.name, i + 1, total, t - prev, None if self.t_run is None else t - self.t_run))
            if callback is not None:
                callback(i, denoised, x, total)
        try:
            return executor(model_wrap, sigmas, extra_args, cb, noise, *args, **kwargs)
        finally:
            mem.sync()
            self.t1 = time.perf_counter()
            self.d["peak_alloc_gib"], self.d["peak_reserved_gib"] = mem.peaks()
            if p is not None:
                self.d["resident_end_gib"] = p.loaded_size() / GiB
                moves = replan_moves(p.model)
                if moves:
                    self.d["replan"] = moves

    def result(self, wall_s, attention=None, estimator=None) -> dict:
        d = dict(self.d)
        steps = [b - a for a, b in zip([self.t0] + self.marks[:-1], self.marks)] if self.t0 else []
        d["step_s"] = [round(s, 3) for s in steps]
        if self.step_mem:
            d["step_peak_alloc_gib"] = [_r(a) for a, _ in self.step_mem]
            d["step_peak_reserved_gib"] = [_r(r) for _, r in self.step_mem]
        d["s_per_step"] = _r(statistics.mean(steps)) if steps else None
        d["sampler_s"] = _r(self.t1 - self.t0) if self.t0 and self.t1 else None
        d["wall_s"] = _r(wall_s)
        if d.get("weights_gib"):
            d["resident_frac"] = _r(d.get("resident_gib", 0) / d["weights_gib"], 4)
        if d.get("peak_alloc_gib") is not None and d.get("base_alloc_gib") is not None:
            d["working_gib"] = d["peak_alloc_gib"] - d["base_alloc_gib"]
            if d.get("predicted_working_gib"):
                d["predicted_peak_gib"] = d["base_alloc_gib"] + d["predicted_working_gib"]
                d["predicted_over_measured"] = _r(d["predicted_working_gib"] / max(d["working_gib"], 1e-9), 3)
        d["attention"] = attention
        d["estimator"] = estimator
        return {k: (_r(v) if isinstance(v, float) else v) for k, v in d.items()}


def replan_moves(base) -> list:
    """The weights the pack moved between ``base``'s model calls as it planned the reservation again
    (``nodes/replan.py``): per move, the model call it came before (one call per step for the samplers here), the
    reservation before and after, and the GiB loaded (negative: unloaded)."""
    for name, m in list(sys.modules.items()):
        if name.endswith(".nodes.replan") and hasattr(m, "moves"):
            found = m.moves(base)
            if found:
                return [{"call": c, "from_gib": _r(a / GiB), "to_gib": _r(b / GiB), "moved_gib": _r(d / GiB)}
                        for c, a, b, d in found]
    return []


def _stats_modules():
    """Every loaded copy of the pack's stats module (the pack imported as ``wan_sage`` and, in
    workflow mode, again by ComfyUI's custom-node loader under its folder's name)."""
    return [m for name, m in list(sys.modules.items())
            if name.endswith(".attention.stats") and hasattr(m, "last_runs")]


def attention_summary(patch_id):
    if patch_id is None:
        return None
    for m in _stats_modules():
        st = m.last_runs().get(patch_id)
        if st:
            return {k: st.get(k) for k in ("sage_calls", "sdpa_calls", "by_kernel", "reasons", "fallbacks",
                                           "head_split_calls", "saved_ms", "calibration_ms")}
    return {"sage_calls": 0, "sdpa_calls": 0, "note": "no attention calls recorded for this patch"}


# Device memory still allocated after every model was unloaded, above which a budget run is not faithful:
# ComfyUI does not count it (the ballast is sized from what is free after it), so the card is in effect
# that much larger.  A CUDA context's own allocations are outside PyTorch's count; cuBLAS workspaces are
# tens of MiB.
INHERITED_LIMIT_GIB = 0.25


def budget_check(inherited_gib, budget_gib, log) -> dict:
    """``inherited_alloc_gib`` and, for a budget run, ``faithful``: False when more than
    :data:`INHERITED_LIMIT_GIB` was still allocated before the ballast (a leak from an earlier run)."""
    if inherited_gib is None:
        return {"inherited_alloc_gib": None}
    d = {"inherited_alloc_gib": _r(inherited_gib)}
    if budget_gib is not None:
        d["faithful"] = inherited_gib <= INHERITED_LIMIT_GIB
        if not d["faithful"]:
            log(f"e2e WARNING: {inherited_gib:.2f} GiB was still allocated after unloading every model; ComfyUI "
                f"does not see it, so this run's {budget_gib:g} GiB budget is in effect {budget_gib + inherited_gib:.1f} GiB")
    return d


def faithful(r: dict) -> bool:
    """False for a budget run that started with memory ComfyUI could not see (:func:`budget_check`)."""
    return (r.get("budget") or {}).get("faithful", True) is not False


# --------------------------------------------------------------------------- the host

def _pack_log_to_stderr() -> None:
    """The pack's logger at INFO on stderr, prefixed ``wan-sage log:``, once per process, whatever level ComfyUI's
    root logger has (``--quiet`` sets WARNING)."""
    import logging
    lg = logging.getLogger("wan_sage")
    if any(getattr(h, "_e2e", False) for h in lg.handlers):
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter("wan-sage log: %(message)s"))
    h._e2e = True
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    lg.propagate = False


class Host:
    def __init__(self, args):
        self.args = args
        t0 = time.perf_counter()
        _host.set_allocator(args.allocator)
        import torch
        self.torch = torch
        self.cuda = torch.cuda.is_available() and not args.cpu
        self.av = _host.ensure_av(args.av_stub)
        ce = _host.comfy_env()
        extra = {"reserve_vram": args.reserve_vram} if args.reserve_vram is not None else None
        self.ns = ce.boot(cpu=not self.cuda, attention="pytorch" if not self.cuda else None,
                          output_dir=str(Path(args.work_dir).resolve()), quiet=args.quiet, extra_args=extra)
        ce.init_extra_nodes()
        gguf = Path(args.gguf_path or Path(self.ns.path).parent / "ComfyUI-GGUF")
        if args.weights == "gguf" or args.workflow:
            if not (gguf / "nodes.py").is_file():
                raise SystemExit(f"ComfyUI-GGUF not found at {gguf} (pass --gguf-path)")
            ce.load_custom_node(gguf)
        self.gguf_path = gguf
        self.pack = _host.load_pack()
        _pack_log_to_stderr()  # the pack's INFO lines (page-locking, compile caches) reach the run's log
        if not getattr(args, "sage_trim", True):
            from wan_sage.nodes import comfy_bridge
            without_sampling_trim(comfy_bridge)   # this process only: its runs are labelled /no-trim
        if getattr(args, "decode_room_extra_gib", None):
            from wan_sage.memory import vae_decode
            with_decode_room_extra(vae_decode, args.decode_room_extra_gib)   # labelled /decode-room+X
        if args.workflow:
            ce.load_custom_node(_host.ROOT)
        self.ce = ce
        self.mm = self.ns.model_management
        self.dev = self.mm.get_torch_device()
        import comfy.model_patcher  # noqa: E402  (ComfyUI is on sys.path once booted)
        self.comfy_timers = ComfyTimers(self.mm, comfy.model_patcher.ModelPatcher)
        self.mem = Mem(torch, self.cuda)
        self.N = self.ns.nodes.NODE_CLASS_MAPPINGS
        t1 = time.perf_counter()
        from . import e2e_models as EM
        self.files = EM.ensure_models(args.models_dir, scale=args.scale, weights=args.weights, te_dtype=args.te_dtype,
                                      lora_rank=args.lora_rank, seed=args.seed, device=args.gen_device, log=self.log,
                                      model_set=workflow_model_set(args))
        fp = self.ns.folder_paths
        root = Path(args.models_dir).resolve()
        for key, sub in (("diffusion_models", "diffusion_models"), ("text_encoders", "text_encoders"),
                         ("vae", "vae"), ("loras", "loras"), ("clip_vision", "clip_vision")):
            fp.add_model_folder_path(key, str(root / sub), is_default=True)
        # torch, ComfyUI and its nodes, ComfyUI-GGUF and the pack; then the model files' check (or writing)
        self.startup = {"comfyui_import_s": _r(t1 - t0), "model_files_s": _r(time.perf_counter() - t1)}
        self.cache = {}
        self.decoded = False
        self._dynamo = None
        self.last_start = None     # perf_counter() at the start of the last run's first node

    def log(self, msg):
        print(msg, file=sys.stderr, flush=True)

    def dynamo(self):
        """The dynamo watch of the compiled runs (made at the first, as it switches dynamo's recompile log on)."""
        if self._dynamo is None:
            from . import _compile
            self._dynamo = _compile.DynamoWatch(self.torch)
        return self._dynamo

    # ------------------------------------------------------------------ environment
    def env(self) -> dict:
        t = self.torch
        probe = None
        try:
            from wan_sage.attention import kernels
            probe = kernels.probe()
        except Exception:
            pass
        comfy_ver = None
        try:
            import comfyui_version
            comfy_ver = comfyui_version.__version__
        except Exception:
            pass
        d = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "python": platform.python_version(),
             "torch": t.__version__, "cuda": t.version.cuda, "device": t.cuda.get_device_name() if self.cuda else "cpu",
             "allocator": (t.cuda.memory.get_allocator_backend() if self.cuda else None),
             "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
             "comfyui": comfy_ver, "comfyui_gguf": _read_version(self.gguf_path / "pyproject.toml"),
             "sageattention": getattr(probe, "sage_version", None), "sage_flavour": getattr(probe, "sage_flavour", None),
             "sageattention_commit": os.environ.get("SAGEATTENTION_COMMIT"),
             "wan_sage": getattr(self.pack, "__version__", None), "wan_sage_commit": _host.git_head(),
             "av": self.av, "scale": self.args.scale, "weights": self.args.weights, "te_dtype": self.args.te_dtype,
             "lora_rank": self.args.lora_rank, "seed": self.args.seed}
        return d

    # ------------------------------------------------------------------ loaders (cached, like ComfyUI's node cache)
    @contextmanager
    def te_config(self):
        """At ``--scale tiny`` only: give ComfyUI's loader the miniature UMT5 config (its own
        ``model_options["umt5xxl_model_config"]`` hook), since CLIPLoader always builds the XXL
        layout from ``umt5_config_xxl.json``.  At full scale nothing is changed."""
        cfg = self.files.get("te_config")
        if not cfg:
            yield
            return
        sd = self.ns.sd
        orig = sd.load_clip

        def load_clip(*a, model_options=None, **k):
            mo = dict(model_options or {})
            mo.setdefault("umt5xxl_model_config", dict(cfg))
            return orig(*a, model_options=mo, **k)
        sd.load_clip = load_clip
        try:
            yield
        finally:
            sd.load_clip = orig

    def _cached(self, key, fn):
        if self.args.reload or key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def clip(self):
        def load():
            with self.te_config():
                return self.N["CLIPLoader"]().load_clip(self.files["names"]["te"], "wan", "default")[0]
        return self._cached("clip", load)

    def expert(self, e: str, lora: bool = True, fp8_fast: bool = False):
        def unet():
            name = self.files["names"][f"unet_{e}"]
            if self.args.weights == "gguf":
                return self.N["UnetLoaderGGUF"]().load_unet(name)[0]
            return self.N["UNETLoader"]().load_unet(name, "fp8_e4m3fn_fast" if fp8_fast else "default")[0]

        def load():          # one loader per expert file and weight dtype, with or without the LoRA after it
            m = self._cached(f"unet_{e}" + ("_fp8fast" if fp8_fast else ""), unet)
            if lora:
                m = self.N["LoraLoaderModelOnly"]().load_lora_model_only(m, self.files["names"][f"lora_{e}"], 1.0)[0]
            if self.args.shift:          # as the pack's A14B workflows: LoRA -> ModelSamplingSD3 (shift 5)
                m = self.N["ModelSamplingSD3"]().patch(m, self.args.shift)[0]
            return m
        return self._cached(f"expert_{e}" + ("" if lora else "_nolora") + ("_fp8fast" if fp8_fast else ""), load)

    def vae(self):
        return self._cached("vae", lambda: self.N["VAELoader"]().load_vae(self.files["names"]["vae"])[0])

    # ------------------------------------------------------------------ one run
    def free_all(self):
        gc.collect()
        self.mm.unload_all_models()
        gc.collect()
        self.mm.soft_empty_cache(True)
        if self.cuda:
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def run(self, spec: RunSpec, decode: bool, seed: int | None = None, session: "PromptSession | None" = None) -> dict:
        """One run of the graph; the record.  Without ``session`` the run stands alone: every model is unloaded
        before and after it, its ballast is its own and a compiled run starts from ``torch._dynamo.reset()``.
        With ``session`` it is one prompt queued to a ComfyUI process that keeps running: the session's
        ballast stays for every prompt, nothing is unloaded between prompts, and a node whose inputs did not
        change is not run again (ComfyUI's node cache): the text encode, the empty latent and each expert's
        chain from its loader to the compile are served from the first prompt, so a repeat prompt with a new
        seed runs the two samplers and the decode only.  ``seed``: the samplers' seed (default ``--seed``)."""
        torch, mem = self.torch, self.mem
        from wan_sage.nodes.estimator import Settings, apply_estimator
        from wan_sage.nodes.sage_patch import apply_patch, find_override
        W = self.ns.patcher_extension.WrappersMP
        seed = self.args.seed if seed is None else seed
        steps, cfg = spec.steps_of(self.args), spec.cfg_of(self.args)
        if session is None:
            self.free_all()
            inherited = mem.alloc()
            ballast = Ballast(torch, self.mm, self.dev, spec.budget_gib, self.log)
        else:
            inherited, ballast = session.hold(self, spec.budget_gib)
        mem.ballast = ballast.nbytes
        mem.reset()
        w, h_px, f = spec.res
        if spec.compile:
            if session is None:
                self.dynamo().reset()   # a fresh process's compile state; the experts' modules are kept between runs
            dynamo0, mark0 = self.dynamo().reading(), self.dynamo().mark()
        dynamo_low = None                 # (reading, recompiles seen) when the low-noise expert starts
        row = {"schema": SCHEMA, "run": run_label(spec, self.args),
               "config": {"estimator": spec.estimator, "attention": spec.attention, "budget_gib": spec.budget_gib,
                          "width": w, "height": h_px, "frames": f,
                          "weights": "fp8_fast" if spec.fp8_fast else self.args.weights, "steps": steps,
                          "cfg": cfg, "sampler": "euler", "scheduler": "simple", "shift": self.args.shift,
                          "lora_rank": self.args.lora_rank if spec.lora else None,
                          "decode": decode,
                          **({"te_host_copy": True} if spec.te_copy else {}),
                          **({"trim_load": True} if spec.trim_load else {}),
                          **({"check_finite": False} if finite_check_off(spec, self.args) else {}),
                          **({"trim_after_sampling": False} if trim_off(spec, self.args) else {}),
                          **({"decode_room_extra_gib": self.args.decode_room_extra_gib}
                             if decode_room_extra(spec, self.args) else {}),
                          **({"memory_mode": self.args.sage_memory_mode} if memory_mode_set(spec, self.args) else {}),
                          **({"compile": {"node": "TorchCompileModel", "backend": self.args.compile_backend,
                                          "keys": ["diffusion_model"]}} if spec.compile == "model" else {}),
                          **({"compile": {"node": "per block (set_torch_compile_wrapper)", "backend": self.args.compile_backend,
                                          "keys": ["diffusion_model.blocks.N"]}} if spec.compile == "blocks" else {}),
                          **({"compile": {"node": "Wan Compile Blocks", "backend": self.args.compile_backend,
                                          "keys": ["diffusion_model.blocks.N"], "streamed_blocks": "lifted or staged"}}
                             if spec.compile == "node" else {})},
               "budget": {"free_before_gib": _r(ballast.free_before and ballast.free_before / GiB),
                          "free_seen_gib": _r(ballast.free_seen and ballast.free_seen / GiB),
                          "ballast_gib": _r(ballast.nbytes / GiB), "note": ballast.note,
                          **budget_check(inherited, spec.budget_gib, self.log)},
               "status": "ok", "error": None, "failed_phase": None, "seed": seed}
        phases, probes, extras, walls = {}, {}, {}, {}
        h = {}                      # every object of the run, cleared at the end
        reused = []                 # what a session served from an earlier prompt (ComfyUI's node cache)
        phase = {"name": None}
        t_run = time.perf_counter()
        self.last_start = t_run
        t_latent = t_frames = None

        def loaded():
            """What ComfyUI holds on the GPU now: {model class: GiB of its weights loaded}, summed per class."""
            out = {}
            for lm in list(getattr(self.mm, "current_loaded_models", ())):
                try:
                    name = type(lm.model.model).__name__
                    out[name] = _r(out.get(name, 0.0) + lm.model_loaded_memory() / 2**30)
                except Exception:  # a model being unloaded; the record is diagnostics only
                    continue
            return out

        @contextmanager
        def timed(name):
            phase["name"] = name
            mem.sync()
            mem.reset()
            before = loaded()
            pool = mem.pool()
            timers0 = self.comfy_timers.snapshot()
            t = time.perf_counter()
            try:
                yield
            finally:
                mem.sync()
                pa, pr = mem.peaks()
                # the weights ComfyUI held on the GPU as the phase began and ended: what a phase evicted or
                # loaded (a decode after a sampling that kept more weights resident has more to move), and the
                # seconds the phase spent in ComfyUI's loading and evicting calls and how often each ran (a
                # soft_empty_cache hands the allocator's cached blocks back); the allocator's state as it began
                phases[name] = {"s": _r(time.perf_counter() - t), "peak_alloc_gib": _r(pa), "peak_reserved_gib": _r(pr),
                                "loaded_gib_before": before, "loaded_gib_after": loaded(),
                                "comfy_memory_s": self.comfy_timers.since(timers0),
                                "comfy_memory_calls": self.comfy_timers.calls_since(timers0), "pool_before": pool}
        retries0 = mem.retries()
        with torch.inference_mode():     # as ComfyUI's PromptExecutor runs every node
            try:
                if session is not None and "encode" in session.outputs:
                    h["pos"], h["neg"] = session.outputs["encode"]
                    reused.append("encode")
                else:
                    with timed("encode"):
                        h["clip"] = self.clip()
                        if spec.te_copy:  # the pack's Wan Text Encoder Host Copy, through its wiring
                            from wan_sage.nodes.text_encoder import apply_text_encoder_host_copy
                            h["clip"], extras["te_copy"] = apply_text_encoder_host_copy(h["clip"])
                        enc = self.N["CLIPTextEncode"]()
                        h["pos"] = enc.encode(h["clip"], PROMPT)[0]
                        h["neg"] = enc.encode(h["clip"], NEGATIVE)[0]
                    if session is not None:
                        session.outputs["encode"] = (h["pos"], h["neg"])
                latent_key = ("latent", w, h_px, f)
                if session is not None and latent_key in session.outputs:
                    h["latent"] = session.outputs[latent_key]
                else:
                    h["latent"] = self.N["EmptyHunyuanLatentVideo"]().generate(w, h_px, f, 1)[0]
                    if session is not None:
                        session.outputs[latent_key] = h["latent"]
                shape = list(h["latent"]["samples"].shape)
                for e in ("high", "low"):
                    chain_key = ("expert", e, spec, tuple(shape))
                    if session is not None and chain_key in session.outputs:
                        h[f"model_{e}"], probes[e], kept = session.outputs[chain_key]
                        probes[e].restart(t_run)
                        extras.update(kept)
                        reused.append(f"expert {e}")
                        continue
                    made = {}
                    m = self.expert(e, spec.lora, spec.fp8_fast)
                    if spec.estimator:
                        m, est, report = apply_estimator(m, Settings(), shape)
                        made[f"est_{e}"] = _estimate_fields(est)
                        made[f"report_{e}"] = report
                    if spec.attention == "sage":
                        m, status = apply_patch(m, check_finite=self.args.sage_check_finite, **patch_kwargs(self.args))
                        made[f"patch_{e}"] = status
                    if spec.compile == "model":  # after the patch, so the compiled model carries the override
                        m = self.N["TorchCompileModel"].execute(model=m, backend=self.args.compile_backend)[0]
                        made[f"compile_{e}"] = dict(m.model_options.get("torch_compile_kwargs") or {})
                    elif spec.compile == "blocks":
                        from . import _compile
                        m = m.clone()
                        _compile.set_recompile_limit(torch, _compile.BLOCK_RECOMPILE_LIMIT)
                        made[f"compile_{e}"] = _compile.compile_blocks(m, self.args.compile_backend)
                    elif spec.compile == "node":  # the pack's Wan Compile Blocks, through its wiring
                        from wan_sage.nodes.compile_blocks import apply_compile_blocks
                        m, text = apply_compile_blocks(m, self.args.compile_backend)
                        made[f"compile_{e}"] = {"how": "Wan Compile Blocks (streamed blocks staged)", "status": text,
                                                "backend": self.args.compile_backend}
                    ov = find_override(m.model_options.get("transformer_options", {}))
                    made[f"patch_id_{e}"] = ov.patch_id if ov is not None else None
                    if spec.attention == "sage" and ov is None:
                        self.log(f"e2e WARNING: the Sage patch passed the {e}-noise expert through ({status}); "
                                 "this run measures SDPA")
                    probes[e] = ExpertProbe(e, mem, log=self.log, t_run=t_run, trim_load=spec.trim_load)
                    h[f"model_{e}"] = probes[e].install(m, W)
                    extras.update(made)
                    if session is not None:
                        session.outputs[chain_key] = (h[f"model_{e}"], probes[e], made)
                    del m
                ks = self.N["KSamplerAdvanced"]()
                half = steps // 2
                with timed("high"):
                    t = time.perf_counter()
                    h["lat"] = ks.sample(h["model_high"], "enable", seed, steps, cfg, "euler", "simple",
                                         h["pos"], h["neg"], h["latent"], 0, half, "enable")[0]
                    walls["high"] = time.perf_counter() - t
                if spec.compile:
                    dynamo_low = (self.dynamo().reading(), self.dynamo().mark())
                with timed("low"):
                    t = time.perf_counter()
                    h["lat"] = ks.sample(h["model_low"], "disable", seed, steps, cfg, "euler", "simple",
                                         h["pos"], h["neg"], h["lat"], half, steps, "disable")[0]
                    walls["low"] = time.perf_counter() - t
                t_latent = time.perf_counter()       # timed() synchronised the device
                row["latent_finite"] = bool(torch.isfinite(h["lat"]["samples"]).all())
                if decode:
                    with timed("decode"), profiled(torch, self.args.profile_decode) as prof:
                        h["images"] = self.N["VAEDecode"]().decode(self.vae(), h["lat"])[0]
                    if prof:
                        phases["decode"]["profile"] = prof
                    t_frames = time.perf_counter()
                    row["decoded"] = list(h["images"].shape)
                    row["images_finite"] = bool(torch.isfinite(h["images"]).all())
                    self.decoded = True
            except torch.OutOfMemoryError as e:
                row["status"], row["error"], row["failed_phase"] = "oom", str(e).split("\n")[0][:300], phase["name"]
                row["oom_memory"] = mem.at_oom()     # while the frames that held the tensors are alive
                row["oom_figures"] = oom_figures(str(e))
                row["oom_where"] = oom_where(e.__traceback__)
                self.log(f"e2e OOM in {phase['name']} at {row['oom_where'][-1] if row['oom_where'] else '?'}")
                e.__traceback__ = None
            except Exception as e:
                row["status"], row["error"], row["failed_phase"] = "error", f"{type(e).__name__}: {e}"[:500], phase["name"]
                self.log(traceback.format_exc())
        row["run_s"] = _r(time.perf_counter() - t_run)
        # the user's clock: from the prompt's first node (text encode, model loads, both experts) to the latent,
        # and to the decoded frames
        row["to_latent_s"] = _r(t_latent - t_run) if t_latent is not None else None
        row["to_frames_s"] = _r(t_frames - t_run) if t_frames is not None else None
        if session is not None:
            row["reused"] = reused
        retries1 = mem.retries()
        row["alloc_retries"] = None if retries0 is None or retries1 is None else retries1 - retries0
        row["experts"] = {}
        for e, p in probes.items():
            row["experts"][e] = p.result(walls.get(e), attention=attention_summary(extras.get(f"patch_id_{e}")),
                                         estimator=extras.get(f"est_{e}"))
        row["phases"] = phases
        peaks = [p for ph in phases.values() for p in (ph["peak_alloc_gib"],) if p is not None]
        peaks += [ex.get("load_peak_alloc_gib") for ex in row["experts"].values() if ex.get("load_peak_alloc_gib") is not None]
        row["peak_alloc_gib"] = _r(max(peaks)) if peaks else None
        rpeaks = [ph["peak_reserved_gib"] for ph in phases.values() if ph["peak_reserved_gib"] is not None]
        rpeaks += [ex.get("load_peak_reserved_gib") for ex in row["experts"].values() if ex.get("load_peak_reserved_gib") is not None]
        row["peak_reserved_gib"] = _r(max(rpeaks)) if rpeaks else None
        if "high" in walls and "low" in walls:
            row["denoise_s"] = _r(walls["high"] + walls["low"])
            row["denoise_steps_s"] = _r(sum(sum(x["step_s"]) for x in row["experts"].values()))
        row["patch_status"] = {e: extras.get(f"patch_{e}") for e in ("high", "low") if f"patch_{e}" in extras} or None
        row["sage_active"] = spec.attention == "sage" and all(extras.get(f"patch_id_{e}") for e in ("high", "low"))
        row["estimator_report"] = {e: extras.get(f"report_{e}") for e in ("high", "low") if f"report_{e}" in extras} or None
        if "te_copy" in extras:
            row["te_copy_status"] = extras["te_copy"]
        if spec.compile:              # what dynamo did in this run (the node leaves the recompile limit as it is)
            from . import _compile
            watch = self.dynamo()
            end = watch.reading()
            row["compile"] = {"kwargs": {e: extras.get(f"compile_{e}") for e in ("high", "low")},
                              **watch.delta(end, dynamo0),
                              "graph_break_reasons": watch.break_reasons(), "recompile_reasons": watch.recompile_reasons(start=mark0),
                              "recompile_limit": _compile.set_recompile_limit(torch, None)}
            if dynamo_low is not None:    # each expert's share, and why its blocks missed their earlier graphs
                row["compile"]["by_expert"] = {
                    "high": {**watch.delta(dynamo_low[0], dynamo0), "guard_causes": watch.guard_causes(mark0, dynamo_low[1])},
                    "low": {**watch.delta(end, dynamo_low[0]), "guard_causes": watch.guard_causes(dynamo_low[1])}}
                for e, got in row["compile"]["by_expert"].items():
                    self.log(f"e2e compile {e}: {got['unique_graphs']} graphs, {got['recompiles']} recompiles; "
                             f"causes {json.dumps(got['guard_causes'])}")
            if spec.compile == "node":  # how Wan Compile Blocks ran each expert's blocks in this prompt
                from wan_sage.nodes import compile_blocks
                row["compile"]["blocks_ran"] = {}
                for e in ("high", "low"):
                    ran = compile_blocks.blocks_ran(h.get(f"model_{e}")) if h.get(f"model_{e}") is not None else None
                    if ran is not None and ran.any_calls:
                        row["compile"]["blocks_ran"][e] = {"blocks": ran.blocks, "calls": ran.calls, "why": ran.why}
                        self.log(f"e2e compile blocks {e}: {compile_blocks.blocks_ran_text(ran)}")
            from .compile_cache_probe import autotune_kernels  # the Triton kernels benchmarked in this process
            row["compile"]["autotune_missed"] = [k for k in autotune_kernels(torch) if k.get("state") == "miss"]
            if row["compile"]["autotune_missed"]:
                self.log("e2e compile autotune missed: " + ", ".join(
                    f"{k['kernel']} ({k['configs']} configs, cache file {k.get('best_config_file')}, "
                    f"{k.get('matching_configs')} matching)" for k in row["compile"]["autotune_missed"]))
            phases = row["compile"].get("phases") or {}
            top = sorted(((k, v) for k, v in phases.items() if k.startswith("s:")), key=lambda kv: -kv[1])[:8]
            self.log("e2e compile phases: " + ", ".join(f"{k[2:]} {v:.2f} s" for k, v in top)
                     + "; " + ", ".join(f"{k[2:]} {v:.0f}" for k, v in phases.items() if k.startswith("n:")))
        if session is not None:       # the process keeps running: models, ballast and compiled graphs stay
            h.clear()
            probes.clear()
            return row
        # free everything before the next run (unload first, while the run's patchers are alive)
        self.mm.unload_all_models()
        h.clear()
        probes.clear()
        ballast.release()
        mem.ballast = 0
        self.free_all()
        row["alloc_after_free_gib"] = _r(mem.alloc())      # what the next run inherits (leak check): about 0
        return row

    # ------------------------------------------------------------------ a saved workflow
    def workflow_prompt(self, path: Path) -> tuple[dict, dict]:
        """The saved workflow's API prompt (converted from the UI format as the frontend queues it) with its loaders
        pointed at the generated files, and what was substituted (:func:`substitute_models`)."""
        from .workflow_api import is_api_prompt, ui_to_api
        wf = json.loads(path.read_text())
        prompt = wf if is_api_prompt(wf) else ui_to_api(wf, self.N)
        return prompt, substitute_models(prompt, self.files["names"], self.args.weights)

    def start_images(self, prompt: dict) -> dict:
        """Write the start images the prompt's LoadImage nodes read into ComfyUI's input folder of this process
        (:func:`write_start_images`); the record's ``inputs``."""
        inputs = write_start_images(prompt, Path(self.ns.folder_paths.get_input_directory()))
        for nid, d in inputs.items():
            self.log(f"e2e start image node {nid}: {d['image']} {d['width']}x{d['height']} written to ComfyUI's "
                     "input folder")
        return inputs

    def run_workflow(self, path: Path, spec_res, budget_gib) -> dict:
        """A saved workflow run once, standing alone: every model unloaded before and after it, its own ballast."""
        from . import workflow_variants as WV
        prompt, mapping = self.workflow_prompt(path)
        prompt = WV.resized(prompt, spec_res)
        inputs = self.start_images(prompt)
        self.free_all()
        inherited = self.mem.alloc()
        ballast = Ballast(self.torch, self.mm, self.dev, budget_gib, self.log)
        self.mem.ballast = ballast.nbytes
        row = {"schema": SCHEMA, "run": f"workflow:{path.name}", "workflow": str(path.name), "models": mapping,
               "inputs": inputs, "budget": workflow_budget(budget_gib, ballast, inherited, self.log)}
        row.update(WorkflowRunner(self).run(prompt))
        ballast.release()
        self.mem.ballast = 0
        self.free_all()
        row["alloc_after_free_gib"] = _r(self.mem.alloc())
        return row

    def workflow_prompts(self, spec, session: "PromptSession"):
        """The prompts of a saved workflow's whole-prompt process: a function of the seed that runs the spec's
        prompt (:func:`bench.workflow_variants.spec_prompt`) with that seed through one :class:`WorkflowRunner`
        (one node cache for every prompt of the process) with the session's ballast, and returns its record."""
        from . import workflow_variants as WV
        prompt, mapping = self.workflow_prompt(Path(self.args.workflow))
        prompt = WV.spec_prompt(prompt, spec, self.args.compile_backend)
        inputs = self.start_images(prompt)
        runner = WorkflowRunner(self)
        config = workflow_config(spec, prompt, self.args, files_weights(self.args))

        def run(seed: int) -> dict:
            inherited, ballast = session.hold(self, spec.budget_gib)
            self.mem.ballast = ballast.nbytes
            row = {"schema": SCHEMA, "run": spec.name, "workflow": spec.workflow, "models": mapping, "inputs": inputs,
                   "seed": seed, "config": config,
                   "budget": workflow_budget(spec.budget_gib, ballast, inherited, self.log)}
            row.update(runner.run(WV.with_seed(prompt, seed)))
            return row
        return run


START_IMAGE_SIZE = (832, 480)     # a start image's size where the prompt has no node that sets the video size


def start_image_pixels(width: int, height: int):
    """A deterministic RGB start image (uint8, height x width x 3): horizontal and vertical ramps and diagonal
    waves, the same bytes on every machine."""
    import numpy as np
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    rgb = np.stack([u, v, 0.5 + 0.5 * np.sin(2 * np.pi * (3 * u + 2 * v))], axis=-1)
    return np.rint(rgb * 255).astype(np.uint8)


def write_start_images(prompt: dict, input_dir: Path) -> dict:
    """Write the file each LoadImage node of the prompt reads into ``input_dir`` (ComfyUI's input folder): a PNG of
    :func:`start_image_pixels` at the prompt's video size (its latent node's width and height,
    ``bench.workflow_variants.prompt_settings``).  Returns {node id: image, width, height, sha256 of the pixels}."""
    import hashlib
    from PIL import Image
    from . import workflow_variants as WV
    settings = WV.prompt_settings(prompt)
    w, h = (settings["width"], settings["height"]) if settings["width"] and settings["height"] else START_IMAGE_SIZE
    pixels, out = start_image_pixels(int(w), int(h)), {}
    for nid, name in WV.start_images(prompt).items():
        path = input_dir / name
        tmp = path.with_name(path.name + ".part")
        input_dir.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels, "RGB").save(tmp, format="PNG")
        os.replace(tmp, path)
        out[nid] = {"image": name, "width": int(w), "height": int(h),
                    "sha256": hashlib.sha256(pixels.tobytes()).hexdigest()[:16]}
    return out


def workflow_budget(budget_gib, ballast, inherited, log) -> dict:
    """The ``budget`` of a saved workflow's record: what was asked, what ComfyUI saw, the ballast."""
    return {"requested_gib": budget_gib, "free_seen_gib": _r(ballast.free_seen and ballast.free_seen / GiB),
            "ballast_gib": _r(ballast.nbytes / GiB), "note": ballast.note, **budget_check(inherited, budget_gib, log)}


def workflow_config(spec, prompt: dict, args, weights: str) -> dict:
    """The ``config`` of a saved workflow's whole-prompt record: the workflow, its variant, the budget, the pack's
    nodes in its prompt, what its latent and sampler nodes are set to, the diffusion model files' weights, and
    for ``compilenode`` what Wan Compile Blocks was given."""
    from . import workflow_variants as WV
    return {"workflow": spec.workflow, "variant": spec.variant, "budget_gib": spec.budget_gib,
            "pack_nodes": WV.pack_nodes(prompt), **WV.prompt_settings(prompt), "weights": weights,
            **({"compile": {"node": "Wan Compile Blocks", "backend": args.compile_backend,
                            "keys": ["diffusion_model.blocks.N"], "streamed_blocks": "lifted or staged"}}
               if spec.variant == "compilenode" else {})}


def node_spans(events: list, t_end: float) -> dict:
    """{node id: (start, end)} from the executor's "executing" messages, ``(time, node id)`` in order: a node
    ends where the next begins, the last at ``t_end`` (a node started twice spans both)."""
    spans = {}
    for (t, nid), (t_next, _n) in zip(events, list(events[1:]) + [(t_end, None)]):
        if nid is not None:
            spans[nid] = (spans[nid][0] if nid in spans else t, t_next)
    return spans


def steps_by_node(marks: list, starts: dict, t0: float) -> dict:
    """{node id: [seconds of each step]} from the progress hook's ``(time, node id, ...)`` marks; a node's first
    step counts from the node's start (its model loading included)."""
    per_node, prev = {}, {}
    for t, nid, *_rest in marks:
        per_node.setdefault(nid, []).append(round(t - prev.get(nid, starts.get(nid, t0)), 3))
        prev[nid] = t
    return per_node


class WorkflowRunner:
    """One ``execution.PromptExecutor`` for the prompts of a saved workflow: one node cache, as a running ComfyUI
    keeps between queued prompts, so that a prompt queued again with a new seed runs the samplers and what
    follows them only.  Per prompt it times each node from the executor's "executing" messages (a node ends
    where the next begins), each sampler step from ComfyUI's progress hook, and reads which nodes the cache
    served (its "execution_cached" message)."""

    def __init__(self, host):
        self.host = host
        ex = host.ns.execution
        self.server = host.ce.StubServer()
        self.server.client_id = "e2e-harness"      # so the executor reports each node it starts
        self.executor = ex.PromptExecutor(self.server, cache_type=ex.CacheType.CLASSIC)
        self.events, self.cached = [], []
        send = self.server.send_sync

        def send_sync(event, data, sid=None):
            if event == "executing" and isinstance(data, dict):
                host.mem.sync()
                self.events.append((time.perf_counter(), None if data.get("node") is None else str(data["node"])))
            elif event == "execution_cached" and isinstance(data, dict):
                self.cached = [str(x) for x in data.get("nodes") or []]
            return send(event, data, sid)
        self.server.send_sync = send_sync

    def output(self, nid: str):
        """The first output of a node that ran, from the executor's cache (None when it has none)."""
        try:
            out = self.executor.caches.outputs.get(nid)
            return out[0][0] if out and out[0] else None
        except Exception:          # the record's diagnostics never fail the run
            return None

    def _execute(self, prompt: dict, row: dict) -> None:
        """Validate the prompt as ComfyUI's server does and execute it up to its VAE decodes; the status in ``row``."""
        import asyncio
        import uuid
        ns = self.host.ns
        targets = [k for k, n in prompt.items() if n["class_type"].startswith("VAEDecode")]
        pid = str(uuid.uuid4())
        ok, err, outputs, node_errors = asyncio.run(ns.execution.validate_prompt(pid, validation_view(prompt), None))[:4]
        if not ok:
            row.update(status="error", error=f"validation: {err} {node_errors}"[:800])
            return
        ex = self.executor
        with self.host.te_config():
            ex.execute(prompt, pid, extra_data={"client_id": self.server.client_id}, execute_outputs=targets or outputs)
        msgs = [m for m in ex.status_messages if m[0] == "execution_error"]
        oom = any("OutOfMemory" in json.dumps(m[1].get("exception_type", "")) for m in msgs)
        row.update(status="ok" if ex.success else ("oom" if oom else "error"),
                   error=None if ex.success else json.dumps(msgs[-1][1] if msgs else "failed")[:800])

    def run(self, prompt: dict) -> dict:
        """One prompt through the runner's executor; the record's fields of the prompt."""
        host, mem = self.host, self.host.mem
        self.events, self.cached, marks, step_mem, last = [], [], [], {}, {}
        server = self.server

        def hook(value, total, preview, node_id=None):
            mem.sync()
            t, nid = time.perf_counter(), str(server.last_node_id)
            marks.append((t, nid, value, total))
            if mem.cuda:
                step_mem.setdefault(nid, []).append(mem.step_peaks())
            prev = last.get(nid) or next((t_ for t_, n in self.events if n == nid), t0)
            last[nid] = t
            host.log(step_line(f"node {nid}", value, total, t - prev, t - t0))
        compiled = any(n["class_type"] == "WanCompileBlocks" for n in prompt.values())
        dynamo0 = host.dynamo().reading() if compiled else None
        utils = host.ns.utils
        old = utils.PROGRESS_BAR_HOOK
        utils.set_progress_bar_global_hook(hook)
        row = {"status": "ok", "error": None}
        mem.reset()
        retries0 = mem.retries()
        t0 = time.perf_counter()
        host.last_start = t0
        try:
            self._execute(prompt, row)
        finally:
            utils.set_progress_bar_global_hook(old)
        mem.sync()
        t_end = time.perf_counter()
        spans = node_spans(self.events, t_end)
        row.update(prompt_timings(prompt, spans, t0))
        row["run_s"] = _r(t_end - t0)
        row["reused"] = [k for k in self.cached if k in prompt]
        row["peak_alloc_gib"], row["peak_reserved_gib"] = (_r(x) for x in mem.peaks())
        retries1 = mem.retries()
        row["alloc_retries"] = None if retries0 is None or retries1 is None else retries1 - retries0
        row["step_s_by_node"] = steps_by_node(marks, {k: v[0] for k, v in spans.items()}, t0)
        row["node_types"] = {k: n["class_type"] for k, n in prompt.items()}
        row["attention"] = [v for m in _stats_modules() for v in m.last_runs().values()]
        row["experts"] = sampler_entries(prompt, row, spans, step_mem)
        row.update(self.outputs_checked(prompt))
        if compiled:   # what dynamo did in this prompt; with one sampler, that sampler's share is all of it
            delta = host.dynamo().delta(host.dynamo().reading(), dynamo0)
            row["compile"] = {**delta, "blocks_ran": self.blocks_ran(prompt),
                              **({"by_expert": {k: delta for k in row["experts"]}} if len(row["experts"]) == 1 else {})}
        return row

    def outputs_checked(self, prompt: dict) -> dict:
        """Whether the last sampler's latent is finite and the decoded frames' shape, from the executor's cache."""
        from . import workflow_variants as WV
        torch, out = self.host.torch, {}
        ks = WV.samplers(prompt)
        lat = self.output(ks[-1]) if ks else None
        if isinstance(lat, dict) and "samples" in lat:
            out["latent_finite"] = bool(torch.isfinite(lat["samples"]).all())
        for k in (k for k, n in prompt.items() if n["class_type"].startswith("VAEDecode")):
            images = self.output(k)
            if images is not None and hasattr(images, "shape"):
                out["decoded"] = list(images.shape)
                out["images_finite"] = bool(torch.isfinite(images).all())
        return out

    def blocks_ran(self, prompt: dict) -> dict:
        """How Wan Compile Blocks ran each compile node's blocks in this prompt, by node id (the pack's own count:
        ``compile_blocks.blocks_ran``, read from whichever copy of the pack the node was loaded from)."""
        out = {}
        mods = [m for name, m in list(sys.modules.items()) if name.endswith("nodes.compile_blocks")
                and hasattr(m, "blocks_ran")]
        for k in (k for k, n in prompt.items() if n["class_type"] == "WanCompileBlocks"):
            model = self.output(k)
            for m in mods:
                ran = m.blocks_ran(model) if model is not None else None
                if ran is not None and ran.any_calls:
                    out[k] = {"blocks": ran.blocks, "calls": ran.calls, "why": ran.why}
                    self.host.log(f"e2e compile blocks node {k}: {m.blocks_ran_text(ran)}")
                    break
        return out


def validation_view(prompt: dict) -> dict:
    """The prompt as validated: a Wan Compile Blocks backend the node does not offer (``eager``, for CPU smoke
    runs: ``--compile-backend``) is validated as the node's default and runs as given."""
    import copy
    from wan_sage.nodes.compile_blocks import BACKENDS
    view = copy.deepcopy(prompt)
    for n in view.values():
        if n["class_type"] == "WanCompileBlocks" and n["inputs"].get("backend") not in BACKENDS:
            n["inputs"]["backend"] = BACKENDS[0]
    return view


def prompt_timings(prompt: dict, spans: dict, t0: float) -> dict:
    """The user's clock of a saved workflow's prompt: from its start to the end of its last sampler (the latent)
    and of its VAE decode (the frames); None where that node did not run.  ``node_s``: the seconds of each node
    that ran, from its start to the next node's (:func:`node_spans`), so a prompt's time can be laid out by node."""
    from . import workflow_variants as WV
    ends = [spans[k][1] for k in WV.samplers(prompt) if k in spans]
    decodes = [spans[k][1] for k, n in prompt.items() if n["class_type"].startswith("VAEDecode") and k in spans]
    return {"to_latent_s": _r(max(ends) - t0) if ends else None,
            "to_frames_s": _r(max(decodes) - t0) if decodes else None,
            "node_s": {k: _r(end - start) for k, (start, end) in spans.items()}}


def sampler_entries(prompt: dict, row: dict, spans: dict, step_mem: dict) -> dict:
    """Per sampler node that ran (by node id), what a run record keeps per expert: its steps, wall time (model
    loading included), its steps' peaks (CUDA) and, where the prompt has one Sage patch run and one sampler, the
    patch's call counts."""
    from . import workflow_variants as WV
    out = {}
    ran = [k for k in WV.samplers(prompt) if k in spans]
    for k in ran:
        steps = (row.get("step_s_by_node") or {}).get(k, [])
        d = {"node_type": prompt[k]["class_type"], "step_s": steps,
             "s_per_step": _r(statistics.mean(steps)) if steps else None,
             "wall_s": _r(spans[k][1] - spans[k][0]), "attention": None}
        if step_mem.get(k):
            d["step_peak_alloc_gib"] = [_r(a) for a, _ in step_mem[k]]
            d["step_peak_reserved_gib"] = [_r(r) for _, r in step_mem[k]]
        out[k] = d
    runs = row.get("attention") or []
    if len(ran) == 1 and len(runs) == 1:
        out[ran[0]]["attention"] = {x: runs[0].get(x) for x in ("sage_calls", "sdpa_calls", "by_kernel", "reasons",
                                                                "fallbacks", "head_split_calls", "saved_ms",
                                                                "calibration_ms")}
    return out


# The loaders a saved workflow may have: {class: (the input naming the file, the generated file's role)}.
LOADER_ROLES = {"UnetLoaderGGUF": ("unet_name", "unet"), "UnetLoaderGGUFAdvanced": ("unet_name", "unet"),
                "UNETLoader": ("unet_name", "unet"), "CLIPLoader": ("clip_name", "te"),
                "CLIPVisionLoader": ("clip_name", "clipvision"), "VAELoader": ("vae_name", "vae"),
                "LoraLoaderModelOnly": ("lora_name", "lora")}
# The one diffusion model and the VAE of the sets that have a single model (the TI2V-5B, the Wan 2.1 I2V 14B).
SINGLE_MODEL = {"unet_5b": "vae_22", "unet_i2v": "vae"}


def substitute_models(prompt: dict, names: dict, weights: str) -> dict:
    """Point the workflow's loaders at the generated files (experts and LoRAs by 'high'/'low' in
    the original name, else in node order; with a one-model set (:data:`SINGLE_MODEL`: the TI2V-5B and the Wan 2.2
    VAE, the Wan 2.1 I2V 14B and the Wan 2.1 VAE), its model and VAE; CLIP vision, the generated ViT-H; the
    text encoder, whatever the workflow names (an fp8 umt5), the generated one).  Returns {node id:
    [old, new]}, the record's ``models``; raises on loaders it cannot map."""
    single = next((r for r in SINGLE_MODEL if r in names), None)
    seen = {"unet": [], "lora": []}
    mapping = {}
    for nid in sorted(prompt, key=lambda k: int(k) if str(k).isdigit() else 0):
        n = prompt[nid]
        if n["class_type"] not in LOADER_ROLES:
            if any(s in n["class_type"] for s in ("Loader", "loader")) and "Lora" not in n["class_type"]:
                raise ValueError(f"node {nid} ({n['class_type']}) loads a model the harness does not generate")
            continue
        key, role = LOADER_ROLES[n["class_type"]]
        old = n["inputs"].get(key)
        if single and role in ("unet", "vae"):
            new = names[single if role == "unet" else SINGLE_MODEL[single]]
        elif role in seen:
            low = str(old).lower()
            e = "high" if "high" in low else "low" if "low" in low else ("high" if not seen[role] else "low")
            seen[role].append(e)
            new = names[f"{role}_{e}"]
        elif role in names:
            new = names[role]
        else:
            raise ValueError(f"node {nid} ({n['class_type']}) loads a file the generated set ({', '.join(names)}) "
                             "has none of: the workflow is not one bench.workflow_variants.model_set knows")
        check_loader_weights(nid, n["class_type"], role, single, weights)
        n["inputs"][key] = new
        mapping[nid] = [old, new]
    return mapping


def check_loader_weights(nid: str, class_type: str, role: str, single: str | None, weights: str) -> None:
    """Refuse a diffusion model loader that cannot read the generated file: a one-model set's model is a
    safetensors file for UNETLoader, the experts GGUF for ComfyUI-GGUF's loaders or fp8 for UNETLoader
    (``--weights``)."""
    if role != "unet":
        return
    if single:
        if class_type != "UNETLoader":
            raise ValueError(f"node {nid} is {class_type}: the {single} stand-in is a safetensors file for UNETLoader")
    elif (class_type == "UNETLoader") == (weights == "gguf"):    # GGUF files for GGUF loaders, fp8 for UNETLoader
        raise ValueError(f"node {nid} is {class_type} but --weights is {weights}")


NO_CHECK = "/no-finite-check"
MEMORY_MODE = "/memory-"
NO_TRIM = "/no-trim"
DECODE_ROOM = "/decode-room+"


def finite_check_off(spec, args) -> bool:
    """The Sage patch runs without its per-call NaN/Inf check in this run (``--sage-check-finite off``)."""
    return spec.attention == "sage" and not args.sage_check_finite


def trim_off(spec, args) -> bool:
    """The Sage patch leaves the sampling's cached blocks in the pool when its sampling ends (``--sage-trim off``)."""
    return spec.attention == "sage" and not getattr(args, "sage_trim", True)


def decode_room_extra(spec, args) -> bool:
    """The estimator keeps ``--decode-room-extra-gib`` more than ComfyUI's figure for the VAE decode."""
    return bool(spec.estimator and getattr(args, "decode_room_extra_gib", None))


def with_decode_room_extra(vae_decode, gib: float):
    """Make ``vae_decode.decode_bytes`` (the room the estimator keeps for the decode) ``gib`` GiB more in this
    process (``--decode-room-extra-gib``); returns the function to put back."""
    original = vae_decode.decode_bytes

    def decode_bytes(latent, dtype_size: int = 2):
        need = original(latent, dtype_size)
        return None if need is None else need + int(gib * GiB)
    vae_decode.decode_bytes = decode_bytes
    return original


def without_sampling_trim(comfy_bridge):
    """Make the Sage patch's trim when its sampling ends a no-op in this process (``--sage-trim off``), leaving the
    estimator's trim after loading as it is; returns the function to put back."""
    original = comfy_bridge.trim_allocator

    def trim_allocator(dev, when: str) -> None:
        if when != "after sampling":
            original(dev, when)
    comfy_bridge.trim_allocator = trim_allocator
    return original


def memory_mode_set(spec, args) -> bool:
    """The Sage patch runs in the memory mode named by ``--sage-memory-mode`` (not its default)."""
    return spec.attention == "sage" and getattr(args, "sage_memory_mode", None) is not None


def patch_kwargs(args) -> dict:
    """The Sage patch's options beyond the node's defaults: the memory mode, when one is named."""
    mode = getattr(args, "sage_memory_mode", None)
    return {} if mode is None else {"memory_mode": mode}


def check_sage_memory_mode(mode) -> None:
    """Stop before any work when ``--sage-memory-mode`` names a mode the pack's node wiring
    (``apply_patch``) cannot take."""
    if mode is None:
        return
    import inspect
    from wan_sage.nodes.sage_patch import apply_patch
    if "memory_mode" not in inspect.signature(apply_patch).parameters:
        raise SystemExit(f"--sage-memory-mode {mode}: this checkout's Sage patch (nodes/sage_patch.apply_patch) takes "
                         "no memory_mode (dispatch v2 adds it); leave the option out to run the patch's default")


def run_label(spec, args) -> str:
    """The record's ``run``: the spec, marked when the Sage patch ran without its NaN/Inf check, in a named
    memory mode or without its trim when sampling ends, or the estimator kept more room for the decode, so that
    ``--skip-done`` and the tables never take one for the other.  A saved workflow's spec: its name (the workflow
    and the spec), the workflow's nodes setting the rest."""
    if not isinstance(spec, RunSpec):
        return spec.name
    return (spec.label + (NO_CHECK if finite_check_off(spec, args) else "")
            + (MEMORY_MODE + args.sage_memory_mode if memory_mode_set(spec, args) else "")
            + (NO_TRIM if trim_off(spec, args) else "")
            + (f"{DECODE_ROOM}{args.decode_room_extra_gib:g}" if decode_room_extra(spec, args) else ""))


def done_runs(paths: str, weights: str) -> set:
    """Labels of the runs with an ``ok`` or ``oom`` record for these weights in the JSONL files (a budget
    run marked not faithful does not count: it is run again)."""
    return {r.get("run") for r in _host.jsonl_records(paths) if r.get("schema") == SCHEMA and r.get("status") in
            ("ok", "oom") and model_files((r.get("config") or {}).get("weights")) == weights and faithful(r)}


def model_files(weights: str | None) -> str | None:
    """The ``--weights`` whose model files a record's ``config.weights`` ran on (``fp8_fast``: the fp8 files)."""
    return "fp8" if weights == "fp8_fast" else weights


def check_specs(specs, weights: str) -> None:
    """Refuse run specs the model files cannot serve: ``:fp8fast`` loads the fp8 files."""
    for spec in specs:
        if spec.fp8_fast and weights != "fp8":
            raise SystemExit(f"run spec {spec.label!r}: :fp8fast loads fp8 model files; run it with --weights fp8")


def workflow_model_set(args) -> str:
    """The model files a process loads: those its ``--workflow`` names (``bench.workflow_variants.model_set``),
    else the A14B set of the built-in graph."""
    from . import workflow_variants as WV
    return WV.model_set(json.loads(Path(args.workflow).read_text())) if getattr(args, "workflow", None) else "a14b"


def files_weights(args) -> str:
    """A record's ``config.weights``: the diffusion model files' format, a one-model set's own (``fp16`` for the
    TI2V-5B, ``fp8`` for the Wan 2.1 I2V 14B: ``bench.workflow_variants.MODEL_SET_WEIGHTS``), else ``--weights``."""
    from . import workflow_variants as WV
    return WV.MODEL_SET_WEIGHTS.get(workflow_model_set(args), args.weights)


def check_workflow_file(path: str) -> None:
    """Stop with the saved workflows' folder named where ``--workflow`` names no file."""
    if Path(path).is_file():
        return
    wf_dir = _host.ROOT / "example_workflows"
    have = sorted(p.name for p in wf_dir.glob("*.json")) if wf_dir.is_dir() else []
    raise SystemExit(f"--workflow: file {path} not found. The pack's saved workflows live in "
                     f"example_workflows/ ({', '.join(have) if have else 'none there yet'}).")


def whole_spec(runs: str, workflow: str | None):
    """The one spec of a whole-prompt process: a built-in graph's :class:`RunSpec`, or with ``--workflow`` a
    :class:`bench.workflow_variants.WorkflowSpec`."""
    from . import workflow_variants as WV
    text = runs.strip().strip(",")
    return WV.WorkflowSpec.parse(text, workflow) if workflow else RunSpec.parse(text)


def _read_version(pyproject: Path):
    try:
        for line in pyproject.read_text().splitlines():
            if line.strip().startswith("version"):
                return line.split("=", 1)[1].split("#")[0].strip().strip('"')
    except Exception:
        return None


# --------------------------------------------------------------------------- whole prompts (--whole-prompt)

WHOLE_SCHEMA = "wan-sage-whole-prompt/1"
PROMPT_NAMES = ("first", "repeat")
# The caches a first prompt can find filled, by the variable that names each folder, and the folder's name
# under a --caches kept DIR: the pack's timing cache (the Sage patch's calibration), TorchInductor's
# compiled graphs and Triton's compiled kernels (SageAttention's quantisation kernels, inductor's kernels).
CACHE_FOLDERS = {"WAN_SAGE_CACHE_DIR": "wan-sage", "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
                 "TRITON_CACHE_DIR": "triton"}


def folder_contents(path) -> dict:
    """Files and bytes under a folder (0 and 0 for a missing one)."""
    n = size = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            n += 1
            try:
                size += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return {"files": n, "bytes": size}


# The cache folder a ``--caches pack DIR`` process keeps: the pack's own (its timing cache and the torch.compile
# files it keeps, nodes/compile_cache.py); inductor's and Triton's start empty, as after a reboot.
PACK_CACHE = "WAN_SAGE_CACHE_DIR"
# Where a ``pack`` process's inductor and Triton folders lie, under the configuration's folder: the same path in
# every process, emptied at each start, as a reboot empties the temporary folder torch's default cache path
# names (``<temp>/torchinductor_<user>``) and leaves the path.  The path matters: a graph loaded from inductor's
# cache brings its Triton kernels with the absolute file name they were compiled under, and torch looks for their
# autotuning beside that name, so a fresh path per process would miss every kernel's saved choice where a user's
# restart finds it.
PACK_TEMP = "temp-emptied-each-start"


def kept_path(caches: dict) -> bool:
    """Whether a record's ``pack`` process found inductor's folder at the path the earlier process had, as a
    user's restart does (:data:`PACK_TEMP`).  Before the harness kept one path, each process had a new folder,
    where the pack's file's kernels missed their saved autotuning: such a process is no evidence of a restart."""
    fresh = str(caches.get("fresh_dir") or "")
    return fresh.rstrip("/").rsplit("/", 1)[-1] == PACK_TEMP


def set_caches(mode: str, kept_dir: str | None, work_dir) -> dict:
    """Point the three caches of :data:`CACHE_FOLDERS` at this run's folders, before torch is imported:
    ``none``, fresh empty folders under ``work_dir`` (the first prompt after installing; removed at exit
    by :func:`drop_caches`), ``kept``, the folders under ``kept_dir``, made when missing and left for the
    next process (the first prompt after a restart, once a process has filled them), or ``pack``, the pack's
    folder under ``kept_dir`` and empty ones for inductor and Triton at the same path in every process
    (:data:`PACK_TEMP`: the first prompt after a reboot that emptied the temporary folders torch keeps its
    caches in).  Returns the record's ``caches``: the mode,
    each variable's folder and what it held at the start."""
    import tempfile
    fresh = None
    if mode == "none":
        base = fresh = Path(tempfile.mkdtemp(prefix="caches-none-", dir=str(work_dir)))
    elif mode == "kept" and kept_dir:
        base = Path(kept_dir).resolve()
    elif mode == "pack" and kept_dir:
        import shutil
        base = Path(kept_dir).resolve()
        fresh = base / PACK_TEMP
        shutil.rmtree(fresh, ignore_errors=True)   # what an earlier process left, were it stopped before its exit
        fresh.mkdir(parents=True)
    else:
        raise SystemExit("--caches takes 'none', 'kept DIR' or 'pack DIR'")
    folders, at_start = {}, {}
    for var, name in CACHE_FOLDERS.items():
        p = (base if mode != "pack" or var == PACK_CACHE else fresh) / name
        p.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(p)
        folders[var] = str(p)
        at_start[var] = folder_contents(p)
    out = {"mode": mode, "dir": str(base), "folders": folders, "at_start": at_start,
           "filled_at_start": any(v["files"] for v in at_start.values())}
    if mode == "pack":
        out["fresh_dir"] = str(fresh)
    return out


def caches_in_use() -> dict:
    """Where this process's pack, inductor and Triton read their caches (after the prompts): the check
    that the folders of :func:`set_caches` are the ones used."""
    out = {}
    try:
        from wan_sage.attention import timing
        out["wan_sage_timing"] = str(timing.default_dir())
    except Exception as e:
        out["wan_sage_timing"] = f"? ({type(e).__name__})"
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        out["torchinductor"] = cache_dir()
    except Exception as e:
        out["torchinductor"] = f"? ({type(e).__name__})"
    try:
        import triton.knobs
        out["triton"] = str(triton.knobs.cache.dir)
    except Exception:
        out["triton"] = os.environ.get("TRITON_CACHE_DIR")
    return out


def record_caches(caches: dict) -> dict:
    """The ``caches`` of a record: its folders inside this checkout named relative to it (a record names no
    absolute path of the machine that wrote it); folders elsewhere (a ``kept DIR`` given on the command line)
    as given."""
    root = str(ROOT).rstrip("/") + "/"

    def rel(p):
        return p[len(root):] if isinstance(p, str) and p.startswith(root) else p
    out = dict(caches, dir=rel(caches.get("dir")))
    if "fresh_dir" in caches:
        out["fresh_dir"] = rel(caches["fresh_dir"])
    for key in ("folders", "in_use"):
        if isinstance(caches.get(key), dict):
            out[key] = {k: rel(v) for k, v in caches[key].items()}
    return out


def drop_caches(caches: dict) -> None:
    """Remove the fresh folders of a ``--caches none`` or ``pack`` process (a kept folder is left for the next one)."""
    import shutil
    if caches.get("mode") == "none":
        shutil.rmtree(caches["dir"], ignore_errors=True)
    elif caches.get("mode") == "pack" and caches.get("fresh_dir"):
        shutil.rmtree(caches["fresh_dir"], ignore_errors=True)


def process_age_s() -> float | None:
    """Seconds since this process started, as the kernel counts it (``/proc/self/stat``, to 10 ms), or
    None where there is no /proc."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        start = float(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        return float(Path("/proc/uptime").read_text().split()[0]) - start
    except (OSError, ValueError, IndexError):
        return None


class PromptSession:
    """What a running ComfyUI process keeps between queued prompts: the outputs of the nodes whose inputs
    did not change (ComfyUI's node cache), the loaded models (nothing unloads them between prompts) and,
    here, the ballast of the budget, made once before the first prompt and held to the end."""

    def __init__(self):
        self.outputs = {}
        self.ballast = None
        self.inherited = None

    def hold(self, host, budget_gib):
        if self.ballast is None:
            self.inherited = host.mem.alloc()
            self.ballast = Ballast(host.torch, host.mm, host.dev, budget_gib, host.log)
        return self.inherited, self.ballast

    @staticmethod
    def between(host):
        """What ComfyUI's prompt worker does while the queue is idle (after 10 s): collect garbage and
        give the allocator's free cache back (``soft_empty_cache``); the models stay loaded."""
        gc.collect()
        host.mm.soft_empty_cache()


def expert_summary(row: dict) -> dict:
    """Per expert, the figures the first prompt and the repeat prompt are compared by: the first step (the
    first Sage call of the process, the compile of a fresh process), the median of the later steps, the
    sampler's wall time with the model loads, the Sage patch's calibration time and calls, dynamo's graphs
    and recompiles."""
    out = {}
    by_compile = ((row.get("compile") or {}).get("by_expert") or {})
    for e, x in (row.get("experts") or {}).items():
        steps = x.get("step_s") or []
        att = x.get("attention") or {}
        comp = by_compile.get(e) or {}
        out[e] = {"first_step_s": steps[0] if steps else None,
                  "later_step_s": _r(statistics.median(steps[1:])) if len(steps) > 1 else None,
                  "wall_s": x.get("wall_s"), "calibration_ms": att.get("calibration_ms"),
                  "sage_calls": att.get("sage_calls"), "sdpa_calls": att.get("sdpa_calls"),
                  "graphs": comp.get("unique_graphs"), "recompiles": comp.get("recompiles")}
    return out


# What a whole-prompt record holds once for the process, not in each prompt's entry (a saved workflow's records
# add the workflow's file name, the model files substituted for its loaders and the start images written for it).
WORKFLOW_KEYS = ("workflow", "models", "inputs")
PROCESS_KEYS = ("schema", "run", "config", "budget") + WORKFLOW_KEYS


def prompt_entry(name: str, row: dict) -> dict:
    """One prompt of a whole-prompt record: the run record without what the process record holds once
    (:data:`PROCESS_KEYS`), with ``prompt`` (first / repeat), ``first_step_s`` and ``by_expert``."""
    d = {"prompt": name, **{k: v for k, v in row.items() if k not in PROCESS_KEYS}}
    d["by_expert"] = expert_summary(row)
    d["first_step_s"] = {e: v["first_step_s"] for e, v in d["by_expert"].items()}
    return d


def whole_decode(spec, args) -> bool:
    """Whether a whole-prompt run decodes: the spec's ``:decode`` / ``:nodecode``, else every prompt unless
    ``--decode none``."""
    return spec.decode if spec.decode is not None else args.decode != "none"


def prompt_runner(host, spec, args, session: PromptSession):
    """The function of the seed that runs one prompt of a whole-prompt process in ``session`` and returns its
    record: the built-in graph for a :class:`RunSpec`, the saved workflow's prompt (``Host.workflow_prompts``:
    one PromptExecutor for both prompts) for a workflow's spec."""
    if not isinstance(spec, RunSpec):
        return host.workflow_prompts(spec, session)
    decode = whole_decode(spec, args)
    return lambda seed: host.run(spec, decode, seed=seed, session=session)


def run_whole(host, spec, args, caches: dict, process_t0: float | None, t_main: float) -> dict:
    """The first prompt of this process, then the repeat prompt with a new seed, in one session (no
    warm-up, nothing unloaded between them); one record for the process, for the built-in graph and a saved
    workflow alike (:func:`prompt_runner`).  ``process_t0``: the process's
    start on the ``perf_counter`` clock (None where unknown), ``t_main``: the start of :func:`main`."""
    session = PromptSession()
    run_prompt = prompt_runner(host, spec, args, session)
    seeds = (args.seed, args.repeat_seed if args.repeat_seed is not None else args.seed + 1)
    prompts = []
    for name, seed in zip(PROMPT_NAMES, seeds):
        if prompts:
            if prompts[-1]["status"] != "ok":
                host.log(f"e2e prompt {name}: not run, the {prompts[-1]['prompt']} prompt ended {prompts[-1]['status']}")
                break
            session.between(host)
        host.log(f"e2e prompt {name}: {spec.name}, seed {seed}")
        row = run_prompt(seed)
        if not prompts:
            config, budget = row["config"], row["budget"]
            once = {k: row[k] for k in WORKFLOW_KEYS if k in row}
            # the process's start to the first prompt: the interpreter, ComfyUI's import, the model files' check
            process_start_s = None if process_t0 is None else _r(host.last_start - process_t0)
            startup = {"python_s": None if process_t0 is None else _r(t_main - process_t0), **host.startup,
                       "main_to_prompt_s": _r(host.last_start - t_main)}
        host.log(f"e2e prompt {name}: {row['status']}, to the latent {row['to_latent_s']} s, "
                 f"to the frames {row['to_frames_s']} s")
        prompts.append(prompt_entry(name, row))
    env = host.env()
    return {"schema": WHOLE_SCHEMA, "run": run_label(spec, host.args),
            "status": next((p["status"] for p in prompts if p["status"] != "ok"), "ok"), **once,
            "config": config, "caches": record_caches({**caches, "in_use": caches_in_use()}),
            "process": {"index": args.process_index, "count": args.process_count},
            "process_start_s": process_start_s, "startup": startup, "budget": budget,
            "prompts": prompts, "env": env, "commit": env.get("wan_sage_commit")}


# --------------------------------------------------------------------------- CLI

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", required=True, help="where the random-weight model files are (written when missing)")
    ap.add_argument("--scale", choices=["full", "tiny"], default="full")
    ap.add_argument("--weights", choices=["gguf", "fp8"], default="gguf")
    ap.add_argument("--te-dtype", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gen-device", default="auto", help="device that makes the random weights (auto: cuda if present)")
    ap.add_argument("--generate-only", action="store_true", help="write the model files and exit")
    ap.add_argument("--gguf-path", default=os.environ.get("COMFYUI_GGUF_PATH"),
                    help="ComfyUI-GGUF checkout (default: $COMFYUI_GGUF_PATH, else <COMFYUI_PATH>/../ComfyUI-GGUF)")
    ap.add_argument("--work-dir", default=None, help="ComfyUI user/output/temp folders (default: <models-dir>/../e2e-work)")
    ap.add_argument("--runs", default=None, help="comma list of run specs, e.g. est+sage@24:720p81,comfy+sdpa@full:480p81")
    ap.add_argument("--matrix", action="store_true", help="the 16 runs of the targets for --weights, 24 GB 720p81 first")
    ap.add_argument("--estimator", action="store_true", help="single run: with the Working-Memory Estimator")
    ap.add_argument("--attention", choices=["sdpa", "sage"], default="sdpa", help="single run: SDPA or the Sage patch")
    ap.add_argument("--res", default=None, help="single run / workflow: WxHxF or 720p81 / 480p81 (default 720p81; tiny: 64x64x5)")
    ap.add_argument("--vram-budget", type=float, default=None, metavar="GB",
                    help="single run / workflow: hold a ballast so ComfyUI sees GB GiB free; with --matrix: the small budget (24)")
    ap.add_argument("--steps", type=int, default=4, help="sampler steps of a run whose spec names none (:Nsteps)")
    ap.add_argument("--cfg", type=float, default=1.0, help="cfg of a run whose spec names none (:cfgX); 1.0 as with "
                    "the Lightning LoRAs, the 20-step workflows without them use 3.5")
    ap.add_argument("--shift", type=float, default=5.0,
                    help="ModelSamplingSD3 shift after each LoRA, as in the pack's A14B workflows (0: no node)")
    ap.add_argument("--profile-decode", type=int, default=0, metavar="N",
                    help="profile each VAE decode with torch.profiler and keep its device time, top N kernels and "
                         "per convolution shape its calls, device ms and each call's ms and free memory in the decode "
                         "phase's record (\"profile\"); 0: off")
    ap.add_argument("--decode", choices=["all", "first", "none"], default="all",
                    help="VAE decode in every run, only in the first, or never (a spec's :decode / :nodecode wins); "
                         "with --whole-prompt: in both prompts unless none")
    ap.add_argument("--whole-prompt", action="store_true",
                    help="one spec in this fresh process, no warm-up: the first prompt, then a repeat prompt with a "
                         "new seed, as queued to a running ComfyUI (node cache, models kept loaded); one record "
                         f"({WHOLE_SCHEMA}) with both. Needs --caches")
    ap.add_argument("--caches", nargs="+", metavar=("none|kept|pack", "DIR"), default=None,
                    help="with --whole-prompt: the pack's timing cache, TorchInductor's and Triton's cache folders: "
                         "'none' = fresh empty folders (the first prompt after installing), 'kept DIR' = DIR/wan-sage, "
                         "DIR/torchinductor, DIR/triton, kept for the next process (the first prompt after a restart), "
                         "'pack DIR' = DIR/wan-sage kept, inductor's and Triton's fresh (the first prompt after a reboot)")
    ap.add_argument("--repeat-seed", type=int, default=None, help="with --whole-prompt: the repeat prompt's seed "
                    "(default --seed + 1)")
    ap.add_argument("--process-index", type=int, default=1, help="with --whole-prompt: this process's number in "
                    "its driver's sequence (bench.whole_prompt), for the record")
    ap.add_argument("--process-count", type=int, default=1, help="with --whole-prompt: how many processes the "
                    "driver runs for this configuration, for the record")
    ap.add_argument("--warmup", action="store_true",
                    help="before the measured runs, one unrecorded comfy@full:384x384x5 run (with the Sage patch when a "
                         "measured run uses it): reads the files from disk, releases GGUF's mmap, initialises cuBLAS/cuDNN "
                         "and Sage's kernels, so the first measured run does not pay it")
    ap.add_argument("--reload", action="store_true", help="reload every model in every run (default: loader outputs are "
                    "kept, as ComfyUI's node cache keeps them between queued prompts; GPU memory is freed either way)")
    ap.add_argument("--workflow", default=None, help="run a saved workflow (UI or API JSON) instead of the built-in graph; "
                    "with --whole-prompt, --runs names its variant: VARIANT@{GB|full}[:WxHxF][:Nsteps], VARIANT one of "
                    "template (as saved), comfy (the pack's nodes bypassed), compilenode (Wan Compile Blocks added "
                    "after the Sage patch)")
    ap.add_argument("--allocator", choices=["async", "native"], default="async",
                    help="async: cudaMallocAsync, what ComfyUI's main.py selects; native: PyTorch's caching allocator")
    ap.add_argument("--sage-check-finite", choices=["on", "off"], default="on",
                    help="the Sage patch's per-call NaN/Inf check (default on, as the node); off measures its cost "
                         "(recorded as config.check_finite: false)")
    ap.add_argument("--sage-trim", choices=["on", "off"], default="on",
                    help="the Sage patch's allocator trim when its sampling ends (default on, as the node); off leaves "
                         "the sampling's cached blocks in the pool for the next node, to measure what the trim does to the "
                         "VAE decode (recorded as config.trim_after_sampling: false and /no-trim)")
    ap.add_argument("--decode-room-extra-gib", type=float, default=None, metavar="GIB",
                    help="the estimator keeps GIB more than ComfyUI's figure for the VAE decode after the sampling "
                         "(fewer weights resident while sampling), to measure what room the decode needs (recorded as "
                         "config.decode_room_extra_gib and /decode-room+GIB)")
    ap.add_argument("--sage-memory-mode", choices=["sdpa", "fastest"], default=None,
                    help="the Sage patch's memory mode (dispatch v2): sdpa = head groups at SDPA's memory, fastest = "
                         "whole calls; default: the node's own (recorded as config.memory_mode and /memory-MODE)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="TorchCompileModel's backend for +compile runs: inductor or cudagraphs, as the node offers "
                         "(eager: CPU smoke runs only)")
    ap.add_argument("--reserve-vram", type=float, default=None, help="ComfyUI's --reserve-vram (GB), e.g. 0.68 to copy Windows")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run after this many seconds")
    ap.add_argument("--skip-done", default=None, metavar="JSONL[,JSONL]",
                    help="skip runs that already have a completed or out-of-memory record (same run and weights) there")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    ap.add_argument("--av-stub", action="store_true", help="if PyAV is missing, stub it (video I/O only; see bench._host.ensure_av)")
    ap.add_argument("--cpu", action="store_true", help="force the CPU")
    ap.add_argument("--quiet", action="store_true", help="ComfyUI logs at WARNING")
    a = ap.parse_args(argv)
    a.sage_check_finite = a.sage_check_finite == "on"
    a.sage_trim = a.sage_trim == "on"
    if a.decode_room_extra_gib is not None and a.decode_room_extra_gib <= 0:
        ap.error("--decode-room-extra-gib: give a positive GiB figure, e.g. 2")
    if a.workflow:
        check_workflow_file(a.workflow)
    if a.whole_prompt:
        why = [x for x, bad in (("--matrix", a.matrix), ("--warmup", a.warmup),
                                ("--reload", a.reload), ("--skip-done", a.skip_done)) if bad]
        if why:
            ap.error(f"--whole-prompt runs one spec in a fresh process as ComfyUI runs it: {', '.join(why)} do not apply")
        if not a.runs or len([x for x in a.runs.split(",") if x.strip()]) != 1:
            ap.error("--whole-prompt takes exactly one spec in --runs (one configuration per fresh process)")
        a.spec = whole_spec(a.runs, a.workflow)
        if not a.caches or a.caches[0] not in ("none", "kept", "pack") or len(a.caches) != (1 if a.caches[0] == "none" else 2):
            ap.error("--whole-prompt needs --caches none, --caches kept DIR or --caches pack DIR: every record says "
                     "which caches it had")
    elif a.caches:
        ap.error("--caches applies to --whole-prompt runs only")
    if a.work_dir is None:
        a.work_dir = str(Path(a.models_dir).resolve().parent / "e2e-work")
    return a


def main(argv=None):
    t_start = time.perf_counter()
    age = process_age_s()
    process_t0 = None if age is None else t_start - age
    args = parse_args(argv)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    caches = set_caches(args.caches[0], args.caches[1:] and args.caches[1], args.work_dir) if args.whole_prompt else None
    try:
        host = Host(args)
    except BaseException:
        if caches:
            drop_caches(caches)
        raise
    try:
        return _main_runs(host, args, caches, process_t0, t_start)
    finally:
        host.comfy_timers.close()


def _main_runs(host, args, caches, process_t0, t_start) -> int:
    """main's runs on a booted host: one whole-prompt process, a workflow, or the run specs."""
    if args.whole_prompt:
        try:
            spec = args.spec
            if isinstance(spec, RunSpec):
                check_specs([spec], args.weights)
            if getattr(spec, "compile", "") == "model" and "TorchCompileModel" not in host.N:
                raise SystemExit("+compile runs need ComfyUI's TorchCompileModel node, which did not load")
            check_sage_memory_mode(args.sage_memory_mode)
            record = run_whole(host, spec, args, caches, process_t0, t_start)
            emit = _host.JsonLines(args.out)
            emit(record)
            emit.close()
        finally:
            drop_caches(caches)
        return 0
    check_sage_memory_mode(args.sage_memory_mode)
    whole_model = args.runs and any(RunSpec.parse(x.strip()).compile == "model" for x in args.runs.split(",") if x.strip())
    if whole_model and "TorchCompileModel" not in host.N:
        raise SystemExit("+compile runs need ComfyUI's TorchCompileModel node (comfy_extras/nodes_torch_compile.py), "
                         "which did not load: see ComfyUI's import log")
    if args.generate_only:
        print(json.dumps({"schema": SCHEMA, "generated": {k: str(v) for k, v in host.files.items() if k != "names"}}))
        return 0
    env = host.env()
    host.log("e2e env: " + json.dumps(env))
    out = open(args.out, "a") if args.out else None
    default_res = RES["tiny"] if args.scale == "tiny" else RES["720p81"]
    res = (RES.get(args.res) or tuple(int(x) for x in args.res.split("x"))) if args.res else None

    def emit(row):
        row["env"] = env
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
    if args.workflow:
        emit(host.run_workflow(Path(args.workflow), res, args.vram_budget))
    else:
        if args.runs:
            specs = [RunSpec.parse(s.strip()) for s in args.runs.split(",") if s.strip()]
        elif args.matrix:
            specs = matrix(args.vram_budget if args.vram_budget is not None else 24.0)
            if args.scale == "tiny":
                specs = [RunSpec(s.estimator, s.attention, s.budget_gib, RES["tiny"]) for s in specs]
        else:
            specs = [RunSpec(args.estimator, args.attention, args.vram_budget, res or default_res)]
        check_specs(specs, args.weights)
        done = done_runs(args.skip_done, args.weights) if args.skip_done else set()
        todo = [s for s in specs if run_label(s, args) not in done]
        if args.warmup and todo and not (args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s):
            ws = warmup_spec(todo, args.scale)
            w = host.run(ws, decode=False)
            host.log(f"e2e warm-up ({ws.label}): {w['status']} in {w['run_s']} s (not recorded)")
        for i, spec in enumerate(specs):
            run = run_label(spec, args)
            if run in done:
                host.log(f"e2e run {i + 1}/{len(specs)}: {run} already recorded, skipped")
                continue
            if args.deadline_s is not None and time.perf_counter() - t_start > args.deadline_s:
                emit({"schema": SCHEMA, "run": run, "status": "skipped", "error": f"deadline {args.deadline_s:g} s"})
                continue
            decode = spec.decode if spec.decode is not None else (
                args.decode == "all" or (args.decode == "first" and not host.decoded))
            host.log(f"e2e run {i + 1}/{len(specs)}: {spec.label}")
            emit(host.run(spec, decode))
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
