"""LRU eviction with retention priorities, one set of free lists per tier (TensorRT-LLM's LRUEvictionPolicy).

A free block sits in the list of its tier and level: level 0 holds blocks with
no reusable content (taken first), level ``p + 1`` blocks of priority ``p``.
The victim is the head of the lowest non-empty level, so the lowest priority
goes first and, within a priority, the least recently freed. A bitmask of
non-empty levels finds it without scanning.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvledger.worker.ledger.block import PLACEHOLDER, PRIMARY, Block
from kvledger.worker.ledger.free_list import FreeList
from kvledger.worker.wire.request import MAX_PRIORITY

EMPTY_LEVEL = 0
NUM_LEVELS = MAX_PRIORITY + 2


def level_of(block: Block) -> int:
    return EMPTY_LEVEL if block.key is None else block.priority + 1


class EvictionPolicy:
    """Free lists of every tier; knows nothing of trees, pools or events."""

    __slots__ = ("_lists", "_mask", "_free", "_tick")

    def __init__(self, num_tiers: int) -> None:
        self._lists = [[FreeList() for _ in range(NUM_LEVELS)] for _ in range(num_tiers)]
        self._mask = [0] * num_tiers
        self._free = [0] * num_tiers
        self._tick = 0

    def release(self, block: Block) -> None:
        """Make an unreferenced block available, as the most recently used of its level."""
        self.release_each((block,))

    def unref_n(self, blocks: list[Block]) -> list[Block]:
        """Drop one reference of each held block (placeholders hold none), the last first (so a prefix outlives its
        suffix in the LRU order), and ``release`` each block no longer held, in one pass: freeing a sequence is a
        hot path, so each run of one level is linked onto the tail of its free list as it is walked. Held blocks
        are on the device tier (the engine reads them there; the integrity check's walk proves it). Returns the
        freed blocks with no reusable content, for the caller to wipe."""
        empties: list[Block] = []
        tick = start = self._tick
        lists = self._lists[PRIMARY]
        empty = EMPTY_LEVEL
        level = -1
        last = None
        for b in reversed(blocks):
            rc = b.ref_count
            if rc != 1:
                if b is PLACEHOLDER:  # a sliding window's position whose block slid out: it holds nothing
                    continue
                assert rc > 1, f"block {b.block_id} released more often than held"
                b.ref_count = rc - 1
                continue
            b.ref_count = 0
            key = b.key
            lv = empty if key is None else b.priority + 1  # level_of(b), inlined: once per freed block
            if lv != level:
                if tick > start:
                    self._close_run(PRIMARY, level, last, tick - start)
                level, start = lv, tick
                last = lists[level].sentinel.fl_prev
            if key is None:
                empties.append(b)
            b.level = lv
            b.freed_at = tick   # stamps count freed blocks only, so a run's length is its stamps' span
            tick += 1
            b.fl_prev = last
            last.fl_next = b
            last = b
        if tick > start:
            self._close_run(PRIMARY, level, last, tick - start)
        self._tick = tick
        return empties

    def _close_run(self, tier: int, level: int, last: Block, run: int) -> None:
        """Finish a run of ``run`` blocks of ``tier`` linked after the tail of a free list (``unref_n``,
        ``release_each``): ``last`` is the new tail."""
        lst = self._lists[tier][level]
        head = lst.sentinel
        last.fl_next = head
        head.fl_prev = last
        lst.size += run
        self._mask[tier] |= 1 << level
        self._free[tier] += run

    def claim(self, block: Block) -> None:
        """Take a free block out of its list (it is being used or moved)."""
        self.claim_each((block,))

    def claim_each(self, blocks: Sequence[Block]) -> None:
        """``claim`` each free block, in one pass (holding a matched prefix claims a block per matched block)."""
        lists, mask, free = self._lists, self._mask, self._free
        for b in blocks:
            tier, level = b.tier, b.level
            assert level >= 0, f"block {b.block_id} claimed while not free"
            lst = lists[tier][level]
            lst.remove(b)
            if not lst.size:
                mask[tier] &= ~(1 << level)
            b.level = -1
            free[tier] -= 1

    def take(self, tier: int) -> Block | None:
        """Claim the block to reuse next in ``tier``, the head of its lowest non-empty level; ``None`` when none is
        free."""
        mask = self._mask[tier]
        if not mask:
            return None
        level = (mask & -mask).bit_length() - 1
        lst = self._lists[tier][level]
        b = lst.popleft()
        if lst.size == 0:
            self._mask[tier] = mask & ~(1 << level)
        b.level = -1
        self._free[tier] -= 1
        return b

    def take_n(self, tier: int, n: int) -> list[Block]:
        """The ``n`` blocks that ``n`` calls of ``take`` would claim, in that order, unlinked a level's run at a time
        (at least ``n`` are free)."""
        assert n <= self._free[tier], f"{n} blocks taken of {self._free[tier]} free"
        out: list[Block] = []
        mask, lists = self._mask[tier], self._lists[tier]
        left = n
        while left:
            level = (mask & -mask).bit_length() - 1
            lst = lists[level]
            head = lst.sentinel
            m = min(left, lst.size)
            b = head.fl_next
            for _ in range(m):
                nxt = b.fl_next
                b.fl_prev = b.fl_next = None
                b.level = -1
                out.append(b)
                b = nxt
            head.fl_next = b
            b.fl_prev = head
            lst.size -= m
            if not lst.size:
                mask &= ~(1 << level)
            left -= m
        self._mask[tier] = mask
        self._free[tier] -= n
        return out

    def level_at(self, tier: int, k: int) -> int:
        """The level of the ``k``-th block (from 1) that ``take`` would claim of ``tier``; -1 when fewer are free."""
        mask, lists = self._mask[tier], self._lists[tier]
        while mask:
            level = (mask & -mask).bit_length() - 1
            k -= lists[level].size
            if k <= 0:
                return level
            mask &= mask - 1
        return -1

    def release_each(self, blocks: Sequence[Block]) -> None:
        """Make each unreferenced block available, in order, as the most recently used of its level; each run of one
        tier and level is linked onto the tail of its list as it is walked (a batch of tier moves releases one)."""
        lists = self._lists
        tick = start = self._tick
        tier = level = -1
        last = None
        for b in blocks:
            assert b.level < 0, f"block {b.block_id} released twice"
            lv = EMPTY_LEVEL if b.key is None else b.priority + 1   # level_of(b), inlined
            if lv != level or b.tier != tier:
                if tick > start:
                    self._close_run(tier, level, last, tick - start)
                tier, level, start = b.tier, lv, tick
                last = lists[tier][level].sentinel.fl_prev
            b.level = lv
            b.freed_at = tick
            tick += 1
            b.fl_prev = last
            last.fl_next = b
            last = b
        if tick > start:
            self._close_run(tier, level, last, tick - start)
        self._tick = tick

    def requeue(self, blocks: list[Block]) -> None:
        """Move free blocks to the levels their keys and priorities now call for, keeping their LRU order."""
        blocks = sorted(blocks, key=lambda b: b.freed_at)
        for b in blocks:
            self.claim(b)
        self.release_each(blocks)

    def num_free(self, tier: int) -> int:
        return self._free[tier]

    def free_blocks(self, tier: int) -> Iterator[Block]:
        """Free blocks of ``tier`` in eviction order."""
        for lst in self._lists[tier]:
            yield from lst

    def lists(self, tier: int) -> list[FreeList]:
        """The free lists of ``tier``, by level (for the integrity check's walk)."""
        return self._lists[tier]

    def list_sizes(self, tier: int) -> list[int]:
        return [lst.size for lst in self._lists[tier]]
