"""LRU eviction with retention priorities, one set of free lists per tier (TensorRT-LLM's LRUEvictionPolicy).

A free block sits in the list of its tier and level: level 0 holds blocks with
no reusable content (taken first), level ``p + 1`` blocks of priority ``p``.
The victim is the head of the lowest non-empty level, so the lowest priority
goes first and, within a priority, the least recently freed. A bitmask of
non-empty levels finds it without scanning.
"""
from __future__ import annotations

from collections.abc import Iterator

from kvledger.worker.ledger.block import Block
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
        assert block.level < 0, f"block {block.block_id} released twice"
        level = level_of(block)
        self._lists[block.tier][level].append(block)
        block.level = level
        block.freed_at = self._tick
        self._tick += 1
        self._mask[block.tier] |= 1 << level
        self._free[block.tier] += 1

    def release_n(self, blocks: list[Block]) -> None:
        """``release`` each block in order, in one pass: each run of one tier and level is stamped and linked onto
        the tail of its free list as it is walked (freeing a sequence is a hot path)."""
        i, n = 0, len(blocks)
        tick = self._tick
        lists, mask, free = self._lists, self._mask, self._free
        while i < n:
            b = blocks[i]
            tier = b.tier
            level = level_of(b)
            lst = lists[tier][level]
            head = lst.sentinel
            last = head.fl_prev
            j = i
            while j < n:
                c = blocks[j]
                assert c.level < 0, f"block {c.block_id} released twice"
                # level_of(c), inlined: this loop runs once per freed block
                if c.tier != tier or (EMPTY_LEVEL if c.key is None else c.priority + 1) != level:
                    break
                c.level = level
                c.freed_at = tick
                tick += 1
                c.fl_prev = last
                last.fl_next = c
                last = c
                j += 1
            last.fl_next = head
            head.fl_prev = last
            lst.size += j - i
            mask[tier] |= 1 << level
            free[tier] += j - i
            i = j
        self._tick = tick

    def claim(self, block: Block) -> None:
        """Take a free block out of its list (it is being used or moved)."""
        assert block.level >= 0, f"block {block.block_id} claimed while not free"
        lst = self._lists[block.tier][block.level]
        lst.remove(block)
        if lst.size == 0:
            self._mask[block.tier] &= ~(1 << block.level)
        block.level = -1
        self._free[block.tier] -= 1

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

    def requeue(self, blocks: list[Block]) -> None:
        """Move free blocks to the levels their keys and priorities now call for, keeping their LRU order."""
        blocks = sorted(blocks, key=lambda b: b.freed_at)
        for b in blocks:
            self.claim(b)
        for b in blocks:
            self.release(b)

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
