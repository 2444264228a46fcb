"""The reservation planned again between model calls, as the sampling shows how it runs.

A sampling's weights are placed once, when it starts, against the reservation the estimator can plan then.  Two
facts that lower it arrive only with the first model call:

* whether Wan Compile Blocks runs the streamed blocks compiled (:func:`.compile_blocks.streamed_path`).  Until a
  block of the model's kind has, the estimator plans the eager streamed forward (the eager floor), which holds
  more: the seed workflow's first prompt at 16 GiB on the H200 left 1.6 GiB of the budget unused while 23 % of the
  high-noise expert's weights streamed;
* how the Sage patch's dispatcher settles a shape's head groups: a shape's first, timed calls run ungrouped, and the
  grouped call it settles on needs less (:func:`.estimator.run_mode`).

and one raises it: a streamed block that ran eagerly brings the eager floor back.

The plan is an estimate, and for fp8 weights it keeps room for the allocator's holes around the per-call casts at
the largest they were measured (1.2-3.6 GiB at A14B 720p81, :mod:`..memory.estimate`'s cast term).  A sampling's
own calls show how large they are this time: PyTorch's pool keeps what a call reserved until it is emptied, so its
reserved bytes as the next call begins, less what was allocated as the call began, are what the call held, holes
included.  The reservation is the lesser of the plan and that figure with a margin (:func:`measured_reservation`),
read again after each move from the calls that ran with the weights where they now are.  A call whose allocation
the allocator had to retry, or that ran out of memory, is not read (it showed less than it needed), and from then
on the plan alone decides.  A call that runs out of memory where the weights stand for the measured figure, below
the plan, is run again once they stand for the plan (:func:`after_out_of_memory`, from the estimator's model-call
wrapper): the user's prompt pays one call, not the prompt.

The first call of a sampling runs before anything is read.  The most a sampling's calls held is kept for the next
sampling of the same setup (:mod:`.held_record`: Wan 2.2's low-noise expert after the high-noise one, the repeat
prompt, the next ComfyUI start), and that one places its weights for it with the same margin where it is below the
plan (:func:`starting_reservation`); its first call counts as lowered, so the same fallback stands.  A sampling whose
figure cannot be trusted removes its key's.

So before each model call after the first, the sampling is planned again through the same entry point as its
start (:func:`.estimator.sampling_plan`).  Where the reservation fell by at least ComfyUI's smallest partial load
(128 MiB) and part of the weights streams, the allocator's free blocks are handed back and the weights that the
room freed holds are loaded, as ComfyUI's ``load_models_gpu`` sizes a partial load (free memory less the
reservation and what ComfyUI keeps free), through the patcher's own ``partially_load``.  Where it rose past the
free memory, weights are unloaded to it first (``partially_unload``), so the next call has what the plan says it
needs.  Nothing else changes: the next step runs the weights where they now are, as a later sampling would.  A
whole-model compile (ComfyUI's TorchCompileModel) is left alone: its one graph would compile again for weights moved.

ComfyUI's partial load picks modules greedily, largest first, against its budget, and a larger budget does not
always pick a superset: with more of the largest modules loaded, a smaller module that filled the gap before no
longer fits, and the load sets it to stream where it lies, still on the device.  ComfyUI then counts it off the
loaded bytes, and where a LoRA was merged into its weights at the first load, applies the LoRA again at each call
(``LowVramPatch``, or ComfyUI-GGUF's forced patch of an unquantized tensor).  So a lowered plan loads with a
budget within the room for which ComfyUI's load keeps every module on the device where it is (:func:`safe_budget`,
which follows ``ModelPatcher.load``'s choice, 0.3.64's or 0.38's with its offload buffer), and only where the
patcher's load list has one of those forms; after the load, a module set to stream on the device all the same
places the model again for the larger plan.

Only on the legacy memory path (ComfyUI 0.3.64, GGUF, ``--disable-dynamic-vram``), where the estimator places the
weights, only where ComfyUI places a model in part (its normal and low VRAM states, a load device that is neither
the CPU nor the offload device), and only for a patcher that moves its weights with ComfyUI's own methods; a
dynamic-VRAM model's residency is ComfyUI's.  A load that fails (ComfyUI detaches the model), a load that set a
module on the device to stream, and an unload that fails (ComfyUI's ``partially_unload`` stops midway without
counting what it moved) place the model again as ComfyUI's own load would for the larger of the two plans, and
where that load fails too, with every module that can stream streaming.  One warning is logged, and after it only
a rise of the plan moves weights in that sampling; a cancel goes on up.
"""
from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

from . import comfy_bridge, held_record
from .log_once import reason, warn_once

log = logging.getLogger("wan_sage")

MIN_MOVE_BYTES = 128 << 20  # ComfyUI's smallest partial load (load_models_gpu's lowvram_model_memory floor)
GiB = float(1 << 30)
# What the measured figure keeps on top of the most a call was seen to hold: a call that lays the pool out
# differently from the one read.  The holes form again after each move and can come out larger than the first
# call's (docs/attention.md, "The re-plan between model calls"); a call that then needs more raises the plan again.
MEASURED_MARGIN = 0.05
MEASURED_FLOOR = 256 << 20


@dataclass
class _Sampling:
    """One sampling's reservation in force, and how to plan it again."""

    patcher: weakref.ref
    shape: tuple  # the noise shape the sampling's load was planned for
    plan: object  # (patcher, shape) -> the reservation in bytes, as the sampling's start planned it
    reservation: int
    moves: list = field(default_factory=list)  # (call index, reservation before, after, bytes loaded (-unloaded))
    calls: int = 0
    failed: bool = False  # a move failed: the weights stay where they were placed again
    start: tuple | None = None  # the pool as the last model call began (:func:`_pool`), None where unread
    held: int = 0  # the most a model call held above what was allocated as it began, since the last move
    measured: bool = True  # False once a call's figure cannot be read or trusted: the plan alone from then on
    lowered: bool = False  # the weights stand where the measured figure, below the plan, placed them
    key: str | None = None  # the key the most its calls held is kept under for the next sampling (.held_record)
    most: int = 0  # the most a call of this sampling held, over all its moves


_lock = threading.Lock()
_samplings: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # BaseModel -> _Sampling


def tracks(patcher) -> bool:
    """Whether a sampling of ``patcher`` is planned again between its model calls: a model whose weights ComfyUI
    places in part and that moves them with ComfyUI's own methods; a dynamic-VRAM model is left to ComfyUI."""
    return (getattr(patcher, "model", None) is not None and not comfy_bridge.is_dynamic(patcher)
            and _comfy_moves(patcher) and _placed_in_part(patcher))


def starting_reservation(keys, planned: int) -> int:
    """The reservation a sampling places its weights for: the lesser of its plan, ``planned`` bytes, and what the
    latest sampling of the first of ``keys`` that has a figure held, with the margin (:mod:`.held_record`; its own
    key first, then one whose figure bounds it).  No keys, or no figure: the plan."""
    for key in keys or ():
        found = held_record.recorded(key)
        if found is not None:
            return min(int(planned), measured_reservation(found))
    return int(planned)


def begin(patcher, shape, plan, reservation: int, key: str | None = None, planned: int | None = None) -> None:
    """Note the sampling of ``patcher`` that just placed its weights for ``shape`` against ``reservation`` bytes;
    ``plan(patcher, shape)`` plans it again.  ``key``: what its calls hold is kept under it for the next sampling;
    ``planned``: the plan, where ``reservation`` is below it (:func:`starting_reservation`)."""
    if not tracks(patcher):
        return
    s = _Sampling(weakref.ref(patcher), tuple(int(x) for x in shape), plan, int(reservation), key=key,
                  lowered=planned is not None and int(reservation) < int(planned))
    with _lock:
        _samplings[patcher.model] = s


def _comfy_moves(patcher) -> bool:
    """Whether ``patcher`` loads and unloads in part with ComfyUI's own ``ModelPatcher`` methods (ComfyUI-GGUF's
    patcher keeps them).  A patcher that replaces them (another pack's multi-GPU or sharded one) places its weights
    its own way, and is not moved between calls."""
    try:
        from comfy.model_patcher import ModelPatcher
    except ImportError:
        return False
    t = type(patcher)
    return (getattr(t, "partially_load", None) is ModelPatcher.partially_load
            and getattr(t, "partially_unload", None) is ModelPatcher.partially_unload)


def _placed_in_part(patcher) -> bool:
    """Whether ComfyUI's ``load_models_gpu`` places ``patcher``'s weights in part: its normal and low VRAM states
    (``--highvram``, ``--gpu-only`` and ``--novram`` load whole or nothing), a load device that is not the CPU, and
    an offload device that is not the load device."""
    try:
        import comfy.model_management as mm
        load, offload = torch.device(patcher.load_device), torch.device(patcher.offload_device)
        return (bool(mm.lowvram_available) and mm.vram_state in (mm.VRAMState.LOW_VRAM, mm.VRAMState.NORMAL_VRAM)
                and load.type != "cpu" and load != offload)
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return False


def _get(base) -> _Sampling | None:
    with _lock:
        try:
            return _samplings.get(base)
        except TypeError:  # an object that takes no weak reference began no sampling here
            return None


def end(base) -> None:
    """Forget ``base``'s sampling: a new one begins (its estimate may fail and leave ComfyUI's own)."""
    with _lock:
        try:
            _samplings.pop(base, None)
        except TypeError:
            pass


def moves(base) -> list:
    """The moves of ``base``'s current or last sampling: (call, reservation before, after, bytes loaded)."""
    s = _get(base)
    return list(s.moves) if s is not None else []


def before_call(base) -> int:
    """Plan ``base``'s sampling again before a model call and move weights to the new reservation; returns the
    bytes loaded (negative: unloaded), 0 where nothing moved."""
    s = _get(base)
    if s is None:
        return 0
    s.calls += 1
    patcher = s.patcher()
    if patcher is None or getattr(base, "current_patcher", patcher) is not patcher:
        s.start = None  # this call is not the sampling's: the next one is not read against it
        return 0
    dev = comfy_bridge.device_of(patcher)
    if s.calls > 1:
        _note_held(s, dev)
    moved = 0 if s.calls == 1 else _replan(s, patcher, base)
    s.start = _pool(dev)
    return moved


def _plan(s: _Sampling, patcher) -> int | None:
    """The sampling's plan now, or None (logged once) where planning fails: the weights stay where they are."""
    try:
        return int(s.plan(patcher, s.shape))
    except Exception as e:
        warn_once(("replan", type(e).__name__), "wan-sage: planning the reservation again between steps failed "
                  "(%s); the weights stay where the sampling's start placed them.", reason(e))
        return None


def _replan(s: _Sampling, patcher, base) -> int:
    planned = _plan(s, patcher)
    if planned is None:
        return 0
    shown = measured_reservation(s.held) if s.measured and s.held > 0 else None
    new = planned if shown is None else min(planned, shown)
    old = s.reservation
    if abs(new - old) < MIN_MOVE_BYTES or (s.failed and new < old):  # after a failed move only a rise moves
        return 0
    moved = _apply(s, patcher, base, new)
    s.lowered = s.reservation < planned
    if moved:
        s.held = 0  # what the calls hold is read again with the weights where they now are
        log.info("wan-sage: reservation %.2f -> %.2f GiB after %d model call(s)%s: %s %.2f GiB of weights",
                 old / GiB, s.reservation / GiB, s.calls - 1,
                 " (from what they held)" if s.lowered else "", "loaded" if moved > 0 else "unloaded",
                 abs(moved) / GiB)
    return moved


def _apply(s: _Sampling, patcher, base, new: int) -> int:
    """Move the weights from ``s.reservation`` to ``new`` and note the move; returns the bytes loaded."""
    old = s.reservation
    try:
        moved, failed = _move(patcher, base, new, old)
    except Exception as e:
        unplaced = int(patcher.loaded_size()) == 0 and not getattr(base, "model_lowvram", False)
        if comfy_bridge.user_cancel(e) or unplaced:
            raise  # a cancel, or a model that could not be placed again at all: ComfyUI reports it
        warn_once(("replan-move", type(e).__name__), "wan-sage: moving weights between steps failed (%s); nothing "
                  "more moves in this sampling unless its plan rises.", reason(e))
        moved, failed = 0, True
    if failed:  # placed for the larger of the two plans; from here on only a rise moves weights
        s.failed = True
        s.reservation = max(old, new)
    else:
        s.reservation = new
    s.moves.append((s.calls, old, new, moved))
    return moved


def measured_reservation(held: int) -> int:
    """The reservation for what model calls were seen to hold above their start: that figure and a margin for a
    call that holds a little more than the ones read (``MEASURED_MARGIN`` of it, at least ``MEASURED_FLOOR``)."""
    return int(held) + max(MEASURED_FLOOR, int(held * MEASURED_MARGIN))


def _pool(dev) -> tuple | None:
    """(allocated, reserved, allocator retries, out-of-memory errors) of PyTorch's CUDA pool on ``dev``, or None
    off CUDA or where it cannot be read."""
    try:
        d = torch.device(dev)
        if d.type != "cuda" or not torch.cuda.is_available():
            return None
        stats = torch.cuda.memory_stats(d)
        return (int(torch.cuda.memory_allocated(d)), int(torch.cuda.memory_reserved(d)),
                int(stats.get("num_alloc_retries", 0)), int(stats.get("num_ooms", 0)))
    except Exception:  # an allocator that reports nothing: the plan alone decides
        return None


def _note_held(s: _Sampling, dev) -> None:
    """Read what the call that just ended held: the pool's reserved bytes now less what was allocated as it
    began.  The pool keeps what a call reserved until it is emptied, and nothing empties it during a call, so this
    covers the call's peak and its holes.  A call the allocator had to retry (it emptied its cache to satisfy an
    allocation) or that ran out of memory shows less than it needed: the measured figure is dropped for the rest of
    the sampling, as it is where the pool cannot be read.  A call whose start was not read (one made for another
    patcher came between) is not read."""
    now, start, s.start = _pool(dev), s.start, None
    if now is None or (start is not None and now[2:] != start[2:]):
        _distrust(s)
    elif start is not None:
        s.held = max(s.held, now[1] - start[0])
        if s.measured and s.held > s.most:
            s.most = s.held
            if s.key is not None:
                held_record.keep(s.key, s.most)


def _distrust(s: _Sampling) -> None:
    """Drop the measured figure for the rest of ``s``, and the kept one of its key for the samplings after it."""
    s.measured = False
    if s.key is not None:
        held_record.keep(s.key, None)


def lowered_by_measure(base) -> bool:
    """Whether ``base``'s sampling runs with its weights placed for a measured figure below its plan."""
    s = _get(base)
    return s is not None and s.lowered


def after_out_of_memory(base, what: str) -> bool:
    """A model call ran out of memory with the weights placed for the measured figure: drop that figure for the
    rest of the sampling and place the weights for the plan alone, so that the call can run again.  True where
    they moved (or stood there already) and the call may be run again."""
    s = _get(base)
    patcher = s.patcher() if s is not None else None
    if s is None or not s.lowered or patcher is None:
        return False
    _distrust(s)
    s.lowered = False
    warn_once(("replan-oom",), "wan-sage: a model call ran out of memory with the weights placed for what the "
              "earlier calls held (%s); they are placed for the estimate again and the call runs again.", what)
    planned = _plan(s, patcher)
    if planned is None:
        return False
    if planned > s.reservation:
        _apply(s, patcher, base, planned)  # its move hands the failed call's cached blocks back first
    else:
        comfy_bridge.trim_allocator(comfy_bridge.device_of(patcher), "after running out of memory")
    return True


def _needed(reservation: int) -> int:
    """What a load leaves free for a sampling whose reservation is ``reservation``, as ``load_models_gpu`` does."""
    import comfy.model_management as mm
    return max(int(mm.minimum_inference_memory()), reservation + comfy_bridge.extra_reserved())


def _budget(patcher, dev, reservation: int) -> int:
    """The bytes of ``patcher``'s weights ``load_models_gpu`` would have on the device for ``reservation`` now: its
    ``lowvram_model_memory``, from the free memory and what the model holds."""
    import comfy.model_management as mm
    free = comfy_bridge.free_memory(dev) + int(patcher.loaded_size())
    ratio = float(getattr(mm, "MIN_WEIGHT_MEMORY_RATIO", 0.0))
    return int(max(MIN_MOVE_BYTES, free - _needed(reservation),
                   min(free * ratio, free - mm.minimum_inference_memory())))


def _on_device(module) -> bool:
    """Whether ComfyUI's load left ``module``'s weights on the device: a module that casts per call
    (``comfy_cast_weights``) and was loaded whole (``comfy_patched_weights``, which a partial unload clears) or is
    not set to stream (``prev_comfy_cast_weights``; a patcher that forces casting sets it on every module)."""
    return hasattr(module, "comfy_cast_weights") and (getattr(module, "comfy_patched_weights", False) is True
                                                      or not hasattr(module, "prev_comfy_cast_weights"))


def load_order(patcher) -> list | None:
    """``patcher``'s modules as ComfyUI's ``ModelPatcher.load`` goes through them, [(bytes, module, room)], or None
    where its ``_load_list`` has neither form below.

    ComfyUI 0.3.64's entries are (bytes, name, module, parameter names), sorted by size then name, and a module fits
    where its bytes do: ``room`` is 0.  Newer ComfyUI's (0.38) are (offload bytes, bytes, name, module, parameters),
    sorted by offload bytes, size then name, and a module fits only with room beside it for the streamed modules'
    offload buffer: its offload bytes and the bytes of the ``NUM_STREAMS`` modules after it, which is ``room``."""
    try:
        items = list(patcher._load_list())
    except Exception:  # no _load_list, or one that fails: a load this cannot follow
        return None
    if all(isinstance(x, tuple) and len(x) == 4 and isinstance(x[0], int) and isinstance(x[1], str) for x in items):
        items.sort(key=lambda x: (x[0], x[1]), reverse=True)  # load's own sort, by size then name
        return [(x[0], x[2], 0) for x in items]
    if all(isinstance(x, tuple) and len(x) == 5 and isinstance(x[0], (int, float)) and isinstance(x[1], int)
           and isinstance(x[2], str) for x in items):
        import comfy.model_management as mm
        streams = int(getattr(mm, "NUM_STREAMS", 0))
        items.sort(key=lambda x: (x[0], x[1], x[2]), reverse=True)
        return [(x[1], x[3], int(x[0]) + sum(y[1] for y in items[i + 1:i + 1 + streams]))
                for i, x in enumerate(items)]
    return None


def safe_budget(order, budget: int, least: int) -> int | None:
    """A budget up to ``budget`` for which ComfyUI's partial load keeps every module on the device where it is and
    loads at least ``least`` bytes more, or None where the search below finds none.

    ``ModelPatcher.load`` goes through ``order`` (:func:`load_order`) with a counter and, where the load keeps an
    offload buffer, the largest room a module that did not fit asked for: a module fits where the counter, its
    bytes and the larger of that buffer and its own room stay under the budget.  One that casts per call and does
    not fit streams (one already streaming is left as it is), every other one that fits is counted and loaded.
    Where a module on the device would stream, the last streaming module loaded before it is left out (the budget
    stops where it no longer fits), and the load is followed again."""
    while True:
        counter, buffer, added, last_new, kept = 0, 0, 0, None, True
        for size, m, room in order:
            cast, need = hasattr(m, "comfy_cast_weights"), max(buffer, room)
            if counter + size + need >= budget:
                buffer = need
                if cast and _on_device(m):
                    kept = False
                    break
                continue
            if cast and not _on_device(m):
                last_new, added = counter + size + need, added + size
            counter += size
        if kept:
            return budget if added >= least else None
        if last_new is None:
            return None
        budget = last_new


def _move(patcher, base, reservation: int, before_reservation: int) -> tuple[int, bool]:
    """Move ``patcher``'s weights from ``before_reservation`` to ``reservation``: (bytes moved onto the device,
    negative where unloaded; whether the move failed)."""
    lowered = reservation < before_reservation
    dev = comfy_bridge.device_of(patcher)
    if lowered and not getattr(base, "model_lowvram", False):
        return 0, False  # every weight resident already
    comfy_bridge.trim_allocator(dev, "before moving weights between steps")
    before = int(patcher.loaded_size())
    target = _budget(patcher, dev, reservation)
    order = None
    if lowered:
        if getattr(base, "current_weight_patches_uuid", None) != getattr(patcher, "patches_uuid", None):
            return 0, False  # patches changed since the load: partially_load would unpatch and load it afresh
        order = load_order(patcher) if target - before >= MIN_MOVE_BYTES else None
        target = safe_budget(order, target, MIN_MOVE_BYTES) if order is not None else None
        if target is None:
            return 0, False
    elif target >= before:
        return 0, False
    # the modules on the device that are not marked streaming, whose mark after the load says it set them to stream
    kept = [m for _, m, _ in order or ()
            if hasattr(m, "comfy_cast_weights") and not hasattr(m, "prev_comfy_cast_weights")]
    failed = None
    try:
        if lowered:
            patcher.partially_load(dev, target - before)
        else:
            patcher.partially_unload(patcher.offload_device, before - target)
    except Exception as e:
        if comfy_bridge.user_cancel(e):
            raise
        failed = reason(e)
    streamed = 0 if failed is not None else sum(1 for m in kept if hasattr(m, "prev_comfy_cast_weights"))
    if failed is not None or streamed:  # out of the except block: the failed move's temporaries are gone
        what = failed if failed is not None else f"{streamed} module(s) on the device were set to stream"
        warn_once(("replan-move", what.partition(":")[0]), "wan-sage: %s weights between steps failed (%s); the "
                  "model is loaded again for the larger plan, and nothing more moves in this sampling unless its "
                  "plan rises", "loading" if lowered else "unloading", what)
        if not (lowered and failed is not None and int(patcher.loaded_size()) == 0):
            # a load that set modules on the device to stream, or an unload that stopped midway: ComfyUI's
            # partially_unload marks each module it moved as streaming but counts none of them and leaves
            # model_lowvram unset, so ComfyUI's detach would leave their per-call patches behind.  Marked, the
            # detach takes every module's off.
            base.model_lowvram = True
            patcher.detach()
        _reload(patcher, dev, max(reservation, before_reservation))
    comfy_bridge.trim_allocator(dev, "after moving weights between steps")
    return int(patcher.loaded_size()) - before, failed is not None or bool(streamed)


def _reload(patcher, dev, reservation: int) -> None:
    """Load ``patcher``'s weights again, as ``load_models_gpu`` places a model for ``reservation`` (ComfyUI's
    ``partially_load`` detaches the model when it fails), without freeing the sampling's other models.  Where that
    load fails too, the model is placed with the least of its weights on the device that ComfyUI loads (every
    module that can stream streams), so that the sampling can go on; a failure of that one goes on up."""
    for budget in (max(MIN_MOVE_BYTES, _budget(patcher, dev, reservation)), 0):
        patcher.model_patches_to(dev)
        patcher.model_patches_to(patcher.model_dtype())
        try:
            patcher.partially_load(dev, budget)
            return
        except Exception as e:
            if comfy_bridge.user_cancel(e) or budget == 0:
                raise
            warn_once(("replan-reload", type(e).__name__), "wan-sage: loading the model again after a failed move "
                      "failed (%s); it streams every weight it can for the rest of this sampling.", reason(e))
            comfy_bridge.trim_allocator(dev, "before streaming every weight")
