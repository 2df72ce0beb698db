"""Continuous batching and bounded admission on a real local Ray cluster: two rank actors and the router actor.

Requests join a rank's running batch at step boundaries, the batch and each step stay within their bounds
(seen in the ranks' load reports and in each outcome's steps), full queues answer 429 with ``Retry-After``
and change nothing, a burst loses nothing, a rank crashing mid-prefill loses nothing either, and every output
equals the one computed from scratch. One cluster and one router for the module, with small bounds.
"""
from __future__ import annotations

import itertools
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.router_actor import RouterActorConfig, start_router
from kvledger.router.config import RouterConfig
from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.engine.tokenizer import encode
from kvledger.worker.ledger import CacheConfig, KVCacheManager
from kvledger.worker.rank.batch import BatchDriver
from kvledger.worker.wire.messages import RankBusyError
from kvledger.worker.wire.request import Request

from router_helpers import idle

T = 8
TIMEOUT = 60
PREFIX = "kvledger-batching-test-rank"
MAX_SEQS, MAX_TOKENS, MAX_QUEUED = 4, 32, 8
ROUTER_SLOTS, ROUTER_QUEUE = 4, 4

_ids = itertools.count(7_000_000)


def cache() -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=1024)


@pytest.fixture(scope="module")
def routed(ray_session):
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache(), num_cpus_per_rank=0.5, name_prefix=PREFIX,
                        group_timeout_s=30, call_timeout_s=TIMEOUT, max_restarts=2, max_num_seqs=MAX_SEQS,
                        max_num_batched_tokens=MAX_TOKENS, max_queued_requests=MAX_QUEUED)
    cluster = Cluster.start(cfg)
    router = RouterConfig(tokens_per_block=T, policy="round_robin", max_inflight_completions=ROUTER_SLOTS,
                          max_queued_completions=ROUTER_QUEUE)
    handle, url = start_router(cluster, RouterActorConfig(port=0, router=router), name=f"{PREFIX}-router")
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            yield cluster, client
    finally:
        ray_session.kill(handle, no_restart=True)
        cluster.shutdown()


def scratch(tokens: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and last-prompt logits of a fresh ledger computing everything."""
    engine = ReferenceEngine(cache(), seed=0)
    (res,) = BatchDriver(engine).serve(KVCacheManager(cache()), [Request(0, list(tokens), max_new)])
    return res.output_tokens, res.last_logits


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def wait_load(rank, cond, what: str) -> None:
    """Ask ``rank`` for its load until ``cond`` holds (bounded: each answer is a call to the rank)."""
    for _ in range(5000):
        if cond(rank.load()):
            return
    pytest.fail(f"timed out waiting for {what}")


def test_a_short_request_joins_a_running_long_one_and_leaves_first(routed, ray_session):
    cluster, _ = routed
    rank = cluster.clients[0]
    long_req, short_req = Request(next(_ids), prompt(1, 21), 700), Request(next(_ids), prompt(2, 13), 2)
    pending = cluster.actors[0].serve.remote([long_req], True)
    wait_load(rank, lambda load: load.running_requests == 1, "the long request to run")
    (short,) = rank.serve([short_req], logits=True).outcomes
    assert rank.probe(long_req.tokens) == 2 * T, "the ledger answers between steps: the long prompt is stored"
    probed_at = rank.load().steps
    (long,) = ray_session.get(pending, timeout=TIMEOUT).outcomes
    assert long.admitted_step < short.admitted_step, "the short request joined the batch the long one ran in"
    assert short.finished_step < long.finished_step, "and left it first"
    assert probed_at < long.finished_step, "the probe was answered while the long request ran"
    for got, r in ((short, short_req), (long, long_req)):
        tokens, logits = scratch(r.tokens, r.max_new_tokens)
        assert got.output_tokens == tokens
        assert torch.allclose(torch.tensor(got.last_logits), logits, atol=1e-4, rtol=1e-4)
    idle(cluster)


def test_the_batch_and_each_step_stay_within_their_bounds(routed):
    cluster, _ = routed
    rank = cluster.clients[1]
    before = rank.load()
    reqs = [Request(next(_ids), prompt(10 + i, 5 * T), 3) for i in range(MAX_QUEUED)]   # 40 > 32 tokens: chunks
    outcomes = rank.serve(reqs).outcomes
    after = rank.load()
    assert after.peak_running_requests == MAX_SEQS, "the first step admits max_num_seqs of the queued eight"
    assert after.peak_step_tokens == MAX_TOKENS, "and computes max_num_batched_tokens of their prompts"
    assert after.served_requests - before.served_requests == MAX_QUEUED
    assert max(o.admitted_step for o in outcomes) > min(o.finished_step for o in outcomes), \
        "the last four joined as the first ones left"
    for o, r in zip(outcomes, reqs):
        assert o.request_id == r.request_id and o.output_tokens == scratch(r.tokens, 3)[0]
    idle(cluster)


def test_a_full_rank_queue_refuses_at_once_and_changes_nothing(routed, ray_session):
    cluster, _ = routed
    rank = cluster.clients[0]
    with pytest.raises(ValueError, match="max_queued_requests"):
        rank.serve([Request(next(_ids), [1, 2, 3]) for _ in range(MAX_QUEUED + 1)])
    running = [Request(next(_ids), prompt(20 + i, 9), 400) for i in range(MAX_SEQS)]
    queued = [Request(next(_ids), prompt(30 + i, 9), 1) for i in range(MAX_QUEUED)]
    pending = [cluster.actors[0].serve.remote(running)]
    wait_load(rank, lambda load: load.running_requests == MAX_SEQS, "the batch to fill")
    pending.append(cluster.actors[0].serve.remote(queued))
    wait_load(rank, lambda load: load.queued_requests == MAX_QUEUED, "the queue to fill")
    before = rank.load()
    with pytest.raises(RankBusyError, match="busy"):
        rank.serve([Request(next(_ids), [5, 6, 7], 1)])
    after = rank.load()
    assert after.refused_requests == before.refused_requests + 1
    assert (after.queued_requests, after.served_requests) == (MAX_QUEUED, before.served_requests)
    assert [len(reply.outcomes) for reply in ray_session.get(pending, timeout=TIMEOUT)] == [MAX_SEQS, MAX_QUEUED]
    idle(cluster)


def test_a_full_router_answers_429_with_retry_after_and_serves_what_it_took(routed):
    cluster, client = routed
    served_before = sum(c.load().served_requests for c in cluster.clients)
    gate = threading.Barrier(3 * (ROUTER_SLOTS + ROUTER_QUEUE), timeout=TIMEOUT)

    def send(i: int) -> httpx.Response:
        gate.wait()
        return client.post("/v1/completions", json={"prompt": f"full {i}: a question", "max_tokens": 300})

    with ThreadPoolExecutor(gate.parties) as pool:
        answers = list(pool.map(send, range(gate.parties)))
    ok = [a for a in answers if a.status_code == 200]
    shed = [a for a in answers if a.status_code == 429]
    assert len(ok) + len(shed) == len(answers), [a.text for a in answers if a.status_code not in (200, 429)]
    assert len(ok) >= ROUTER_SLOTS + ROUTER_QUEUE and shed, "the router took what its bounds hold, and shed"
    for a in shed:
        assert a.headers["Retry-After"] == "1"
        assert a.json()["error"]["type"] == "rate_limit_error" and a.json()["error"]["code"] == "overloaded"
    assert all(len(a.json()["kvledger"]["output_token_ids"]) == 300 for a in ok)
    assert sum(c.load().served_requests for c in cluster.clients) - served_before == len(ok), \
        "a refused request reached no rank"
    (line,) = [x for x in client.get("/metrics").text.splitlines() if x.startswith("kvledger_shed_completions_total")]
    assert float(line.split()[-1]) >= len(shed)
    idle(cluster)


def test_a_burst_loses_nothing_and_equals_the_scratch_computation(routed):
    cluster, client = routed
    texts = [f"burst {i % 5}: what is in block {i}?" for i in range(40)]

    def send(text: str) -> httpx.Response:
        for _ in range(200):   # bounded: a client retrying its 429s after Retry-After
            r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 6})
            if r.status_code != 429:
                return r
            threading.Event().wait(0.05)   # shorter than Retry-After: the test only needs to be answered
        pytest.fail(f"{text!r} was shed 200 times")

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(send, texts))
    assert [a.status_code for a in answers] == [200] * len(texts)
    for text, a in zip(texts, answers):
        assert a.json()["kvledger"]["output_token_ids"] == scratch(encode(text), 6)[0]
    idle(cluster)


def test_a_rank_crashing_mid_prefill_loses_no_request_and_comes_back_balanced(routed, ray_session):
    cluster, client = routed
    victim = 1
    assert ray_session.get(cluster.actors[victim].arm_crash.remote("mid_prefill", 3), timeout=TIMEOUT) == \
        {"mid_prefill": 3}
    texts = [f"crash {i}: a prompt long enough to prefill in two chunks of the step budget, {i}" for i in range(8)]

    def send(text: str) -> httpx.Response:
        for _ in range(200):
            r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
            if r.status_code not in (429, 503):
                return r
            threading.Event().wait(0.05)
        pytest.fail(f"{text!r} was never answered")

    with ThreadPoolExecutor(len(texts)) as pool:
        answers = list(pool.map(send, texts))
    assert [a.status_code for a in answers] == [200] * len(texts), [a.text for a in answers]
    assert any(a.json()["kvledger"]["retries"] for a in answers), "the crashed rank's requests were retried"
    for text, a in zip(texts, answers):
        assert a.json()["kvledger"]["output_token_ids"] == scratch(encode(text), 4)[0]
    assert cluster.heal(timeout_s=TIMEOUT) == [victim]
    for _ in range(400):   # bounded: until the router takes the restarted rank back
        if client.get("/health").json()["live_ranks"] == [0, 1]:
            break
        threading.Event().wait(0.05)
    else:
        pytest.fail("the restarted rank never rejoined")
    idle(cluster)
    for text in texts[:3]:
        approx = client.post("/v1/probe", json={"prompt": text}).json()["ranks"]
        exact = client.post("/v1/probe", json={"prompt": text, "exact": True}).json()["ranks"]
        assert [(r["rank"], r["matched_tokens"]) for r in approx] == [(r["rank"], r["matched_tokens"]) for r in exact]
