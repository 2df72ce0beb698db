"""Every engine the router routes to, by rank: kvledger's own ranks and the vLLM servers added to them.

``Engines`` is the one membership the router asks: which ranks are live, the
``Engine`` under each (``router.engine``), and, for engines whose info lists
the capability, the ledger's own interface (``ledger``: exact probes, event
replay, migration). Own ranks come from a ``RankSet`` (the Ray cluster, the
in-process one, or none: a router in front of vLLM servers only), which keeps
their liveness; each becomes an engine the first time it is asked for, from
its ``RankInfo``. Added engines (``add``) take ranks from
``FOREIGN_RANK_BASE`` on and are down from the first call that finds them
lost until a health round sees ``/health`` answer again.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from kvledger.router.engine import Capability, Engine
from kvledger.router.liveness import Liveness
from kvledger.router.own_engine import OwnEngine, engine_info
from kvledger.router.rank_client import RankClient, RankDiedError, RankSet
from kvledger.worker.wire.batches import PublishedBatch


class EngineCannotError(RuntimeError):
    """An engine was asked for something its info does not list (``Capability``)."""


class AddedEngine(Engine, Protocol):
    """An engine added by address: it answers a health check of its own."""

    def healthy(self) -> bool: ...


class Engines:
    """See the module docstring."""

    def __init__(self, own: RankSet | None, publish: Callable[[int, PublishedBatch], None]) -> None:
        self.own = own
        self._publish = publish
        self._own: dict[int, OwnEngine] = {}
        self._added: dict[int, AddedEngine] = {}
        self._liveness = Liveness()
        self._lock = threading.Lock()

    def add(self, engine: AddedEngine) -> None:
        with self._lock:
            if engine.rank in self._added:
                raise ValueError(f"rank {engine.rank} is already an engine")
            self._added[engine.rank] = engine

    def live(self) -> list[int]:
        own = self.own.live() if self.own is not None else []
        with self._lock:
            added = list(self._added)
        return [*own, *self._liveness.live(added)]

    def engine(self, rank: int) -> Engine:
        """The engine under ``rank``; ``RankDiedError`` when it is not live."""
        added = self._added.get(rank)
        if added is not None:
            self._liveness.check(rank)
            return added
        with self._lock:
            known = self._own.get(rank)
        if known is not None:
            self.client(rank)   # still live
            return known
        client = self.client(rank)
        found = client.info()
        if not found.ready:
            self.mark_down(rank)
            raise RankDiedError(rank, "it has no ledger yet")
        with self._lock:
            return self._own.setdefault(rank, OwnEngine(client, engine_info(found), self._publish))

    def live_engines(self) -> dict[int, Engine]:
        """The engine of every live rank (one lost on the way is left out and marked down)."""
        out = {}
        for r in self.live():
            try:
                out[r] = self.engine(r)
            except RankDiedError:
                continue
        return out

    def added(self) -> dict[int, AddedEngine]:
        """Every added engine, live or down, by rank."""
        with self._lock:
            return dict(self._added)

    def client(self, rank: int) -> RankClient:
        """The ledger of own rank ``rank`` (``RankDiedError`` when it is not live or not an own rank)."""
        if self.own is None or rank in self._added:
            raise RankDiedError(rank, "it has no ledger")
        return self.own.client(rank)

    def ledger(self, rank: int, capability: Capability) -> RankClient:
        """The ledger of ``rank``, for a call its info lists; ``EngineCannotError`` when it does not."""
        if not self.engine(rank).info().can(capability):
            raise EngineCannotError(f"rank {rank} cannot {capability.value.replace('_', ' ')}")
        return self.client(rank)

    def mark_down(self, rank: int) -> None:
        """Stop listing ``rank`` until a health round sees it back (an own rank is asked its info anew then)."""
        if rank in self._added:
            self._liveness.mark_down(rank)
            return
        with self._lock:
            self._own.pop(rank, None)
        if self.own is not None:
            self.own.mark_down(rank)

    def check_health(self) -> list[int]:
        """One round over own ranks and added engines; the ranks back since the last, each asked its info anew."""
        back = self.own.check_health() if self.own is not None else []
        added = self.added()
        with self._lock:
            for r in back:
                self._own.pop(r, None)
        for r in self._liveness.update({r: e.healthy() for r, e in added.items()}):
            try:
                added[r].info(refresh=True)
            except RankDiedError:
                self._liveness.mark_down(r)
                continue
            back.append(r)
        return back

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> int:
        """Move the prefix blocks of ``tokens`` that ``src`` holds and ``dst`` lacks; the blocks sent."""
        for r in (src, dst):
            self.ledger(r, Capability.MIGRATION)
        return self.own.migrate(tokens, src, dst, max_blocks, lora_id, cache_salt)

    def close(self) -> None:
        for engine in self.added().values():
            engine.close()
