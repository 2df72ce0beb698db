"""kvledger's own ranks as the router reaches them: a rank with a ledger, and the cluster of them.

A ``RankClient`` is one rank with named methods returning wire types
(``kvledger.worker.wire``): serving, load and info, and what only a ledger
answers (an exact probe, event replay and snapshots, export and import for
migration). The router generates through the ``Engine`` interface
(``router.engine``) that every engine has; it reaches a ``RankClient``'s
ledger calls by the capabilities an engine lists (``router.engines``). A
``RankSet`` is the cluster of such ranks: which are live, the client of each,
and how to move a prefix between two of them; the same router runs over
kvledger's Ray rank actors (``kvledger.coordinator.cluster.Cluster``) and
ranks in this process (``kvledger.coordinator.local_cluster.LocalCluster``).

Every way a rank can be lost (its process died, it does not answer in time, it
restarted and has no ledger yet) reaches the router as ``RankDiedError``; the
set then stops listing that rank in ``live()`` until its health check sees it
back. An error the rank raised for bad input comes back as itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankInfo, RankLoad, ServeReply
from kvledger.worker.wire.request import Request


class RankDiedError(RuntimeError):
    """``rank`` is gone (its process died, or it restarted and has no ledger yet)."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(rank, reason)
        self.rank = rank
        self.reason = reason

    def __str__(self) -> str:
        return f"rank {self.rank} is down: {self.reason}"


class RankClient(Protocol):
    """One rank. Every method raises ``RankDiedError`` when the rank is lost."""

    @property
    def rank(self) -> int: ...

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        """Run the requests to completion (an own rank: in its running batch, ``worker.rank.scheduler``); with
        ``publish`` the reply carries the events serving caused, as the rank's next numbered batch (otherwise they
        wait for its next poll or push). ``RankBusyError`` (``worker.wire.messages``): the rank's queue is full
        and the requests were not taken."""
        ...

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        """The rank's own answer: tokens of ``tokens[:-1]`` it holds as full blocks (either tier)."""
        ...

    def load(self) -> RankLoad:
        """Its queue, blocks per tier and hit rate, in one call (``ready=False``: it has no ledger yet)."""
        ...

    def info(self) -> RankInfo:
        """What it is: device, blocks, the model it serves and that model's tokenizer."""
        ...

    def poll_events(self) -> PublishedBatch | None:
        """Publish the rank's pending events now (the next numbered batch), or ``None`` when there are none."""
        ...

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        """The rank's batches from ``from_seq`` on, or ``None`` when its replay buffer no longer reaches back."""
        ...

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        """Every block the rank holds (after publishing what was pending, returned too)."""
        ...

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket:
        """Migration source: pin the prefix blocks of ``tokens`` the rank holds (at most ``max_blocks``)."""
        ...

    def export_end(self, pin_id: int) -> None:
        """Release a pin (idempotent)."""
        ...

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket:
        """Migration target: allocate the first ``num_blocks`` prefix blocks of ``tokens`` it lacks."""
        ...

    def import_abort(self, import_id: int) -> None:
        """Give an import's blocks back unstored (idempotent)."""
        ...


class RankSet(Protocol):
    """The ranks the router routes over."""

    def live(self) -> list[int]:
        """Ranks believed live now, ascending (a rank reported dead stays out until its health check sees it)."""
        ...

    def client(self, rank: int) -> RankClient:
        """The client of ``rank``; ``RankDiedError`` when it is not live."""
        ...

    def mark_down(self, rank: int) -> None:
        """Stop listing ``rank`` until its health check sees it back."""
        ...

    def check_health(self) -> list[int]:
        """Ask every rank whether it is ready (one round); returns the ranks that came back since the last one."""
        ...

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> int:
        """Move the prefix blocks of ``tokens`` that ``src`` holds and ``dst`` lacks; returns the blocks sent."""
        ...
