"""Events the index could not take, counted per rank and reason, and logged once each: never silent.

A batch the router drops (it does not decode, a block size other than the
rank's, a field out of range) or an event it must skip (a foreign store whose
parent it never saw, a removal of a hash it never mapped) costs routing
accuracy without any error reaching a client: the probe simply answers less.
So each is counted here, shown by ``status``, ``/v1/cluster``, ``/metrics``
and ``monitor``, and logged the first time a rank has it for a reason.
"""
from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

MALFORMED = "malformed"
"""The batch's bytes or frames did not decode."""
BLOCK_SIZE = "block_size"
"""An event's block size is not the one its rank is indexed at."""
INVALID = "invalid"
"""A field out of range or of the wrong type."""
UNKNOWN_PARENT = "unknown_parent"
"""A foreign store chained to a block the router never saw, so it cannot be re-hashed."""
UNKNOWN_HASH = "unknown_hash"
"""A foreign removal or move of a hash the router never mapped (on that tier)."""


class Rejections:
    """Thread-safe counts of rejected batches and skipped events: ``(rank, reason) -> count``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[int, str], int] = {}

    def add(self, rank: int, reason: str, detail: str, n: int = 1) -> None:
        """Count ``n`` of ``reason`` for ``rank``; the first one is logged with ``detail``."""
        if n <= 0:
            return
        with self._lock:
            first = (rank, reason) not in self._counts
            self._counts[(rank, reason)] = self._counts.get((rank, reason), 0) + n
        if first:
            logger.warning("rank %d: the index rejected events (%s): %s; further ones are only counted",
                           rank, reason, detail)

    def by_rank(self) -> dict[int, dict[str, int]]:
        """Rank -> reason -> count."""
        with self._lock:
            out: dict[int, dict[str, int]] = {}
            for (rank, reason), n in sorted(self._counts.items()):
                out.setdefault(rank, {})[reason] = n
            return out

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())
