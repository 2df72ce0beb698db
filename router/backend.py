"""What the router needs from the ranks, as one interface: ``RankBackend``.

``RouterService`` talks to ranks only through this Protocol, so the same router
runs over ranks in this process (``router.local_backend.LocalBackend``, the
unit tests' backend) and over the rank actors of a Ray cluster
(``coordinator.ray_backend.RayBackend``). A backend turns every way a rank can
be lost (dead actor, restarting without a ledger) into ``RankDiedError``, and
stops listing that rank in ``ranks()`` until it is back.
"""
from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvledger.worker.wire.request import Request
from kvledger.worker.wire.batches import PublishedBatch, Snapshot


class RankDiedError(RuntimeError):
    """``rank`` is gone (its process died, or it restarted and has no ledger yet)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} is down: {reason}")
        self.rank = rank
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ServeOutcome:
    """What serving one request on one rank produced."""

    request_id: int
    rank: int
    output_tokens: list[int]
    cached_tokens: int
    """Prompt tokens whose KV the rank's ledger supplied (reused, copied or onboarded)."""
    computed_tokens: int
    onboarded_blocks: int
    events: PublishedBatch | None = None
    """The batch the rank published right after serving (``RankWorker.serve_published``): the events this
    request caused, for the router to index before it answers."""

    @classmethod
    def from_dict(cls, d: dict, events: PublishedBatch | None = None) -> ServeOutcome:
        """From ``worker.rank.result_to_dict``'s plain form."""
        return cls(d["request_id"], d["rank"], list(d["output_tokens"]), d["cached_tokens"], d["computed_tokens"],
                   d["onboarded_blocks"], events)


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's own report of its load and blocks (``worker.rank.RankWorker.load``)."""

    rank: int
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    running_requests: int = 0
    device_blocks_used: int = 0
    device_blocks_free: int = 0
    host_blocks_used: int = 0
    host_blocks_free: int = 0
    cache_hit_rate: float = 0.0
    """The ledger's reused / (reused + missed) blocks."""
    served_requests: int = 0

    @classmethod
    def from_dicts(cls, load: dict, stats: dict | None = None) -> RankLoad:
        """From ``RankWorker.load()`` (and, for the hit rate, ``RankWorker.stats()``)."""
        hit = load.get("cache_hit_rate", stats.get("cache_hit_rate", 0.0) if stats else 0.0)
        return cls(load["rank"], load["queued_prefill_tokens"], load["queued_requests"], load["running_requests"],
                   load["device_blocks_used"], load["device_blocks_free"], load["host_blocks_used"],
                   load["host_blocks_free"], float(hit), load.get("served_requests", 0))

    @property
    def device_blocks(self) -> int:
        return self.device_blocks_used + self.device_blocks_free


class RankBackend(Protocol):
    """The ranks as the router sees them. Every per-rank method raises ``RankDiedError`` for a lost rank."""

    def ranks(self) -> list[int]:
        """Ranks believed live now, ascending (a rank reported dead stays out until the backend sees it back)."""
        ...

    def serve(self, rank: int, request: Request) -> ServeOutcome:
        """Run one request to completion on ``rank``; the outcome carries the events it published."""
        ...

    def load(self, rank: int) -> RankLoad:
        ...

    def probe_exact(self, rank: int, tokens: Sequence[int], lora_id: int | None,
                    cache_salt: str | None) -> int:
        """The rank's own answer: tokens of ``tokens[:-1]`` it holds as full blocks (either tier)."""
        ...

    def poll(self, rank: int) -> PublishedBatch | None:
        """Publish the rank's pending events now (the next numbered batch), or ``None`` when there are none."""
        ...

    def replay(self, rank: int, from_seq: int) -> list[PublishedBatch] | None:
        """The rank's batches from ``from_seq`` on, or ``None`` when its replay buffer no longer reaches back."""
        ...

    def snapshot(self, rank: int) -> tuple[PublishedBatch | None, Snapshot]:
        """Every block the rank holds (after publishing what was pending, returned too)."""
        ...

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None, lora_id: int | None,
                cache_salt: str | None) -> int:
        """Move the prefix blocks of ``tokens`` that ``src`` holds to ``dst``; returns the blocks sent."""
        ...


class RankMethodsBackend(abc.ABC):
    """The ``RankBackend`` methods that are one call of a ``RankWorker`` method, over ``_call``.

    A backend says how to reach a rank's worker (``_call``: in this process, or
    an actor call with a timeout) and how to migrate; the mapping from the
    router's questions to worker methods lives here once.
    """

    long_call_timeout_s: float | None = None
    """Timeout for the calls that do real work (serve, snapshot); ``None`` = the backend's default."""

    @abc.abstractmethod
    def _call(self, rank: int, method: str, *args: object, timeout: float | None = None) -> Any:
        """``rank``'s worker's ``method(*args)``; raises ``RankDiedError`` when the rank is lost."""

    @abc.abstractmethod
    def mark_down(self, rank: int) -> None:
        """Stop listing ``rank`` until the backend sees it back."""

    def serve(self, rank: int, request: Request) -> ServeOutcome:
        (out,), batch = self._call(rank, "serve_published", [request], "none", timeout=self.long_call_timeout_s)
        return ServeOutcome.from_dict(out, batch)

    def load(self, rank: int) -> RankLoad:
        load = self._call(rank, "load")
        if not load["ready"]:
            self.mark_down(rank)
            raise RankDiedError(rank, "it has no ledger")
        return RankLoad.from_dicts(load, None if "cache_hit_rate" in load else self._call(rank, "stats"))

    def probe_exact(self, rank: int, tokens: Sequence[int], lora_id: int | None, cache_salt: str | None) -> int:
        return self._call(rank, "probe", list(tokens), lora_id, cache_salt)

    def poll(self, rank: int) -> PublishedBatch | None:
        return self._call(rank, "poll_events")

    def replay(self, rank: int, from_seq: int) -> list[PublishedBatch] | None:
        return self._call(rank, "replay_events", from_seq)

    def snapshot(self, rank: int) -> tuple[PublishedBatch | None, Snapshot]:
        return self._call(rank, "event_snapshot", timeout=self.long_call_timeout_s)
