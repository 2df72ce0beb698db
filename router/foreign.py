"""Index a foreign engine (a real vLLM) whose block hashes are not ours.

vLLM names blocks with its own hash, so its hashes never meet the ones the
router probes with. This feed re-hashes each stored block from its
``token_ids`` with our ``chain_hash``, chained from the parent's mapped hash
(``ROOT_HASH`` for a prompt's first block), and keeps, per foreign rank, the
map from vLLM hash to ours with a count of stores per tier (packed as the
index packs them, ``router.refs``), so a later removal or tier move by vLLM
hash reaches the right entry of the index, on the right tier.

vLLM's CPU offloading publishes the blocks it copies to host memory as stores
with medium ``CPU``, under the same hashes as the device's, and their
eviction as removals with medium ``CPU``: the index holds them as the engine's
host tier. A host removal of a hash the engine never stored on its host tier
is skipped and counted (``UNKNOWN_HASH``). Its offloading connector describes
those blocks (tokens, parent) only with ``kv_connector_extra_config:
{"self_describing_kv_events": true}``; without it a store names one hash with
no tokens and block size 0. Such a store of a hash the engine already holds
(on its device: the offload copies a block it computed) adds the host copy to
that entry; one of a hash never mapped cannot be placed and is skipped and
counted (``UNKNOWN_HASH``).

Each engine is indexed at its own block size (``BlockIndex.set_block_size``),
told by its server or, with ``learn_block_size``, taken from its first store.
A salted prompt's blocks are keyed by its salt: vLLM publishes the salt only
among the first block's ``extra_keys`` (after the LoRA name, if any), so each
mapped hash keeps the salt of its chain and a child store inherits it.
A store whose parent was never seen (stored before the router listened) cannot
be re-hashed and is skipped; removals of hashes never mapped are skipped too;
both are counted in ``rejections``.
Multimodal and per-token extra keys are not on vLLM's wire as we decode it, so
only text prompts (with LoRA id and cache salt) map faithfully.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvledger.router.index import BlockSizeError
from kvledger.router.numbering import ApplyResult, ApplyStatus, SequencedIndex
from kvledger.router.refs import held_on, tier_unit
from kvledger.router.rejections import UNKNOWN_HASH, UNKNOWN_PARENT, Rejections
from kvledger.worker.wire.block_key import ROOT_HASH, block_keys, chain_hashes
from kvledger.worker.wire.events import (AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated, EventBatch,
                                         KVCacheCreated, KVEvent, check_batch)


@dataclass(slots=True)
class ForeignStats:
    blocks_mapped: int = 0
    stores_skipped: int = 0
    """Stores whose parent hash was unknown, so could not be re-hashed."""
    hashes_unmapped: int = 0
    """Removals or moves naming a hash never mapped (on that tier)."""


_Mapped = tuple[int, int, "str | None"]
"""A foreign hash's entry: our hash, the stores holding it per tier (packed as ``router.refs`` packs them), the
salt of its chain."""


class _Overlay:
    """One batch's changes to a rank's hash map, kept apart until the index has applied the batch."""

    __slots__ = ("base", "changes", "cleared", "stats")

    def __init__(self, base: dict[int, _Mapped]) -> None:
        self.base = base
        self.changes: dict[int, _Mapped | None] = {}
        self.cleared = False
        self.stats = ForeignStats()

    def get(self, foreign: int) -> _Mapped | None:
        if foreign in self.changes:
            return self.changes[foreign]
        return None if self.cleared else self.base.get(foreign)

    def merged(self) -> dict[int, _Mapped]:
        out = {} if self.cleared else self.base
        for k, v in self.changes.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return out


class ForeignFeed:
    """Feeds ``index`` from foreign engines' batches, translating their hashes (see the module docstring)."""

    __slots__ = ("_index", "_maps", "_learning", "stats", "rejections", "_on_applied")

    def __init__(self, index: SequencedIndex, rejections: Rejections | None = None,
                 on_applied: Callable[[int, int, EventBatch], None] | None = None) -> None:
        """``on_applied(rank, seq, batch)`` hears every applied batch, in our hashes (the router logs it)."""
        self._index = index
        self._on_applied = on_applied
        self._maps: dict[int, dict[int, _Mapped]] = {}   # rank -> foreign hash -> (our hash, stores, salt)
        self._learning: set[int] = set()   # ranks whose block size their first store tells
        self.stats = ForeignStats()
        self.rejections = rejections if rejections is not None else Rejections()

    def learn_block_size(self, rank: int) -> None:
        """Take ``rank``'s block size from its first store (its server did not say)."""
        self._learning.add(rank)

    def mapped(self, rank: int, foreign_hash: int) -> int | None:
        """Our hash for ``rank``'s block ``foreign_hash``, if it is held."""
        entry = self._maps.get(rank, {}).get(foreign_hash)
        return None if entry is None else entry[0]

    def apply(self, rank: int, seq: int, batch: EventBatch) -> ApplyResult:
        """Translate and apply batch ``seq`` of foreign ``rank``; the map changes only if the index applies it.
        Its events are checked first (``TypeError`` or ``ValueError``, changing nothing)."""
        check_batch(batch)
        return self.apply_decoded(rank, seq, batch)

    def apply_decoded(self, rank: int, seq: int, batch: EventBatch) -> ApplyResult:
        """``apply`` for a batch the codec decoded (``decode_batch``): its events are not checked again, nor are
        the ones translated from them (the two checks took over a quarter of the intake's CPU)."""
        index = self._index
        result = index.check(rank, seq)   # a gap, duplicate or restart needs nothing translated
        if result is None:
            if rank in self._learning:
                sizes = [ev.block_size for ev in batch.events if type(ev) is BlockStored]
                if sizes:
                    index.store.set_block_size(rank, sizes[0])
                    self._learning.discard(rank)
            overlay = _Overlay(self._maps.get(rank, {}))
            tpb = index.block_size(rank)
            events = [out for i, ev in enumerate(batch.events)
                      if (out := self._translate(overlay, ev, i, tpb)) is not None]
            translated = EventBatch(batch.ts, events, batch.rank)
            result = index.apply_decoded(rank, seq, translated)
            if result.applied:
                self._maps[rank] = overlay.merged()
                if self._on_applied is not None:
                    self._on_applied(rank, seq, translated)
                got = overlay.stats
                self.stats.blocks_mapped += got.blocks_mapped
                self.stats.stores_skipped += got.stores_skipped
                self.stats.hashes_unmapped += got.hashes_unmapped
                self.rejections.add(rank, UNKNOWN_PARENT, f"batch {seq} stores blocks under a parent never seen "
                                    "(stored before the router listened)", got.stores_skipped)
                self.rejections.add(rank, UNKNOWN_HASH, f"batch {seq} removes or moves hashes never mapped on that "
                                    "tier", got.hashes_unmapped)
                return result
        if result.status is ApplyStatus.SNAPSHOT:
            self._maps.pop(rank, None)   # its cache is gone or our view diverged: the map is stale too
        return result

    def next_seq(self, rank: int) -> int:
        """The batch number expected next from foreign ``rank``."""
        return self._index.next_seq(rank)

    def reset(self, rank: int, next_seq: int) -> None:
        """After a restart: a foreign engine has no snapshot for us, so start ``rank`` empty at ``next_seq``."""
        self._index.load_snapshot(rank, (), next_seq)
        self._maps.pop(rank, None)

    def remove_rank(self, rank: int) -> None:
        self._index.remove_rank(rank)
        self._maps.pop(rank, None)

    def _translate(self, overlay: _Overlay, ev: KVEvent, i: int, tpb: int) -> KVEvent | None:
        t = type(ev)
        if t is BlockStored:
            return self._stored(overlay, ev, i, tpb)
        if t is BlockRemoved:
            unit = tier_unit(ev.medium)
            ours = [h for f in ev.block_hashes if (h := self._release(overlay, f, unit)) is not None]
            return BlockRemoved(ours, ev.medium, ev.group_idx) if ours else None
        if t is BlockUpdated:
            return self._updated(overlay, ev)
        if t is AllBlocksCleared or t is KVCacheCreated:
            overlay.cleared, overlay.changes = True, {}
            return ev
        raise TypeError(f"events[{i}] must be a kvledger.worker.wire.events event, got {t.__name__}")

    def _stored(self, overlay: _Overlay, ev: BlockStored, i: int, tpb: int) -> BlockStored | None:
        n = len(ev.block_hashes)
        if ev.block_size == 0 and not ev.token_ids:
            return self._copied(overlay, ev, tpb)
        if ev.block_size != tpb:
            raise BlockSizeError(f"events[{i}]: block_size {ev.block_size} differs from the engine's {tpb} tokens "
                                 "per block")
        if len(ev.token_ids) != n * tpb:
            raise ValueError(f"events[{i}]: {n} blocks need {n * tpb} token_ids to re-hash, got {len(ev.token_ids)}")
        if ev.parent_block_hash is None:
            parent, salt = ROOT_HASH, ev.cache_salt if ev.cache_salt is not None else _salt_of_root(ev)
        else:
            entry = overlay.get(ev.parent_block_hash)
            if entry is None:
                overlay.stats.stores_skipped += 1
                return None
            parent, salt = entry[0], ev.cache_salt if ev.cache_salt is not None else entry[2]
        ours = chain_hashes(block_keys(ev.token_ids, tpb, lora_id=ev.lora_id, cache_salt=salt), parent)
        unit = tier_unit(ev.medium)
        out = []
        for foreign, mine in zip(ev.block_hashes, ours):
            entry = overlay.get(foreign)
            # A hash already mapped keeps its mapping, so its removal later finds the entry it made.
            mapped = mine if entry is None else entry[0]
            overlay.changes[foreign] = (mapped, unit, salt) if entry is None else (mapped, entry[1] + unit, entry[2])
            out.append(mapped)
        overlay.stats.blocks_mapped += n
        return BlockStored(out, None if ev.parent_block_hash is None else parent, ev.token_ids, ev.block_size,
                           ev.lora_id, ev.medium, ev.lora_name, salt, ev.priority, ev.group_idx,
                           ev.kv_cache_spec_kind, kv_cache_spec_sliding_window=ev.kv_cache_spec_sliding_window)

    def _copied(self, overlay: _Overlay, ev: BlockStored, tpb: int) -> BlockStored | None:
        """A store of hashes only (see the module docstring): one more store, on ``ev.medium``, of each hash
        already mapped, in our hashes (the index holds each already, so it needs no parent)."""
        unit = tier_unit(ev.medium)
        out = []
        for foreign in ev.block_hashes:
            entry = overlay.get(foreign)
            if entry is None:
                overlay.stats.hashes_unmapped += 1
                continue
            overlay.changes[foreign] = (entry[0], entry[1] + unit, entry[2])
            out.append(entry[0])
        return BlockStored(out, None, [], tpb, medium=ev.medium, group_idx=ev.group_idx) if out else None

    def _release(self, overlay: _Overlay, foreign: int, unit: int) -> int | None:
        """Our hash for a removal of ``foreign`` from the tier of ``unit``; ``None`` if it is not held there."""
        entry = overlay.get(foreign)
        if entry is None or not held_on(entry[1], unit):
            overlay.stats.hashes_unmapped += 1
            return None
        left = entry[1] - unit
        overlay.changes[foreign] = (entry[0], left, entry[2]) if left else None
        return entry[0]

    def _updated(self, overlay: _Overlay, ev: BlockUpdated) -> BlockUpdated | None:
        """A priority change, or a tier move: one store of the hash moves from the old tier to the new."""
        entry = overlay.get(ev.block_hash)
        moves = ev.old_medium is not None and ev.new_medium is not None and ev.old_medium != ev.new_medium
        if entry is None or (moves and not held_on(entry[1], tier_unit(ev.old_medium))):
            overlay.stats.hashes_unmapped += 1
            return None
        if moves:
            overlay.changes[ev.block_hash] = (entry[0], entry[1] - tier_unit(ev.old_medium)
                                              + tier_unit(ev.new_medium), entry[2])
        return BlockUpdated(entry[0], ev.old_medium, ev.new_medium, ev.old_priority, ev.new_priority)


def _salt_of_root(ev: BlockStored) -> str | None:
    """The cache salt among a prompt's first block's extra keys: its strings are the LoRA name (when the store
    names one) and then the salt."""
    keys = ev.extra_keys[0] if ev.extra_keys else None
    names = [k for k in keys or () if isinstance(k, str)]
    skip = 1 if ev.lora_name is not None else 0
    return names[skip] if len(names) > skip else None
