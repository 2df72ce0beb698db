"""Which ranks of a cluster the router may use: one account for every kind of cluster.

A rank is *down* from the moment any call finds it lost (``mark_down``) until
a health round sees it ready again (``update``); ``live`` lists the others.
The Ray cluster, the in-process cluster and the router's vLLM servers
(``router.engines``) keep their ranks' liveness here, so "down until its
health check sees it back" means the same in all three.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from kvledger.router.rank_client import RankDiedError


class Liveness:
    """The down set of one cluster's ranks; thread-safe."""

    def __init__(self) -> None:
        self._down: set[int] = set()
        self._lock = threading.Lock()

    def live(self, ranks: Iterable[int]) -> list[int]:
        """Those of ``ranks`` not down, ascending."""
        with self._lock:
            return sorted(r for r in ranks if r not in self._down)

    def check(self, rank: int) -> None:
        """``RankDiedError`` when ``rank`` is down."""
        with self._lock:
            if rank in self._down:
                raise RankDiedError(rank, "it was reported down")

    def mark_down(self, rank: int) -> None:
        with self._lock:
            self._down.add(rank)

    def update(self, ready: Mapping[int, bool]) -> list[int]:
        """Apply one health round (rank -> ready); returns the ranks that came back."""
        back = []
        with self._lock:
            for r, ok in ready.items():
                if ok and r in self._down:
                    self._down.discard(r)
                    back.append(r)
                elif not ok:
                    self._down.add(r)
        return back
