"""The thin ``@ray.remote`` wrapper of ``RankWorker`` the coordinator spawns, one per rank.

The actor is threaded (``max_concurrency``), so a rank blocked in a ``recv``
still serves, probes and reports (``RankBooks`` serializes the ledger). Besides
the worker's own methods it answers where it runs, and pushes its event
batches to every router actor attached (each replica gets every batch). The
class is built on first use, so importing this module needs no Ray.
"""
from __future__ import annotations

import os
from functools import cache

import kvledger.worker
from kvledger.worker.rank.faults import FaultySink, TransportFaults
from kvledger.worker.rank.pusher import ReceiverGone
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.batches import PublishedBatch

#: Event pushes a rank leaves unanswered before its publisher waits for the router.
MAX_PUSHES_IN_FLIGHT = 64


@cache
def rank_actor_class(worker_cls: type[RankWorker] = RankWorker) -> type:
    """``worker_cls`` (``RankWorker`` or a subclass, as benchmarks use) as a threaded Ray actor class."""
    import ray

    @ray.remote(max_concurrency=8)
    class RankActor(worker_cls):  # type: ignore[valid-type, misc]
        """``RankWorker`` as a Ray actor (options such as ``num_gpus`` come from the coordinator)."""

        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def node_id(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def pid(self) -> int:
            return os.getpid()

        def ping(self) -> int:
            return self.rank

        def code_path(self) -> str:
            """Where this process imported kvledger from (the shipped package on a node without an install)."""
            return os.path.dirname(kvledger.worker.__file__)

        def attach_router(self, router: ray.actor.ActorHandle, owner: str, interval_s: float = 0.005,
                          faults: TransportFaults | None = None) -> bool:
            """Push this rank's event batches to ``router.ingest(rank, seq, data)`` too, fire-and-forget, through
            ``faults`` when they are on (``worker.rank.faults``); the routers attached before keep theirs.
            ``owner`` is the router's own id for its pushes, the same after it restarts (its actor id): ``False``
            when that router is attached already (a restarted one: its handle reaches the new process).

            At most ``MAX_PUSHES_IN_FLIGHT`` pushes stay unanswered: past that the
            publisher thread waits for the router (back-pressure, so a slow router's
            queue of calls stays bounded), never longer than 30 s a time. A router
            found dead then is detached (one that restarts attaches itself again).
            """
            in_flight: list = []

            def sink(batch: PublishedBatch) -> None:
                in_flight.append(router.ingest.remote(self.rank, batch.seq, batch.data))
                if len(in_flight) > MAX_PUSHES_IN_FLIGHT:
                    done, in_flight[:] = ray.wait(in_flight, num_returns=len(in_flight) // 2, timeout=30)
                    try:
                        ray.get(done[-1:], timeout=30)
                    except ray.exceptions.ActorDiedError as e:
                        raise ReceiverGone(str(e)) from e

            push = FaultySink(sink, faults, self.rank) if faults is not None and faults.active else sink
            return self.start_publishing(push, interval_s, owner=owner)

    return RankActor
