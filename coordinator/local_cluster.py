"""Ranks in this process, as the router's ``RankSet``: real ``RankWorker`` objects called directly.

The router's unit tests, the contract tests, and anyone embedding the router
without Ray serve through real ledgers and the reference engine, with the same
rank interface the Ray ranks answer. A migration runs the one choreography of
``kvledger.coordinator.migration``, its bytes handed over as a tensor instead
of sent over a process group. ``crash`` injects a failure the cluster only
notices on its next call to that rank, as a dead actor is noticed.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from kvledger.coordinator.migration import Migrator, stepwise
from kvledger.router.liveness import Liveness
from kvledger.router.rank_client import RankDiedError
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankInfo, RankLoad, ServeReply
from kvledger.worker.wire.request import Request


class InProcessRankClient:
    """A ``RankClient`` over a worker of this process; a crashed or unready rank raises ``RankDiedError``."""

    def __init__(self, cluster: LocalCluster, rank: int) -> None:
        self._cluster = cluster
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def worker(self) -> RankWorker:
        return self._cluster.reach(self._rank)

    def _ready(self) -> RankWorker:
        w = self.worker
        if w.manager is None:
            self._cluster.mark_down(self._rank)
            raise RankDiedError(self._rank, f"rank {self._rank}: the ledger is not built yet")
        return w

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        return self._ready().serve(requests, logits, publish)

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        return self._ready().probe(tokens, lora_id, cache_salt)

    def load(self) -> RankLoad:
        return self.worker.load()

    def info(self) -> RankInfo:
        return self.worker.info()

    def poll_events(self) -> PublishedBatch | None:
        return self._ready().poll_events()

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        return self._ready().replay_events(from_seq)

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        return self._ready().event_snapshot()

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket:
        return self._ready().export_begin(tokens, max_blocks, lora_id, cache_salt)

    def export_end(self, pin_id: int) -> None:
        self._ready().export_end(pin_id)

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket:
        return self._ready().import_begin(tokens, num_blocks, lora_id, cache_salt)

    def import_abort(self, import_id: int) -> None:
        self._ready().import_abort(import_id)

    def check_integrity(self) -> None:
        self._ready().check_integrity()


class _CopyMover:
    """A migration's bytes read out of the source's pool and written into the target's, in this process."""

    def __init__(self, src: RankWorker, dst: RankWorker) -> None:
        self.src, self.dst = src, dst

    def move(self, export: ExportTicket, start: int, target: ImportTicket) -> int:
        data = self.src.export_read(export.pin_id, start)
        self.dst.import_write(target.import_id, data)
        return sum(d.numel() * d.element_size() for d in data)


class LocalCluster:
    """The ``RankSet`` of ``RankWorker`` objects of this process (see the module docstring)."""

    def __init__(self, workers: Sequence[RankWorker]) -> None:
        ranks = [w.rank for w in workers]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"workers must have distinct ranks, got {ranks}")
        self._workers = {w.rank: w for w in workers}
        self._clients = {r: InProcessRankClient(self, r) for r in ranks}
        self.liveness = Liveness()
        self._crashed: set[int] = set()
        self._lock = threading.Lock()
        self.migrator = Migrator(stepwise(self.client, lambda s, d: _CopyMover(self.reach(s), self.reach(d))))

    @classmethod
    def build(cls, num_ranks: int, cache: CacheConfig, seed: int = 0, replay_size: int = 1024) -> LocalCluster:
        """``num_ranks`` fresh workers whose ledgers have the smallest block counts any of them can afford."""
        if type(num_ranks) is not int or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
        cache = dataclasses.replace(cache, device="cpu")
        workers = [RankWorker(r, num_ranks, cache, seed=seed, replay_size=replay_size) for r in range(num_ranks)]
        counts = [w.local_block_counts() for w in workers]
        agreed = tuple(min(column) for column in zip(*counts))   # every window's tiers, as the MIN all-reduce
        for w in workers:
            w.build_ledger(*agreed)
        return cls(workers)

    def worker(self, rank: int) -> RankWorker:
        """The worker object of ``rank`` (for tests that look inside the ledger), reachable or not."""
        return self._workers[rank]

    def reach(self, rank: int) -> RankWorker:
        """The worker of ``rank`` for a call now: a crash is noticed here, once, and marks it down."""
        with self._lock:
            crashed = rank in self._crashed
            self._crashed.discard(rank)
            w = self._workers.get(rank)
        if crashed:
            self.liveness.mark_down(rank)
            raise RankDiedError(rank, "its worker crashed")
        if w is None:
            raise ValueError(f"no rank {rank!r} among ranks {sorted(self._workers)}")
        return w

    # ------------------------------------------------------------------ failures and restarts

    def crash(self, rank: int) -> None:
        """The rank dies now; the cluster notices on its next call to it (and then stops listing it)."""
        with self._lock:
            self._crashed.add(rank)

    def restart(self, rank: int) -> RankWorker:
        """A fresh worker for ``rank`` (empty ledger, batches numbered from 0 again), listed as live."""
        old = self._workers[rank]
        m = old.manager
        assert m is not None, f"rank {rank} never had a ledger"
        w = RankWorker(rank, old.world_size, old.template, seed=old.seed, replay_size=old.replay_size,
                       batching=old.batching)
        w.build_ledger(*(n for tiers in m.window_block_counts for n in tiers))
        with self._lock:
            self._workers[rank] = w
            self._crashed.discard(rank)
        self.liveness.update({rank: True})
        return w

    def check_health(self) -> list[int]:
        """Update who is live (a worker with a ledger that did not crash); returns the ranks back."""
        with self._lock:
            ready = {r: r not in self._crashed and w.manager is not None for r, w in self._workers.items()}
        return self.liveness.update(ready)

    # ------------------------------------------------------------------ RankSet

    def live(self) -> list[int]:
        return self.liveness.live(self._workers)

    def client(self, rank: int) -> InProcessRankClient:
        client = self._clients.get(rank)
        if client is None:
            raise ValueError(f"no rank {rank!r} among ranks {sorted(self._workers)}")
        self.liveness.check(rank)
        return client

    def mark_down(self, rank: int) -> None:
        self.liveness.mark_down(rank)

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> int:
        return self.migrator.migrate(tokens, src, dst, max_blocks, lora_id, cache_salt).sent_blocks


__all__ = ["InProcessRankClient", "LocalCluster"]
