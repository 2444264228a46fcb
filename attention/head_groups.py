"""How many head groups a Sage call runs in, and the exact extra bytes of that choice.

A call split over ``g`` head groups allocates its full output first, then runs the kernel ``g``
times on ``ceil(H / g)`` heads each and copies every group's output into place, so its peak extra
bytes are the full output plus the kernel's bytes for one group.  An ungrouped call is one direct
kernel call: the kernel's bytes, plus a copy of the output when the kernel's native output layout
is not the layout the caller wants.

Memory modes:

``"sdpa"`` (default)
    the smallest group count whose peak is within SDPA's extra bytes for the same call plus
    0.5 GiB (:data:`SDPA_SLACK_BYTES`), so Sage costs about SDPA's memory.  When no count gets
    there, the count with the fewest bytes (one head per group).
``"fastest"``
    ungrouped.

The dispatcher and the working-memory estimate both call :func:`head_groups`, so the VRAM check
and the reservation agree.  (The dispatcher runs a shape ungrouped when calibration measured the
grouped call more than 2 % slower, and splits further when free VRAM is short; both are runtime
facts the formula cannot know.)  Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from .kernel_bytes import INTO_Q_PATHS, AttnShape, extra_bytes

__all__ = ["MEMORY_MODES", "SDPA_SLACK_BYTES", "INTO_Q_SLACK_BYTES", "HeadGroups", "head_groups", "group_counts", "split_bytes",
           "fewest_groups_within", "into_q_groups"]

MEMORY_MODES = ("sdpa", "fastest")
SDPA_SLACK_BYTES = 1 << 29  # 0.5 GiB
# What a write-into-q call may hold beyond its formula: the caching allocator hands a request a cached block
# up to 1 MiB larger than asked without splitting it, and about eight blocks live at once in a group (q, k
# and V quantised, their scales, K's copy, the transposed V); the output check's probe and its SDPA
# reference add a few MiB on a call that is due a check.  On an H200 the groups held within 0.5 MiB of the
# formula at 1,560 to 106,080 tokens on a fresh allocator (bench/records/gpu-tier/ has the check's).
INTO_Q_SLACK_BYTES = 16 << 20


@dataclass(frozen=True)
class HeadGroups:
    """A group count for one call and what it costs in extra device bytes."""

    groups: int  # 1: one direct kernel call
    heads_per_group: int
    extra_bytes: int  # peak extra bytes of the call run with ``groups`` groups
    ungrouped_bytes: int  # the direct call's peak extra bytes
    sdpa_bytes: int  # SDPA's extra bytes for the same call


def _heads_per_group(heads: int, groups: int) -> int:
    return -(-heads // groups)


def group_counts(heads: int) -> tuple:
    """Every distinct group count for ``heads`` heads, ascending: a count is listed only when it
    changes the heads per group (40 heads: 1, 2, 3, 4, 5, 6, 7, 8, 10, 14, 20, 40)."""
    counts = []
    for per_group in range(heads, 0, -1):
        groups = _heads_per_group(heads, per_group)
        if _heads_per_group(heads, groups) == per_group and (not counts or counts[-1] != groups):
            counts.append(groups)
    return tuple(counts)


def split_bytes(path: str, shape: AttnShape, groups: int, output_copy: bool = False) -> int:
    """Peak extra bytes of a call of the kernel behind ``path`` run in ``groups`` head groups.

    ``output_copy``: the ungrouped call's output is copied into the caller's layout afterwards
    (the kernel's native layout differs); only the output is alive then.  A grouped call writes
    every group straight into the full output, allocated in the caller's layout.  A path that writes
    the output into q's own memory (:data:`.kernel_bytes.INTO_Q_PATHS`) allocates no full output: each
    group's peak is the kernel's bytes for its heads."""
    if path in INTO_Q_PATHS:
        return extra_bytes(path, shape.with_heads(_heads_per_group(shape.Hq, max(1, groups))))
    if groups <= 1:
        direct = extra_bytes(path, shape)
        if output_copy:
            out = shape.s * shape.B * shape.Hq * shape.Nq * shape.D
            return max(direct, 2 * out)
        return direct
    full_output = shape.s * shape.B * shape.Hq * shape.Nq * shape.D
    return full_output + extra_bytes(path, shape.with_heads(_heads_per_group(shape.Hq, groups)))


def fewest_groups_within(path: str, shape: AttnShape, limit: int, start: int = 1,
                         output_copy: bool = False) -> tuple | None:
    """(groups, bytes) of the smallest group count >= ``start`` whose peak is <= ``limit``;
    None when even one head per group is over it."""
    for groups in group_counts(shape.Hq):
        if groups < start:
            continue
        nbytes = split_bytes(path, shape, groups, output_copy)
        if nbytes <= limit:
            return groups, nbytes
    return None


def head_groups(path: str, shape: AttnShape, mode: str = "sdpa", output_copy: bool = False) -> HeadGroups:
    """The group count the memory ``mode`` gives a call of the kernel behind ``path`` (a
    :mod:`.kernel_bytes` formula, e.g. ``registry.memory_path(name, cc)``) on ``shape``, with
    its peak extra bytes.  ``output_copy`` as in :func:`split_bytes` (False for Wan's calls
    on SageAttention, which returns the caller's layout)."""
    if mode not in MEMORY_MODES:
        raise ValueError(f"memory mode must be one of {', '.join(MEMORY_MODES)}; got {mode!r}")
    sdpa = extra_bytes("sdpa", shape)
    ungrouped = split_bytes(path, shape, 1, output_copy)
    if mode == "fastest" or ungrouped <= sdpa + SDPA_SLACK_BYTES:
        return HeadGroups(1, shape.Hq, ungrouped, ungrouped, sdpa)
    found = fewest_groups_within(path, shape, sdpa + SDPA_SLACK_BYTES, 2, output_copy)
    if found is None:
        groups = shape.Hq
        found = (groups, split_bytes(path, shape, groups, output_copy))
    groups, nbytes = found
    return HeadGroups(groups, _heads_per_group(shape.Hq, groups), nbytes, ungrouped, sdpa)


def into_q_groups(path: str, shape: AttnShape) -> HeadGroups | None:
    """The fewest head groups in which the kernel path ``path``, writing its output into q's memory,
    stays at or below SDPA's extra bytes for the same call with :data:`INTO_Q_SLACK_BYTES` to spare:
    SDPA allocates the full output, this path only one group's quantised q, k and V.  None when not
    even one head per group gets there (then the call takes the ordinary path)."""
    sdpa = extra_bytes("sdpa", shape)
    found = fewest_groups_within(path, shape, sdpa - INTO_Q_SLACK_BYTES)
    if found is None:
        return None
    groups, nbytes = found
    return HeadGroups(groups, _heads_per_group(shape.Hq, groups), nbytes, split_bytes(path, shape, 1), sdpa)
