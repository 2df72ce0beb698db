"""The router's global prefix index: block hash -> the ranks holding it and on which tier.

Built only from the ranks' numbered event batches. Chained hashes name whole
prefixes, so the index is a flat map rather than a tree: ``holders[h]`` is a
bit mask of the ranks holding ``h`` on any tier, ``host_only[h]`` of those
holding it only on the host tier (each rank owns one bit, reused after it
leaves). Masks are plain ints: one AND per block walks every rank at once, and
the maps hold no container objects for the garbage collector to traverse.

Each rank's holdings are reference counts per (hash, tier) -- two stores of one
hash then one removal leave it held, as vLLM's block pool may hold two blocks
with one hash -- packed into one int: device refs in the low 32 bits, host refs
above. The per-rank map makes purging a rank O(its blocks).

Batches are numbered per rank from 0. ``apply`` applies the expected number,
ignores old ones, asks for a replay on a gap and for a snapshot on a restart (or
when an event contradicts the books, which means the view has diverged). Field
types and block sizes are checked before anything changes; a contradiction found
while applying rolls back what the batch did, so no batch is ever half applied.

Ranks may have different block sizes (real vLLM engines take multiples of 32
on the CPU, 16 on GPUs): each rank is indexed at its own (``set_block_size``;
``tokens_per_block`` is the default), and one flat map holds them all, since
chained hashes over blocks of different sizes never meet. A probe walks one
chain per block size in use (``block_sizes``).

A probe is a chain: each hash the child of the one before. The index keeps each
held hash's parent (as the first event to store it named it) and, per rank, how
many of its held blocks have each parent and how many it holds without their
parent ("orphans", left by an eviction in the middle of a chain). A rank with no
orphans holds whole prefixes only, so along a chain its blocks stop at one place
and ``chain_prefixes`` finds that place by bisection: one lookup every 32
blocks, then five per distinct match length, instead of one per block (run in
C by ``bisect`` while no rank at all holds orphans, since then the holder masks
themselves only shrink along a chain). Ranks
with orphans, or holdings of unknown parents (a snapshot), are walked block by
block as ``longest_prefixes`` walks any sequence of hashes.

A model with attention windows (VSWA) publishes its blocks per KV cache group
(``group_idx``). The flat maps hold group 0, as for every model; a rank whose
events name another group or a sliding window keeps its groups in
``router/groups.py`` too, and a probe answers for it by the safe-prefix rule:
a prefix counts only as far as every group can serve it. Ranks without
windows pay one check per probe and per event for this.
"""
from __future__ import annotations

import enum
import heapq
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import and_, ne, not_, or_
from typing import Protocol, TypeVar

from kvledger.router.groups import RankGroups, is_windowed
from kvledger.worker.wire.events import (EVENT_CLASS, AllBlocksCleared, BatchView, BlockRemoved, BlockStored,
                                         BlockUpdated, EventBatch, KVCacheCreated, Medium, check_event, check_hash,
                                         check_medium, decode_view)

_DEV = 1                  # one device-tier ref
_HOST = 1 << 32           # one host-tier ref
_DEV_MASK = _HOST - 1
_UNKNOWN = object()       # a parent the index was never told
_GRID = 32                # blocks between the probes of a chain's first pass
T = TypeVar("T")          # what a probe's caller makes of one match


def _pair(blocks: int, host_blocks: int) -> tuple[int, int]:
    return blocks, host_blocks


def _tier_unit(medium: Medium | None) -> int:
    """The packed increment for one ref on ``medium`` (``None`` = unspecified = device, as vLLM means it)."""
    return _HOST if medium == "CPU" else _DEV


class BlockSizeError(ValueError):
    """An event's block size is not the one its rank is indexed at."""


class ApplyStatus(enum.Enum):
    """What ``PrefixIndex.apply`` did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """An old number (already applied): ignored."""
    REPLAY = "replay"
    """A gap: the batch was not applied; fetch the rank's batches from ``replay_from`` and apply them in order."""
    SNAPSHOT = "snapshot"
    """Restart or divergence: nothing applied until ``load_snapshot`` rebuilds the rank."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of one ``apply``; ``next_seq`` is the number the index expects next from the rank."""

    status: ApplyStatus
    next_seq: int
    reason: str = ""

    @property
    def applied(self) -> bool:
        return self.status is ApplyStatus.APPLIED

    @property
    def replay_from(self) -> int | None:
        """The first batch number to fetch again, when the status is ``REPLAY``."""
        return self.next_seq if self.status is ApplyStatus.REPLAY else None


class SnapshotEntry(Protocol):
    """One block a rank holds, as its snapshot lists it (``kvledger.worker.wire.batches.StoredBlock`` is one)."""

    @property
    def block_hash(self) -> int: ...

    @property
    def medium(self) -> str: ...


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """The least a snapshot entry carries; a hash listed twice holds two refs."""

    block_hash: int
    medium: Medium = "GPU"


@dataclass(slots=True)
class IndexStats:
    """Counters for the edges to export; the core does not know how they are shown."""

    batches_applied: int = 0
    batches_duplicate: int = 0
    replays_requested: int = 0
    snapshots_requested: int = 0
    snapshots_loaded: int = 0


@dataclass(slots=True)
class _Feed:
    """One rank's numbering, its bit in the holder masks, its holdings, and how they chain."""

    next_seq: int
    bit: int
    refs: dict[int, int] = field(default_factory=dict)   # hash -> device refs | host refs << 32
    awaiting_snapshot: bool = False
    kids: dict[int, int] = field(default_factory=dict)   # hash -> held blocks whose parent it is
    orphans: int = 0          # held blocks whose parent is not held
    untracked: bool = False   # holds blocks of unknown parent: chains are walked block by block
    groups: RankGroups | None = None   # a windowed rank's KV cache groups (its blocks of groups 1..)
    rank: int = -1


class PrefixIndex:
    """Block hash -> holding ranks and tiers, from numbered event batches (see the module docstring)."""

    __slots__ = ("tokens_per_block", "stats", "_holders", "_host_only", "_feeds", "_slot_rank", "_free_slots",
                 "_block_sizes", "_parents", "_walked", "_mask_ranks", "_windowed")

    def __init__(self, tokens_per_block: int) -> None:
        if type(tokens_per_block) is not int or tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
        self.tokens_per_block = tokens_per_block
        self.stats = IndexStats()
        self._holders: dict[int, int] = {}     # hash -> mask of the ranks' bits, any tier
        self._host_only: dict[int, int] = {}   # hash -> mask of ranks holding it on the host tier only
        self._feeds: dict[int, _Feed] = {}
        self._slot_rank: list[int | None] = []  # bit position -> rank
        self._free_slots: list[int] = []        # min-heap of freed bit positions
        self._block_sizes: dict[int, int] = {}  # rank -> its block size, where not tokens_per_block
        self._parents: dict[int, int | None] = {}  # hash -> its parent; also stale entries, dropped in bulk
        self._walked = 0                          # mask of the ranks with orphans or untracked holdings
        self._mask_ranks: dict[int, tuple[int, ...]] = {}   # mask -> its ranks, for answers (holder sets repeat)
        self._windowed: dict[int, _Feed] = {}   # rank -> its feed, for ranks whose models have attention windows

    # --- reading ------------------------------------------------------------

    def ranks(self) -> list[int]:
        """Ranks the index has heard from, ascending."""
        return sorted(self._feeds)

    def block_size(self, rank: int) -> int:
        """Tokens per block of ``rank``'s events."""
        return self._block_sizes.get(rank, self.tokens_per_block)

    def other_block_sizes(self) -> set[int]:
        """The block sizes other than ``tokens_per_block`` that some rank is indexed at (mostly none)."""
        return set(self._block_sizes.values())

    def next_seq(self, rank: int) -> int:
        """The batch number expected next from ``rank`` (0 for a rank never heard from)."""
        feed = self._feeds.get(rank)
        return 0 if feed is None else feed.next_seq

    def awaiting_snapshot(self, rank: int) -> bool:
        feed = self._feeds.get(rank)
        return feed is not None and feed.awaiting_snapshot

    def refs(self, rank: int, block_hash: int) -> tuple[int, int]:
        """``(device refs, host refs)`` that ``rank`` holds on ``block_hash``."""
        feed = self._feeds.get(rank)
        v = 0 if feed is None else feed.refs.get(block_hash, 0)
        return v & _DEV_MASK, v >> 32

    def holders(self, block_hash: int) -> list[int]:
        """Ranks holding ``block_hash`` on any tier, ascending."""
        return sorted(self._ranks_in(self._holders.get(block_hash, 0)))

    def num_blocks(self, rank: int | None = None) -> int:
        """Distinct hashes held by ``rank``, or by anyone when ``rank`` is None."""
        if rank is None:
            return len(self._holders)
        feed = self._feeds.get(rank)
        return 0 if feed is None else len(feed.refs)

    def longest_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Per rank holding ``hashes[0]``: ``(blocks, host-only blocks)`` of its longest held prefix of the
        sequence, checking every block (any sequence of hashes; ``chain_prefixes`` is the probe's)."""
        n = len(hashes)
        active = self._holders.get(hashes[0], 0) if n else 0
        if not active:
            return self._answer(hashes, [], _pair) if self._windowed and n else {}
        return self._answer(hashes, self._walk(hashes, active), _pair)

    def chain_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """``longest_prefixes`` of a chain (each hash the child of the one before, as ``prompt_hashes`` makes
        them and ledgers publish them), by bisection where the ranks hold whole prefixes only.

        Where each match ends, the block's recorded parent must be the hash before it; a sequence that is
        found not to be one chain is walked block by block instead.
        """
        return self.chain_matches(hashes, _pair)

    def chain_matches(self, hashes: Sequence[int], make: Callable[[int, int], T]) -> dict[int, T]:
        """``chain_prefixes``, with each distinct ``(blocks, host-only blocks)`` made into
        ``make(blocks, host_blocks)`` once and shared by its ranks: the probe's form, which saves a tuple per
        rank and hashing it to share what it makes."""
        holders = self._holders
        n = len(hashes)
        active = holders.get(hashes[0], 0) if n else 0
        if not active:
            return self._answer(hashes, [], make) if self._windowed and n else {}
        if active & self._walked:
            return self._answer(hashes, self._walk(hashes, active), make)
        # Each rank of ``first`` holds a prefix of the chain, so the ranks of ``first`` holding block j only
        # shrink as j grows. Read them on a grid (one C-level pass), then bisect each grid step where they
        # shrink down to the blocks where they do.
        get, parents, first = holders.get, self._parents, active
        # With no rank holding orphans, every holder of a chain's block holds its first block too: the masks
        # themselves shrink along the chain, so they grow along it reversed and ``bisect`` searches them in C.
        back = None if self._walked else hashes[::-1]
        grid = list(range(0, n - 1, _GRID))
        grid.append(n - 1)
        held = list(map(and_, map(get, hashes[0:n - 1:_GRID], repeat(0)), repeat(first)))
        held.append(get(hashes[n - 1], 0) & first)
        grid.append(n)
        held.append(0)
        ends: list[tuple[int, int]] = []
        for k in compress(range(len(grid) - 1), map(ne, held, held[1:])):
            lo, m_lo, top, m_top = grid[k], held[k], grid[k + 1], held[k + 1]
            while m_lo != m_top:   # the first block past ``lo`` where fewer ranks hold on: (lo, top]
                if back is not None and m_top:   # no block of (lo, top] is unheld, if ``hashes`` is one chain
                    try:
                        b = n - bisect_left(back, m_lo, n - 1 - top, n - 1 - lo, key=get)
                    except TypeError:   # an unheld block (None) after all: not one chain
                        return self._answer(hashes, self._walk(hashes, first), make)
                    a, m_b = b - 1, get(hashes[b], 0)
                else:
                    a, b, m_b = lo, top, m_top
                    while b - a > 1:
                        mid = (a + b) >> 1
                        m = get(hashes[mid], 0) & first
                        if m == m_lo:
                            a = mid
                        else:
                            b, m_b = mid, m
                if m_b & ~m_lo or (a and parents.get(hashes[a], _UNKNOWN) != hashes[a - 1]):
                    return self._answer(hashes, self._walk(hashes, first), make)   # not one chain
                ends.append((m_lo & ~m_b, b))
                lo, m_lo = b, m_b
        return self._answer(hashes, ends, make)

    def _walk(self, hashes: Sequence[int], active: int) -> list[tuple[int, int]]:
        """``(ranks' bits, blocks they matched)`` from one lookup per block, ``active`` holding ``hashes[0]``.

        Consecutive blocks mostly have the same holders, so the common step is one dict lookup and one
        comparison with the previous mask, whatever the number of ranks; Python only does more where the
        holders change.
        """
        holders = self._holders
        ends: list[tuple[int, int]] = []
        end, prev = len(hashes), active
        for j, m in enumerate(map(holders.get, hashes)):
            if m != prev:
                if m is None or active & m != active:   # some rank of ``active`` lacks block j
                    if m is not None:
                        ends.append((active & ~m, j))
                        active &= m
                    if m is None or not active:
                        end = j
                        break
                prev = m
        ends.append((active, end))
        return ends

    def _answer(self, hashes: Sequence[int], ends: list[tuple[int, int]], make: Callable[[int, int], T],
                ) -> dict[int, T]:
        """Per rank of ``ends`` (in no set order): ``make`` of its match and the host-only blocks within it."""
        host: dict[int, int] = {}   # bit -> host-only blocks within its match
        if self._host_only and ends:
            longest = max(matched for bits, matched in ends if bits)
            host_masks = list(map(self._host_only.get, hashes[:longest], repeat(0)))
            for j in compress(range(longest), host_masks):   # only blocks some rank holds on the host tier
                for bits, matched in ends:
                    hit = host_masks[j] & bits
                    while hit and matched > j:
                        low = hit & -hit
                        host[low] = host.get(low, 0) + 1
                        hit ^= low
        out: dict[int, T] = {}
        if not host and ends:   # one answer for the ranks of each end, none holding a block on the host tier only
            masks, at = zip(*ends)
            groups = list(map(self._mask_ranks.get, masks))
            if None in groups:
                groups = list(map(self._ranks_of, masks))
            # A plain loop: cheaper here than ``dict(zip(...))`` of chained ``repeat``s (an object per end)
            for ranks, answer in zip(groups, map(make, at, repeat(0))):
                for rank in ranks:
                    out[rank] = answer
        else:
            made: dict[tuple[int, int], T] = {}
            slot_rank = self._slot_rank
            for bits, matched in ends:
                while bits:
                    low = bits & -bits
                    rank = slot_rank[low.bit_length() - 1]
                    assert rank is not None, "a freed slot's bit was left in a mask"
                    key = (matched, host.get(low, 0))
                    got = made.get(key)
                    out[rank] = made[key] = make(*key) if got is None else got
                    bits ^= low
        return self._answer_windowed(hashes, out, make) if self._windowed else out

    def _answer_windowed(self, hashes: Sequence[int], out: dict[int, T], make: Callable[[int, int], T],
                         ) -> dict[int, T]:
        """``out`` with each windowed rank's match by the safe-prefix rule over its groups instead."""
        for rank, feed in self._windowed.items():
            found = feed.groups.match(feed.refs, hashes, self.block_size(rank))
            if found[0]:
                out[rank] = make(*found)
            else:
                out.pop(rank, None)
        return out

    def _ranks_of(self, mask: int) -> tuple[int, ...]:
        """The ranks of ``mask``, remembered: a probe's answer reuses the same few holder sets."""
        ranks = self._mask_ranks.get(mask)
        if ranks is None:
            if len(self._mask_ranks) >= 4096:
                self._mask_ranks.clear()
            ranks = self._mask_ranks[mask] = tuple(self._ranks_in(mask))
        return ranks

    # --- writing ------------------------------------------------------------

    def apply(self, rank: int, seq: int, batch: EventBatch) -> ApplyResult:
        """Apply batch number ``seq`` of ``rank`` if it is the next one (see ``ApplyStatus`` otherwise).

        Malformed events raise ``TypeError``/``ValueError`` and change nothing.
        """
        if not isinstance(batch, EventBatch):
            raise TypeError(f"batch must be a kvledger.worker.wire.events.EventBatch, got {type(batch).__name__}")
        events = batch.events
        if type(events) is not list:
            raise TypeError(f"batch.events must be a list, got {type(events).__name__}")
        for i, ev in enumerate(events):
            check_event(ev, f"events[{i}]")
        return self._apply(rank, seq, batch)

    def apply_bytes(self, rank: int, seq: int, data: bytes) -> ApplyResult:
        """Decode a wire batch (``kvledger.worker.wire.events.decode_view``: every field is checked, token ids
        checked to be non-negative ints and dropped) and apply it.

        Raises ``EventDecodeError`` (a ``ValueError``) for malformed bytes, changing nothing.
        """
        return self._apply(rank, seq, decode_view(data))

    def set_block_size(self, rank: int, block_size: int) -> None:
        """Index ``rank`` at ``block_size`` tokens per block from now on (it keeps it across ``remove_rank``).

        Changing a rank's size drops what it holds: its old hashes are of another chain.
        """
        _check_rank(rank)
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if block_size == self.block_size(rank):
            return
        feed = self._feeds.get(rank)
        if feed is not None:
            self._purge(feed)
            self._settle(feed)
        if block_size == self.tokens_per_block:
            self._block_sizes.pop(rank, None)
        else:
            self._block_sizes[rank] = block_size

    def load_snapshot(self, rank: int, blocks: Iterable[SnapshotEntry], next_seq: int) -> None:
        """Rebuild ``rank``'s holdings from nothing; batches continue at ``next_seq``."""
        _check_rank(rank)
        _check_seq(next_seq, "next_seq")
        refs: dict[int, int] = {}
        grouped: list[tuple[int, int, int]] = []   # (group, hash, unit) of groups 1..
        described: dict[int, tuple[str | None, int | None]] = {}   # group -> (kind, window), where windowed
        for i, b in enumerate(blocks):
            try:
                h, medium = b.block_hash, b.medium
            except AttributeError:
                raise TypeError(f"blocks[{i}] must have block_hash and medium (e.g. SnapshotBlock), "
                                f"got {type(b).__name__}") from None
            h = check_hash(h, f"blocks[{i}].block_hash")
            if check_medium(medium, f"blocks[{i}].medium") is None:
                raise ValueError(f"blocks[{i}].medium must be 'GPU' or 'CPU', got None")
            g, kind = getattr(b, "group_idx", 0), getattr(b, "kv_cache_spec_kind", None)
            if type(g) is not int or g < 0:
                raise ValueError(f"blocks[{i}].group_idx must be an int >= 0, got {g!r}")
            if is_windowed(g, kind):
                described[g] = (kind, getattr(b, "kv_cache_spec_sliding_window", None))
            if g:
                grouped.append((g, h, _tier_unit(medium)))
            else:
                refs[h] = refs.get(h, 0) + _tier_unit(medium)
        feed = self._feeds.get(rank)
        if feed is None:
            feed = self._new_feed(rank)
        else:
            self._purge(feed)
        feed.next_seq, feed.awaiting_snapshot = next_seq, False
        self._install(feed, refs)
        for g, (kind, window) in described.items():
            self._groups_of(feed).describe(g, kind, window)
        for g, h, unit in grouped:
            self._groups_of(feed).add(g, h, unit)
        self._settle(feed)
        self.stats.snapshots_loaded += 1

    def remove_rank(self, rank: int) -> None:
        """Forget ``rank`` at once (it died): its blocks and its numbering. Unknown ranks are ignored."""
        feed = self._feeds.pop(rank, None)
        self._windowed.pop(rank, None)
        if feed is not None:
            self._purge(feed)
            self._walked &= ~feed.bit
            self._mask_ranks.clear()   # its bit will be another rank's
            slot = feed.bit.bit_length() - 1
            self._slot_rank[slot] = None
            heapq.heappush(self._free_slots, slot)

    # --- internals ----------------------------------------------------------

    def _new_feed(self, rank: int) -> _Feed:
        """A feed with the lowest free bit, so masks stay as short as the cluster is small."""
        self._mask_ranks.clear()   # a bit gets its rank
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._slot_rank[slot] = rank
        else:
            slot = len(self._slot_rank)
            self._slot_rank.append(rank)
        feed = self._feeds[rank] = _Feed(0, 1 << slot, rank=rank)
        return feed

    def _groups_of(self, feed: _Feed) -> RankGroups:
        """The groups of ``feed``'s rank, which its events just showed to be windowed."""
        if feed.groups is None:
            feed.groups = RankGroups()
            self._windowed[feed.rank] = feed
        return feed.groups

    def _ranks_in(self, mask: int) -> list[int]:
        out = []
        while mask:
            low = mask & -mask
            rank = self._slot_rank[low.bit_length() - 1]
            assert rank is not None, "a freed slot's bit was left in a mask"
            out.append(rank)
            mask ^= low
        return out

    def _apply(self, rank: int, seq: int, batch: EventBatch | BatchView) -> ApplyResult:
        _check_rank(rank)
        _check_seq(seq, "seq")
        if batch.rank is not None and batch.rank != rank:
            raise ValueError(f"batch says rank {batch.rank} but was applied as rank {rank}")
        feed = self._feeds.get(rank)
        expected = 0 if feed is None else feed.next_seq
        if feed is not None and feed.awaiting_snapshot:
            return ApplyResult(ApplyStatus.SNAPSHOT, expected, "still waiting for a snapshot")
        if seq == 0 and expected > 0:
            assert feed is not None
            return self._restart(feed, "numbering restarted at 0: the rank restarted")
        if seq < expected:
            self.stats.batches_duplicate += 1
            return ApplyResult(ApplyStatus.DUPLICATE, expected)
        if seq > expected:
            self.stats.replays_requested += 1
            return ApplyResult(ApplyStatus.REPLAY, expected, f"got batch {seq}, expected {expected}")
        events = batch.events
        restart = self._check_sizes(rank, seq, events)
        if feed is None:
            feed = self._new_feed(rank)
        if restart is not None:
            return self._restart(feed, restart)
        diverged = self._commit(feed, events)
        self._settle(feed)
        if diverged is not None:
            return self._ask_snapshot(feed, diverged)
        feed.next_seq = seq + 1
        self.stats.batches_applied += 1
        return ApplyResult(ApplyStatus.APPLIED, seq + 1)

    def _check_sizes(self, rank: int, seq: int, events: Sequence[object]) -> str | None:
        """Raise on a block size that is not the rank's; say why, if the batch shows the rank restarted."""
        tpb = self.block_size(rank)
        for i, ev in enumerate(events):
            t = EVENT_CLASS[type(ev)]
            if (t is BlockStored or t is KVCacheCreated) and ev.block_size != tpb:
                raise BlockSizeError(f"events[{i}]: {t.__name__}.block_size {ev.block_size} differs from rank "
                                     f"{rank}'s {tpb} tokens per block; blocks of another size never match")
            if t is KVCacheCreated:
                if seq > 0:
                    return f"KVCacheCreated in batch {seq}: the rank restarted"
        return None

    def _commit(self, feed: _Feed, events: Sequence[object]) -> str | None:
        """Apply the events in order. A removal or move of a block the rank does not hold on that tier
        means our view diverged: everything this batch did is rolled back and the reason returned.

        Checking as we go keeps the common path free of a second pass over every hash.
        """
        holders = self._holders
        hget = holders.get
        bit = feed.bit
        cleared: list[tuple[dict[int, int], dict[int, dict[int, int]] | None]] = []   # what each clear dropped
        for i, ev in enumerate(events):
            t = EVENT_CLASS[type(ev)]
            refs = feed.refs
            if t is BlockStored:
                if feed.groups is not None or is_windowed(ev.group_idx, ev.kv_cache_spec_kind):
                    if self._commit_grouped(feed, t, ev):
                        continue
                hs = ev.block_hashes
                if ev.medium != "CPU" and refs.keys().isdisjoint(hs):
                    # The common case, new device blocks: one C-level update for the refs.
                    fresh = dict.fromkeys(hs, _DEV)
                    if len(fresh) == len(hs):
                        refs.update(fresh)
                        holders.update(zip(hs, map(or_, map(hget, hs, repeat(0)), repeat(bit))))
                        self._link_run(feed, hs, ev.parent_block_hash)
                        continue
                unit = _tier_unit(ev.medium)
                for h, parent in zip(hs, chain((ev.parent_block_hash,), hs)):
                    self._add(feed, h, unit, parent)
            elif t is BlockRemoved:
                if ev.group_idx or feed.groups is not None:
                    done = self._commit_grouped(feed, t, ev)
                    if done is None:
                        return self._group_diverged(feed, events, i, cleared)
                    if done:
                        continue
                unit = _tier_unit(ev.medium)
                hs = ev.block_hashes
                if unit == _DEV and self._drop_run(feed, hs):
                    continue
                for j, h in enumerate(hs):
                    v = refs.get(h, 0)
                    if v == unit:   # its last ref: the common case
                        del refs[h]
                        m = holders[h] & ~bit
                        if m:
                            holders[h] = m
                        else:
                            del holders[h]
                        if unit == _HOST:
                            self._clear_host_only(h, bit)
                        self._unlink(feed, h)
                    elif _held(v, unit):
                        self._sub(feed, h, unit)
                    else:
                        self._roll_back(feed, events, i, j, cleared)
                        return _diverged(i, "removes", h, unit)
            elif t is BlockUpdated:
                if ev.group_idx:
                    if self._commit_grouped(feed, t, ev) is None:
                        return self._group_diverged(feed, events, i, cleared)
                elif _is_move(ev):
                    old = _tier_unit(ev.old_medium)
                    if not _held(refs.get(ev.block_hash, 0), old):
                        self._roll_back(feed, events, i, 0, cleared)
                        return _diverged(i, "moves", ev.block_hash, old)
                    # add before taking away, so the block never looks absent mid-move
                    self._add(feed, ev.block_hash, _tier_unit(ev.new_medium), _UNKNOWN)
                    self._sub(feed, ev.block_hash, old)
            else:  # AllBlocksCleared, or KVCacheCreated opening batch 0
                cleared.append((refs, None if feed.groups is None else feed.groups.refs))
                self._purge(feed)
        return None

    def _group_diverged(self, feed: _Feed, events: Sequence[object], i: int,
                        cleared: list[tuple[dict[int, int], dict[int, dict[int, int]] | None]]) -> str:
        """Roll the batch back before ``events[i]``, whose group does not hold what it removes or moves."""
        self._roll_back(feed, events, i, 0, cleared)
        return f"events[{i}] removes or moves a block that group {events[i].group_idx} does not hold: the index has " \
               "diverged"

    def _commit_grouped(self, feed: _Feed, t: type, ev: object) -> bool | None:
        """Apply an event of a windowed rank's group 1.. (``True``), or describe its group 0 and leave the event to
        the flat maps (``False``); ``None``, changing nothing, for a removal or move of a block the group does not
        hold (the caller rolls back)."""
        g = ev.group_idx
        if t is BlockStored:
            self._groups_of(feed).describe(g, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
            if not g:
                return False
            unit = _tier_unit(ev.medium)
            for h in ev.block_hashes:
                feed.groups.add(g, h, unit)
            return True
        if not g:
            return False
        groups = self._groups_of(feed)
        if t is BlockRemoved:
            unit = _tier_unit(ev.medium)
            for j, h in enumerate(ev.block_hashes):
                if not groups.sub(g, h, unit):
                    for back in reversed(ev.block_hashes[:j]):
                        groups.add(g, back, unit)
                    return None
            return True
        if _is_move(ev):
            if not groups.sub(g, ev.block_hash, _tier_unit(ev.old_medium)):
                return None
            groups.add(g, ev.block_hash, _tier_unit(ev.new_medium))
        return True

    def _roll_back(self, feed: _Feed, events: Sequence[object], i: int, j: int,
                   cleared: list[dict[int, int]]) -> None:
        """Undo ``events[:i]`` and the first ``j`` hashes of ``events[i]`` (a removal), newest first."""
        ev = events[i]
        parents = self._parents
        if EVENT_CLASS[type(ev)] is BlockRemoved:
            unit = _tier_unit(ev.medium)
            for h in reversed(ev.block_hashes[:j]):
                self._add(feed, h, unit, parents.get(h, _UNKNOWN))
        for ev in reversed(events[:i]):
            t = EVENT_CLASS[type(ev)]
            if t is not AllBlocksCleared and t is not KVCacheCreated and ev.group_idx:
                self._undo_grouped(feed.groups, t, ev)
            elif t is BlockStored:
                unit = _tier_unit(ev.medium)
                for h in reversed(ev.block_hashes):
                    self._sub(feed, h, unit)
            elif t is BlockRemoved:
                unit = _tier_unit(ev.medium)
                for h in reversed(ev.block_hashes):
                    self._add(feed, h, unit, parents.get(h, _UNKNOWN))
            elif t is BlockUpdated:
                if _is_move(ev):
                    self._add(feed, ev.block_hash, _tier_unit(ev.old_medium), _UNKNOWN)
                    self._sub(feed, ev.block_hash, _tier_unit(ev.new_medium))
            else:   # the holdings are empty again, as right after the clear
                refs, grouped = cleared.pop()
                self._install(feed, refs)
                if grouped is not None:
                    feed.groups.refs = grouped

    @staticmethod
    def _undo_grouped(groups: RankGroups, t: type, ev: object) -> None:
        """Undo an applied event of a group 1.."""
        g = ev.group_idx
        if t is BlockStored:
            for h in reversed(ev.block_hashes):
                groups.sub(g, h, _tier_unit(ev.medium))
        elif t is BlockRemoved:
            for h in reversed(ev.block_hashes):
                groups.add(g, h, _tier_unit(ev.medium))
        elif _is_move(ev):
            groups.add(g, ev.block_hash, _tier_unit(ev.old_medium))
            groups.sub(g, ev.block_hash, _tier_unit(ev.new_medium))

    def _add(self, feed: _Feed, h: int, unit: int, parent: object) -> None:
        """One more ref on ``h``; ``parent`` is its parent if this makes the rank hold it (else unused)."""
        refs, bit = feed.refs, feed.bit
        v = refs.get(h, 0)
        refs[h] = w = v + unit
        if v == 0:
            self._holders[h] = self._holders.get(h, 0) | bit
            self._link(feed, h, parent)
        was_host_only = v != 0 and not v & _DEV_MASK
        if not w & _DEV_MASK:
            if not was_host_only:
                self._host_only[h] = self._host_only.get(h, 0) | bit
        elif was_host_only:
            self._clear_host_only(h, bit)

    def _sub(self, feed: _Feed, h: int, unit: int) -> None:
        refs, bit = feed.refs, feed.bit
        v = refs[h]
        w = v - unit
        was_host_only = not v & _DEV_MASK
        if w == 0:
            del refs[h]
            m = self._holders[h] & ~bit
            if m:
                self._holders[h] = m
            else:
                del self._holders[h]
            if was_host_only:
                self._clear_host_only(h, bit)
            self._unlink(feed, h)
            return
        refs[h] = w
        if not w & _DEV_MASK and not was_host_only:
            self._host_only[h] = self._host_only.get(h, 0) | bit

    # --- chains: parents, and each rank's orphans ---------------------------

    def _link_run(self, feed: _Feed, hs: list[int], parent: int | None) -> None:
        """``hs`` (a stored run, each the child of the one before, the first of ``parent``) just became held."""
        if feed.untracked:
            return
        expected = [parent, *hs[:-1]]
        got = list(map(self._parents.setdefault, hs, expected))   # the first parent the index was told
        kids = feed.kids
        if got != expected or feed.orphans:
            healed = sum(map(kids.get, hs, repeat(0)))   # held children of blocks not held until now: orphans
            for p in got:
                if p is not None:
                    kids[p] = kids.get(p, 0) + 1
            refs = feed.refs
            feed.orphans += sum(1 for p in got if p is not None and p not in refs) - healed
            return
        # Every held block's parent is held, so no kid count is keyed by a block not held, as ``hs`` were.
        kids.update(dict.fromkeys(hs[:-1], 1))
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1
            if parent not in feed.refs:
                feed.orphans += 1

    def _drop_run(self, feed: _Feed, hs: list[int]) -> bool:
        """Remove device blocks ``hs`` in bulk if the rank holds each once, on the device tier only (the
        common eviction); else change nothing and say so."""
        refs, holders = feed.refs, self._holders
        took = list(map(refs.pop, hs, repeat(0)))   # a hash listed twice takes 0 the second time
        if took.count(_DEV) != len(hs):
            refs.update(compress(zip(hs, took), took))   # put back what was taken
            return False
        masks = list(map(and_, map(holders.__getitem__, hs), repeat(~feed.bit)))
        holders.update(zip(hs, masks))
        if 0 in masks:
            deque(map(holders.__delitem__, compress(hs, map(not_, masks))), 0)
        if not feed.untracked:
            self._unlink_run(feed, hs)
        return True

    def _unlink_run(self, feed: _Feed, hs: list[int]) -> None:
        """``hs`` (distinct) just stopped being held, all of them (gone from ``feed.refs`` already)."""
        kids, refs = feed.kids, feed.refs
        ps = list(map(self._parents.__getitem__, hs))
        first = ps[0]
        if ps[1:] == hs[:-1] and first not in hs:
            took = list(map(kids.pop, hs[:-1], repeat(0)))
            if took.count(1) == len(took):
                # A chain whose blocks but the last had one held child each: a tail evicted root first.
                lost = first is not None and first not in refs
                if first is not None:
                    _one_kid_fewer(kids, first)
                feed.orphans += kids.get(hs[-1], 0) - lost
                return
            kids.update(compress(zip(hs, took), took))   # put back what was taken
        gone = set(hs)
        lost = sum(1 for p in ps if p is not None and p not in refs and p not in gone)   # orphans removed
        for p in ps:
            if p is not None:
                _one_kid_fewer(kids, p)
        feed.orphans += sum(map(kids.get, hs, repeat(0))) - lost   # held children of removed blocks: orphans

    def _link(self, feed: _Feed, h: int, parent: object) -> None:
        """``h`` just became held, after ``parent`` (``_UNKNOWN``: not said; ``None``: a chain's first block)."""
        if feed.untracked:
            return
        known = self._parents.get(h, _UNKNOWN)
        if known is _UNKNOWN:
            if parent is _UNKNOWN:
                feed.untracked = True
                return
            self._parents[h] = known = parent
        self._count_link(feed, h, known)

    def _count_link(self, feed: _Feed, h: int, parent: int | None) -> None:
        kids = feed.kids
        if parent is not None:
            kids[parent] = kids.get(parent, 0) + 1
            if parent not in feed.refs:
                feed.orphans += 1
        feed.orphans -= kids.get(h, 0)   # its held children were orphans

    def _unlink(self, feed: _Feed, h: int) -> None:
        """``h`` just stopped being held (its entry in ``feed.refs`` is gone)."""
        if feed.untracked:
            return
        parent = self._parents[h]
        kids = feed.kids
        if parent is not None:
            _one_kid_fewer(kids, parent)
            if parent not in feed.refs:
                feed.orphans -= 1
        feed.orphans += kids.get(h, 0)

    def _settle(self, feed: _Feed) -> None:
        """After a change of ``feed``'s holdings: its bit in ``_walked``, and stale parents dropped in bulk."""
        if feed.orphans or feed.untracked:
            self._walked |= feed.bit
        else:
            self._walked &= ~feed.bit
        if len(self._parents) > 2 * len(self._holders) + 4096:
            holders = self._holders
            self._parents = {h: p for h, p in self._parents.items() if h in holders}

    def _install(self, feed: _Feed, refs: dict[int, int]) -> None:
        """Make ``refs`` the holdings of a feed that holds nothing."""
        assert not feed.refs, "install over live holdings"
        feed.refs = refs
        bit, holders, host_only = feed.bit, self._holders, self._host_only
        for h, v in refs.items():
            holders[h] = holders.get(h, 0) | bit
            if not v & _DEV_MASK:
                host_only[h] = host_only.get(h, 0) | bit
        parents = list(map(self._parents.get, refs, repeat(_UNKNOWN)))
        if _UNKNOWN in parents:
            feed.untracked = True
            return
        feed.kids = dict(Counter(p for p in parents if p is not None))
        feed.orphans = sum(1 for p in parents if p is not None and p not in refs)

    def _clear_host_only(self, h: int, bit: int) -> None:
        m = self._host_only[h] & ~bit
        if m:
            self._host_only[h] = m
        else:
            del self._host_only[h]

    def _purge(self, feed: _Feed) -> None:
        holders, host_only, keep = self._holders, self._host_only, ~feed.bit
        for h, v in feed.refs.items():
            m = holders[h] & keep
            if m:
                holders[h] = m
            else:
                del holders[h]
            if not v & _DEV_MASK:
                m = host_only[h] & keep
                if m:
                    host_only[h] = m
                else:
                    del host_only[h]
        feed.refs, feed.kids, feed.orphans, feed.untracked = {}, {}, 0, False
        if feed.groups is not None:
            feed.groups.clear()

    def _restart(self, feed: _Feed, reason: str) -> ApplyResult:
        """The rank's cache is gone: drop its stale blocks now and wait for its snapshot."""
        self._purge(feed)
        self._settle(feed)
        feed.next_seq = 0
        return self._ask_snapshot(feed, reason)

    def _ask_snapshot(self, feed: _Feed, reason: str) -> ApplyResult:
        feed.awaiting_snapshot = True
        self.stats.snapshots_requested += 1
        return ApplyResult(ApplyStatus.SNAPSHOT, feed.next_seq, reason)


def _one_kid_fewer(kids: dict[int, int], parent: int) -> None:
    """``parent`` holds one child fewer (and leaves the count when it holds none)."""
    n = kids[parent] - 1
    if n:
        kids[parent] = n
    else:
        del kids[parent]


def _held(v: int, unit: int) -> bool:
    """Whether packed refs ``v`` include one on the tier of ``unit``."""
    return bool(v >> 32) if unit == _HOST else bool(v & _DEV_MASK)


def _diverged(i: int, what: str, h: int, unit: int) -> str:
    tier = "host" if unit == _HOST else "device"
    return f"events[{i}] {what} {h:#x} from the {tier} tier, which the rank does not hold there: the index has diverged"


def _is_move(ev: BlockUpdated) -> bool:
    """A tier change (offload or onboard); an update of priority alone changes nothing here."""
    return ev.old_medium is not None and ev.new_medium is not None and ev.old_medium != ev.new_medium


# --- input checks (callers' mistakes -> TypeError/ValueError) -----------------

def _check_rank(rank: object) -> None:
    if type(rank) is not int or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")


def _check_seq(seq: object, name: str) -> None:
    if type(seq) is not int or seq < 0:
        raise ValueError(f"{name} must be a non-negative int, got {seq!r}")
