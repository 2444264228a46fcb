"""wan-sage's command line: "wan-sage plan" estimates the working memory of a Wan denoise (no GPU, ComfyUI or
torch needed); "wan-sage bench" times SageAttention kernels against PyTorch SDPA on Wan's attention shapes on
this GPU and fills the kernel timing cache the Sage patch reads.

plan           the plan command: its flags, the estimate request they make, the printed report
bench          the bench command: its flags and its checks before anything is measured
bench_kernels  what bench measures: kernels and the auto override on Wan's shapes, the cache it fills
"""
from __future__ import annotations

import argparse
import sys

from .. import __version__
from ..memory.errors import RequestError, one_line
from . import bench, plan

__all__ = ["main", "UsageError"]


class UsageError(Exception):
    """A bad command line or input file: one line for stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="wan-sage", description=(__doc__ or "").split("\n\n")[0] or None)
    ap.add_argument("--version", action="version", version=f"wan-sage {__version__}")
    sub = ap.add_subparsers(dest="cmd", metavar="{plan,bench}")
    plan.add_parser(sub)
    bench.add_parser(sub)
    return ap


def main(argv=None) -> int:
    ap = parser()
    cmd = None
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        a, extra = ap.parse_known_args(words)
        cmd = a.cmd
        if extra:  # named for the command they were given to (after its name), as its other errors are
            after = words[words.index(cmd) + 1:] if cmd in words else []
            named = cmd if cmd and all(x in after for x in extra) else None
            raise UsageError(f"wan-sage{' ' + named if named else ''}: unrecognized arguments: {' '.join(extra)}"
                             + (f" (wan-sage {named} --help lists them)" if named else ""))
        if cmd is None:  # bare `wan-sage`: say what it does and how to use it; no command ran
            ap.print_help(sys.stderr)
            return 2
        if cmd == "plan":
            return plan.run(a)
        if cmd == "bench":
            return bench.run(a)
    except (UsageError, RequestError, plan.PlanError) as e:
        text = str(e)
        if not text.startswith("wan-sage"):
            text = f"wan-sage {cmd}: {text}" if cmd else f"wan-sage: {text}"
        print(one_line(text), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()
    return 2


def _closed_pipe() -> int:
    """The reader of our output went away (``wan-sage plan | head``): stop quietly, as Unix tools do.
    stdout is pointed at devnull so that the interpreter's final flush raises nothing either."""
    import os
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
