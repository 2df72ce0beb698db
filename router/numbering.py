"""Each rank's batch numbering in front of the block store: the one path every batch takes into the index.

Ranks number their batches from 0. ``SequencedIndex`` looks at the number
first: an old one is a duplicate, dropped before it is decoded; a gap asks for
a replay; a number back at 0 (or a ``KVCacheCreated`` later on) means the rank
restarted, so its blocks go at once and a snapshot is awaited, as after a batch
the store had to roll back. Only the expected batch is decoded, once
(``decode_view``), and applied to the store (a ``BlockIndex``). What to fetch is
the caller's part (``router.feed``): this class does no I/O.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvledger.router.index import BlockIndex
from kvledger.router.snapshot import SnapshotEntry
from kvledger.worker.wire.events import (
    EVENT_CLASS,
    BatchView,
    EventBatch,
    KVCacheCreated,
    check_batch,
    decode_view,
)

_CREATED = frozenset(t for t, cls in EVENT_CLASS.items() if cls is KVCacheCreated)   # its decoded types


class ApplyStatus(enum.Enum):
    """What the numbering did with a batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """An old number (already applied): ignored, undecoded."""
    REPLAY = "replay"
    """A gap: the batch was not applied; fetch the rank's batches from ``replay_from`` and apply them in order."""
    SNAPSHOT = "snapshot"
    """Restart or divergence: nothing applied until ``load_snapshot`` rebuilds the rank."""


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """The outcome of one batch; ``next_seq`` is the number expected next from the rank."""

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


@dataclass(slots=True)
class FeedStats:
    """Counters for the edges to export; the core does not know how they are shown."""

    batches_applied: int = 0
    batches_duplicate: int = 0
    replays_requested: int = 0
    snapshots_requested: int = 0
    snapshots_loaded: int = 0


class SequencedIndex:
    """A ``BlockIndex`` fed by each rank's numbered batches (see the module docstring)."""

    __slots__ = ("store", "stats", "_next", "_awaiting")

    def __init__(self, store: BlockIndex) -> None:
        self.store = store
        self.stats = FeedStats()
        self._next: dict[int, int] = {}   # rank -> the number expected next
        self._awaiting: set[int] = set()  # ranks whose snapshot is awaited

    # --- reading ------------------------------------------------------------

    def ranks(self) -> list[int]:
        """Ranks heard from (and not removed since), ascending."""
        return sorted(self._next)

    def next_seq(self, rank: int) -> int:
        """The batch number expected next from ``rank`` (0 for a rank never heard from)."""
        return self._next.get(rank, 0)

    def awaiting_snapshot(self, rank: int) -> bool:
        return rank in self._awaiting

    def num_blocks(self, rank: int | None = None) -> int:
        """The store's, for reports: distinct hashes held by ``rank``, or by anyone."""
        return self.store.num_blocks(rank)

    def block_size(self, rank: int) -> int:
        """The store's, for reports: tokens per block of ``rank``'s events."""
        return self.store.block_size(rank)

    # --- writing ------------------------------------------------------------

    def check(self, rank: int, seq: int) -> ApplyResult | None:
        """What batch ``seq`` of ``rank`` gets by its number alone; ``None`` when it is the one to apply next."""
        if type(rank) is not int or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if type(seq) is not int or seq < 0:
            raise ValueError(f"seq must be a non-negative int, got {seq!r}")
        expected = self._next.get(rank, 0)
        if seq == expected and rank not in self._awaiting:
            return None
        if rank in self._awaiting:
            return ApplyResult(ApplyStatus.SNAPSHOT, expected, "still waiting for a snapshot")
        if seq == 0:
            return self._restart(rank, "numbering restarted at 0: the rank restarted")
        if seq < expected:
            self.stats.batches_duplicate += 1
            return ApplyResult(ApplyStatus.DUPLICATE, expected)
        self.stats.replays_requested += 1
        return ApplyResult(ApplyStatus.REPLAY, expected, f"got batch {seq}, expected {expected}")

    def ingest(self, rank: int, seq: int, data: bytes) -> tuple[ApplyResult, BatchView | None]:
        """Batch ``seq`` of ``rank`` as wire bytes: checked by number, then (if next) decoded and applied.

        Returns the result and the decoded batch, if it was decoded. Malformed bytes raise
        ``EventDecodeError`` (a ``ValueError``), a wrong block size ``BlockSizeError``; both change nothing.
        """
        res = self.check(rank, seq)
        if res is not None:
            return res, None
        batch = decode_view(data)
        return self._apply(rank, seq, batch), batch

    def apply(self, rank: int, seq: int, batch: EventBatch) -> ApplyResult:
        """``ingest`` for a batch built in this process: its events are checked first (``TypeError`` or
        ``ValueError``, changing nothing)."""
        check_batch(batch)
        return self.apply_decoded(rank, seq, batch)

    def apply_decoded(self, rank: int, seq: int, batch: EventBatch) -> ApplyResult:
        """``apply`` for a batch whose events the codec decoded (``decode_batch``), or that the router built from
        such events (``router.foreign``): they are not checked again (checking took over a quarter of the intake's
        CPU)."""
        return self.check(rank, seq) or self._apply(rank, seq, batch)

    def load_snapshot(self, rank: int, blocks: Iterable[SnapshotEntry], next_seq: int) -> None:
        """Rebuild ``rank``'s holdings from nothing; batches continue at ``next_seq``."""
        if type(next_seq) is not int or next_seq < 0:
            raise ValueError(f"next_seq must be a non-negative int, got {next_seq!r}")
        self.store.load_snapshot(rank, blocks)
        self._next[rank] = next_seq
        self._awaiting.discard(rank)
        self.stats.snapshots_loaded += 1

    def remove_rank(self, rank: int) -> None:
        """Forget ``rank`` at once (it died): its blocks and its numbering. Unknown ranks are ignored."""
        self.store.remove_rank(rank)
        self._next.pop(rank, None)
        self._awaiting.discard(rank)

    def _apply(self, rank: int, seq: int, batch: EventBatch | BatchView) -> ApplyResult:
        if batch.rank is not None and batch.rank != rank:
            raise ValueError(f"batch says rank {batch.rank} but was applied as rank {rank}")
        events = batch.events
        if seq and not _CREATED.isdisjoint(map(type, events)):
            return self._restart(rank, f"KVCacheCreated in batch {seq}: the rank restarted")
        diverged = self.store.apply(rank, events)
        if diverged is not None:
            return self._ask_snapshot(rank, diverged)
        self._next[rank] = seq + 1
        self.stats.batches_applied += 1
        return ApplyResult(ApplyStatus.APPLIED, seq + 1)

    def _restart(self, rank: int, reason: str) -> ApplyResult:
        """The rank's cache is gone: drop its stale blocks now and wait for its snapshot, numbered from 0."""
        self.store.load_snapshot(rank, ())
        self._next[rank] = 0
        return self._ask_snapshot(rank, reason)

    def _ask_snapshot(self, rank: int, reason: str) -> ApplyResult:
        self._next.setdefault(rank, 0)
        self._awaiting.add(rank)
        self.stats.snapshots_requested += 1
        return ApplyResult(ApplyStatus.SNAPSHOT, self._next[rank], reason)
