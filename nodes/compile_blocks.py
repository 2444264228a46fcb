"""Wan Compile Blocks: torch.compile of a Wan model's transformer blocks, one by one, streamed blocks included.

Per-block compile (ComfyUI's ``set_torch_compile_wrapper`` given block keys, KJNodes' Wan compile nodes) traces
each block with its weights.  A block whose weights ComfyUI streams (lowvram: the weights stay on the host and
are cast onto the GPU inside each layer's forward) traces into a different graph from a resident one: dynamo's
guards fail on the parameters' device, on ComfyUI's cast flag and on a streamed GGUF weight's LoRA patch list.
On the H200 a 12 GiB A14B prompt compiled 5 graphs with 4-5 recompiles, 22-51 s on the first prompt and again on
the repeat (docs/benchmarks.md, "Whole generation").

Here each block is swapped, for the sampling only (the ``APPLY_MODEL`` wrapper ComfyUI's own compile uses, under
the same key), for a :class:`BlockStandIn`, which at each call runs
  * the compiled block where every weight of the block is on the input's device;
  * the compiled block made to look resident where some of it streams (:mod:`.staged_blocks`): streamed modules
    without a per-call patch (a ComfyUI-GGUF layer, the block's own ``modulation``) copied onto the GPU for the call
    (the resident block's graph), or, where a streamed Linear has a LoRA patched in at each call, every Linear's
    weight cast onto the GPU by its own cast and handed to the graph as a plain tensor (the staged graph);
  * the block itself, eagerly, where neither can be done (a Linear of a kind not known, an fp8 weight with a
    per-call LoRA, another streamed module with a patch function, a copy that fails).
So a model compiles at most two graphs, the resident block's and the staged block's (a GGUF model one), shared by
every block of both experts of Wan 2.2 A14B, and no guard sees a streamed weight.  Which blocks stream is read at
each call, so a block that ComfyUI loads or offloads between prompts takes the other path without a recompile, and
the cast flags ComfyUI's partial unload and reload leave on a block's modules are settled for its compiled call
(:func:`settle_cast_flags`).  ComfyUI's cond/uncond batching is held within the rows the blocks have run compiled
(:mod:`.cond_rows`), so a step that would batch them where an earlier one did not traces no new batch size.  The
estimator plans a streamed load for the larger of the eager forward and the
compiled one holding a block's staged weights (``memory.estimate.Setup.streamed_blocks_staged``), and, once the
model's streamed Linears have run compiled with no call eager and no sampling failed, for the compiled one holding
the one block's weights its path holds (:func:`streamed_blocks_ran`); what a sampling showed is kept across
ComfyUI starts for the model's kind (:mod:`.streamed_record`, :func:`streamed_path`).

A ComfyUI-GGUF block runs compiled with its weights cast through :mod:`.gguf_cast`: ComfyUI-GGUF's own cast, with
the dequantization on plain tensors, given to the block's layers for that call only.

Each block's ``torch.compile`` is made at the block's first call, and the imports a process's first one makes run on
a thread of their own from the node's run on (:mod:`.compile_import`), beside the prompt's text encoder and model
loads.

The wrapper closes over the dict of compiled keys as ComfyUI's does, so the estimator, the Sage patch's compile
cache and its payback read the scope the same way (``comfy_bridge.compile_scope``).  Each stand-in counts its calls
by the path they took, and the node's ``OUTER_SAMPLE`` wrapper starts the count with each sampling and logs it when
the sampling ends (:func:`blocks_ran`); the Sage patch's payback reads the same count.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections import Counter
from dataclasses import dataclass

import torch
import torch._dynamo

from ..memory import report
from . import comfy_bridge, compile_import, cond_rows, gguf_cast, staged_blocks, streamed_record
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

BACKENDS = ("inductor", "cudagraphs")
MODES = ("default", "max-autotune-no-cudagraphs")
PATHS = ("resident", "lifted", "staged", "eager")  # how a stand-in ran its block (BlockStandIn.ran)
STAND_INS = "wan_sage_stand_ins"  # on the wrapper: its dict of BlockStandIn s by key
OUTER_KEY = "wan_sage_compile_blocks"  # the node's OUTER_SAMPLE wrapper: how the blocks ran, per sampling
NO_LINEAR = "streamed-no-linear"  # BlockStandIn.ever: lifted with only modules beside the Linears streamed
FAILED = "failed"  # BlockStandIn.ever: a sampling that raised (out of memory, a kernel) while the block was in it

# Inductor's options for the blocks.  dynamic_scale_rblock off: with it on, a reduction kernel whose registers limit
# its occupancy gets extra configs with a halved R0_BLOCK after its config list is hashed for the autotune cache;
# when one of those wins, the saved choice matches none of the listed configs in the next process, so the kernel is
# benchmarked again at every ComfyUI start, even with every cache kept.  Measured with bench.compile_cache_probe on
# one bf16 A14B block (bench/records/LOG.md): off, each of its autotuned kernels hits the cache in a later process,
# and its settled call takes the same time.  Torch looks for those choices beside the path a kernel was compiled
# under, so they are found where its cache folder keeps its path across starts, as its default one does
# (docs/attention.md, "The path of torch's cache folder").
INDUCTOR_OPTIONS = {"dynamic_scale_rblock": False}


def block_resident(block, device) -> bool:
    """Whether every parameter and buffer of ``block`` is on ``device`` (the device its input is on)."""
    for t in block.parameters():
        if t.device != device:
            return False
    for t in block.buffers():
        if t.device != device:
            return False
    return True


@contextlib.contextmanager
def settle_cast_flags(block):
    """For the ``with`` body: ComfyUI's cast flag dropped from the modules of ``block`` that hold it as an attribute
    of their own with their class's value, so that dynamo's guards see the state a freshly loaded model has; put
    back afterwards (the modules are shared with the model's other clones).

    ComfyUI's partial unload sets ``comfy_cast_weights`` on each module it moves, and its next full load puts the
    previous value back as an attribute of the module (``model_patcher.wipe_lowvram_weight``).  The value is the
    class's, but dynamo guards on whether the module's ``__dict__`` holds it, so without this a Wan 2.2 repeat
    prompt (the other expert's load unloads part of this one) recompiled 3 graphs, 13-16 s on the H200
    (docs/benchmarks.md, "Whole generation").  Removing an attribute equal to the class's changes nothing that
    ComfyUI reads; a module still in lowvram (``prev_comfy_cast_weights`` set) or with a flag that differs from
    its class's is left as it is."""
    taken = []
    for mod in block.modules():
        d = mod.__dict__
        if ("comfy_cast_weights" in d and "prev_comfy_cast_weights" not in d
                and d["comfy_cast_weights"] == getattr(type(mod), "comfy_cast_weights", None)):
            taken.append((d, d.pop("comfy_cast_weights")))
    try:
        yield
    finally:
        for d, value in taken:
            d.setdefault("comfy_cast_weights", value)


def _input(args, kwargs):
    """The block's input ``x``, given first or by name."""
    return args[0] if args else kwargs.get("x")


class BlockStandIn(torch.nn.Module):
    """Stands in for one transformer block while the model samples: the compiled block where all its weights
    are resident, the compiled block with its Linears staged where some stream and the block can be staged
    (:mod:`.staged_blocks`), the block itself otherwise.  It holds both without registering them as its
    children, so it adds no parameters to the model it is swapped into.  ``ran`` counts its calls by path
    (:data:`PATHS`) and ``why`` its eager calls by reason, since the last :func:`begin_run`; ``ever`` its calls by
    path since it was made, a lifted or staged call that moved no Linear under :data:`NO_LINEAR`, and the samplings
    that failed under :data:`FAILED` (:func:`streamed_blocks_ran`)."""

    def __init__(self, block: torch.nn.Module, compiled):
        super().__init__()
        object.__setattr__(self, "block", block)
        object.__setattr__(self, "compiled", compiled)
        object.__setattr__(self, "ran", Counter())
        object.__setattr__(self, "why", Counter())
        object.__setattr__(self, "ever", Counter())

    def _count(self, path: str, linears: bool = True) -> None:
        self.ran[path] += 1
        self.ever[path if linears else NO_LINEAR] += 1

    def _compiled_call(self, x, args, kwargs):
        # GGUF: dynamo traces no op of their tensor subclass
        with settle_cast_flags(self.block), gguf_cast.plain_casts(self.block, x) as given:
            out = self.compiled(*args, **kwargs)
        cond_rows.ran(type(self.block), x.shape[0])
        return gguf_cast.as_input_class(out, x) if given else out

    def forward(self, *args, **kwargs):
        x = _input(args, kwargs)
        device = getattr(x, "device", None)
        if device is not None and block_resident(self.block, device):
            self._count("resident")
            return self._compiled_call(x, args, kwargs)
        with staged_blocks.staged(self.block, x) as staging:
            if staging:
                self._count(staging.path, linears=staging.linears > 0)
                return self._compiled_call(x, args, kwargs)
        self._count("eager")
        self.why[staging.why] += 1
        return self.block(*args, **kwargs)


@dataclass(frozen=True)
class BlocksRan:
    """How the blocks of a Wan Compile Blocks model ran since :func:`begin_run`: each block counted once, by the
    path most of its calls took (:data:`PATHS`), with the calls and the reasons of the eager ones."""

    blocks: dict  # path -> blocks
    calls: dict  # path -> calls
    why: dict  # reason -> eager calls

    @property
    def compiled(self) -> int:
        """Blocks that ran compiled: in the resident block's graph (resident or lifted) or the staged one."""
        return sum(self.blocks.get(p, 0) for p in PATHS[:3])

    @property
    def any_calls(self) -> bool:
        return sum(self.calls.values()) > 0


def stand_ins(model, model_options=None) -> list:
    """The :class:`BlockStandIn` s of ``model``'s Wan Compile Blocks wrapper, in block order ([] where the node is not
    on the model)."""
    options = model_options if model_options is not None else getattr(model, "model_options", {}) or {}
    for w in comfy_bridge.compile_wrappers(model, options):
        found = getattr(w, STAND_INS, None)
        if found:
            return list(found.values())
    return []


def begin_run(model, model_options=None) -> None:
    """Start counting how ``model``'s blocks run afresh (a sampling run begins)."""
    for s in stand_ins(model, model_options):
        s.ran.clear()
        s.why.clear()


def blocks_ran(model, model_options=None) -> BlocksRan | None:
    """How ``model``'s blocks ran since :func:`begin_run`; None where the node is not on the model."""
    found = stand_ins(model, model_options)
    if not found:
        return None
    blocks, calls, why = Counter(), Counter(), Counter()
    for s in found:
        calls.update(s.ran)
        why.update(s.why)
        if s.ran:
            blocks[max(PATHS, key=lambda p: s.ran.get(p, 0))] += 1
    return BlocksRan({p: blocks[p] for p in PATHS}, {p: calls[p] for p in PATHS}, dict(why))


def _ever(found) -> Counter:
    """The lifetime counts (``BlockStandIn.ever``) of the stand-ins ``found``, added up."""
    ever = Counter()
    for s in found:
        ever.update(s.ever)
    return ever


def _path_of(ever: Counter) -> str:
    if ever["eager"] or ever[FAILED] or not (ever["lifted"] or ever["staged"]):
        return ""
    return "staged" if ever["staged"] else "lifted"


def _showed_path(ever: Counter) -> bool:
    """Whether the counts say anything of the streamed path: a streamed Linear run compiled, a call run eagerly or
    a sampling failed."""
    return bool(ever["eager"] or ever[FAILED] or ever["lifted"] or ever["staged"])


def streamed_blocks_ran(model, model_options=None) -> str:
    """How ``model``'s streamed blocks have run since the node made its stand-ins: "staged" where a call ran the
    staged graph, "lifted" where calls lifted streamed Linears into the resident block's graph; "" where no
    streamed Linear has run compiled yet (a block with only its ``modulation`` streamed proves nothing of its
    Linears), or where, ever, a call ran eagerly or a sampling failed (the next may too: the eager floor stands for
    good)."""
    return _path_of(_ever(stand_ins(model, model_options)))


def streamed_path(model, model_options=None) -> tuple[str, bool]:
    """(the path the estimator plans ``model``'s streamed blocks for, ``memory.estimate.Setup.streamed_blocks_ran``;
    whether it is an earlier start's): what this process saw where its blocks have streamed compiled, run eagerly
    or failed a sampling (:func:`streamed_blocks_ran`), else what an earlier start kept (:mod:`.streamed_record`)."""
    found = stand_ins(model, model_options)
    ever = _ever(found)
    if _showed_path(ever):
        return _path_of(ever), False
    kept = streamed_record.recorded(model, [s.block for s in found]) if found else ""
    return kept, bool(kept)


def _keep_path(model, model_options) -> None:
    """After a sampling: keep what it showed of the streamed path for the next start (:mod:`.streamed_record`),
    where it showed anything."""
    found = stand_ins(model, model_options)
    ever = _ever(found)
    if _showed_path(ever):
        streamed_record.keep(model, [s.block for s in found], _path_of(ever))


def _failed(model, model_options) -> None:
    """A sampling over ``model`` raised: its plan is not trusted again (:func:`streamed_blocks_ran`)."""
    for s in stand_ins(model, model_options):
        s.ever[FAILED] += 1


def _wrapper(stand_ins: dict):
    """The ``APPLY_MODEL`` wrapper: ComfyUI's own compile wrapper (it swaps the modules in for the sampling's model
    calls and puts the blocks back in ``finally``; its closure holds the dict of keys ``diffusion_model.blocks.N``),
    marked as this node's."""
    from comfy_api.torch_helpers.torch_compile import apply_torch_compile_factory

    wrapper = apply_torch_compile_factory(compiled_module_dict=stand_ins)
    setattr(wrapper, comfy_bridge.COMPILE_BLOCKS_MARK, True)
    setattr(wrapper, STAND_INS, stand_ins)  # for blocks_ran: how the blocks ran
    return wrapper


def blocks_ran_text(ran: BlocksRan) -> str:
    return report.blocks_ran_line(ran.blocks, ran.calls, ran.why)


def outer_sample(executor, *args, **kwargs):
    """``OUTER_SAMPLE`` wrapper: counts how the blocks run during the sampling and logs it when the sampling ends.
    Never fails the sampling over it."""
    guider = getattr(executor, "class_obj", None)
    patcher, options = getattr(guider, "model_patcher", None), getattr(guider, "model_options", None)
    try:
        begin_run(patcher, options)
    except Exception as e:
        warn_once(("blocks-ran", type(e).__name__), "wan-sage: how Wan Compile Blocks ran the blocks is not "
                  "counted (%s).", reason(e))
        return executor(*args, **kwargs)
    try:
        return executor(*args, **kwargs)
    except BaseException as e:
        if not comfy_bridge.user_cancel(e):  # the user's cancel says nothing of the plan
            try:
                _failed(patcher, options)
            except Exception:
                pass
        raise
    finally:
        try:
            _keep_path(patcher, options)
        except Exception as e:
            warn_once(("streamed-path", type(e).__name__), "wan-sage: how Wan Compile Blocks ran the streamed "
                      "blocks is not kept for the next start (%s).", reason(e))
        try:
            ran = blocks_ran(patcher, options)
            if ran is not None and ran.any_calls:
                log.info("wan-sage: %s", blocks_ran_text(ran))
        except Exception as e:
            warn_once(("blocks-ran", type(e).__name__), "wan-sage: how Wan Compile Blocks ran the blocks is not "
                      "counted (%s).", reason(e))


def count_compiled_blocks(model) -> tuple[int, int, int] | None:
    """(blocks that run the resident block's graph: every weight on the load device, or streamed quantized layers
    lifted; blocks that run the staged block's graph; blocks) of a Wan model as it is loaded now, or None where it
    has no blocks."""
    dm = comfy_bridge.diffusion_model(model)
    blocks = list(getattr(dm, "blocks", ()) or ())
    if not blocks:
        return None
    device = torch.device(getattr(model, "load_device", "cpu"))
    try:
        dtype = comfy_bridge.compute_torch_dtype(model)
    except Exception:  # no dtype to read: no block counts as staged
        dtype = None
    resident = staged = 0
    for b in blocks:
        if block_resident(b, device):
            resident += 1
            continue
        actions = staged_blocks.plan(b, device, dtype)
        if actions is not None:
            if all(a[0] == "lift" for a in actions):
                resident += 1
            else:
                staged += 1
    return resident, staged, len(blocks)


def compile_kwargs(backend: str = "inductor", mode: str = "default") -> dict:
    """``torch.compile``'s arguments for each block.  For inductor, the mode's options and :data:`INDUCTOR_OPTIONS`
    (torch.compile takes a mode or options, not both)."""
    kwargs = {"backend": backend, "options": None, "mode": None if mode == "default" else mode,
              "fullgraph": False, "dynamic": None}
    if backend == "inductor":
        from torch._inductor import list_mode_options
        kwargs["options"] = dict(list_mode_options(kwargs["mode"]) if kwargs["mode"] else {}, **INDUCTOR_OPTIONS)
        kwargs["mode"] = None
    return kwargs


def apply_compile_blocks(model, backend: str = "inductor", mode: str = "default"):
    """A clone of ``model`` whose Wan blocks run compiled one by one, streamed ones staged; (model, status text).
    A model that is not Wan passes through unchanged, and says so."""
    # the node offers BACKENDS; another dynamo backend by name is for callers of this function.  Listing dynamo's
    # backends imports each of them, so it is asked only for a name the node does not offer.
    if backend not in BACKENDS and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {str(backend)[:40]!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {str(mode)[:40]!r}")
    if not comfy_bridge.is_wan(model):
        return model, "not a Wan model: passed through unchanged, nothing compiled"
    m, note = _clone_to_compile(model)
    if m is None:
        return model, note
    dm = comfy_bridge.diffusion_model(m)
    kwargs = compile_kwargs(backend, mode)
    compile_import.start(kwargs)  # torch.compile's imports, beside the text encoder's and the model's loads
    stand_ins = {}
    for i, block in enumerate(dm.blocks):
        stand_ins[f"diffusion_model.blocks.{i}"] = BlockStandIn(block, compile_import.LazyCompile(block, kwargs))
    wmp = comfy_bridge.wrappers_mp()
    key = comfy_bridge.COMPILE_WRAPPER_KEY  # the key of ComfyUI's own compile: one compile per model
    m.remove_wrappers_with_key(wmp.APPLY_MODEL, key)
    m.add_wrapper_with_key(wmp.APPLY_MODEL, key, _wrapper(stand_ins))
    m.remove_wrappers_with_key(wmp.OUTER_SAMPLE, OUTER_KEY)
    m.add_wrapper_with_key(wmp.OUTER_SAMPLE, OUTER_KEY, outer_sample)
    m.remove_wrappers_with_key(wmp.CALC_COND_BATCH, cond_rows.KEY)
    m.add_wrapper_with_key(wmp.CALC_COND_BATCH, cond_rows.KEY, cond_rows.wrapper(type(dm.blocks[0])))
    m.model_options[comfy_bridge.COMPILE_KWARGS_KEY] = kwargs
    text = (f"{len(stand_ins)} blocks compiled one by one ({backend}"
            + ("" if mode == "default" else f", {mode}") + "); a block whose weights stream runs compiled with its "
            "layers' weights cast onto the GPU first, or eagerly where they cannot be. "
            "The Sage patch's panel says after a run whether compiling pays back over the prompt's steps.")
    return m, text if note is None else f"{text} {note}"


DYNAMIC_OFF = ("Dynamic VRAM is off for this model, as ComfyUI's own compile node turns it off: ComfyUI loaded it "
               "again for its legacy memory path, which places its weights (the estimator's reservation applies).")


def _clone_to_compile(model):
    """(clone, note) for the compile: a plain clone; where ComfyUI manages the model's residency itself (dynamic
    VRAM, on by default in newer ComfyUI), a clone without it, as ComfyUI's own ``TorchCompileModel`` makes one
    (``clone(disable_dynamic=True)``: ComfyUI loads the model again from its loader).  Dynamic VRAM casts each
    weight in at every call, which dynamo cannot trace as a weight.  (None, why) where that clone cannot be made:
    the model passes through uncompiled."""
    if not comfy_bridge.is_dynamic(model):
        return model.clone(), None
    cannot = ("not compiled: dynamic VRAM manages this model and its patcher cannot give a copy without it; start "
              "ComfyUI with --disable-dynamic-vram to compile it")
    try:
        params = inspect.signature(model.clone).parameters
    except (TypeError, ValueError):
        params = {}
    if "disable_dynamic" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None, cannot
    try:
        clone = model.clone(disable_dynamic=True)
    except (RuntimeError, TypeError) as e:  # no way registered to load the model again (cached_patcher_init)
        return None, (f"not compiled: dynamic VRAM manages this model and ComfyUI could not load it again without it "
                      f"({str(e).splitlines()[0][:160] if str(e) else type(e).__name__}); start ComfyUI with "
                      f"--disable-dynamic-vram to compile it")
    if comfy_bridge.is_dynamic(clone):  # a patcher that took the keyword and stayed dynamic
        return None, cannot
    return clone, DYNAMIC_OFF
