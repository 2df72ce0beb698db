"""How each rank's held blocks chain: the parent of every held hash, and per rank its orphans.

A probe is a chain of hashes, each the child of the one before. The index
keeps each held hash's parent (as the first event to store it named it) and,
per rank, how many of its held blocks have each parent (``kids``) and how many
it holds without their parent (``orphans``, left by an eviction in the middle
of a chain). A rank with no orphans holds whole prefixes only, which is what
lets the probe bisect its chains (``router.chain_match``). A rank holding
blocks of unknown parent (a snapshot names none) is ``untracked``: its chains
are walked block by block until it holds nothing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import compress, repeat

UNKNOWN = object()   # a parent the index was never told


@dataclass(slots=True)
class RankHoldings:
    """One rank's bit in the holder masks, its holdings, and how they chain."""

    rank: int
    bit: int
    refs: dict[int, int] = field(default_factory=dict)   # hash -> device refs | host refs << 32
    kids: dict[int, int] = field(default_factory=dict)   # hash -> held blocks whose parent it is
    orphans: int = 0          # held blocks whose parent is not held
    untracked: bool = False   # holds blocks of unknown parent: chains are walked block by block

    def forget_chains(self) -> None:
        """The rank holds nothing now."""
        self.kids, self.orphans, self.untracked = {}, 0, False


class Chains:
    """The parents of held hashes (shared by every rank) and each rank's counts (see the module docstring)."""

    __slots__ = ("parents",)

    def __init__(self) -> None:
        self.parents: dict[int, int | None] = {}   # hash -> its parent; also stale entries, dropped in bulk

    def link_run(self, rh: RankHoldings, hs: list[int], parent: int | None) -> None:
        """``hs`` (a stored run, each the child of the one before, the first of ``parent``) just became held."""
        if rh.untracked:
            return
        expected = [parent, *hs[:-1]]
        got = list(map(self.parents.setdefault, hs, expected))   # the first parent the index was told
        kids = rh.kids
        if got != expected or rh.orphans:
            healed = sum(map(kids.get, hs, repeat(0)))   # held children of blocks not held until now: orphans
            for p in got:
                if p is not None:
                    kids[p] = kids.get(p, 0) + 1
            refs = rh.refs
            rh.orphans += sum(1 for p in got if p is not None and p not in refs) - healed
            return
        # Every held block's parent is held, so no kid count is keyed by a block not held, as ``hs`` were.
        kids.update(dict.fromkeys(hs[:-1], 1))
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1
            if parent not in rh.refs:
                rh.orphans += 1

    def unlink_run(self, rh: RankHoldings, hs: list[int]) -> None:
        """``hs`` (distinct) just stopped being held, all of them (gone from ``rh.refs`` already)."""
        if rh.untracked:
            return
        kids, refs = rh.kids, rh.refs
        ps = list(map(self.parents.__getitem__, hs))
        first = ps[0]
        if ps[1:] == hs[:-1] and first not in hs:
            took = list(map(kids.pop, hs[:-1], repeat(0)))
            if took.count(1) == len(took):
                # A chain whose blocks but the last had one held child each: a tail evicted root first.
                lost = first is not None and first not in refs
                if first is not None:
                    _one_kid_fewer(kids, first)
                rh.orphans += kids.get(hs[-1], 0) - lost
                return
            kids.update(compress(zip(hs, took), took))   # put back what was taken
        gone = set(hs)
        lost = sum(1 for p in ps if p is not None and p not in refs and p not in gone)   # orphans removed
        for p in ps:
            if p is not None:
                _one_kid_fewer(kids, p)
        rh.orphans += sum(map(kids.get, hs, repeat(0))) - lost   # held children of removed blocks: orphans

    def link(self, rh: RankHoldings, h: int, parent: object) -> None:
        """``h`` just became held, after ``parent`` (``UNKNOWN``: not said; ``None``: a chain's first block)."""
        if rh.untracked:
            return
        known = self.parents.get(h, UNKNOWN)
        if known is UNKNOWN:
            if parent is UNKNOWN:
                rh.untracked = True
                return
            self.parents[h] = known = parent
        kids = rh.kids
        if known is not None:
            kids[known] = kids.get(known, 0) + 1
            if known not in rh.refs:
                rh.orphans += 1
        rh.orphans -= kids.get(h, 0)   # its held children were orphans

    def unlink(self, rh: RankHoldings, h: int) -> None:
        """``h`` just stopped being held (its entry in ``rh.refs`` is gone)."""
        if rh.untracked:
            return
        parent = self.parents[h]
        kids = rh.kids
        if parent is not None:
            _one_kid_fewer(kids, parent)
            if parent not in rh.refs:
                rh.orphans -= 1
        rh.orphans += kids.get(h, 0)

    def parent_of(self, h: int) -> object:
        """``h``'s parent, or ``UNKNOWN``."""
        return self.parents.get(h, UNKNOWN)

    def count(self, rh: RankHoldings) -> None:
        """Count the chains of ``rh.refs``, just installed whole (a snapshot)."""
        refs = rh.refs
        parents = list(map(self.parents.get, refs, repeat(UNKNOWN)))
        if UNKNOWN in parents:
            rh.untracked = True
            return
        rh.kids = dict(Counter(p for p in parents if p is not None))
        rh.orphans = sum(1 for p in parents if p is not None and p not in refs)

    def prune(self, holders: dict[int, int]) -> None:
        """Drop the parents of hashes nobody holds, once they outnumber the held ones."""
        if len(self.parents) > 2 * len(holders) + 4096:
            self.parents = {h: p for h, p in self.parents.items() if h in holders}


def _one_kid_fewer(kids: dict[int, int], parent: int) -> None:
    """``parent`` holds one child fewer (and leaves the count when it holds none)."""
    n = kids[parent] - 1
    if n:
        kids[parent] = n
    else:
        del kids[parent]
