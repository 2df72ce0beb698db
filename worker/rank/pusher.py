"""Pushing a rank's event batches to a router from a background thread.

The rank knows when it has events, so it sets the pace: every ``interval_s``
the thread drains the ledger (under the rank's lock) into the next numbered
batch and, only when there was something, hands it to the sink. Pushing costs
nothing while the rank is idle. A sink that raises is logged and pushing goes
on: the receiver sees the gap in the numbering and asks for a replay.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvledger.worker.rank.books import RankBooks
from kvledger.worker.wire.batches import PublishedBatch

logger = logging.getLogger(__name__)


class EventPusher:
    """At most one publisher thread per rank, owned by one receiver at a time."""

    def __init__(self, books: RankBooks) -> None:
        self.books = books
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._owner: str | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, sink: Callable[[PublishedBatch], object], interval_s: float = 0.005, owner: str = "") -> bool:
        """Push every new batch to ``sink``, checking every ``interval_s``.

        Returns ``False`` when ``owner`` is already being pushed to; another owner
        replaces the current one.
        """
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"start_publishing: interval_s must be > 0, got {interval_s!r}")
        if self.running:
            if self._owner == owner:
                return False
            self.stop()
        stop = threading.Event()
        self._stop, self._owner = stop, owner
        books = self.books

        def push() -> None:
            while not stop.wait(interval_s):
                with books.lock:
                    batch = books.publisher.poll() if books.publisher is not None else None
                if batch is None:
                    continue
                try:
                    sink(batch)
                except Exception as e:  # the receiver notices the gap and asks for a replay
                    logger.warning("rank %d: pushing batch %d failed: %s", books.rank, batch.seq, e)

        self._thread = threading.Thread(target=push, name=f"rank{books.rank}-publisher", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        self._stop.set()
        self._owner = None
        if thread is not None:
            thread.join(timeout=10)
