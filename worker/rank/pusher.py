"""Pushing a rank's event batches to its routers from a background thread.

The rank knows when it has events, so it sets the pace: every ``interval_s``
the thread drains the ledger (under the rank's lock) into the next numbered
batch and, only when there was something, hands that same batch to every
attached sink (one per router replica: each builds the same index from the
same stream). Pushing costs nothing while the rank is idle. A batch someone
else drained (a serve with ``publish=True`` returns its batch to the router
that sent it; a snapshot returns the pending one to the router that asked) is
pushed too, from the replay buffer, so every other router gets it without
waiting to notice a gap (the one that has it already ignores the duplicate).
A sink that raises
is logged and pushing goes on: the receiver sees the gap in the numbering and
asks for a replay; the other sinks still get the batch. A sink that raises
``ReceiverGone`` is detached (a router that comes back attaches itself again).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvledger.worker.rank.books import RankBooks
from kvledger.worker.wire.batches import PublishedBatch

logger = logging.getLogger(__name__)

Sink = Callable[[PublishedBatch], object]


class ReceiverGone(Exception):
    """Raised by a sink whose receiver is gone for good: it is pushed to no more."""


class EventPusher:
    """At most one publisher thread per rank, pushing to every attached receiver (``owner``) in turn."""

    def __init__(self, books: RankBooks) -> None:
        self.books = books
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, sink: Sink, interval_s: float = 0.005, owner: str = "") -> bool:
        """Push every new batch to ``sink`` too, checking every ``interval_s`` (the first attach sets it).

        Returns ``False`` when ``owner`` is already pushed to (a restarted router re-attaching keeps its sink:
        its handle reaches the new process); the other owners are left as they are.
        """
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"start_publishing: interval_s must be > 0, got {interval_s!r}")
        with self._lock:
            if owner in self._sinks and self.running:
                return False
            self._sinks[owner] = sink
            if self.running:
                return True
            stop = threading.Event()
            self._stop = stop
            self._thread = threading.Thread(target=self._push, args=(stop, interval_s),
                                            name=f"rank{self.books.rank}-publisher", daemon=True)
            self._thread.start()
        return True

    def _push(self, stop: threading.Event, interval_s: float) -> None:
        books = self.books
        publisher, cursor = None, 0   # the next batch number this thread has not pushed
        while not stop.wait(interval_s):
            with books.lock:
                pub = books.publisher
                if pub is None:
                    continue
                if pub is not publisher:   # attached now, or a new ledger: push from here on
                    publisher, cursor = pub, pub.next_seq
                latest = pub.poll()
                batches = pub.replay(cursor) if cursor < pub.next_seq else []
            if batches is None:   # the buffer no longer reaches back: receivers close the gap by snapshot
                batches = [latest] if latest is not None else []
            if batches:
                cursor = batches[-1].seq + 1
                self._fan_out(batches)

    def _fan_out(self, batches: list[PublishedBatch]) -> None:
        with self._lock:
            sinks = list(self._sinks.items())
        for owner, sink in sinks:
            for batch in batches:
                try:
                    sink(batch)
                except ReceiverGone:
                    logger.info("rank %d: %s is gone; no more pushes to it", self.books.rank, owner)
                    with self._lock:
                        if self._sinks.get(owner) is sink:
                            del self._sinks[owner]
                    break
                except Exception as e:  # the receiver notices the gap and asks for a replay
                    logger.warning("rank %d: pushing batch %d to %s failed: %s", self.books.rank, batch.seq,
                                   owner, e)

    def stop(self) -> None:
        """Stop pushing to every owner."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            self._sinks.clear()
        if thread is not None:
            thread.join(timeout=10)
