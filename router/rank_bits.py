"""One bit per rank in the index's holder masks: which bit is whose, and the ranks of a mask.

A rank takes the lowest free bit, so masks stay as short as the cluster is
small, and gives it back when it leaves (another rank may take it then).
"""
from __future__ import annotations

import heapq


class RankBits:
    """The bit of each rank the index holds, and back (see the module docstring)."""

    __slots__ = ("slot_rank", "_free", "_mask_ranks")

    def __init__(self) -> None:
        self.slot_rank: list[int | None] = []   # bit position -> its rank
        self._free: list[int] = []               # min-heap of freed bit positions
        self._mask_ranks: dict[int, tuple[int, ...]] = {}   # mask -> its ranks (a probe's holder sets repeat)

    def take(self, rank: int) -> int:
        """The lowest free bit, now ``rank``'s."""
        self._mask_ranks.clear()
        if self._free:
            slot = heapq.heappop(self._free)
            self.slot_rank[slot] = rank
        else:
            slot = len(self.slot_rank)
            self.slot_rank.append(rank)
        return 1 << slot

    def give_back(self, bit: int) -> None:
        """``bit``'s rank left: the bit is free for another rank."""
        self._mask_ranks.clear()
        slot = bit.bit_length() - 1
        self.slot_rank[slot] = None
        heapq.heappush(self._free, slot)

    def rank_of(self, bit: int) -> int:
        """The rank of a single ``bit``."""
        rank = self.slot_rank[bit.bit_length() - 1]
        assert rank is not None, "a freed slot's bit was left in a mask"
        return rank

    def ranks_in(self, mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(self.rank_of(low))
            mask ^= low
        return out

    def ranks_of(self, masks: list[int]) -> list[tuple[int, ...]]:
        """The ranks of each of ``masks``, remembered."""
        known = list(map(self._mask_ranks.get, masks))
        if None not in known:
            return known
        if len(self._mask_ranks) >= 4096:
            self._mask_ranks.clear()
        for i, mask in enumerate(masks):
            if known[i] is None:
                known[i] = self._mask_ranks[mask] = tuple(self.ranks_in(mask))
        return known
