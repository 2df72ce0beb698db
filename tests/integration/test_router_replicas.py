"""Router replicas: several router actors over the same ranks, each with its own index fed by the same event
streams, each told the others' dispatches by the others (``router.replica_sync``; in process:
``tests/unit/test_router_replica_sync.py``).

The plain parts first (a rank's publisher pushing every batch to every attached receiver; a load account and a
rank's report of the same requests; a rank's report of work no router sent), then real router actors on a real
local Ray cluster: replicas fed the same events decide alike for the same prompt, a request sent to any replica is
served and indexed by all, and each replica is told of it before the next is routed (``peer_sync``, not a sleep).
"""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
import torch
from router_helpers import TIMEOUT, system, wait_for, wait_logged

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.coordinator.router_actor import RouterActorConfig, router_name, start_routers
from kvledger.router.config import RouterConfig
from kvledger.router.groups import WindowedIndex
from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.numbering import ApplyStatus, SequencedIndex
from kvledger.router.probe import probe
from kvledger.router.replica_sync import DispatchEvent
from kvledger.router.service import RouterService
from kvledger.worker.engine.tokenizer import encode
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.pusher import ReceiverGone
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.batches import PublishedBatch
from kvledger.worker.wire.request import Request

T = 8
PREFIX = "kvledger-replica-test-rank"
REPLICAS = 2


def cache(primary: int) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=primary)


# ---------------------------------------------------------------------- plain parts, no cluster


def test_a_rank_pushes_every_batch_to_every_attached_router_in_order():
    """Every batch reaches every router, including one a published serve drained for the router that sent it."""
    w = RankWorker(0, 1, cache(32))
    w.build_ledger(*w.local_block_counts())
    created = w.poll_events()   # batch 0 (the ledger's announcement), taken before either router attaches
    got: dict[str, list[PublishedBatch]] = {"a": [], "b": []}
    seen = {k: threading.Event() for k in got}

    def sink(owner: str):
        def push(batch: PublishedBatch) -> None:
            got[owner].append(batch)
            if batch.seq >= 2:
                seen[owner].set()
        return push

    gone: list[int] = []

    def dead(batch: PublishedBatch) -> None:
        gone.append(batch.seq)
        raise ReceiverGone("a router killed for good")

    assert w.start_publishing(dead, interval_s=0.001, owner="dead")
    assert w.start_publishing(sink("a"), interval_s=0.001, owner="a")
    assert w.start_publishing(sink("b"), interval_s=0.001, owner="b"), "a second router is added, not swapped in"
    assert not w.start_publishing(sink("b"), interval_s=0.001, owner="b"), "re-attaching the same router: no-op"
    try:
        for rid in (1, 2):   # two batches after the one that announced the ledger
            # the second is drained by a published serve and handed to its caller: it is pushed all the same
            reply = w.serve([Request(rid, list(range(100 * rid, 100 * rid + 3 * T)), 0)], publish=rid == 2)
            assert (reply.events is not None) == (rid == 2)
            assert wait_for(lambda: max((b.seq for b in got["a"]), default=-1) >= rid, "the pushed batch")
        for owner, event in seen.items():
            assert event.wait(timeout=10), f"router {owner} never got batch 2"
    finally:
        w.stop_publishing()
    assert [b.seq for b in got["a"]] == [b.seq for b in got["b"]] == list(range(1, len(got["a"]) + 1))
    assert [b.data for b in got["a"]] == [b.data for b in got["b"]], "the same bytes to each router"
    assert gone == [1], "a receiver that is gone is detached at its first failed push; the others go on"
    for batches in got.values():
        index = SequencedIndex(WindowedIndex(T))
        assert index.ingest(0, created.seq, created.data)[0].status is ApplyStatus.APPLIED
        assert all(index.ingest(0, b.seq, b.data)[0].status is ApplyStatus.APPLIED for b in batches)
        assert probe(index.store, list(range(200, 200 + 3 * T)))[0].matched_tokens == 2 * T


def test_a_replica_counts_the_requests_it_was_told_of_and_the_ranks_report_of_them_once():
    """Router A sent rank 0 two requests and told B; B sent one. The rank reports all three; B, holding A's two
    and its own, sees three in flight (not its count plus the report: the report holds them too)."""
    a, b = LoadAccount(), LoadAccount()
    sent = [a.dispatch(0, 100, 4) for _ in range(2)]
    b.peer_events("a", [DispatchEvent("dispatched", d.id, d.rank, d.prefill_tokens, d.blocks) for d in sent])
    b.dispatch(0, 50, 2)
    told = b.state(0, 0.0)
    assert (told.queued_requests, told.running_requests, told.queued_prefill_tokens) == (3, 0, 250)
    report = ReportedQueue(waiting=2, running=1, prefill_tokens=150)   # one of A's runs; the others wait
    s = b.state(0, 0.0, reported=report)
    assert (s.queued_requests, s.running_requests, s.queued_prefill_tokens) == (2, 1, 250)
    # a report older than A's latest dispatch does not hide it: the larger total wins
    a.dispatch(0, 10, 1)
    s = a.state(0, 0.0, reported=report)
    assert s.queued_requests + s.running_requests == 3 and s.queued_prefill_tokens == 210
    # one router alone, its one request running on the rank: counted once (it still calls it queued)
    solo = LoadAccount()
    solo.dispatch(1, 80, 3)
    s = solo.state(1, 0.0, reported=ReportedQueue(waiting=0, running=1))
    assert (s.queued_requests, s.running_requests) == (0, 1)


def test_a_router_sees_load_no_router_sent_through_the_ranks_report():
    """Two router services over the same ranks: what a client no router saw queued on rank 0 reaches router B
    only through rank 0's load report, and B sends the next prompt of rank 0's prefix elsewhere until it
    drains."""
    cluster = LocalCluster.build(2, cache(256))
    a, b = (RouterService(cluster, RouterConfig(tokens_per_block=T, policy="kv")) for _ in range(2))
    shared = list(range(1, 2 * T + 2))
    assert a.complete(shared, max_tokens=1).rank is not None
    home = a.complete(shared + [7], max_tokens=1).rank
    b.check_health()
    b.refresh_loads(force=True)
    assert b.route(shared + [9]).rank == home, "idle: the prefix decides"
    busy = cluster.worker(home)
    senders = []
    with busy.books.lock:   # the rank's step loop waits: what is sent to it stays queued
        for i in range(4):
            t = threading.Thread(target=busy.serve, args=([Request(900 + i, [50 + i] * 600, 1)],), daemon=True)
            t.start()
            senders.append(t)
        wait_for(lambda: busy.load().queued_requests == 4, "the four requests to queue on the rank")
        b.refresh_loads(force=True)
        busy_route = b.route(shared + [9])
        assert busy_route.rank == 1 - home, "2400 queued prompt tokens outweigh one cached block"
        seen = busy_route.loads[home]
        assert (seen.queued_requests, seen.queued_prefill_tokens) == (4, 2400), "the load it was weighed with"
    for t in senders:
        t.join(timeout=TIMEOUT)
        assert not t.is_alive(), "a queued request never finished"
    b.refresh_loads(force=True)
    assert b.route(shared + [9]).rank == home, "drained: the prefix decides again"
    a.close()
    b.close()


# ---------------------------------------------------------------------- real router actors


@pytest.fixture(scope="module")
def replicas(ray_session):
    """Two replicas with no health round while the tests run: each asks the ranks for their load once, at its
    start, when they are idle, so what it weighs of the other's requests it has from the other alone."""
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache(128), num_cpus_per_rank=0.5, name_prefix=PREFIX,
                        group_timeout_s=30, call_timeout_s=TIMEOUT)
    cluster = Cluster.start(cfg)
    routers = []
    try:
        routers = start_routers(cluster, RouterActorConfig(port=0, routers=REPLICAS, health_interval_s=600),
                                name=f"{PREFIX}-router")
        handles = [h for h, _ in routers]
        for _ in range(2):   # past first contact: each replica's first batch to a peer is a reset
            peer_sync(ray_session, handles)
        clients = [httpx.Client(base_url=url, timeout=TIMEOUT) for _, url in routers]
        yield cluster, handles, clients
        for c in clients:
            c.close()
    finally:
        for h, _ in routers:
            ray_session.kill(h, no_restart=True)
        cluster.shutdown()


def matched(client: httpx.Client, prompt: str) -> list[int]:
    return [r["matched_tokens"] for r in client.post("/v1/probe", json={"prompt": prompt}).json()["ranks"]]


def exact(client: httpx.Client, prompt: str) -> list[int]:
    body = {"prompt": prompt, "exact": True}
    return [r["matched_tokens"] for r in client.post("/v1/probe", json=body).json()["ranks"]]


def peer_sync(ray_session, handles) -> list[dict[str, int]]:
    """Once every replica has applied what every other one told it so far: per replica, each peer that took it
    with the count of that replica's events it has applied (every replica reachable)."""
    synced = ray_session.get([h.peer_sync.remote(TIMEOUT) for h in handles], timeout=2 * TIMEOUT)
    names = [router_name(i, f"{PREFIX}-router") for i in range(len(handles))]
    for i, got in enumerate(synced):
        assert set(got) == set(names) - {names[i]}, f"replica {i} reached only {got}"
    return synced


def idle(client: httpx.Client, prompt: str) -> bool:
    ranks = client.post("/v1/route", json={"prompt": prompt}).json()["ranks"]
    return all(r["load"] == {"queued_requests": 0, "queued_prefill_tokens": 0, "running_requests": 0}
               for r in ranks)


def test_replicas_listen_on_ports_of_their_own_under_names_of_their_own(replicas, ray_session):
    _, handles, clients = replicas
    assert len({str(c.base_url) for c in clients}) == REPLICAS
    assert all(c.base_url.host == "127.0.0.1" for c in clients)
    assert [ray_session.get_actor(router_name(i, f"{PREFIX}-router"), namespace="kvledger")
            for i in range(REPLICAS)] == handles
    assert all(c.get("/health").json()["live_ranks"] == [0, 1] for c in clients)


def test_a_rank_knows_each_replica_by_the_id_the_replica_hands_it(replicas, ray_session):
    """The pushes are keyed by the id each replica passes when it attaches (its actor id, from Ray's public
    runtime context), so the same replica attaching again is a no-op and each replica is pushed to apart."""
    cluster, handles, _ = replicas
    ids = ray_session.get([h.push_id.remote() for h in handles], timeout=TIMEOUT)
    assert len(set(ids)) == REPLICAS and all(ids)
    for handle, owner in zip(handles, ids):
        for rank in (0, 1):
            assert not cluster.client(rank).attach_router(handle, owner, 0.005, None), "attached already, by its id"


def test_replicas_fed_the_same_events_make_the_same_decision(replicas):
    cluster, _, clients = replicas
    homes = {0: system("r0") + "Q: held by rank zero", 1: system("r1") + "Q: held by rank one"}
    for r, text in homes.items():   # served on the ranks directly: only the pushed events tell the routers
        cluster.client(r).serve([Request(5000 + r, encode(text), 1)])
    for text in homes.values():
        truth = exact(clients[0], text)
        for c in clients:
            wait_logged(c, lambda: matched(c, text) == truth, "every replica to index the pushes")
    assert all(idle(c, system("r0")) for c in clients), "no router dispatched anything"
    # (a prompt nobody holds is a tie every rank wins equally: which one each replica draws is no disagreement)
    questions = [homes[0] + " and a follow-up", homes[1] + " and another", system("r0")[:40] + " half a prefix"]
    for q in questions:
        decisions = [c.post("/v1/route", json={"prompt": q, "max_tokens": 4}).json() for c in clients]
        assert len({d["rank"] for d in decisions}) == 1, (q, decisions)
        assert len({tuple(r["matched_tokens"] for r in d["ranks"]) for d in decisions}) == 1, decisions
    for r, text in homes.items():
        assert clients[1].post("/v1/route", json={"prompt": text + "!"}).json()["rank"] == r


def test_a_request_to_any_replica_is_served_and_indexed_by_all(replicas, ray_session):
    """Every replica is told of each request another sent, and of its end, before the next is routed: the
    follow-ups all go where the prefix is, each replica weighing the ranks idle."""
    _, handles, clients = replicas
    shared = system("any")
    told = peer_sync(ray_session, handles)

    def via(k: int, prompt: str, max_tokens: int) -> dict:
        nonlocal told
        got = clients[k].post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens})
        assert got.status_code == 200, got.text
        now = peer_sync(ray_session, handles)
        told[k] = {peer: n + 2 for peer, n in told[k].items()}
        assert now == told, f"replica {k}'s dispatch and finish, taken by every other, and nothing else"
        assert all(idle(c, shared) for c in clients), f"every replica knows replica {k}'s request ended"
        return got.json()["kvledger"]

    for i in range(REPLICAS):
        text = shared + f"Q: first via replica {i}?"
        home = via(i, text, 2)["rank"]
        for other in clients:
            wait_logged(other, lambda: matched(other, text)[home] > 0, f"replica {clients.index(other)} to index it")
            assert matched(other, text) == exact(other, text)
        for j in range(REPLICAS):   # a follow-up to any replica goes where the prefix is
            got = via(j, shared + f"Q: then via {j}?", 1)
            assert got["rank"] == home and got["cached_tokens"] >= len(encode(shared)) // T * T


def test_a_replica_that_restarts_reattaches_itself_and_the_others_keep_their_stream(replicas, ray_session):
    cluster, handles, clients = replicas
    pid = ray_session.get(handles[1].pid.remote(), timeout=TIMEOUT)
    os.kill(pid, signal.SIGKILL)
    text = system("restart") + "Q: pushed while replica 1 was down"
    cluster.client(0).serve([Request(6000, encode(text), 1)])

    def ready(client: httpx.Client) -> bool:
        try:
            return client.get("/health").status_code == 200
        except httpx.TransportError:   # restarting: its port is closed until it listens again
            return False

    wait_for(lambda: ready(clients[1]), "replica 1 to come back", timeout_s=TIMEOUT)
    truth = exact(clients[0], text)
    assert truth[0] > 0
    for client in clients:
        wait_logged(client, lambda: matched(client, text) == truth, "both replicas to hold the rank's blocks")
    later = system("later") + "Q: pushed after the restart"
    cluster.client(1).serve([Request(6001, encode(later), 1)])
    truth = exact(clients[0], later)
    for client in clients:   # replica 0 was never detached; replica 1 is attached again
        wait_logged(client, lambda: matched(client, later) == truth, "both replicas to get the next pushes")
    peer_sync(ray_session, handles)   # each replica reaches the other: replica 0 the new process of replica 1
    assert all(idle(c, later) for c in clients)
