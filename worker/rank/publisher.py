"""Numbered event batches of one rank, with a replay buffer and snapshots for routers that fall behind.

The rank drains its ledger every few milliseconds; each non-empty drain becomes
batch ``seq`` (from 0, per rank). A router that sees a gap asks ``replay``; one
that starts late, or that the buffer no longer reaches, asks ``snapshot``. An
overflow of the ledger's own event buffer lost events no replay can restore,
so the next batch opens with ``KVCacheCreated`` (one per attention window), which tells routers to
re-snapshot the rank.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.rank.faults import CrashPoints
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.events import EventBatch, KVEvent, encode_batch


class EventPublisher:
    """Turns one ledger's events into numbered, replayable batches.

    Its own state is guarded by a lock; callers serialize access to the manager
    (the rank worker holds one lock around every ledger call). ``faults`` are the
    rank's crash points (``mid_publish``: a batch numbered and kept for replay
    that has not left yet).
    """

    def __init__(self, manager: KVCacheManager, rank: int, replay_size: int = 1024,
                 clock: Callable[[], float] = time.time, faults: CrashPoints | None = None) -> None:
        if replay_size < 1:
            raise ValueError(f"replay_size must be >= 1, got {replay_size}")
        self.manager = manager
        self.rank = rank
        self.clock = clock
        self._replay: deque[PublishedBatch] = deque(maxlen=replay_size)
        self._next = 0
        self._dropped_seen = 0
        self._lock = threading.Lock()
        self._faults = faults or CrashPoints(rank)

    @property
    def next_seq(self) -> int:
        return self._next

    def poll(self) -> PublishedBatch | None:
        """Drain the ledger into the next batch; ``None`` when nothing happened."""
        with self._lock:
            return self._poll()

    def _poll(self) -> PublishedBatch | None:
        events: list[KVEvent] = self.manager.take_events()
        dropped = self.manager.stats().events_dropped
        if dropped != self._dropped_seen:
            self._dropped_seen = dropped
            events = [*self.manager.created_events(), *events]
        if not events:
            return None
        batch = PublishedBatch(self._next, encode_batch(EventBatch(ts=self.clock(), events=events, rank=self.rank)))
        self._next += 1
        self._replay.append(batch)
        self._faults.reached("mid_publish")
        return batch

    def replay(self, from_seq: int) -> list[PublishedBatch] | None:
        """Batches ``from_seq`` onwards, or ``None`` when the buffer no longer reaches back that far."""
        with self._lock:
            if from_seq < 0 or from_seq > self._next:
                raise ValueError(f"replay from {from_seq}: batches are numbered 0..{self._next - 1}")
            if from_seq == self._next:
                return []
            if not self._replay or self._replay[0].seq > from_seq:
                return None
            # the buffer holds consecutive numbers up to ``_next - 1``: the asked ones are its last, read from the
            # end (the pusher asks for the newest one or two every few milliseconds; the buffer holds a thousand)
            return [self._replay[i] for i in range(from_seq - self._next, 0)]

    def snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        """Every block held now, after publishing what is pending (returned too, for the caller to send)."""
        with self._lock:
            pending = self._poll()
            return pending, Snapshot(self._next, self.manager.snapshot())
