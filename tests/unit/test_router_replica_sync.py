"""Router replicas sharing their dispatches (``router.replica_sync``), joined in this process.

Two router services over one in-process cluster, each telling the other what it sends: the other weighs it at
once and stops when it ends, with no load report asked. Then the sync alone over load accounts: a peer gone has
its dispatches dropped, one restarted starts its peers' view of it afresh and learns their open dispatches, and a
stale load report no longer counts what a replica saw end.
"""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.config import RouterConfig
from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.replica_sync import DispatchEvent, PeerBatch, PeerGone, ReplicaSync
from kvledger.router.service import RouterService
from kvledger.worker.ledger.config import CacheConfig

T = 4
TIMEOUT = 30


class Peers:
    """In-process transport: each replica's ``receive`` by name; a replica marked dead is ``PeerGone``."""

    def __init__(self) -> None:
        self.syncs: dict[str, ReplicaSync] = {}
        self.dead: set[str] = set()

    def send(self, peer: str, batch: PeerBatch) -> int:
        if peer in self.dead or peer not in self.syncs:
            raise PeerGone(f"{peer} is not running")
        return self.syncs[peer].receive(batch)

    def join(self, name: str, peers: list[str], sink) -> ReplicaSync:
        self.dead.discard(name)
        sync = self.syncs[name] = ReplicaSync(name, peers, self.send, sink, heartbeat_s=60, call_timeout_s=TIMEOUT)
        return sync.start()


@pytest.fixture
def peers():
    p = Peers()
    yield p
    for sync in p.syncs.values():
        sync.close()


def quiesce(*syncs: ReplicaSync) -> None:
    """Past the replicas' first contact: each one's first batch to a peer is a reset, and may draw one back."""
    for _ in range(2):
        for sync in syncs:
            sync.flush(TIMEOUT)


def dispatched(id: int, rank: int = 0, tokens: int = 100, blocks: int = 4) -> DispatchEvent:
    return DispatchEvent("dispatched", id, rank, tokens, blocks)


def finished(e: DispatchEvent) -> DispatchEvent:
    return DispatchEvent("finished", e.id, e.rank, e.prefill_tokens, e.blocks)


def test_a_replica_weighs_the_others_request_from_its_dispatch_to_its_finish(peers):
    """Replica A's request is held on its rank; replica B, told by A, weighs it queued there without asking any
    rank for its load, and weighs the rank idle once A has finished it."""
    cfg = CacheConfig(tokens_per_block=T, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=64)
    cluster = LocalCluster.build(2, cfg)
    a, b = (RouterService(cluster, RouterConfig(tokens_per_block=T, policy="kv")) for _ in range(2))
    for svc in (a, b):
        svc.feed.sync()
    sync_a, sync_b = peers.join("a", ["b"], a), peers.join("b", ["a"], b)
    sent: list[DispatchEvent] = []
    went = threading.Event()

    def tell(e: DispatchEvent) -> None:
        sync_a(e)
        sent.append(e)
        went.set()

    a.listen(tell)
    b.listen(sync_b)
    quiesce(sync_a, sync_b)
    prompt = list(range(1, 6 * T + 2))
    result: list = []
    with contextlib.ExitStack() as held:
        for r in range(2):   # every rank's step loop waits: the request stays in flight where it went
            held.enter_context(cluster.worker(r).books.lock)
        t = threading.Thread(target=lambda: result.append(a.complete(prompt, max_tokens=2)), daemon=True)
        t.start()
        assert went.wait(TIMEOUT), "replica A never dispatched"
        (d,) = sent
        assert sync_a.flush(TIMEOUT) == {"b": 1}
        seen = b.route(prompt).loads[d.rank]
        assert (seen.queued_requests, seen.queued_prefill_tokens) == (1, len(prompt)), "A's request, weighed by B"
        assert b.account.peers() == {"a": 1}
        assert (b.route(prompt).loads[1 - d.rank].queued_requests) == 0
    t.join(timeout=TIMEOUT)
    assert not t.is_alive() and result[0].rank == d.rank
    assert [e.kind for e in sent] == ["dispatched", "finished"]
    assert sync_a.flush(TIMEOUT) == {"b": 2}
    seen = b.route(prompt).loads[d.rank]
    assert (seen.queued_requests, seen.running_requests, seen.queued_prefill_tokens) == (0, 0, 0)
    assert b.account.peers() == {"a": 0}
    assert a.account.peers() == {"b": 0}, "B sent nothing but its empty open set"
    a.close()
    b.close()


def test_a_peer_found_gone_has_its_dispatches_dropped(peers):
    a, b = LoadAccount(), LoadAccount()
    sync_a, sync_b = peers.join("a", ["b"], a), peers.join("b", ["a"], b)
    quiesce(sync_a, sync_b)
    for i in (1, 2):
        sync_a(dispatched(i, tokens=10 * i))
    sync_a.flush(TIMEOUT)
    assert b.inflight(0) == (2, 30)
    sync_a(finished(dispatched(1, tokens=10)))
    sync_a.flush(TIMEOUT)
    assert b.inflight(0) == (1, 20), "A's finish removes exactly its own entry"
    peers.dead.add("a")   # A's process dies with its request 2 in flight
    assert sync_b.flush(TIMEOUT) == {}, "B found A gone trying"
    assert b.inflight(0) == (0, 0) and b.peers() == {}


def test_a_replica_that_restarts_starts_over_at_its_peers_and_learns_their_open_dispatches(peers):
    a, b = LoadAccount(), LoadAccount()
    sync_a, sync_b = peers.join("a", ["b"], a), peers.join("b", ["a"], b)
    quiesce(sync_a, sync_b)
    sync_a(dispatched(1, rank=0, tokens=40))
    sync_b(dispatched(7, rank=1, tokens=70))
    sync_b(dispatched(8, rank=1, tokens=80))
    sync_b(finished(dispatched(8, rank=1, tokens=80)))
    assert sync_a.flush(TIMEOUT) == {"b": 1} and sync_b.flush(TIMEOUT) == {"a": 3}
    assert b.inflight(0) == (1, 40) and a.inflight(1) == (1, 70)
    sync_a.close()   # A restarts: a new process, nothing in flight, ids from 1 again
    a2 = LoadAccount()
    sync_a2 = peers.join("a", ["b"], a2)
    assert sync_a2.flush(TIMEOUT) == {"b": 0}, "its first batch, a reset of nothing open"
    assert b.inflight(0) == (0, 0), "the old process's request no longer counts"
    sync_a2(dispatched(1, rank=0, tokens=5))
    assert sync_a2.flush(TIMEOUT) == {"b": 1}
    assert b.inflight(0) == (1, 5), "a new request 1 is not mistaken for the old one"
    # B notices the new process on its next call and sends it what it has open
    assert sync_b.flush(TIMEOUT) == {"a": 1}
    assert a2.inflight(1) == (1, 70)


def test_events_reach_a_peer_in_the_order_they_were_made(peers):
    got: list[DispatchEvent] = []

    class Sink:
        def peer_events(self, peer, events, reset):
            got.extend(events)

        def drop_peer(self, peer):
            raise AssertionError("no peer is gone here")

    sync_a, sync_b = peers.join("a", ["b"], LoadAccount()), peers.join("b", ["a"], Sink())
    quiesce(sync_a, sync_b)
    made = []
    for i in range(1, 201):
        made.append(dispatched(i, rank=i % 3))
        sync_a(made[-1])
        if i % 3 == 0:
            made.append(finished(made[-2]))
            sync_a(made[-1])
    assert sync_a.flush(TIMEOUT) == {"b": len(made)}
    assert got == made


def test_a_stale_load_report_no_longer_counts_what_a_replica_saw_end():
    """Rank 0's report was asked while replica A's two requests ran there; one has ended since. B, told of both
    and of the end, reads the report less it; a client no replica saw still counts from the report."""
    b = LoadAccount()
    first, second = dispatched(1, tokens=30), dispatched(2, tokens=20)
    b.peer_events("a", [first, second])
    asked = b.ended(0)
    report = ReportedQueue(waiting=1, running=2, prefill_tokens=60)   # A's two and a client's own request
    b.peer_events("a", [finished(first)])
    fresh = report.less(b.ended(0).since(asked))
    assert fresh == ReportedQueue(waiting=1, running=1, prefill_tokens=30)
    s = b.state(0, 0.0, reported=fresh)
    assert (s.queued_requests + s.running_requests, s.queued_prefill_tokens) == (2, 30)
    b.peer_events("a", [finished(second)])
    s = b.state(0, 0.0, reported=report.less(b.ended(0).since(asked)))
    assert (s.queued_requests + s.running_requests, s.queued_prefill_tokens) == (1, 10), "the client's alone"
