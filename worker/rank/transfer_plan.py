"""The pieces a migration's bytes travel in: as few messages as keep the copies out of the way.

A block goes from a source slot to a target slot; the order the blocks travel
in is free, so the plan picks it: the source's slots in ascending order, so
that runs of adjacent slots (free lists hand them out in runs, often descending
ones: a sequence's blocks are freed last block first) become pieces sent
straight from the source's pool, one message each. The target's fresh blocks
hold nothing yet, so which of them takes which block is free too:
``aligned_slots`` hands them out so that the target's slots ascend along the
source's. The target answers with those slots before anything is sent, so both
sides cut the same pieces where either side's slots stop running, and each
piece goes from one pool slice straight into the other.

Pieces are cut at ``chunk_blocks`` too, so that a side's copies of one piece
(when it has any) overlap the next one on the wire; when the runs alone would
take more than ``max_pieces`` messages, the blocks go in fixed chunks of the
same order instead, and a side gathers (or scatters) the chunks that are not
one run in its pool.
"""
from __future__ import annotations

from collections.abc import Sequence

#: Messages one migration may take: on gloo up to 64 outstanding sends cost about what one message does.
MAX_PIECES = 64


def is_run(slots: Sequence[int]) -> bool:
    """Whether ``slots`` are one ascending run (a pool slice holds them, in this order)."""
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))


def plan_pieces(src: Sequence[int], chunk_blocks: int, max_pieces: int = MAX_PIECES,
                dst: Sequence[int] | None = None) -> list[list[int]]:
    """The pieces that carry blocks with source slots ``src`` (into target slots ``dst``, one each, when given):
    each piece a list of indices into ``src``, in the order they travel (see the module docstring); ``[]`` when
    there are none."""
    if type(chunk_blocks) is not int or chunk_blocks < 1 or type(max_pieces) is not int or max_pieces < 1:
        raise ValueError(f"chunk_blocks and max_pieces must be ints >= 1, got {chunk_blocks!r} and {max_pieces!r}")
    if dst is not None and len(dst) != len(src):
        raise ValueError(f"plan_pieces needs one target slot per source slot, got {len(dst)} for {len(src)}")
    order = sorted(range(len(src)), key=src.__getitem__)
    sides = [src] if dst is None else [src, dst]
    starts = [i for i in range(len(order))
              if i == 0 or any(s[order[i]] != s[order[i - 1]] + 1 for s in sides)]
    bounds = [*starts, len(order)]
    cuts = [c for a, b in zip(bounds, bounds[1:]) for c in range(a, b, chunk_blocks)]
    if len(cuts) > max_pieces:
        step = max(chunk_blocks, -(-len(order) // max_pieces))
        cuts = starts if len(starts) <= max_pieces else list(range(0, len(order), step))
    ends = [*cuts[1:], len(order)]
    return [order[a:b] for a, b in zip(cuts, ends)]


def aligned_slots(src: Sequence[int], slots: Sequence[int]) -> list[int]:
    """Target slots ``slots`` handed to the blocks with source slots ``src`` (one each, ``out[i]`` for ``src[i]``) so
    that they ascend in the order the blocks travel (see the module docstring)."""
    if len(src) != len(slots):
        raise ValueError(f"aligned_slots needs one target slot per source slot, got {len(slots)} for {len(src)}")
    out = [0] * len(src)
    for i, s in zip(sorted(range(len(src)), key=src.__getitem__), sorted(slots)):
        out[i] = s
    return out
