"""Retention: the priorities a request asks for its blocks, and their expiry by the injected clock.

A priority orders eviction (see eviction.py); a duration makes it temporary.
As in TensorRT-LLM, the countdown starts when the block is released (the pool
starts it, see block_pool.py) and only free blocks expire: a block a request
still holds keeps its priority however long it runs. Expiry is lazy and needs
no timer: the pool's heap of ``(expires_at, block id)`` is popped when the
manager next looks (``refresh``), so a fake clock in tests decides exactly
when a priority falls back. A heap entry whose block has since been taken
again, or given another expiry, is stale and skipped.
"""
from __future__ import annotations

import heapq

from kvledger.worker.ledger.block import PLACEHOLDER, Block
from kvledger.worker.ledger.block_pool import BlockPool
from kvledger.worker.ledger.eviction import level_of
from kvledger.worker.wire.events import BlockUpdated
from kvledger.worker.wire.request import DEFAULT_PRIORITY, Request


class Retention:
    """Applies retention configs to the blocks of one pool and expires the durations of its free blocks."""

    __slots__ = ("_pool", "_tokens_per_block")

    def __init__(self, pool: BlockPool, tokens_per_block: int) -> None:
        self._pool = pool
        self._tokens_per_block = tokens_per_block

    def apply(self, request: Request, blocks: list[Block], first: int) -> None:
        """Give ``blocks[first:]`` (a sequence's blocks in one window) the priority (and duration) ``request`` asks
        for at their positions; placeholders are skipped.

        A request without a retention config leaves the priority of the blocks it
        reuses alone (new blocks start at the default), so plain traffic never
        demotes a prefix someone asked to keep.
        """
        retention = request.retention
        if retention is None:
            return
        T = self._tokens_per_block
        prompt_len = len(request.tokens)
        # the answer of ``for_block`` changes only at blocks where a range starts or ends or the decode begins:
        # asked once per run of blocks between such edges
        edges = {-(-prompt_len // T), len(blocks)}
        for r in retention.ranges:
            edges.add(r.start // T)
            if r.end is not None:
                edges.add(-(-r.end // T))
        put = self._pool.events.put
        i = first
        for edge in sorted(e for e in edges if e > first):
            if edge > len(blocks):
                break
            pri, dur = retention.for_block(i * T, (i + 1) * T, prompt_len)
            if dur is not None:
                self._pool.timed = True
            for b in blocks[i:edge]:
                if b is PLACEHOLDER:
                    continue
                b.duration_s = dur
                if b.priority != pri:
                    if b.block_hash is not None:
                        put(BlockUpdated(block_hash=b.block_hash, old_priority=b.priority, new_priority=pri,
                                         group_idx=b.window))
                    b.priority = pri
            i = edge

    def refresh(self) -> None:
        """Free blocks whose retention duration has passed fall back to the default priority."""
        pool = self._pool
        expiry = pool.expiry
        if not expiry or expiry[0][0] > pool.clock():
            return
        now = pool.clock()
        moved = []
        while expiry and expiry[0][0] <= now:
            at, bid = heapq.heappop(expiry)
            b = pool.blocks[bid]
            if b.expires_at != at:
                continue
            b.expires_at = b.duration_s = None
            if b.priority != DEFAULT_PRIORITY:
                if b.block_hash is not None:
                    pool.events.put(BlockUpdated(block_hash=b.block_hash, old_priority=b.priority,
                                                 new_priority=DEFAULT_PRIORITY, group_idx=pool.window))
                b.priority = DEFAULT_PRIORITY
                if b.level != level_of(b):
                    moved.append(b)
        pool.requeue(moved)
