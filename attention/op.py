"""The custom op ``wan_sage::attention``: under ``torch.compile`` every statically eligible
attention call is one node of the graph, and everything decided at run time (device and kernel
resolution, self-test, timing cache, calibration, the VRAM check, head split, the kernel, every
fallback, the stats) happens inside it, in :func:`.execution.run_attention`.

Its arguments are tensors, ints, bools, a float and the patch id; the implementation finds the
patch's override in the registry of live patches (:attr:`.state.DispatchState.patches`, filled
when an override is made or unpickled).  The fake implementation returns the output's shape:
``[B, N, H*D]``, or ``[B, H, N, D]`` with ``skip_output_reshape``, contiguous, in q's dtype; the
real one returns exactly that layout.  The op is tagged ``cudagraph_unsafe`` where torch has the
tag, so CUDA-graph modes leave it outside their graphs (its decisions and checks run on the host).

On a torch without ``torch.library.custom_op`` (< 2.4), :func:`call_attention` runs the same
implementation wrapped in ``torch.compiler.disable`` instead (one graph break per call).

A second op, ``wan_sage::attention_into_q``, mutates q: a call site whose q is dead after the call (a
self-attention call whose q was handed over, :meth:`.override.SageAttentionOverride.container_function`)
gets its output in q.  Inductor reinplaces the mutation on q's own buffer, so the compiled call allocates no
output, as the eager write-into-q path does.

Each copy of the package in a process registers its own op: the first is
``wan_sage::attention``; another copy (ComfyUI loading the pack while a test or tool imports it
as ``wan_sage``) gets ``wan_sage::attention_<its module name>``.
"""
import inspect
import logging
import re

import torch

from . import execution, policy
from .sdpa import attention_sdpa
from .state import STATE

__all__ = ["call_attention", "call_attention_into_q", "run_registered", "run_registered_into_q", "OP_NAME", "SCHEMA",
           "INTO_Q_OP", "INTO_Q_SCHEMA"]

log = logging.getLogger("wan_sage")

NAMESPACE = "wan_sage"
SCHEMA = ("(Tensor q, Tensor k, Tensor v, int heads, bool skip_reshape, bool skip_output_reshape, float? scale, "
          "str graph_key) -> Tensor")


def run_registered(q, k, v, heads, skip_reshape, skip_output_reshape, scale, graph_key):
    """The op's implementation: the call run by the override that ``graph_key`` names now
    (``DispatchState.override_for``: the patch of the model being sampled)."""
    override = STATE.override_for(graph_key)
    if override is None:  # the patches were garbage-collected while a compiled graph still names them
        if STATE.log_once(("unknown_patch", graph_key)):
            log.warning("wan-sage: attention patch %s is gone; its compiled calls run on SDPA.", graph_key)
        return attention_sdpa(q, k, v, heads, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                              **({} if scale is None else {"scale": scale})).contiguous()
    return execution.run_attention(override, q, k, v, heads, skip_reshape, skip_output_reshape, scale)


def _fake(q, k, v, heads, skip_reshape, skip_output_reshape, scale, graph_key):
    B = q.shape[0]
    if skip_reshape:
        H, Nq, D = q.shape[1], q.shape[2], q.shape[3]
    else:
        H, Nq, D = heads, q.shape[1], q.shape[2] // heads
    return q.new_empty((B, H, Nq, D) if skip_output_reshape else (B, Nq, H * D))


def _op_name() -> str:
    package = __name__.rsplit(".attention.op", 1)[0]
    if not hasattr(getattr(torch.ops, NAMESPACE), "attention"):
        return "attention"
    return "attention_" + re.sub(r"\W", "_", package)


def _register(name: str, impl, fake, schema: str, mutates_args: tuple, instead: str):
    """``impl`` registered as the custom op ``wan_sage::<name>`` with ``fake`` for tracing, tagged
    ``cudagraph_unsafe`` where torch has the tag; None (logged, with what happens ``instead``) on a torch
    without ``torch.library.custom_op`` or whose custom-op API differs."""
    custom_op = getattr(getattr(torch, "library", None), "custom_op", None)
    if custom_op is None:
        return None
    options = {"mutates_args": mutates_args, "schema": schema}
    unsafe = getattr(getattr(torch, "Tag", None), "cudagraph_unsafe", None)
    if unsafe is not None and "tags" in inspect.signature(custom_op).parameters:
        options["tags"] = (unsafe,)
    try:
        definition = custom_op(f"{NAMESPACE}::{name}", impl, **options)
        definition.register_fake(fake)
        return getattr(getattr(torch.ops, NAMESPACE), name)
    except (RuntimeError, TypeError, ValueError) as e:  # a torch whose custom-op API differs
        log.warning("wan-sage: could not register the %s::%s custom op (%s: %s); %s", NAMESPACE, name,
                    type(e).__name__, e, instead)
        return None


def _define():
    name = _op_name()
    registered = _register(name, run_registered, _fake, SCHEMA, (),
                           "under torch.compile each Sage call is kept out of the graph instead.")
    return (registered, name) if registered is not None else (None, None)


OP, OP_NAME = _define()
_RUN_UNTRACED = torch.compiler.disable(run_registered) if OP is None else None


# ---------------------------------------------------------------- the write-into-q op
INTO_Q_SCHEMA = "(Tensor(a!) q, Tensor k, Tensor v, int heads, float? scale, str graph_key) -> ()"


def run_registered_into_q(q, k, v, heads, scale, graph_key):
    """The write-into-q op's implementation: the self-attention call of a call site whose q is dead after
    it (q, k, v ``[B, N, H*D]``), its output left in q.  The call shape is marked ``into_q``, so a kernel with a
    write-into-q path writes the output into q head group by head group (:func:`.execution._run_into_q`);
    any other outcome (SDPA, another kernel, a fallback) is copied into q, holding what that call holds."""
    override = STATE.override_for(graph_key)
    if override is None:
        out = run_registered(q, k, v, heads, False, False, scale, graph_key)
    else:
        shape = policy.call_shape(q, k, heads, False, False)._replace(into_q=True)
        out = execution.run_attention(override, q, k, v, heads, False, False, scale, shape)
    if out.data_ptr() != q.data_ptr():
        q.copy_(out)


def _define_into_q():
    if OP is None:
        return None
    return _register(OP_NAME + "_into_q", run_registered_into_q, lambda q, k, v, heads, scale, graph_key: None,
                     INTO_Q_SCHEMA, ("q",), "compiled Sage calls return a new output instead of writing it into q.")


# Under torch.compile a mutating op on a tensor that nothing reads afterwards is reinplaced by inductor: the
# op writes into q's own buffer, so the compiled call allocates no output either.  None where the op could
# not be registered (then call sites take the ordinary op).
INTO_Q_OP = _define_into_q()


def call_attention(q, k, v, heads: int, skip_reshape: bool, skip_output_reshape: bool, scale, graph_key: str):
    """What the override calls while being compiled: the registered op, one node in the graph."""
    if OP is not None:
        return OP(q, k, v, heads, skip_reshape, skip_output_reshape, scale, graph_key)
    return _RUN_UNTRACED(q, k, v, heads, skip_reshape, skip_output_reshape, scale, graph_key)


def call_attention_into_q(q, k, v, heads: int, scale, graph_key: str) -> None:
    """What a call site whose q is dead after the call calls while being compiled (only where
    :data:`INTO_Q_OP` is registered): the write-into-q op, one node in the graph; the output is then q."""
    INTO_Q_OP(q, k, v, heads, scale, graph_key)
