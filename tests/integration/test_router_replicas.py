"""Router replicas: several router actors over the same ranks, each with its own index fed by the same event
streams, told the others' dispatches only through the ranks' load reports.

The plain parts first (a rank's publisher pushing every batch to every attached receiver; two load accounts
reading one rank's report), then real router actors on a real local Ray cluster: replicas fed the same events
decide alike for the same prompt, and a request sent to any replica is served and indexed by all.
"""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest
import torch
from router_helpers import TIMEOUT, system, wait_for

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.coordinator.router_actor import RouterActorConfig, router_name, start_routers
from kvledger.router.config import RouterConfig
from kvledger.router.groups import WindowedIndex
from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.numbering import ApplyStatus, SequencedIndex
from kvledger.router.probe import probe
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


def test_replicas_count_the_others_dispatches_once_through_the_ranks_report():
    """Router A sent rank 0 two requests, router B one; the rank reports all three. Each router then sees three
    in flight (not its own count plus the report: the report holds its own too), and neither ignores the other."""
    a, b = LoadAccount(), LoadAccount()
    for _ in range(2):
        a.dispatch(0, 100, 4)
    b.dispatch(0, 50, 2)
    alone = b.state(0, 0.0)
    assert (alone.queued_requests, alone.running_requests, alone.queued_prefill_tokens) == (1, 0, 50)
    report = ReportedQueue(waiting=2, running=1, prefill_tokens=150)   # one of A's runs; the others wait
    for account in (a, b):
        s = account.state(0, 0.0, reported=report)
        assert (s.queued_requests, s.running_requests, s.queued_prefill_tokens) == (2, 1, 200 if account is a
                                                                                     else 150)
        assert s.queued_requests + s.running_requests == 3
    # a report older than A's latest dispatch does not hide it: the larger total wins
    a.dispatch(0, 10, 1)
    s = a.state(0, 0.0, reported=report)
    assert s.queued_requests + s.running_requests == 3 and s.queued_prefill_tokens == 210
    # one router alone, its one request running on the rank: counted once (it still calls it queued)
    solo = LoadAccount()
    solo.dispatch(1, 80, 3)
    s = solo.state(1, 0.0, reported=ReportedQueue(waiting=0, running=1))
    assert (s.queued_requests, s.running_requests) == (0, 1)


def test_a_router_sees_load_it_did_not_send_through_the_ranks_report():
    """Two router services over the same ranks: what another sender queued on rank 0 reaches router B only
    through rank 0's load report, and B sends the next prompt of rank 0's prefix elsewhere until it drains."""
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
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache(128), num_cpus_per_rank=0.5, name_prefix=PREFIX,
                        group_timeout_s=30, call_timeout_s=TIMEOUT)
    cluster = Cluster.start(cfg)
    routers = []
    try:
        routers = start_routers(cluster, RouterActorConfig(port=0, routers=REPLICAS, health_interval_s=0.3),
                                name=f"{PREFIX}-router")
        clients = [httpx.Client(base_url=url, timeout=TIMEOUT) for _, url in routers]
        yield cluster, [h for h, _ in routers], clients
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


def settle(clients: list[httpx.Client], prompt: str) -> None:
    """Wait until every replica weighs every rank idle. A replica learns of a request another replica sent only
    from the rank's load report, asked for every ``health_interval_s``: one asked while that request ran still
    shows it queued after it ended, and rightly steers away from the rank until the next report."""
    def idle(client: httpx.Client) -> bool:
        ranks = client.post("/v1/route", json={"prompt": prompt}).json()["ranks"]
        return all(r["load"] == {"queued_requests": 0, "queued_prefill_tokens": 0, "running_requests": 0}
                   for r in ranks)
    for i, client in enumerate(clients):
        wait_for(lambda: idle(client), f"replica {i} to see the ranks idle")


def test_replicas_listen_on_ports_of_their_own_under_names_of_their_own(replicas, ray_session):
    _, handles, clients = replicas
    assert len({str(c.base_url) for c in clients}) == REPLICAS
    assert all(c.base_url.host == "127.0.0.1" for c in clients)
    assert [ray_session.get_actor(router_name(i, f"{PREFIX}-router"), namespace="kvledger")._actor_id
            for i in range(REPLICAS)] == [h._actor_id for h in handles]
    assert all(c.get("/health").json()["live_ranks"] == [0, 1] for c in clients)


def test_replicas_fed_the_same_events_make_the_same_decision(replicas):
    cluster, _, clients = replicas
    homes = {0: system("r0") + "Q: held by rank zero", 1: system("r1") + "Q: held by rank one"}
    for r, text in homes.items():   # served on the ranks directly: only the pushed events tell the routers
        cluster.client(r).serve([Request(5000 + r, encode(text), 1)])
    for text in homes.values():
        truth = exact(clients[0], text)
        wait_for(lambda: all(matched(c, text) == truth for c in clients), "every replica to index the pushes")
    settle(clients, system("r0"))
    # (a prompt nobody holds is a tie every rank wins equally: which one each replica draws is no disagreement)
    questions = [homes[0] + " and a follow-up", homes[1] + " and another", system("r0")[:40] + " half a prefix"]
    for q in questions:
        decisions = [c.post("/v1/route", json={"prompt": q, "max_tokens": 4}).json() for c in clients]
        assert len({d["rank"] for d in decisions}) == 1, (q, decisions)
        assert len({tuple(r["matched_tokens"] for r in d["ranks"]) for d in decisions}) == 1, decisions
    for r, text in homes.items():
        assert clients[1].post("/v1/route", json={"prompt": text + "!"}).json()["rank"] == r


def test_a_request_to_any_replica_is_served_and_indexed_by_all(replicas):
    _, _, clients = replicas
    shared = system("any")
    for i, client in enumerate(clients):
        settle(clients, shared)   # else a report of the last follow-up can send this one away from the prefix
        first = client.post("/v1/completions", json={"prompt": shared + f"Q: first via replica {i}?",
                                                     "max_tokens": 2})
        assert first.status_code == 200, first.text
        home = first.json()["kvledger"]["rank"]
        text = shared + f"Q: first via replica {i}?"
        for other in clients:
            wait_for(lambda: matched(other, text)[home] > 0, f"replica {clients.index(other)} to index it")
            assert matched(other, text) == exact(other, text)
        for j, other in enumerate(clients):   # a follow-up to any replica goes where the prefix is
            settle(clients, shared)
            again = other.post("/v1/completions", json={"prompt": shared + f"Q: then via {j}?", "max_tokens": 1})
            assert again.status_code == 200, again.text
            got = again.json()["kvledger"]
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
        wait_for(lambda: matched(client, text) == truth, "both replicas to hold the rank's blocks")
    later = system("later") + "Q: pushed after the restart"
    cluster.client(1).serve([Request(6001, encode(later), 1)])
    truth = exact(clients[0], later)
    for client in clients:   # replica 0 was never detached; replica 1 is attached again
        wait_for(lambda: matched(client, later) == truth, "both replicas to get the next pushes")
