"""The pieces a migration's bytes travel in: as few messages as keep the copies out of the way.

A block goes from a source slot to a target slot; the order the blocks travel
in is free, so the plan picks it: the source's slots in ascending order, so
that runs of adjacent slots (free lists hand them out in runs, often descending
ones: a sequence's blocks are freed last block first) become pieces sent
straight from the source's pool, one message each. The plan depends on the
source's slots alone, which the target learns from the source's first message,
so the source never waits for the target's slots before it sends. The target's
fresh blocks hold nothing yet, so which of them takes which block is free too:
``aligned_slots`` hands them out so that the target's slots ascend along the
source's, and wherever both sides' slots run, the target receives a piece
straight into its pool; elsewhere into a staging buffer it scatters from.

Pieces are cut at ``chunk_blocks`` so that a target's scatter of piece ``i``
overlaps the arrival of piece ``i + 1``; when the source's runs alone would
take more than ``max_pieces`` messages, the blocks go in fixed chunks of the
same order instead and the source gathers the chunks that are not one run.
"""
from __future__ import annotations

from collections.abc import Sequence

#: Messages one migration may take: on gloo up to 64 outstanding sends cost about what one message does.
MAX_PIECES = 64


def is_run(slots: Sequence[int]) -> bool:
    """Whether ``slots`` are one ascending run (a pool slice holds them, in this order)."""
    return all(b == a + 1 for a, b in zip(slots, slots[1:]))


def plan_pieces(src: Sequence[int], chunk_blocks: int, max_pieces: int = MAX_PIECES) -> list[list[int]]:
    """The pieces that carry blocks with source slots ``src``: each piece a list of indices into ``src``, in
    the order they travel (see the module docstring); ``[]`` when there are none."""
    if type(chunk_blocks) is not int or chunk_blocks < 1 or type(max_pieces) is not int or max_pieces < 1:
        raise ValueError(f"chunk_blocks and max_pieces must be ints >= 1, got {chunk_blocks!r} and {max_pieces!r}")
    order = sorted(range(len(src)), key=src.__getitem__)
    starts = [i for i in range(len(order)) if i == 0 or src[order[i]] != src[order[i - 1]] + 1]
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
