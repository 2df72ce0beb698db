"""Where each rank's held prefix of a sequence of hashes ends, read from the holder masks.

Both probes answer ``ends``: a list of ``(ranks' bits, blocks they matched)``.
``walk`` looks up every block, for any sequence. ``chain_ends`` serves a chain
(each hash the child of the one before) whose holders all hold whole prefixes
only (no orphans, ``router.chains``): along the chain their blocks stop at one
place, found by bisection: one lookup every 32 blocks, then five per distinct
match length, instead of one per block (in C by ``bisect`` while no rank at
all holds orphans, since then the holder masks themselves only shrink along a
chain).
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import compress, repeat
from operator import and_, ne

from kvledger.router.chains import UNKNOWN

GRID = 32   # blocks between the probes of a chain's first pass


def walk(holders: dict[int, int], hashes: Sequence[int], active: int) -> list[tuple[int, int]]:
    """``ends`` from one lookup per block, ``active`` holding ``hashes[0]``.

    Consecutive blocks mostly have the same holders, so the common step is one dict lookup and one
    comparison with the previous mask, whatever the number of ranks; Python only does more where the
    holders change.
    """
    ends: list[tuple[int, int]] = []
    end, prev = len(hashes), active
    for j, m in enumerate(map(holders.get, hashes)):
        if m != prev:
            if m is None or active & m != active:   # some rank of ``active`` lacks block j
                if m is not None:
                    ends.append((active & ~m, j))
                    active &= m
                if m is None or not active:
                    end = j
                    break
            prev = m
    ends.append((active, end))
    return ends


def chain_ends(holders: dict[int, int], parents: dict[int, int | None], hashes: Sequence[int], first: int,
               any_orphans: bool) -> list[tuple[int, int]] | None:
    """``ends`` of the chain ``hashes`` for the ranks of ``first`` (holding ``hashes[0]``, none with orphans);
    ``None`` where ``hashes`` is found not to be one chain (the caller walks it). ``any_orphans``: whether some
    rank outside ``first`` holds orphans.

    Where each match ends, the block's recorded parent must be the hash before it.
    """
    get = holders.get
    n = len(hashes)
    # Each rank of ``first`` holds a prefix of the chain, so the ranks of ``first`` holding block j only
    # shrink as j grows. Read them on a grid (one C-level pass), then bisect each grid step where they
    # shrink down to the blocks where they do.
    # With no rank holding orphans, every holder of a chain's block holds its first block too: the masks
    # themselves shrink along the chain, so they grow along it reversed and ``bisect`` searches them in C.
    back = None if any_orphans else hashes[::-1]
    grid = list(range(0, n - 1, GRID))
    grid.append(n - 1)
    held = list(map(and_, map(get, hashes[0:n - 1:GRID], repeat(0)), repeat(first)))
    held.append(get(hashes[n - 1], 0) & first)
    grid.append(n)
    held.append(0)
    ends: list[tuple[int, int]] = []
    for k in compress(range(len(grid) - 1), map(ne, held, held[1:])):
        lo, m_lo, top, m_top = grid[k], held[k], grid[k + 1], held[k + 1]
        while m_lo != m_top:   # the first block past ``lo`` where fewer ranks hold on: (lo, top]
            if back is not None and m_top:   # no block of (lo, top] is unheld, if ``hashes`` is one chain
                try:
                    b = n - bisect_left(back, m_lo, n - 1 - top, n - 1 - lo, key=get)
                except TypeError:   # an unheld block (None) after all: not one chain
                    return None
                a, m_b = b - 1, get(hashes[b], 0)
            else:
                a, b, m_b = lo, top, m_top
                while b - a > 1:
                    mid = (a + b) >> 1
                    m = get(hashes[mid], 0) & first
                    if m == m_lo:
                        a = mid
                    else:
                        b, m_b = mid, m
            if m_b & ~m_lo or (a and parents.get(hashes[a], UNKNOWN) != hashes[a - 1]):
                return None   # not one chain
            ends.append((m_lo & ~m_b, b))
            lo, m_lo = b, m_b
    return ends
