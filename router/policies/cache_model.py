"""The router's model of each engine's prefix cache: an LRU of the blocks it sent there, and how often each is reused.

An engine (vLLM's block pool, a kvledger rank) evicts its least recently used
free block first, and every block a request touches becomes most recent there.
The router sees every request it sends, so it can keep the same order per rank:
``touch`` makes a request's blocks most recent on its rank (its prompt's full
blocks by hash, the rest of its blocks to completion as blocks nobody reuses),
and a rank holds at most its capacity, the oldest falling out as they would
there (a request's blocks are freed tail first, so its first block is the last of
them to go). What a placement would push out is then the rank's oldest blocks, and
their worth is how likely each is to be asked for again: a block seen by
``c`` requests over ``t`` requests since its first has been reused ``(c - 1) / t``
per request; over the ``a`` requests it has already waited, that rate makes
``1 - exp(-rate * a)`` the chance it is wanted again (a block seen once is worth
nothing). Time is counted in requests, so the simulator and the live router
keep the same books.
"""
from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class _Seen:
    """One block's reuse, cluster-wide: how many requests touched it, the first and the last."""

    count: int
    first: int


class CacheModel:
    """Per rank, the LRU order of the blocks the router sent there (see the module docstring); not thread-safe."""

    def __init__(self, max_blocks_per_rank: int = 1 << 20) -> None:
        self._max = max_blocks_per_rank
        self._ranks: dict[int, OrderedDict[object, int]] = {}
        """rank -> block key -> the request count when it was last touched there, oldest first."""
        self._seen: dict[int, _Seen] = {}
        self._now = 0
        self._anonymous = itertools.count()

    @property
    def now(self) -> int:
        """Requests touched so far."""
        return self._now

    def held(self, rank: int) -> int:
        """Blocks the model has on ``rank``."""
        lru = self._ranks.get(rank)
        return 0 if lru is None else len(lru)

    def touch(self, rank: int, hashes: Sequence[int], other_blocks: int, capacity: int) -> None:
        """A request with these full-block ``hashes`` (and ``other_blocks`` more to completion) went to ``rank``,
        which holds ``capacity`` blocks (0: unknown, bounded by ``max_blocks_per_rank``)."""
        self._now += 1
        now = self._now
        lru = self._ranks.setdefault(rank, OrderedDict())
        for _ in range(other_blocks):
            lru[("other", next(self._anonymous))] = now
        for h in reversed(hashes):   # an engine frees a request's blocks tail first: its first block goes last
            seen = self._seen.get(h)
            if seen is None:
                self._seen[h] = _Seen(1, now)
            else:
                seen.count += 1
            lru[h] = now
            lru.move_to_end(h)
        limit = min(capacity, self._max) if capacity else self._max
        while len(lru) > limit:
            key, _ = lru.popitem(last=False)
            if type(key) is int and not any(key in other for r, other in self._ranks.items() if r != rank):
                self._seen.pop(key, None)

    def recent_prefix(self, rank: int, hashes: Sequence[int], within: int) -> int:
        """How many of ``hashes``, from the first, the router sent to ``rank`` within the last ``within`` requests."""
        lru = self._ranks.get(rank)
        if not lru or within <= 0:
            return 0
        oldest, k = self._now - within, 0
        for h in hashes:   # bounded by the prompt's blocks
            last = lru.get(h)
            if last is None or last <= oldest:
                break
            k += 1
        return k

    def eviction_value(self, rank: int, blocks: int, keep: Collection[int]) -> float:
        """Expected reuses lost if ``blocks`` more of ``rank``'s oldest blocks (none in ``keep``) were evicted."""
        lru = self._ranks.get(rank)
        if not lru or blocks <= 0:
            return 0.0
        now, lost, taken = self._now, 0.0, 0
        for key, last in lru.items():   # oldest first; bounded by ``blocks`` taken
            if key in keep:
                continue
            taken += 1
            seen = self._seen.get(key) if type(key) is int else None
            if seen is not None and seen.count > 1:
                rate = (seen.count - 1) / max(1, now - seen.first)
                lost += 1.0 - math.exp(-rate * max(1, now - last))
            if taken >= blocks:
                break
        return lost

    def forget(self, rank: int) -> None:
        """``rank`` left the cluster: its cache is gone."""
        self._ranks.pop(rank, None)
