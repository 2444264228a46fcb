"""torch.compile in the benchmark harness: per-block compile through ComfyUI's own wrapper, and a
watch on what dynamo did between two readings (graph breaks and their reasons, graphs, frames
compiled, recompiles and their reasons, compile seconds)."""
from __future__ import annotations

import logging
import re

from ._paths import machine_free

# Per-block compile nodes commonly raise dynamo's recompile limit to 64 (the default 8 can be hit when
# each block or each graph-break resume needs its own entry); the harness raises it alike.
BLOCK_RECOMPILE_LIMIT = 64


def block_keys(patcher) -> list[str]:
    """ComfyUI's compile keys of every transformer block of a Wan model: ``diffusion_model.blocks.N``."""
    return [f"diffusion_model.blocks.{i}" for i in range(len(patcher.model.diffusion_model.blocks))]


def compile_blocks(patcher, backend: str = "inductor", fullgraph: bool = False, dynamic=None) -> dict:
    """Compile each transformer block on its own, as users usually compile Wan: ComfyUI's
    ``set_torch_compile_wrapper`` with one key per block (an APPLY_MODEL wrapper that swaps the
    compiled blocks in for the call).  Returns the settings, for the record."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    keys = block_keys(patcher)
    set_torch_compile_wrapper(patcher, backend, fullgraph=fullgraph, dynamic=dynamic, keys=keys)
    return {"how": "per block (set_torch_compile_wrapper, keys diffusion_model.blocks.N)", "blocks": len(keys),
            "backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}


def set_recompile_limit(torch, limit: int | None) -> int:
    """Set dynamo's recompile limit (``cache_size_limit`` before torch 2.6) when ``limit`` is given;
    returns the limit in force."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if limit is not None:
        setattr(config, name, limit)
    return getattr(config, name)


# A guard on ComfyUI's LowVramPatch by its weight key: the cache entry was compiled for another block
# (each block whose streamed modules carry a LoRA has a graph of its own), so its failure says nothing
# about why this block's own graph, if one exists, did not match.
_ANOTHER_BLOCKS_KEY = re.compile(r"\.key == '[^']*\bblocks\.\d+\.")


_ENTRY = re.compile(r"^- (\d+/\d+: .*)")


def _failures(message: str) -> list[str]:
    """The guard failures one ``recompiles`` record lists, one per cache entry of the frame (``- 0/3:
    guard``); the user stack under each (its lines are also prefixed "- ") is left out."""
    found = (_ENTRY.match(x.strip()) for x in message.splitlines())
    return [m.group(1) for m in found if m]


def fold_guard(failure: str) -> str:
    """A guard failure with its entry number, source comment, block number and list indices left out,
    so that the same guard on different blocks counts as one."""
    text = re.sub(r"^\d+/\d+: ", "", failure).split("  # ")[0]
    text = re.sub(r"\bblocks\.\d+\.", "blocks.N.", text)
    return machine_free(re.sub(r"\[\d+\]", "[i]", text))[:200]


def _short(text: str, n: int = 200) -> str:
    """The first two lines of a dynamo message (the reason and its explanation), on one line."""
    lines = [x.strip() for x in machine_free(text).splitlines() if x.strip()]
    return " | ".join(lines[:2])[:n]


class DynamoWatch:
    """What dynamo did since :meth:`reset`: read :meth:`reading` before and after a stretch of work and
    subtract (:meth:`delta`).  Recompiles are counted from dynamo's own ``recompiles`` log records (one
    per recompiled frame, with the guard that failed), which :meth:`__init__` switches on."""

    def __init__(self, torch):
        self.torch = torch
        from torch._dynamo.utils import counters
        self.counters = counters
        self.recompiles: list[str] = []
        self._compile_s0 = 0.0
        watch = self

        class _Recompiles(logging.Handler):
            def emit(self, record):
                if record.name.endswith("__recompiles"):
                    watch.recompiles.append(record.getMessage())
        self.handler = _Recompiles(level=logging.DEBUG)
        try:
            torch._logging.set_logs(recompiles=True)
        except Exception:        # an older torch without the artifact: recompiles stay uncounted
            pass
        logging.getLogger("torch._dynamo").addHandler(self.handler)

    def close(self):
        logging.getLogger("torch._dynamo").removeHandler(self.handler)

    def reset(self):
        """Forget every compiled graph (a fresh process's state) and every count."""
        self.torch._dynamo.reset()
        self.counters.clear()
        self.recompiles.clear()
        self._compile_s0 = self.compile_seconds_total() or 0.0

    def compile_seconds_total(self) -> float | None:
        """Dynamo's own cumulative compile time (its ``_compile.compile_inner`` timer, backend included)."""
        try:
            from torch._dynamo.utils import compile_times
            names, values = compile_times(repr="csv", aggregate=True)
        except Exception:        # a torch without these timers
            return None
        return float(values[names.index("_compile.compile_inner")]) if "_compile.compile_inner" in names else 0.0

    def frames(self) -> int:
        """Frames dynamo has tried to compile (``fullgraph=True`` compiles do not count here)."""
        return int(self.counters["frames"]["total"])

    def graphs(self) -> int:
        """Graphs dynamo has handed to the backend."""
        return int(self.counters["stats"]["unique_graphs"])

    def phases(self) -> dict:
        """Where compiling went: dynamo's and inductor's cumulative seconds per timed function
        (``compile_times``, ``s:`` keys) and the compile caches' hits and misses (``n:`` keys: the FX graph cache's
        and AOTAutograd's counters), to tell tracing from compiling from loading a cached graph."""
        out: dict = {}
        try:
            from torch._dynamo.utils import compile_times
            names, values = compile_times(repr="csv", aggregate=True)
            out.update({f"s:{n}": float(v) for n, v in zip(names, values)})
        except Exception:        # a torch without these timers
            pass
        for group in ("inductor", "aot_autograd"):
            for name, n in self.counters[group].items():
                if "cache" in name:
                    out[f"n:{group}.{name}"] = float(n)
        return out

    def reading(self) -> dict:
        total = self.compile_seconds_total()
        return {"graph_breaks": int(sum(self.counters["graph_break"].values())),
                "unique_graphs": self.graphs(),
                "frames": self.frames(), "recompiles": len(self.recompiles),
                "compile_s": None if total is None else round(total - self._compile_s0, 3),
                "phases": self.phases()}

    @staticmethod
    def delta(after: dict, before: dict) -> dict:
        """``after`` minus ``before`` per key; a dict of counts or seconds per key of its own, the keys that
        changed only."""
        out: dict = {}
        for k, a in after.items():
            b = before.get(k)
            if isinstance(a, dict):
                d = {n: round(v - (b or {}).get(n, 0.0), 3) for n, v in a.items()}
                out[k] = {n: v for n, v in d.items() if v}
            else:
                out[k] = None if a is None or b is None else round(a - b, 3)
        return out

    def break_reasons(self, n: int = 10) -> dict:
        """The most frequent graph-break reasons (first line and explanation) with their counts."""
        out: dict = {}
        for key, count in self.counters["graph_break"].items():
            k = _short(key)
            out[k] = out.get(k, 0) + count
        return dict(sorted(out.items(), key=lambda kv: -kv[1])[:n])

    def mark(self) -> int:
        """How many recompiles have been seen: a boundary for :meth:`guard_causes`."""
        return len(self.recompiles)

    def guard_causes(self, start: int = 0, end: int | None = None, n: int = 12) -> dict:
        """{folded guard failure: recompiles it was part of} over the recompiles ``start:end``, leaving out
        the entries compiled for another block (:data:`_ANOTHER_BLOCKS_KEY`): what remains is why a block's
        own entry, made by an earlier expert or step, did not match.  A recompile whose every entry
        belongs to another block (the block's first compile) counts under "first graph of this block"."""
        counts: dict = {}
        for message in self.recompiles[start:end]:
            causes = {fold_guard(f) for f in _failures(message) if not _ANOTHER_BLOCKS_KEY.search(f)}
            for cause in causes or {"first graph of this block"}:
                counts[cause] = counts.get(cause, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n])

    def recompile_reasons(self, n: int = 8, start: int = 0) -> list[str]:
        """The distinct guard failures that caused recompiles (the first one named in each record), from the
        recompile ``start`` on (a :meth:`mark`)."""
        out = []
        for msg in self.recompiles[start:]:
            lines = [x.strip() for x in msg.splitlines()]
            fails = _failures(msg)
            text = _short(lines[0] + (": " + fails[0] if fails else ""), 240)
            if text not in out:
                out.append(text)
        return out[:n]
