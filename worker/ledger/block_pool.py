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

from kvledger.worker.ledger.block import PRIMARY, SECONDARY, Block
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.eviction import EvictionPolicy
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.wire.events import AllBlocksCleared, BlockRemoved, BlockUpdated, KVCacheCreated
from kvledger.worker.wire.request import DEFAULT_PRIORITY


class BlockPool:
    """The blocks of both tiers: where each one's data lives, how often it is held, which are free.

    Knows nothing of requests: the manager tells it which blocks to hold and release.
    """

    __slots__ = ("config", "num_primary", "num_secondary", "pools", "blocks", "eviction", "tree", "events",
                 "alloc_total", "alloc_new", "offloaded", "onboarded", "clock", "expiry", "timed")

    def __init__(self, config: CacheConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock
        self.expiry: list[tuple[float, int]] = []
        """``(expires_at, block id)`` of released blocks with a retention duration; stale entries are skipped."""
        self.timed = False
        """Whether any block was ever given a retention duration: until then releases skip the countdowns."""
        n_primary, n_secondary = config.primary_blocks(), config.secondary_blocks()
        self.num_primary, self.num_secondary = n_primary, n_secondary
        self.pools = TieredPools(config, n_primary, n_secondary)
        self.blocks = [Block(block_id=i, slot=i, tier=PRIMARY) for i in range(n_primary)]
        self.blocks += [Block(block_id=n_primary + i, slot=i, tier=SECONDARY) for i in range(n_secondary)]
        self.eviction = EvictionPolicy(num_tiers=2)
        # Device blocks go out in ascending slot order (a sequence's blocks are adjacent, so a migration
        # reads them as one run); released tail first, they are evicted in descending order, so host slots
        # go out descending too: an offloaded run of adjacent blocks moves as one slice copy.
        for b in (*self.blocks[:n_primary], *reversed(self.blocks[n_primary:])):
            self.eviction.release(b)
        self.tree = PrefixTree()
        self.events = EventBuffer(config.event_buffer_size)
        self.alloc_total = self.alloc_new = 0  # as in KvCacheStats
        self.offloaded = self.onboarded = 0
        self.events.put(KVCacheCreated(num_blocks={"GPU": n_primary, "CPU": n_secondary},
                                       block_size=config.tokens_per_block))

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
        freed = []
        for b in reversed(blocks):
            assert b.ref_count > 0, f"block {b.block_id} released more often than held"
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.node is None:
                    self._wipe(b)
                freed.append(b)
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
        evict = self.eviction
        b = evict.victim(PRIMARY)
        assert b is not None, "capacity was checked before allocating"
        evict.claim(b)
        if count_alloc:
            self.alloc_total += 1
            if b.key is None:
                self.alloc_new += 1
        if b.node is None:
            return b
        if b.priority >= self.config.offload_min_priority and evict.num_free(SECONDARY) > 0:
            dest = evict.victim(SECONDARY)
            evict.claim(dest)
            if dest.node is not None:
                self.forget(dest)
            self.pools.plan(PRIMARY, b.slot, SECONDARY, dest.slot)
            b.slot, dest.slot = dest.slot, b.slot
            b.tier, dest.tier = SECONDARY, PRIMARY
            self.events.put(BlockUpdated(block_hash=b.block_hash, old_medium="GPU", new_medium="CPU"))
            evict.release(b)
            self.offloaded += 1
            return dest
        self.forget(b)
        return b

    def onboard(self, b: Block) -> None:
        """Bring a claimed host-tier block back to the device before use; it keeps its id and node."""
        dst = self.take_free(count_alloc=False)
        self.pools.plan(SECONDARY, b.slot, PRIMARY, dst.slot)
        b.slot, dst.slot = dst.slot, b.slot
        b.tier, dst.tier = PRIMARY, SECONDARY
        self.eviction.release(dst)
        if b.block_hash is not None:
            self.events.put(BlockUpdated(block_hash=b.block_hash, old_medium="CPU", new_medium="GPU"))
        self.onboarded += 1

    def forget(self, b: Block) -> None:
        """Take a stored block out of the tree and announce it gone from its tier."""
        self.events.put(BlockRemoved(block_hashes=[b.block_hash], medium=b.medium))
        self.tree.detach(b)
        self._wipe(b)

    def requeue(self, blocks: list[Block]) -> None:
        """Move free blocks to the free levels their keys and priorities now call for."""
        self.eviction.requeue(blocks)

    def clear(self) -> None:
        """Forget every stored block at once; announces ``AllBlocksCleared`` instead of each removal."""
        stored = [b for b in self.blocks if b.node is not None]
        for b in stored:
            self.tree.detach(b)
            self._wipe(b)
        self.eviction.requeue(stored)
        self.events.put(AllBlocksCleared())

    def _wipe(self, b: Block) -> None:
        b.key = b.block_hash = b.prev = None
        b.is_full = False
        b.priority, b.duration_s, b.expires_at = DEFAULT_PRIORITY, None, None
