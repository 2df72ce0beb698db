"""End to end on a real local Ray cluster: two rank actors, the router actor serving HTTP on 127.0.0.1,
events pushed by the ranks' publisher threads, the HTTP API and the command line against it.

The cluster and its router live as long as the module, so each test is independent of the others' order:
its prompts begin with a letter of their own (``system(tag)``; the ranks reuse even part of a block, so a
shared first byte would show as cached), it compares counters before and after instead of absolute values,
and a test that restarts a rank waits until the router has taken it back in full. The tests with a router of
their own have ranks of their own too, so that what they inject (a vLLM engine, transport faults) stays out of
the module's index (several routers over the same ranks: ``test_router_replicas.py``).
"""
from __future__ import annotations

import json
import os
import re
import signal

import httpx
import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.router_actor import RouterActorConfig, start_router
from kvledger.launch.cli import main as cli
from kvledger.worker.engine.tokenizer import encode
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.faults import TransportFaults
from kvledger.worker.wire.request import Request

from fake_vllm import FakeVllmPublisher, vllm_stored
from router_helpers import TIMEOUT, system, wait_for, wait_logged

T = 8
PREFIX = "kvledger-router-test-rank"
SHARED = 64   # tokens of SYSTEM + "Q": the full blocks every question shares


def cache(primary: int = 128) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=primary, num_secondary_blocks=16)


@pytest.fixture(scope="module")
def routed(ray_session):
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache(), num_cpus_per_rank=0.5, name_prefix=PREFIX,
                        group_timeout_s=30, call_timeout_s=TIMEOUT)
    cluster = Cluster.start(cfg)
    handle, url = start_router(cluster, RouterActorConfig(port=0), name=f"{PREFIX}-router")
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            yield cluster, handle, client
    finally:
        ray_session.kill(handle, no_restart=True)
        cluster.shutdown()


def totals(client: httpx.Client) -> dict:
    """The router's counters now (``/v1/cluster``'s ``router``), to compare before and after."""
    return client.get("/v1/cluster").json()["router"]


def events(client: httpx.Client, since: int, rank: int | None = None) -> list[dict]:
    """The events logged from id ``since`` on, as ``/v1/events`` streams them in 0.3 s."""
    params = {"since": since, "timeout": 0.3, **({} if rank is None else {"rank": rank})}
    return [json.loads(line) for line in client.get("/v1/events", params=params).text.splitlines() if line]


def test_completions_reuse_a_shared_prefix_and_the_index_matches_the_ranks(routed):
    _, _, client = routed
    assert client.base_url.host == "127.0.0.1"
    assert client.get("/health").json()["live_ranks"] == [0, 1]
    shared = system("ask")   # held by no rank before this test, whatever ran first
    first = client.post("/v1/completions", json={"prompt": shared + "Q: colour of the sky?", "max_tokens": 4})
    assert first.status_code == 200, first.text
    second = client.post("/v1/completions", json={"prompt": shared + "Q: colour of grass?", "max_tokens": 4}).json()
    a, b = first.json()["kvledger"], second["kvledger"]
    assert a["cached_tokens"] == 0 and b["rank"] == a["rank"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == b["cached_tokens"] >= SHARED
    assert second["usage"]["prompt_tokens"] == len(encode(shared + "Q: colour of grass?"))
    for text in (shared + "Q: anything", shared[:40], "unrelated words here, nothing shared at all"):
        approx = client.post("/v1/probe", json={"prompt": text}).json()["ranks"]
        exact = client.post("/v1/probe", json={"prompt": text, "exact": True}).json()["ranks"]
        assert [(r["rank"], r["matched_tokens"]) for r in approx] == [(r["rank"], r["matched_tokens"]) for r in exact]
    route = client.post("/v1/route", json={"prompt": shared + "Q: next"}).json()
    assert route["rank"] == a["rank"] and max(r["matched_tokens"] for r in route["ranks"]) == SHARED


def test_ranks_push_events_that_stream_to_monitors(routed):
    cluster, _, client = routed
    # served on a rank directly, not through the router: only the rank's publisher thread can tell the router
    text = "Pushed, not flushed: the publisher thread carries these blocks."
    before = totals(client)["events_logged"]   # this test's events only, whatever others logged
    (res,) = cluster.client(1).serve([Request(777, encode(text), 1)]).outcomes
    assert res.cached_tokens == 0
    wait_logged(client, lambda: client.post("/v1/probe", json={"prompt": text}).json()["ranks"][1]["matched_tokens"],
                "the pushed batch to reach the index", rank=1)
    pushed = events(client, before, rank=1)
    stored = [e for e in pushed if e["type"] == "BlockStored"]
    assert stored and all(e["rank"] == 1 for e in pushed) and all(e["block_size"] == T for e in stored)
    assert any(e["token_ids"] == list(encode(text))[:len(e["token_ids"])] for e in stored)
    # follows live: a stream opened now gets the next completion's events
    since = totals(client)["events_logged"]
    with client.stream("GET", "/v1/events", params={"since": since, "limit": 1, "timeout": 20}) as resp:
        client.post("/v1/completions", json={"prompt": "fresh text that nobody cached", "max_tokens": 1})
        lines = [json.loads(x) for x in resp.iter_lines() if x]
    assert len(lines) == 1 and lines[0]["type"] == "BlockStored" and lines[0]["id"] == since


def test_metrics_and_cluster(routed):
    _, _, client = routed
    before = totals(client)
    shared = system("metrics")
    for q in ("Q: one", "Q: two"):   # this test's own completions: the second reuses the first's prefix
        assert client.post("/v1/completions", json={"prompt": shared + q, "max_tokens": 1}).status_code == 200
    c = client.get("/v1/cluster").json()
    assert [r["rank"] for r in c["ranks"]] == [0, 1] and c["router"]["completions"] == before["completions"] + 2
    assert c["ranks"][0]["blocks"]["GPU"]["used"] + c["ranks"][0]["blocks"]["GPU"]["free"] == 128
    assert c["router"]["cached_tokens"] - before["cached_tokens"] >= SHARED
    text = client.get("/metrics").text
    for family in ("kvledger_blocks{", "kvledger_cache_hit_rate{", "kvledger_events_per_second{",
                   "kvledger_routing_decisions_total{", "kvledger_probe_latency_seconds_bucket{",
                   "kvledger_router_hit_rate "):
        assert family in text, family


def test_command_line_route_and_monitor(routed, capsys, monkeypatch):
    _, _, client = routed
    monkeypatch.setenv("COLUMNS", "160")   # rich sizes the table to the (captured) terminal
    url = str(client.base_url)
    shared = system("cli")
    # the shared prefix, cached by this test itself (not by whichever test ran before)
    warm = client.post("/v1/completions", json={"prompt": shared + "Q: warm up", "max_tokens": 1})
    assert warm.status_code == 200 and warm.json()["kvledger"]["cached_tokens"] == 0, warm.text
    assert cli(["route", shared + "Q: the command line?", "--max-tokens", "3", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "rank " in out and "output:" in out
    assert int(re.search(r"cached (\d+)", out).group(1)) >= SHARED
    assert cli(["route", shared + "Q: salted", "--salt", "tenant-z", "--url", url]) == 0
    assert "cached 0" in capsys.readouterr().out
    assert cli(["monitor", "--json", "--seconds", "1", "--url", url]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert lines and {"id", "rank", "seq", "type"} <= set(lines[0])
    assert cli(["monitor", "--rank", "0", "--seconds", "1", "--url", url]) == 0
    table = capsys.readouterr().out
    assert "events/s" in table and "GPU used/free" in table and "last events" in table


def test_a_rank_that_dies_leaves_the_index_and_its_request_is_served_elsewhere(routed, ray_session):
    cluster, handle, client = routed
    shared = system("death")
    text = shared + "Q: who holds this one?"
    before = totals(client)
    home = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["kvledger"]["rank"]
    ray_session.kill(cluster.actors[home], no_restart=False)     # Ray restarts it, with no ledger
    out = client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert out.status_code == 200, out.text
    assert out.json()["kvledger"]["rank"] != home, "served by a live rank, nothing lost"
    c = client.get("/v1/cluster").json()
    assert home not in [r["rank"] for r in c["ranks"]] and c["router"]["ranks_removed"] >= before["ranks_removed"] + 1
    assert client.get("/health").json()["live_ranks"] == [1 - home]
    (removed,) = [e["id"] for e in events(client, before["events_logged"], rank=home) if e["type"] == "RankRemoved"]
    assert cluster.heal(timeout_s=TIMEOUT) == [home]                 # back, group re-formed, empty ledger

    def rejoined() -> bool:
        """Back in full, as the next test must find it: live, its snapshot indexed, its load reported."""
        if client.get("/health").json()["live_ranks"] != [0, 1]:
            return False
        if not any(e["type"] == "Snapshot" for e in events(client, removed + 1, rank=home)):
            return False
        return all(r["blocks"] is not None for r in client.get("/v1/cluster").json()["ranks"])

    # one forced round (or the maintenance thread's, if it came first: rounds take turns) sees it back
    ray_session.get(handle.maintenance_round.remote(), timeout=TIMEOUT)
    assert rejoined(), "back in full after one health round"
    for prompt in (text, shared + "Q: after the restart"):
        client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        approx = client.post("/v1/probe", json={"prompt": prompt}).json()["ranks"]
        exact = client.post("/v1/probe", json={"prompt": prompt, "exact": True}).json()["ranks"]
        assert approx == [{**r, "tiers": a["tiers"]} for r, a in zip(exact, approx)]


def test_the_router_actor_indexes_a_vllm_engine_given_on_the_command_line(ray_session):
    """``kvledger up --vllm-events`` reaches the router actor as ``RouterActorConfig.vllm_events``."""

    # Ranks of its own: the module's ranks would go on pushing to this router until it is found dead.
    cluster = Cluster.start(ClusterConfig(num_ranks=1, device="cpu", cache=cache(32), num_cpus_per_rank=0.5,
                                          name_prefix=f"{PREFIX}-vllm", group_timeout_s=30, call_timeout_s=TIMEOUT))
    engine = FakeVllmPublisher()
    handle = None
    try:
        endpoint = f"tcp://127.0.0.1:{engine.pub_port},tcp://127.0.0.1:{engine.replay_port}"
        handle, url = start_router(cluster, RouterActorConfig(port=0, vllm_events=(endpoint,)),
                                   name=f"{PREFIX}-router-vllm")
        engine.wait_subscribed(timeout_ms=20_000)
        tokens = encode(system("vllm") + "Q: vllm")
        engine.publish([{**vllm_stored([71, 72], None, tokens[:2 * T]), "block_size": T}])
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            held = wait_logged(client, lambda: [r for r in client.post("/v1/probe", json={"prompt": tokens}).json()[
                "ranks"] if r.get("vllm") and r["matched_tokens"]], "the vLLM engine's blocks")
            assert held[0]["matched_tokens"] == 2 * T and held[0]["vllm"].startswith("tcp://127.0.0.1:")
    finally:
        if handle is not None:
            ray_session.kill(handle, no_restart=True)
        cluster.shutdown()
        engine.close()


def test_the_router_comes_back_on_its_port_with_its_index_rebuilt(routed, ray_session):
    cluster, handle, client = routed
    text = system("back") + "Q: is this still cached once the router died?"
    home = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["kvledger"]["rank"]
    pid = ray_session.get(handle.pid.remote(), timeout=TIMEOUT)
    os.kill(pid, signal.SIGKILL)

    def serving() -> bool:
        try:
            r = client.get("/health")
        except httpx.TransportError:   # down, or restarting: the port is closed until it listens again
            return False
        return r.status_code == 200 and r.json()["live_ranks"] == [0, 1]

    wait_for(serving, "the router to come back", timeout_s=TIMEOUT)
    assert ray_session.get(handle.pid.remote(), timeout=TIMEOUT) != pid, "a new process, on the same port"
    approx = client.post("/v1/probe", json={"prompt": text}).json()["ranks"]
    exact = client.post("/v1/probe", json={"prompt": text, "exact": True}).json()["ranks"]
    assert [r["matched_tokens"] for r in approx] == [r["matched_tokens"] for r in exact]
    assert approx[home]["matched_tokens"] > 0, "the index was rebuilt from the ranks' snapshots"
    again = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}).json()["kvledger"]
    assert again["rank"] == home and again["cached_tokens"] > 0


def test_a_lossy_event_transport_still_gives_the_exact_index(ray_session):
    """Batches dropped, sent twice, reordered and delayed on the way to the router (a seeded share of each):
    after the traffic, the index agrees with every rank's own ledger, and every ledger's books balance."""
    faults = TransportFaults(drop=0.2, duplicate=0.15, reorder=0.15, delay=0.1, delay_s=0.02, seed=3)
    cluster = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=cache(64), num_cpus_per_rank=0.5,
                                          name_prefix=f"{PREFIX}-lossy", group_timeout_s=30, call_timeout_s=TIMEOUT))
    handle = None
    try:
        handle, url = start_router(cluster, RouterActorConfig(port=0, transport_faults=faults, health_interval_s=0.2),
                                   name=f"{PREFIX}-router-lossy")
        prompts = [system(f"l{i:02d}") + f"Q: number {i}?" for i in range(40)]   # no two share a block
        for i, p in enumerate(prompts):   # served on the ranks directly: the pushes alone tell the router
            cluster.client(i % 2).serve([Request(9000 + i, encode(p), 2)])
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            def agrees() -> bool:
                for p in prompts:
                    approx = client.post("/v1/probe", json={"prompt": p}).json()["ranks"]
                    exact = client.post("/v1/probe", json={"prompt": p, "exact": True}).json()["ranks"]
                    if [r["matched_tokens"] for r in approx] != [r["matched_tokens"] for r in exact]:
                        return False
                return True

            wait_logged(client, agrees, "the index to agree with the ledgers", timeout_s=TIMEOUT)
            c = client.get("/v1/cluster").json()
            assert c["router"]["replays"] > 0 and c["router"]["batches_duplicate"] > 0, "the faults did happen"
        for r in range(2):
            cluster.clients[r].check_integrity()
    finally:
        if handle is not None:
            ray_session.kill(handle, no_restart=True)
        cluster.shutdown()
