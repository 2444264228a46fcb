"""Keep ComfyUI's cond/uncond batching within the rows a compiled block has run, so no step traces a new batch.

ComfyUI runs cond and uncond in one forward where ``memory_required(rows) * 1.5 < free memory``
(``calc_cond_batch``), asked again at every step.  Where that is near the line the answer changes between steps:
the TI2V-5B template at 24 GiB ran its first step's cond and uncond apart and its second together, and every
compiled block, traced for one row, compiled again for two (the second step took 8.5 s against 1.7 s settled).

Wan Compile Blocks' ``CALC_COND_BATCH`` wrapper therefore answers a forward of more rows than the blocks have run
compiled as not fitting (:class:`RowsCap`), and ComfyUI splits it, as it does when memory is short.  Fewer rows are
never forced into one forward: that is ComfyUI's memory decision, and a split never needs more memory than a
batch.  The rows are counted per block class for the process (:func:`ran`): dynamo keeps one code cache per block
``forward``, shared by every block of both experts of Wan 2.2 A14B, so what one expert traced the other reuses.
Before any block has run compiled nothing is held: the first forward's rows are ComfyUI's.  So no later step or
prompt of the process compiles the blocks again for a batch; what a process that first ran cond and uncond apart
gives up is the batching itself, where a later prompt would have had the room for it.

A memory estimate swapped in by another wrapper keeps the cap (:func:`keep_cap`), whichever wrapper is outside.
"""
from __future__ import annotations

import logging

from . import comfy_bridge
from .log_once import warn_once

log = logging.getLogger("wan_sage")

KEY = "wan_sage_cond_rows"  # the node's CALC_COND_BATCH wrapper
_rows: dict = {}  # block class -> the most rows (input batch size) its compiled forward has run


def ran(block_type: type, rows: int) -> None:
    """A block of ``block_type`` ran compiled on an input of ``rows`` rows."""
    if rows > _rows.get(block_type, 0):
        _rows[block_type] = int(rows)


def rows_run(block_type: type) -> int | None:
    """The most rows a compiled ``block_type`` has run in this process; None before its first compiled call."""
    return _rows.get(block_type)


def forget() -> None:
    """Forget every count (a test's fresh process)."""
    _rows.clear()


class RowsCap:
    """``memory_required`` that answers an input of more than ``rows`` rows as not fitting and asks ``inner`` for
    the rest.  Immutable; deep copies are itself (it lives on the BaseModel for one ``calc_cond_batch`` call)."""

    __slots__ = ("inner", "rows")

    def __init__(self, inner, rows: int):
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "rows", int(rows))

    def __setattr__(self, name, value):
        raise AttributeError("RowsCap is immutable")

    def __deepcopy__(self, memo):
        return self

    def __call__(self, input_shape, *args, **kwargs):
        asked = int(input_shape[0])
        if asked > self.rows:
            warn_once(("cond-rows", self.rows, asked), "wan-sage: Wan Compile Blocks: cond and uncond run as "
                      "forwards of at most %d row(s), the batch the blocks were compiled for; one forward of %d rows "
                      "would compile every block again.", self.rows, asked, level=logging.INFO)
            return float("inf")
        return self.inner(input_shape, *args, **kwargs)


def keep_cap(base, fn):
    """``fn`` to set as ``base.memory_required`` with the cap in force on ``base`` kept: ``fn`` itself where none is."""
    current = base.__dict__.get("memory_required")
    return RowsCap(fn, current.rows) if isinstance(current, RowsCap) else fn


def wrapper(block_type: type):
    """The ``CALC_COND_BATCH`` wrapper for a model whose blocks of ``block_type`` run compiled: while ComfyUI decides
    the batching, ``memory_required`` refuses a forward of more rows than those blocks have run; restored in
    ``finally``."""
    def calc_cond_batch(executor, model, *args, **kwargs):
        rows = rows_run(block_type)
        if rows is None:
            return executor(model, *args, **kwargs)
        prev = comfy_bridge.swap_memory_required(model, RowsCap(model.memory_required, rows))
        try:
            return executor(model, *args, **kwargs)
        finally:
            comfy_bridge.restore_memory_required(model, prev)
    return calc_cond_batch
