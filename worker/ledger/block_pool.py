"""The block pool: every block of one rank, its free lists and tensors, and the moves between tiers.

The cache manager decides what to admit; the pool carries it out, as vLLM v1's
``BlockPool`` does under its ``KVCacheManager``. The pool hands out clean device
blocks, evicting the free block the eviction policy picks (offloaded to the
host tier when its priority earns that and the host tier has room, else
dropped), brings host blocks back on demand, counts references, and announces
every tier move and removal. It owns the prefix tree because evicting a block
takes it out of the tree; storing blocks and matching prompts are the manager's.

It also starts retention countdowns: a block released with a retention
duration gets its expiry then (``now + duration`` on the injected clock, in
the ``expiry`` heap that ``Retention.refresh`` pops), and a request taking the
block again stops it, so a block in use never expires.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable

from kvledger.worker.ledger.block import PRIMARY, SECONDARY, TIER_MEDIUM, Block
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.eviction import EvictionPolicy
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.wire.events import AllBlocksCleared, BlockRemoved, BlockUpdated
from kvledger.worker.wire.request import DEFAULT_PRIORITY


class BlockPool:
    """The blocks of both tiers: where each one's data lives, how often it is held, which are free.

    Knows nothing of requests: the manager tells it which blocks to hold and release.
    """

    __slots__ = ("config", "window", "num_primary", "num_secondary", "pools", "blocks", "eviction", "tree", "events",
                 "alloc_total", "alloc_new", "offloaded", "onboarded", "clock", "expiry", "timed")

    def __init__(self, config: CacheConfig, clock: Callable[[], float], window: int = 0,
                 tree: PrefixTree | None = None, events: EventBuffer | None = None) -> None:
        """The pool of attention window ``window`` (``CacheConfig.window_layouts``); the windows of one ledger share
        its prefix ``tree`` and event buffer (by default the pool's own)."""
        self.config = config
        self.clock = clock
        self.window = window
        self.expiry: list[tuple[float, int]] = []
        """``(expires_at, block id)`` of released blocks with a retention duration; stale entries are skipped."""
        self.timed = False
        """Whether any block was ever given a retention duration: until then releases skip the countdowns."""
        n_primary, n_secondary = config.window_block_counts()[window]
        self.num_primary, self.num_secondary = n_primary, n_secondary
        self.pools = TieredPools(config, n_primary, n_secondary, config.window_layouts[window].pools)
        self.blocks = [Block(block_id=i, slot=i, tier=PRIMARY, window=window) for i in range(n_primary)]
        self.blocks += [Block(block_id=n_primary + i, slot=i, tier=SECONDARY, window=window)
                        for i in range(n_secondary)]
        self.eviction = EvictionPolicy(num_tiers=2)
        # Device blocks go out in ascending slot order (a sequence's blocks are adjacent, so a migration
        # reads them as one run); released tail first, they are evicted in descending order, so host slots
        # go out descending too: an offloaded run of adjacent blocks moves as one slice copy.
        for b in (*self.blocks[:n_primary], *reversed(self.blocks[n_primary:])):
            self.eviction.release(b)
        self.tree = PrefixTree() if tree is None else tree
        self.events = EventBuffer(config.event_buffer_size) if events is None else events
        self.alloc_total = self.alloc_new = 0  # as in KvCacheStats
        self.offloaded = self.onboarded = 0

    def num_free(self, tier: int) -> int:
        return self.eviction.num_free(tier)

    def ref(self, b: Block) -> None:
        """Hold ``b`` once more; a free block leaves its free list."""
        if b.ref_count == 0 and b.level >= 0:
            self.eviction.claim(b)
            b.expires_at = None   # in use again: its countdown stops (it starts anew at the next release)
        b.ref_count += 1

    def unref(self, b: Block) -> None:
        """Drop one reference; an unstored block is wiped as it becomes free."""
        assert b.ref_count > 0, f"block {b.block_id} released more often than held"
        b.ref_count -= 1
        if b.ref_count == 0:
            if b.node is None:
                self._wipe(b)
            elif self.timed and b.duration_s is not None:
                self._start_countdown(b)
            self.eviction.release(b)

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference of each block, tail first, so a prefix outlives its suffix in the LRU order."""
        freed: list[Block] = []
        append = freed.append
        for b in reversed(blocks):
            rc = b.ref_count - 1
            assert rc >= 0, f"block {b.block_id} released more often than held"
            b.ref_count = rc
            if not rc:
                if b.node is None:
                    self._wipe(b)
                append(b)
        if self.timed:
            for b in freed:
                if b.duration_s is not None and b.node is not None:
                    self._start_countdown(b)
        self.eviction.release_n(freed)

    def _start_countdown(self, b: Block) -> None:
        b.expires_at = self.clock() + b.duration_s
        heapq.heappush(self.expiry, (b.expires_at, b.block_id))

    def take_free(self, count_alloc: bool) -> Block:
        """A clean primary block: the eviction victim, offloaded to the host tier or dropped."""
        return self.take_free_n(1, count_alloc)[0]

    def take_free_n(self, n: int, count_alloc: bool) -> list[Block]:
        """``n`` clean primary blocks, taken one after another as ``take_free`` takes one (the same victims, moves
        and events), in one loop: allocation is the ledger's hottest path."""
        take, clean = self.eviction.take, self._clean
        out: list[Block] = []
        append = out.append
        new = 0
        for _ in range(n):
            b = take(PRIMARY)
            assert b is not None, "capacity was checked before allocating"
            if b.key is None:
                new += 1
            append(b if b.node is None else clean(b))
        if count_alloc:
            self.alloc_total += n
            self.alloc_new += new
        return out

    def _clean(self, b: Block) -> Block:
        """A clean primary block in place of claimed stored victim ``b``: offloaded when its priority earns that and
        the host tier has room (the host block it swapped with is returned), else dropped."""
        if b.priority >= self.config.offload_min_priority and self.eviction.num_free(SECONDARY) > 0:
            return self._offload(b)
        self.forget(b)
        return b

    def _offload(self, b: Block) -> Block:
        """Move claimed primary block ``b`` to a free host slot; returns the host block it swapped with, now a clean
        primary block."""
        evict = self.eviction
        dest = evict.take(SECONDARY)
        if dest.node is not None:
            self.forget(dest)
        self.pools.plan(PRIMARY, b.slot, SECONDARY, dest.slot)
        b.slot, dest.slot = dest.slot, b.slot
        b.tier, dest.tier = SECONDARY, PRIMARY
        self.events.put(BlockUpdated(block_hash=b.block_hash, old_medium="GPU", new_medium="CPU",
                                     group_idx=self.window))
        evict.release(b)
        self.offloaded += 1
        return dest

    def onboard_n(self, blocks: list[Block]) -> None:
        """Bring claimed host-tier blocks back to the device before use, in order; each keeps its id and node."""
        evict = self.eviction
        take, release, clean, plan, put = evict.take, evict.release, self._clean, self.pools.plan, self.events.put
        window = self.window
        for b in blocks:
            dst = take(PRIMARY)
            assert dst is not None, "capacity was checked before onboarding"
            if dst.node is not None:
                dst = clean(dst)
            plan(SECONDARY, b.slot, PRIMARY, dst.slot)
            b.slot, dst.slot = dst.slot, b.slot
            b.tier, dst.tier = PRIMARY, SECONDARY
            release(dst)
            if b.block_hash is not None:
                put(BlockUpdated(block_hash=b.block_hash, old_medium="CPU", new_medium="GPU", group_idx=window))
        self.onboarded += len(blocks)

    def forget(self, b: Block) -> None:
        """Take a stored block out of the tree and announce it gone from its tier."""
        self.events.put(BlockRemoved([b.block_hash], TIER_MEDIUM[b.tier], self.window))
        self.tree.detach(b)
        self._wipe(b)

    def requeue(self, blocks: list[Block]) -> None:
        """Move free blocks to the free levels their keys and priorities now call for."""
        self.eviction.requeue(blocks)

    def clear(self, announce: bool = True) -> None:
        """Forget every stored block at once; announces ``AllBlocksCleared`` (unless the caller does, for every
        window at once) instead of each removal."""
        stored = [b for b in self.blocks if b.node is not None]
        for b in stored:
            self.tree.detach(b)
            self._wipe(b)
        self.eviction.requeue(stored)
        if announce:
            self.events.put(AllBlocksCleared())

    def _wipe(self, b: Block) -> None:
        b.key = b.block_hash = b.prev = None
        b.is_full = False
        b.priority, b.duration_s, b.expires_at = DEFAULT_PRIORITY, None, None
