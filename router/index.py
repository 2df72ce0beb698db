"""The router's block store: block hash -> the ranks holding it and on which tier, behind ``BlockIndex``.

It applies decoded batches that the numbering (``router.numbering``) has put
in order, and answers probes. Chained hashes name whole prefixes, so the store
is a flat map, not a tree: ``holders[h]`` is a bit mask of the ranks holding
``h`` on any tier (``router.rank_bits``), ``host_only[h]`` of those holding it
on the host tier only; one AND per block walks every rank at once. Each rank's
refs per hash are one packed int (``router.refs``). Ranks are indexed at their
own block sizes in the one map, since chains of different sizes never meet.

A batch applies whole or not at all: a removal or move of a block the rank
does not hold there rolls the batch back and says why (the view diverged).
How held blocks chain (``router.chains``) lets a probe bisect instead of
walking (``router.chain_match``). Models with attention windows use the
``WindowedIndex`` variant (``router.groups``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, compress, repeat
from operator import and_, not_, or_
from typing import Protocol, TypeVar

from kvledger.router.chain_match import chain_ends, walk
from kvledger.router.chains import UNKNOWN, Chains, RankHoldings
from kvledger.router.rank_bits import RankBits
from kvledger.router.refs import DEV, DEV_MASK, HOST, held_on, tier_unit
from kvledger.router.snapshot import SnapshotEntry, group0_refs, read_snapshot
from kvledger.worker.wire.events import EVENT_CLASS, BlockRemoved, BlockStored, BlockUpdated, KVCacheCreated

T = TypeVar("T")          # what a probe's caller makes of one match


def as_pair(blocks: int, host_blocks: int) -> tuple[int, int]:
    """A match as ``(blocks, host-only blocks)``: the ``make`` of the tuple-answering probes."""
    return blocks, host_blocks


class BlockSizeError(ValueError):
    """An event's block size is not the one its rank is indexed at."""


class BlockIndex(Protocol):
    """What the feed needs of a block store (as Dynamo's ``KvIndexerInterface``, llm-d's ``kvblock.Index``)."""

    tokens_per_block: int

    def apply(self, rank: int, events: Sequence[object]) -> str | None:
        """Apply one batch whole; ``None``, or why it was rolled back (the rank's view diverged)."""

    def remove_rank(self, rank: int) -> None: ...

    def load_snapshot(self, rank: int, blocks: Iterable[SnapshotEntry]) -> None:
        """Make ``blocks`` all that ``rank`` holds."""

    def match(self, hashes: Sequence[int], make: Callable[[int, int], T]) -> dict[int, T]:
        """Per rank holding the chain's first block: ``make(blocks, host-only blocks)`` of its held prefix."""

    def block_size(self, rank: int) -> int: ...

    def set_block_size(self, rank: int, block_size: int) -> None: ...

    def other_block_sizes(self) -> set[int]: ...

    def num_blocks(self, rank: int | None = None) -> int: ...

    def host_only_blocks(self, rank: int) -> int:
        """Of ``rank``'s blocks, those it holds on its host tier only."""


class FlatStore:
    """What both flat stores (``PrefixIndex``, ``router.array_index.ArrayIndex``) share: the block size of each
    rank, and the checks before a batch or a snapshot changes anything. A subclass keeps the blocks
    (``_drop``, ``_load_refs``)."""

    __slots__ = ("tokens_per_block", "_block_sizes")

    def __init__(self, tokens_per_block: int) -> None:
        if type(tokens_per_block) is not int or tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
        self.tokens_per_block = tokens_per_block
        self._block_sizes: dict[int, int] = {}  # rank -> its block size, where not tokens_per_block

    def block_size(self, rank: int) -> int:
        """Tokens per block of ``rank``'s events."""
        return self._block_sizes.get(rank, self.tokens_per_block)

    def other_block_sizes(self) -> set[int]:
        """The block sizes other than ``tokens_per_block`` that some rank is indexed at (mostly none)."""
        return set(self._block_sizes.values())

    def _check_sizes(self, rank: int, events: Sequence[object]) -> None:
        check_block_sizes(rank, self.block_size(rank), events)

    def set_block_size(self, rank: int, block_size: int) -> None:
        """Index ``rank`` at ``block_size`` tokens per block from now on (it keeps it across ``remove_rank``).

        Changing a rank's size drops what it holds: its old hashes are of another chain.
        """
        check_rank(rank)
        if type(block_size) is not int or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if block_size == self.block_size(rank):
            return
        self._drop(rank)
        if block_size == self.tokens_per_block:
            self._block_sizes.pop(rank, None)
        else:
            self._block_sizes[rank] = block_size

    def load_snapshot(self, rank: int, blocks: Iterable[SnapshotEntry]) -> None:
        """Rebuild ``rank``'s holdings from nothing; a bad entry raises and changes nothing."""
        rows = read_snapshot(blocks)
        if any(row.group or row.kind == "sliding_window" for row in rows):   # router.groups.is_windowed
            raise ValueError(f"rank {rank}'s snapshot has attention windows: index it with a router.groups.Windowed "
                             "store")
        self._load_refs(rank, group0_refs(rows))

    def _drop(self, rank: int) -> None:
        """Drop what ``rank`` holds, if the store knows it (its bit stays)."""
        raise NotImplementedError

    def _load_refs(self, rank: int, refs: dict[int, int]) -> None:
        """Make ``refs`` (packed refs per hash) all that ``rank`` holds."""
        raise NotImplementedError


class PrefixIndex(FlatStore):
    """The flat-map ``BlockIndex`` (see the module docstring); group 0 only (``WindowedIndex`` keeps the rest)."""

    __slots__ = ("_holders", "_host_only", "_holdings", "_bits", "_chains", "_walked")

    def __init__(self, tokens_per_block: int) -> None:
        super().__init__(tokens_per_block)
        self._holders: dict[int, int] = {}     # hash -> mask of the ranks' bits, any tier
        self._host_only: dict[int, int] = {}   # hash -> mask of ranks holding it on the host tier only
        self._holdings: dict[int, RankHoldings] = {}
        self._bits = RankBits()
        self._chains = Chains()
        self._walked = 0                          # mask of the ranks with orphans or untracked holdings

    # --- reading ------------------------------------------------------------

    def ranks(self) -> list[int]:
        """Ranks the store has a bit for, ascending."""
        return sorted(self._holdings)

    def refs(self, rank: int, block_hash: int) -> tuple[int, int]:
        """``(device refs, host refs)`` that ``rank`` holds on ``block_hash``."""
        v = self.held(rank).get(block_hash, 0)
        return v & DEV_MASK, v >> 32

    def held(self, rank: int) -> dict[int, int]:
        """``rank``'s packed refs per hash (read only)."""
        rh = self._holdings.get(rank)
        return {} if rh is None else rh.refs

    def held_among(self, rank: int, hashes: Sequence[int]) -> dict[int, int]:
        """``rank``'s packed refs of at least ``hashes`` (here all of ``held``, uncopied)."""
        return self.held(rank)

    def holders(self, block_hash: int) -> list[int]:
        """Ranks holding ``block_hash`` on any tier, ascending."""
        return sorted(self._bits.ranks_in(self._holders.get(block_hash, 0)))

    def num_blocks(self, rank: int | None = None) -> int:
        """Distinct hashes held by ``rank``, or by anyone when ``rank`` is None."""
        return len(self._holders) if rank is None else len(self.held(rank))

    def host_only_blocks(self, rank: int) -> int:
        """Of ``rank``'s distinct hashes, those it holds on its host tier only (to onboard before reuse)."""
        return sum(1 for v in self.held(rank).values() if not v & DEV_MASK)

    def longest_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Per rank holding ``hashes[0]``: ``(blocks, host-only blocks)`` of its longest held prefix of the
        sequence, checking every block (any sequence of hashes; ``chain_prefixes`` is the probe's)."""
        active = self._holders.get(hashes[0], 0) if hashes else 0
        return self._answer(hashes, walk(self._holders, hashes, active), as_pair) if active else {}

    def chain_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        """``longest_prefixes`` of a chain (each hash the child of the one before, as ``prompt_hashes`` makes
        them and ledgers publish them), by bisection where the ranks hold whole prefixes only."""
        return self.match(hashes, as_pair)

    def match(self, hashes: Sequence[int], make: Callable[[int, int], T]) -> dict[int, T]:
        """``chain_prefixes``, with each distinct ``(blocks, host-only blocks)`` made into
        ``make(blocks, host_blocks)`` once and shared by its ranks: the probe's form, which saves a tuple per
        rank and hashing it to share what it makes. A sequence found not to be one chain is walked."""
        holders = self._holders
        first = holders.get(hashes[0], 0) if hashes else 0
        if not first:
            return {}
        ends = None
        if not first & self._walked:
            ends = chain_ends(holders, self._chains.parents, hashes, first, bool(self._walked))
        return self._answer(hashes, walk(holders, hashes, first) if ends is None else ends, make)

    def _answer(self, hashes: Sequence[int], ends: list[tuple[int, int]], make: Callable[[int, int], T],
                ) -> dict[int, T]:
        """Per rank of ``ends`` (in no set order): ``make`` of its match and the host-only blocks within it."""
        host: dict[int, int] = {}   # bit -> host-only blocks within its match
        if self._host_only:
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
        if not host:   # one answer for the ranks of each end, none holding a block on the host tier only
            masks, at = zip(*ends)
            groups = self._bits.ranks_of(list(masks))
            # A plain loop: cheaper here than ``dict(zip(...))`` of chained ``repeat``s (an object per end)
            for ranks, answer in zip(groups, map(make, at, repeat(0))):
                for rank in ranks:
                    out[rank] = answer
            return out
        made: dict[tuple[int, int], T] = {}
        rank_of = self._bits.rank_of
        for bits, matched in ends:
            while bits:
                low = bits & -bits
                rank = rank_of(low)
                key = (matched, host.get(low, 0))
                got = made.get(key)
                out[rank] = made[key] = make(*key) if got is None else got
                bits ^= low
        return out

    # --- writing ------------------------------------------------------------

    def apply(self, rank: int, events: Sequence[object]) -> str | None:
        """Apply one batch's events in order, all or none (events checked, as ``decode_view`` and ``check_event``
        check them); ``None``, or why the batch was rolled back. ``BlockSizeError`` changes nothing."""
        self._check_sizes(rank, events)
        rh = self._holdings.get(rank) or self._new_holdings(rank)
        diverged = self._commit(rh, events)
        self._settle(rh)
        return diverged

    def _drop(self, rank: int) -> None:
        rh = self._holdings.get(rank)
        if rh is not None:
            self._purge(rh)
            self._settle(rh)

    def _load_refs(self, rank: int, refs: dict[int, int]) -> None:
        check_rank(rank)
        rh = self._holdings.get(rank)
        if rh is None:
            rh = self._new_holdings(rank)
        else:
            self._purge(rh)
        self._install(rh, refs)
        self._settle(rh)

    def remove_rank(self, rank: int) -> None:
        """Forget ``rank`` at once (it died): its blocks and its bit. Unknown ranks are ignored."""
        rh = self._holdings.pop(rank, None)
        if rh is not None:
            self._purge(rh)
            self._walked &= ~rh.bit
            self._bits.give_back(rh.bit)

    # --- internals ----------------------------------------------------------

    def _new_holdings(self, rank: int) -> RankHoldings:
        rh = self._holdings[rank] = RankHoldings(rank, self._bits.take(rank))
        return rh

    def _commit(self, rh: RankHoldings, events: Sequence[object]) -> str | None:
        """Apply the events in order; on a removal or move of a block the rank does not hold on that tier, roll
        back everything this batch did and say why. Checking as we go keeps the common path to one pass."""
        holders, chains = self._holders, self._chains
        hget = holders.get
        bit = rh.bit
        cleared: list[dict[int, int]] = []   # what each clear dropped
        for i, ev in enumerate(events):
            t = EVENT_CLASS[type(ev)]
            refs = rh.refs
            if t is BlockStored:
                hs = ev.block_hashes
                if ev.medium != "CPU" and refs.keys().isdisjoint(hs):
                    # The common case, new device blocks: one C-level update for the refs.
                    fresh = dict.fromkeys(hs, DEV)
                    if len(fresh) == len(hs):
                        refs.update(fresh)
                        holders.update(zip(hs, map(or_, map(hget, hs, repeat(0)), repeat(bit))))
                        chains.link_run(rh, hs, ev.parent_block_hash)
                        continue
                unit = tier_unit(ev.medium)
                for h, parent in zip(hs, chain((ev.parent_block_hash,), hs)):
                    self._add(rh, h, unit, parent)
            elif t is BlockRemoved:
                unit = tier_unit(ev.medium)
                hs = ev.block_hashes
                if unit == DEV and self._drop_run(rh, hs):
                    continue
                for j, h in enumerate(hs):
                    if held_on(refs.get(h, 0), unit):
                        self._sub(rh, h, unit)
                    else:
                        self._roll_back(rh, events, i, j, cleared)
                        return diverged(i, "removes", h, unit)
            elif t is BlockUpdated:
                if is_move(ev):
                    old = tier_unit(ev.old_medium)
                    if not held_on(refs.get(ev.block_hash, 0), old):
                        self._roll_back(rh, events, i, 0, cleared)
                        return diverged(i, "moves", ev.block_hash, old)
                    # add before taking away, so the block never looks absent mid-move
                    self._add(rh, ev.block_hash, tier_unit(ev.new_medium), UNKNOWN)
                    self._sub(rh, ev.block_hash, old)
            else:  # AllBlocksCleared, or KVCacheCreated opening a rank's numbering
                cleared.append(refs)
                self._purge(rh)
        return None

    def _roll_back(self, rh: RankHoldings, events: Sequence[object], i: int, j: int,
                   cleared: list[dict[int, int]]) -> None:
        """Undo ``events[:i]`` and the first ``j`` hashes of ``events[i]`` (a removal), newest first."""
        ev = events[i]
        parent_of = self._chains.parent_of
        if EVENT_CLASS[type(ev)] is BlockRemoved:
            unit = tier_unit(ev.medium)
            for h in reversed(ev.block_hashes[:j]):
                self._add(rh, h, unit, parent_of(h))
        for ev in reversed(events[:i]):
            t = EVENT_CLASS[type(ev)]
            if t is BlockStored:
                unit = tier_unit(ev.medium)
                for h in reversed(ev.block_hashes):
                    self._sub(rh, h, unit)
            elif t is BlockRemoved:
                unit = tier_unit(ev.medium)
                for h in reversed(ev.block_hashes):
                    self._add(rh, h, unit, parent_of(h))
            elif t is BlockUpdated:
                if is_move(ev):
                    self._add(rh, ev.block_hash, tier_unit(ev.old_medium), UNKNOWN)
                    self._sub(rh, ev.block_hash, tier_unit(ev.new_medium))
            else:   # the holdings are empty again, as right after the clear
                self._install(rh, cleared.pop())

    def _add(self, rh: RankHoldings, h: int, unit: int, parent: object) -> None:
        """One more ref on ``h``; ``parent`` is its parent if this makes the rank hold it (else unused)."""
        refs, bit = rh.refs, rh.bit
        v = refs.get(h, 0)
        refs[h] = w = v + unit
        if v == 0:
            self._holders[h] = self._holders.get(h, 0) | bit
            self._chains.link(rh, h, parent)
        was_host_only = v != 0 and not v & DEV_MASK
        if not w & DEV_MASK:
            if not was_host_only:
                self._host_only[h] = self._host_only.get(h, 0) | bit
        elif was_host_only:
            _clear_bit(self._host_only, h, bit)

    def _sub(self, rh: RankHoldings, h: int, unit: int) -> None:
        refs, bit = rh.refs, rh.bit
        v = refs[h]
        w = v - unit
        was_host_only = not v & DEV_MASK
        if w == 0:
            del refs[h]
            _clear_bit(self._holders, h, bit)
            if was_host_only:
                _clear_bit(self._host_only, h, bit)
            self._chains.unlink(rh, h)
            return
        refs[h] = w
        if not w & DEV_MASK and not was_host_only:
            self._host_only[h] = self._host_only.get(h, 0) | bit

    def _drop_run(self, rh: RankHoldings, hs: list[int]) -> bool:
        """Remove device blocks ``hs`` in bulk if the rank holds each once, on the device tier only (the
        common eviction); else change nothing and say so."""
        refs, holders = rh.refs, self._holders
        took = list(map(refs.pop, hs, repeat(0)))   # a hash listed twice takes 0 the second time
        if took.count(DEV) != len(hs):
            refs.update(compress(zip(hs, took), took))   # put back what was taken
            return False
        masks = list(map(and_, map(holders.__getitem__, hs), repeat(~rh.bit)))
        holders.update(zip(hs, masks))
        if 0 in masks:
            deque(map(holders.__delitem__, compress(hs, map(not_, masks))), 0)
        self._chains.unlink_run(rh, hs)
        return True

    def _settle(self, rh: RankHoldings) -> None:
        """After a change of ``rh``'s holdings: its bit in ``_walked``, and stale parents dropped in bulk."""
        if rh.orphans or rh.untracked:
            self._walked |= rh.bit
        else:
            self._walked &= ~rh.bit
        self._chains.prune(self._holders)

    def _install(self, rh: RankHoldings, refs: dict[int, int]) -> None:
        """Make ``refs`` the holdings of a rank that holds nothing."""
        assert not rh.refs, "install over live holdings"
        rh.refs = refs
        bit, holders, host_only = rh.bit, self._holders, self._host_only
        for h, v in refs.items():
            holders[h] = holders.get(h, 0) | bit
            if not v & DEV_MASK:
                host_only[h] = host_only.get(h, 0) | bit
        self._chains.count(rh)

    def _purge(self, rh: RankHoldings) -> None:
        holders, host_only, bit = self._holders, self._host_only, rh.bit
        for h, v in rh.refs.items():
            _clear_bit(holders, h, bit)
            if not v & DEV_MASK:
                _clear_bit(host_only, h, bit)
        rh.refs = {}
        rh.forget_chains()


def _clear_bit(masks: dict[int, int], h: int, bit: int) -> None:
    """Take ``bit`` out of ``masks[h]``, dropping the entry when no bit is left."""
    m = masks[h] & ~bit
    if m:
        masks[h] = m
    else:
        del masks[h]


def check_block_sizes(rank: int, tpb: int, events: Sequence[object]) -> None:
    """``BlockSizeError`` for the first store or creation of another block size than ``rank``'s ``tpb``."""
    for i, ev in enumerate(events):
        t = EVENT_CLASS[type(ev)]
        if (t is BlockStored or t is KVCacheCreated) and ev.block_size != tpb:
            raise BlockSizeError(f"events[{i}]: {t.__name__}.block_size {ev.block_size} differs from rank "
                                 f"{rank}'s {tpb} tokens per block; blocks of another size never match")


def diverged(i: int, what: str, h: int, unit: int) -> str:
    """Why a batch was rolled back: ``events[i]`` ``what`` (removes, moves) ``h`` from a tier it is not held on."""
    tier = "host" if unit == HOST else "device"
    return f"events[{i}] {what} {h:#x} from the {tier} tier, which the rank does not hold there: the index has diverged"


def is_move(ev: BlockUpdated) -> bool:
    """A tier change (offload or onboard); an update of priority alone changes nothing here."""
    return ev.old_medium is not None and ev.new_medium is not None and ev.old_medium != ev.new_medium


def check_rank(rank: object) -> None:
    if type(rank) is not int or rank < 0:
        raise ValueError(f"rank must be a non-negative int, got {rank!r}")
