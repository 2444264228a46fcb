"""The answer to an estimate request: the one path from a request to ``{"estimate", "summary", "text"}``, which the
server route (``POST /wan_sage/estimate``) returns and ``wan-sage plan`` prints (its table, or with ``--json`` the
whole answer).  :func:`.request.build` validates the request and makes its setup, :func:`.estimate.plan` estimates
it, and :mod:`.report` words it.  docs/route.md documents the fields."""
from __future__ import annotations

from collections.abc import Sequence

from . import report, request
from .estimate import plan

__all__ = ["estimate_answer"]


def estimate_answer(payload, env: request.Env | None = None, *, text: bool = False, labels: dict | None = None,
                    model_info=None, notes: Sequence[str] = (), gpu: str | None = None) -> dict:
    """The estimate of request ``payload`` (a dict of :data:`.request.FIELDS`), its summary and its report.

    ``env``: this machine's GPU and model folders (None: neither); ``text``/``labels``/``model_info`` as for
    :func:`.request.build` (the command line's strings, its flag names, a model file it read); ``notes``: the
    caller's facts about this machine, in the summary's notes and the report's; ``gpu``: the GPU's name where the
    VRAM figure is the card's.  A bad field raises :class:`.errors.RequestError` naming it."""
    built = request.build(payload, env or request.Env(), text=text, labels=labels, model_info=model_info)
    est = plan(built.setup)
    summary = report.summary(est, notes)
    summary["detected"] = built.detected
    summary["assumed"] = built.assumed
    if model_info is not None:
        summary["model_file"] = {"format": model_info.format, "ffn_dim": model_info.dims.ffn_dim,
                                 "weight_dtype": model_info.main_dtype, "weights_bytes": model_info.weights_bytes}
    return {"estimate": est.as_dict(), "summary": summary,
            "text": report.report(est, held=built.weights.held, gpu=gpu, notes=notes)}
