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
from collections.abc import Callable, Iterable
from operator import attrgetter

from kvledger.worker.ledger.block import PRIMARY, SECONDARY, TIER_MEDIUM, Block
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.eviction import EvictionPolicy
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.wire.events import AllBlocksCleared, BlockRemoved, BlockUpdated, KVEvent
from kvledger.worker.wire.request import DEFAULT_PRIORITY

_priority = attrgetter("priority")


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

    def ref_n(self, blocks: list[Block]) -> None:
        """Hold each block once more; a free block leaves its free list, and its retention countdown stops (it
        starts anew at the next release)."""
        free = [b for b in blocks if b.ref_count == 0 and b.level >= 0]
        if free:
            self.eviction.claim_each(free)
            for b in free:
                b.expires_at = None
        for b in blocks:
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
        """Drop one reference of each block (placeholders hold none), tail first, so a prefix outlives its suffix in
        the LRU order."""
        for b in self.eviction.unref_n(blocks):
            self._wipe(b)
        if self.timed:
            for b in blocks:
                if not b.ref_count and b.duration_s is not None and b.node is not None:
                    self._start_countdown(b)

    def _start_countdown(self, b: Block) -> None:
        b.expires_at = self.clock() + b.duration_s
        heapq.heappush(self.expiry, (b.expires_at, b.block_id))

    def take_free(self, count_alloc: bool) -> Block:
        """A clean primary block: the eviction victim, offloaded to the host tier or dropped."""
        return self.take_free_n(1, count_alloc)[0]

    def take_free_n(self, n: int, count_alloc: bool) -> list[Block]:
        """``n`` clean primary blocks, the same victims and moves as ``n`` calls of ``take_free`` (their removals
        announced together, ``_move_n``), booked in one pass: allocation is the ledger's hottest path."""
        out = self.eviction.take_n(PRIMARY, n)
        # ``take_n`` empties the lowest level first: the blocks with no key (level 0) come before the stored ones
        first = next((i for i, b in enumerate(out) if b.key is not None), n)
        if count_alloc:
            self.alloc_total += n
            self.alloc_new += first   # a block has a key exactly while it is in the tree
        if first < n:
            out[first:] = self._clean_n(out[first:])
        return out

    def _clean_n(self, victims: list[Block]) -> list[Block]:
        """Clean primary blocks in place of claimed stored ``victims``, in order, as ``_clean`` gives one victim after
        another: the victims earning it move to the host tier in one run (the host blocks they swap with are
        returned in their places), the others are dropped (and returned, clean).

        The host slots are the next ones ``take`` would claim there unless a victim moved before could come back
        as a later one's slot (the host tier has too few free blocks, or the victims' priorities are below those
        of its free blocks): then victim by victim.
        """
        evict = self.eviction
        min_priority = self.config.offload_min_priority
        movers = [b for b in victims if b.priority >= min_priority] if evict.num_free(SECONDARY) else []
        k = len(movers)
        if k > 1 and not 0 <= evict.level_at(SECONDARY, k) <= min(map(_priority, movers[:-1])) + 1:
            return [self._clean(b) for b in victims]
        hosts = evict.take_n(SECONDARY, k)
        every = k == len(victims)   # the common case: each victim swaps with the host block taken for it
        more = iter(hosts)
        dsts: list[Block | None] = hosts if every else [next(more) if k and b.priority >= min_priority else None
                                                         for b in victims]
        self._move_n(victims, dsts, SECONDARY)
        if k:
            evict.release_each(movers)
            self.offloaded += k
        return hosts if every else [b if d is None else d for b, d in zip(victims, dsts)]

    def _move_n(self, blocks: list[Block], dsts: list[Block | None], to: int) -> None:
        """Book a run of tier moves in order, in one pass (eviction is a hot path; ``_offload`` and ``_swap_in``
        book one): each of ``blocks`` swaps into tier ``to`` with its block of ``dsts`` there (clean, or stored and
        dropped first, as ``forget`` drops one), or is dropped where that is ``None``. The removals go out first, one
        event per tier naming every block it lost in order (as vLLM batches them: 64 events fewer to build, publish
        and index for a 64-block onboard), then each move's update in order; the copies are planned together,
        nothing is released."""
        window, frm = self.window, SECONDARY if to == PRIMARY else PRIMARY
        old, new = TIER_MEDIUM[frm], TIER_MEDIUM[to]
        self.pools.plan_n(frm, [b.slot for b, d in zip(blocks, dsts) if d is not None], to,
                          [d.slot for d in dsts if d is not None])
        events: list[KVEvent] = []
        put = events.append
        dropped: list[Block] = []   # victims dropped in place of a move: gone from tier ``frm``
        displaced: list[Block] = []   # stored blocks of tier ``to`` a move overwrites
        for b, d in zip(blocks, dsts):
            if d is None:
                dropped.append(b)
                continue
            if d.node is not None:
                displaced.append(d)
            b.slot, d.slot = d.slot, b.slot
            b.tier, d.tier = to, frm
            if b.block_hash is not None:   # positional: ``block_hash, old_medium, new_medium, priorities, group``
                put(BlockUpdated(b.block_hash, old, new, None, None, window))
        # each tier's removals as one event, before the moves (they name other blocks: the order between them is
        # the consumer's to ignore)
        removals = [BlockRemoved([g.block_hash for g in gone], medium, window)
                    for gone, medium in ((dropped, old), (displaced, new)) if gone]
        gone = dropped + displaced
        self.tree.detach_n(gone)
        self._wipe_n(gone)
        self.events.put_n(removals + events)

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
        dest = self.eviction.take(SECONDARY)
        self._move_n([b], [dest], SECONDARY)
        self.eviction.release(b)
        self.offloaded += 1
        return dest

    def onboard_n(self, blocks: list[Block]) -> None:
        """Bring claimed host-tier blocks back to the device before use, in order; each keeps its id and node.

        The device slots are the next victims whatever happens on the host tier (onboarding frees host slots only).
        Unless a victim earns a move to the host tier, where it could take the slot an earlier onboard vacated
        (then block by block), the victims are dropped and the copies, events and host releases booked in one pass.
        """
        if not blocks:
            return
        evict = self.eviction
        dsts = evict.take_n(PRIMARY, len(blocks))
        top = dsts[-1]   # ``take_n`` goes up the levels: the last victim has the highest, if any is stored
        if top.key is not None and top.priority >= self.config.offload_min_priority:
            for b, d in zip(blocks, dsts):
                self._swap_in(b, d if d.node is None else self._clean(d))
        else:
            self._move_n(blocks, dsts, PRIMARY)
            evict.release_each(dsts)
        self.onboarded += len(blocks)

    def _swap_in(self, b: Block, dst: Block) -> None:
        """Onboard host block ``b`` into clean primary block ``dst``'s slot; ``dst`` takes ``b``'s host slot, free."""
        self._move_n([b], [dst], PRIMARY)
        self.eviction.release(dst)

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
        self._wipe_n((b,))

    @staticmethod
    def _wipe_n(blocks: Iterable[Block]) -> None:
        """Forget what each block held, in one loop (a run of dropped victims)."""
        for b in blocks:
            b.key = b.block_hash = b.prev = None
            b.is_full = False
            b.priority, b.duration_s, b.expires_at = DEFAULT_PRIORITY, None, None
