"""Ranks in this process, as a ``RankBackend``: real ``RankWorker`` objects called directly.

The router's unit tests (and anyone embedding the router without Ray) serve
through real ledgers and the reference engine, with the same rank methods the
Ray backend calls remotely. A migration copies the blocks between the two
ranks' pools in memory instead of over a process group. ``crash`` injects a
failure the backend only notices on its next call, as a dead actor is noticed.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from kvledger.router.backend import RankDiedError, RankMethodsBackend
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.rank.worker import RankNotReadyError, RankWorker


class LocalBackend(RankMethodsBackend):
    """``RankBackend`` over ``RankWorker`` objects of this process (see the module docstring)."""

    def __init__(self, workers: Sequence[RankWorker]) -> None:
        ranks = [w.rank for w in workers]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"workers must have distinct ranks, got {ranks}")
        self._workers = {w.rank: w for w in workers}
        self._down: set[int] = set()
        self._crashed: set[int] = set()
        self._lock = threading.Lock()

    @classmethod
    def build(cls, num_ranks: int, cache: CacheConfig, seed: int = 0, replay_size: int = 1024) -> LocalBackend:
        """``num_ranks`` fresh workers whose ledgers have the smallest block counts any of them can afford."""
        if type(num_ranks) is not int or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        cache = dataclasses.replace(cache, device="cpu")
        workers = [RankWorker(r, num_ranks, cache, seed=seed, replay_size=replay_size) for r in range(num_ranks)]
        counts = [w.local_block_counts() for w in workers]
        agreed = (min(c[0] for c in counts), min(c[1] for c in counts))
        for w in workers:
            w.build_ledger(*agreed)
        return cls(workers)

    def worker(self, rank: int) -> RankWorker:
        """The worker object of ``rank`` (for tests that look inside the ledger)."""
        return self._workers[rank]

    # ------------------------------------------------------------------ failures and restarts

    def crash(self, rank: int) -> None:
        """The rank dies now; the backend notices on its next call to it (and then stops listing it)."""
        with self._lock:
            self._crashed.add(rank)

    def restart(self, rank: int) -> RankWorker:
        """A fresh worker for ``rank`` (empty ledger, batches numbered from 0 again), listed as live."""
        old = self._workers[rank]
        w = RankWorker(rank, old.world_size, old.template, seed=old.seed, replay_size=old.replay_size)
        m = old.manager
        assert m is not None, f"rank {rank} never had a ledger"
        w.build_ledger(m.num_primary, m.num_secondary)
        with self._lock:
            self._workers[rank] = w
            self._down.discard(rank)
            self._crashed.discard(rank)
        return w

    def _get(self, rank: int) -> RankWorker:
        with self._lock:
            if rank in self._crashed:
                self._crashed.discard(rank)
                self._down.add(rank)
                raise RankDiedError(rank, "its worker crashed")
            if rank in self._down:
                raise RankDiedError(rank, "it was reported down")
            w = self._workers.get(rank)
        if w is None:
            raise RankDiedError(rank, "no such rank")
        return w

    def mark_down(self, rank: int) -> None:
        with self._lock:
            self._down.add(rank)

    def _call(self, rank: int, method: str, *args, timeout: float | None = None):
        w = self._get(rank)
        try:
            return getattr(w, method)(*args)
        except RankNotReadyError as e:
            raise RankDiedError(rank, str(e)) from e

    # ------------------------------------------------------------------ RankBackend

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(r for r in self._workers if r not in self._down)

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None, lora_id: int | None,
                cache_salt: str | None) -> int:
        if src == dst:
            raise ValueError(f"migrate needs two different ranks, got {src} twice")
        a, b = self._get(src), self._get(dst)
        tokens = list(tokens)
        pin_id, matched = a.export_begin(tokens, max_blocks, lora_id, cache_salt)
        if matched == 0:
            a.export_end(pin_id)
            return 0
        try:
            import_id, count = b.import_begin(tokens, matched, lora_id, cache_salt)
        except BaseException:
            a.export_end(pin_id)
            raise
        if count == 0:
            a.export_end(pin_id)
            return 0
        try:
            buf = a.export_read(pin_id, matched - count)
        except BaseException:
            b.import_abort(import_id)
            raise
        return b.import_write(import_id, buf)
