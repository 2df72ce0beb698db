"""The router's default block store: ``PrefixIndex``'s answers from numpy arrays and compiled loops.

``PrefixIndex`` (``router.index``) is the reference: Python dicts, four
entries and several int objects per held block. ``ArrayIndex`` keeps the same
books in two open-addressing tables (``router.index_kernels``): per hash one
slot with the id of its holder mask (interned: as many 64-bit words as the
ranks' bits need, stored once per distinct set of holders) and its count of
host-only holders, and per ``(hash, rank)`` refs only where they
are not one device ref. A batch is encoded once into flat arrays and applied
whole by one compiled call; a probe is one compiled walk of the chain, one
lookup per block, so it needs no chain books to be fast.

The kernels compile on first call and are cached on disk; ``warm_kernels``
compiles them ahead (the router calls it before it reports ready).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from itertools import chain, repeat

import numpy as np

from kvledger.router import index_kernels as k
from kvledger.router.index import FlatStore, T, as_pair, check_rank, diverged, is_move
from kvledger.router.rank_bits import RankBits
from kvledger.router.refs import DEV_MASK, tier_unit
from kvledger.worker.wire.events import (EVENT_CLASS, BlockRemoved, BlockStored, BlockUpdated, EventBatch,
                                         decode_view, encode_batch)

logger = logging.getLogger(__name__)

_MIN_SLOTS = 1024
_MAX_LOAD = 0.8     # grow by half past this: linear probing stays short, and the tables stay dense


class _Table:
    """One open-addressing table's rows: ``[key, tag + 1, payload words...]`` (see ``router.index_kernels``)."""

    __slots__ = ("rows",)

    def __init__(self, slots: int, words: int) -> None:
        self.rows = np.zeros((slots, 2 + words), np.uint64)

    def grown(self, used: int, words: int, keyed: bool) -> _Table:
        """This table with room for ``used`` entries and ``words`` payload words (itself if it has both)."""
        slots = len(self.rows)
        if used <= _MAX_LOAD * slots and 2 + words == self.rows.shape[1]:
            return self
        while used > _MAX_LOAD * slots:
            slots += slots // 2
        new = _Table(slots, words)
        k.rehash(self.rows, new.rows, keyed)
        return new


class ArrayIndex(FlatStore):
    """The array-backed ``BlockIndex`` (see the module docstring); group 0 only, as ``PrefixIndex``."""

    __slots__ = ("_blocks", "_refs", "_pool", "_mtab", "_free", "_counts", "_bits", "_bit_of", "_out", "_bit_rank",
                 "_slots")

    def __init__(self, tokens_per_block: int) -> None:
        super().__init__(tokens_per_block)
        self._blocks = _Table(_MIN_SLOTS, 0)    # hash -> its holder mask's id and host-only holders
        self._refs = _Table(_MIN_SLOTS, 1)      # (hash, bit) -> packed refs, where not one device ref
        self._pool = np.zeros((_MIN_SLOTS, 2), np.uint64)   # mask id -> [refcount, words...]
        self._mtab = np.zeros(2 * _MIN_SLOTS, np.int64)     # the masks by content
        self._free = np.zeros(_MIN_SLOTS, np.int64)         # freed mask ids
        self._counts = np.zeros(k.FIXED_COUNTS + 2 * 64, np.int64)
        self._bits = RankBits()
        self._bit_of: dict[int, int] = {}        # rank -> its bit position
        self._out = np.zeros((7, 64), np.int64)  # a probe's answer (``index_kernels.match_walk``)
        self._bit_rank = np.zeros(64, np.int64)  # bit position -> its rank
        self._slots = np.zeros(1024, np.int64)   # a probe's scratch: the slot of each block

    # --- reading ------------------------------------------------------------

    def ranks(self) -> list[int]:
        """Ranks the store has a bit for, ascending."""
        return sorted(self._bit_of)

    def refs(self, rank: int, block_hash: int) -> tuple[int, int]:
        """``(device refs, host refs)`` that ``rank`` holds on ``block_hash``."""
        v = self.held_among(rank, [block_hash]).get(block_hash, 0)
        return v & DEV_MASK, v >> 32

    def held(self, rank: int) -> dict[int, int]:
        """``rank``'s packed refs per hash (a copy: one pass over the table)."""
        bit = self._bit_of.get(rank)
        if bit is None:
            return {}
        n = int(self._counts[k.FIXED_COUNTS + 2 * bit])
        hs, vs = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
        b, r = self._blocks, self._refs
        k.held(b.rows, r.rows, self._pool, bit, hs, vs, 0)
        return dict(zip(hs.tolist(), vs.tolist()))

    def held_among(self, rank: int, hashes: Sequence[int]) -> dict[int, int]:
        """``held(rank)`` restricted to ``hashes``, one lookup each."""
        bit = self._bit_of.get(rank)
        if bit is None or not hashes:
            return {}
        hs = np.array(hashes, np.uint64)
        vs = np.zeros(len(hs), np.uint64)
        b, r = self._blocks, self._refs
        k.refs_of(b.rows, r.rows, self._pool, bit, hs, vs)
        return {h: v for h, v in zip(hashes, vs.tolist()) if v}

    def holders(self, block_hash: int) -> list[int]:
        """Ranks holding ``block_hash`` on any tier, ascending."""
        return sorted(r for r in self._bit_of if self.held_among(r, [block_hash]))

    def num_blocks(self, rank: int | None = None) -> int:
        """Distinct hashes held by ``rank``, or by anyone when ``rank`` is None."""
        if rank is None:
            return int(self._counts[0])
        bit = self._bit_of.get(rank)
        return 0 if bit is None else int(self._counts[k.FIXED_COUNTS + 2 * bit])

    def host_only_blocks(self, rank: int) -> int:
        """Of ``rank``'s distinct hashes, those it holds on its host tier only (to onboard before reuse)."""
        bit = self._bit_of.get(rank)
        return 0 if bit is None else int(self._counts[k.FIXED_COUNTS + 2 * bit + 1])

    def longest_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Per rank holding ``hashes[0]``: ``(blocks, host-only blocks)`` of its longest held prefix."""
        return self.match(hashes, as_pair)

    def chain_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """``longest_prefixes`` (a chain is walked as any sequence)."""
        return self.match(hashes, as_pair)

    def match(self, hashes: Sequence[int], make: Callable[[int, int], T]) -> dict[int, T]:
        """``PrefixIndex.match``: per rank holding ``hashes[0]``, ``make(blocks, host-only blocks)`` of its held
        prefix, made once per run of ranks with one answer (so mostly once per distinct answer), in the reference's
        order (by blocks, then bit)."""
        n = len(hashes)
        if not n or not self._counts[0]:
            return {}
        if len(self._slots) < n:
            self._slots = np.zeros(2 * n, np.int64)
        out = self._out
        b, r = self._blocks, self._refs
        found, runs = k.match_walk(b.rows, r.rows, self._pool, self._bit_rank,
                                   np.fromiter(hashes, np.uint64, n), out, self._slots)
        if not found:
            return {}
        made = map(make, out[5, :runs].tolist(), out[6, :runs].tolist())
        return dict(zip(out[1, :found].tolist(), chain.from_iterable(map(repeat, made, out[4, :runs].tolist()))))

    # --- writing ------------------------------------------------------------

    def apply(self, rank: int, events: Sequence[object]) -> str | None:
        """``PrefixIndex.apply``: the events in order, all or none; ``None``, or why the batch was rolled back.
        ``BlockSizeError`` changes nothing."""
        self._check_sizes(rank, events)
        bit = self._bit(rank)
        ops: list[int] = []
        hs: list[int] = []
        clears = 0
        for i, ev in enumerate(events):
            t = EVENT_CLASS[type(ev)]
            if t is BlockStored or t is BlockRemoved:
                ops += (k.STORE if t is BlockStored else k.REMOVE, tier_unit(ev.medium), 0, len(ev.block_hashes), i)
                hs += ev.block_hashes
            elif t is BlockUpdated:
                if is_move(ev):
                    ops += (k.MOVE, tier_unit(ev.old_medium), tier_unit(ev.new_medium), 1, i)
                    hs.append(ev.block_hash)
            else:   # AllBlocksCleared, or KVCacheCreated opening a rank's numbering
                ops += (k.CLEAR, 0, 0, 0, i)
                clears += 1
        if not ops:
            return None
        log = len(hs) + clears * (self.num_blocks(rank) + len(hs))
        self._reserve(len(hs), log)
        b, r = self._blocks, self._refs
        i, h, unit = k.apply_ops(b.rows, r.rows, self._pool, self._mtab, self._free, self._counts, bit,
                                 np.array(ops, np.int64), np.fromiter(hs, np.uint64, len(hs)),
                                 np.zeros(log, np.uint64), np.zeros(log, np.uint64))
        if i < 0:
            return None
        what = "removes" if EVENT_CLASS[type(events[i])] is BlockRemoved else "moves"
        return diverged(int(i), what, int(h), int(unit))

    def _drop(self, rank: int) -> None:
        if rank in self._bit_of:
            self._purge(self._bit_of[rank])

    def _load_refs(self, rank: int, refs: dict[int, int]) -> None:
        check_rank(rank)
        bit = self._bit(rank)
        self._purge(bit)
        self._reserve(len(refs), len(refs))
        self._set_all(bit, np.array(list(refs), np.uint64), np.array(list(refs.values()), np.uint64))

    def remove_rank(self, rank: int) -> None:
        """Forget ``rank`` at once (it died): its blocks and its bit. Unknown ranks are ignored."""
        bit = self._bit_of.pop(rank, None)
        if bit is not None:
            self._purge(bit)
            self._bits.give_back(1 << bit)

    # --- internals ----------------------------------------------------------

    def _bit(self, rank: int) -> int:
        """``rank``'s bit position, taking the lowest free one (and widening the masks) for a new rank."""
        bit = self._bit_of.get(rank)
        if bit is not None:
            return bit
        bit = self._bit_of[rank] = self._bits.take(rank).bit_length() - 1
        words = bit // 64 + 1
        if words > self._pool.shape[1] - 1:
            self._set_pool(len(self._pool), words)
            self._counts = np.concatenate([self._counts, np.zeros(2 * 64, np.int64)])
            self._out = np.zeros((7, 64 * words), np.int64)
            self._bit_rank = np.concatenate([self._bit_rank, np.zeros(64, np.int64)])
        self._bit_rank[bit] = rank
        return bit

    def _reserve(self, entries: int, changes: int) -> None:
        """Room for ``entries`` more entries in each table (a batch adds at most one per hash) and for the new
        masks of ``changes`` changes and as many undone (at most one new mask each)."""
        self._blocks = self._blocks.grown(int(self._counts[0]) + entries, 0, False)
        self._refs = self._refs.grown(int(self._counts[1]) + entries, 1, True)
        rows = len(self._pool)
        while rows - 1 - self._counts[2] + self._counts[3] < 2 * changes:
            rows *= 2
        if rows != len(self._pool):
            self._set_pool(rows, self._pool.shape[1] - 1)

    def _set_pool(self, rows: int, words: int) -> None:
        """A mask pool of ``rows`` masks of ``words`` words, holding the masks of the one it replaces."""
        pool, free = np.zeros((rows, 1 + words), np.uint64), np.zeros(rows, np.int64)
        old = self._pool
        pool[:len(old), :old.shape[1]] = old
        free[:len(self._free)] = self._free
        self._pool, self._free, self._mtab = pool, free, np.zeros(2 * rows, np.int64)
        k.rebuild_masks(pool, self._mtab, self._counts)

    def _purge(self, bit: int) -> None:
        n = int(self._counts[k.FIXED_COUNTS + 2 * bit])
        if not n:
            return
        self._reserve(0, n)
        hs = np.zeros(n, np.uint64)
        b, r = self._blocks, self._refs
        k.held(b.rows, r.rows, self._pool, bit, hs, np.zeros(n, np.uint64), 0)
        self._set_all(bit, hs, np.zeros(n, np.uint64))

    def _set_all(self, bit: int, hs: np.ndarray, vs: np.ndarray) -> None:
        b, r = self._blocks, self._refs
        k.set_all(b.rows, r.rows, self._pool, self._mtab, self._free, self._counts, bit, hs, vs)


_WARM_BLOCKS = 5000
_WARM_WIDE_RANK = 100


@functools.cache
def warm_kernels() -> None:
    """Compile (or load from the disk cache) every kernel now, on a throwaway store and batch, so that no batch
    or probe of the router's pays for it; once a process."""
    logger.info("compiling the index kernels (once; cached on disk)")
    decode_view(encode_batch(EventBatch(0.0, [BlockStored([1], None, [1], 1)])))   # the token ids' check
    store = ArrayIndex(1)
    store.apply(0, [BlockStored([1, 2], None, [], 1), BlockRemoved([3])])
    many = list(range(10, 10 + _WARM_BLOCKS))   # past the first sizes: the tables' rehash and the masks' rebuild too
    store.apply(0, [BlockStored(many, None, [], 1)])
    store.apply(0, [BlockStored(many, None, [], 1)])   # a second ref each: the refs table grows
    store.apply(_WARM_WIDE_RANK, [BlockStored(many, None, [], 1)])   # a rank past 64 bits: wider masks
    store.load_snapshot(1, [])
    store.match([1, 2], as_pair)
    store.held(0)
    store.refs(0, 1)
    store.remove_rank(0)
