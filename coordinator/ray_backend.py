"""The router's ``RankBackend`` over a cluster's rank actors.

Each call is one actor method call waited on with a timeout. A dead actor
(``RayActorError``), one that does not answer in time, and one that restarted
and has no ledger yet (``RankNotReadyError``) all become ``RankDiedError``;
the rank then stays out of ``ranks()`` until ``check_health`` finds it ready
again. An error the rank raised for bad input comes back as itself (the cause,
not Ray's wrapper), so the router can answer it as such.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.migration import Migrator
from kvledger.router.backend import RankDiedError, RankMethodsBackend
from kvledger.worker.wire.errors import RankNotReadyError

logger = logging.getLogger(__name__)


class RayBackend(RankMethodsBackend):
    """``RankBackend`` over rank actor handles, by rank (see the module docstring)."""

    def __init__(self, cluster: Cluster, quick_timeout_s: float = 10.0) -> None:
        if not cluster.actors:
            raise ValueError("RayBackend needs a cluster with at least one rank actor")
        self.cluster = cluster
        self.actors = list(cluster.actors)
        self.migrator = Migrator(cluster)
        self.long_call_timeout_s = cluster.config.call_timeout_s
        self.quick_timeout_s = quick_timeout_s
        self._down: set[int] = set()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ health

    def mark_down(self, rank: int) -> None:
        with self._lock:
            self._down.add(rank)

    def check_health(self) -> list[int]:
        """Ask every rank whether it is ready; returns the ranks that came back since the last check."""
        refs = [a.load.remote() for a in self.actors]
        back = []
        for r, ref in enumerate(refs):
            try:
                ready = ray.get(ref, timeout=self.quick_timeout_s)["ready"]
            except (RayActorError, GetTimeoutError, RayTaskError):
                ready = False
            with self._lock:
                if ready and r in self._down:
                    self._down.discard(r)
                    back.append(r)
                elif not ready:
                    self._down.add(r)
        return back

    def _call(self, rank: int, method: str, *args, timeout: float | None = None):
        with self._lock:
            if rank in self._down:
                raise RankDiedError(rank, "it was reported down")
        if not 0 <= rank < len(self.actors):
            raise RankDiedError(rank, "no such rank")
        ref = getattr(self.actors[rank], method).remote(*args)
        try:
            return ray.get(ref, timeout=self.quick_timeout_s if timeout is None else timeout)
        except RayActorError as e:
            self.mark_down(rank)
            raise RankDiedError(rank, f"its actor died ({type(e).__name__})") from e
        except GetTimeoutError as e:
            ray.cancel(ref)
            self.mark_down(rank)
            raise RankDiedError(rank, f"{method} did not answer within the timeout") from e
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, RankNotReadyError):
                self.mark_down(rank)
                raise RankDiedError(rank, str(cause)) from e
            if isinstance(cause, Exception):
                raise cause from None
            raise

    # ------------------------------------------------------------------ RankBackend

    def ranks(self) -> list[int]:
        with self._lock:
            return [r for r in range(len(self.actors)) if r not in self._down]

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None, lora_id: int | None,
                cache_salt: str | None) -> int:
        for r in (src, dst):
            with self._lock:
                if r in self._down:
                    raise RankDiedError(r, "it was reported down")
        try:
            res = self.migrator.migrate(tokens, src, dst, max_blocks, lora_id, cache_salt)
        except RayActorError as e:
            dead = self._which_died((src, dst))
            raise RankDiedError(dead, f"it died during a migration ({type(e).__name__})") from e
        return res.sent_blocks

    def _which_died(self, ranks: Sequence[int]) -> int:
        for r in ranks:
            try:
                ray.get(self.actors[r].ping.remote(), timeout=self.quick_timeout_s)
            except (RayActorError, GetTimeoutError):
                self.mark_down(r)
                return r
        return ranks[0]
