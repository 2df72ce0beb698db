"""Ranks under pressure, driven through the router: every answer equals the one a rank with room to spare gives.

Two rank actors whose pools are small enough that a burst of concurrent completions must wait for blocks (and,
where a migration takes blocks from under a running batch, be preempted), behind the router actor's HTTP API.
The prompts share a few prefixes, each first served on rank 0 alone, so blocks are reused, evicted, offloaded to
the host tier, onboarded again and pulled to rank 1;
greedy and seeded sampling, varied ``max_tokens``, a few ``n`` > 1. Each answer is compared with the same
request served alone on a fresh ledger of the same model with room to spare (``rank_fuzz.scratch``): the first
choice by its token ids (the ``kvledger`` block), every choice by its text and its tokens' log-probabilities.

Two geometries, a cluster each: one full-attention window with a host tier and chunked prefill, and a sliding
window beside a full one (``--attention-windows 8 --attention-windows full --window-shares 1 --window-shares 2``).

The router's own bounds are set wide enough that it never sheds, and a rank with room in its queue makes a
request wait rather than refuse it: so every answer must be a 200, and a 429 here is a lost request, not
back-pressure to retry. The ranks' load reports, read while the burst runs, show that requests did wait for
blocks (queued while the batch had seats free), so the comparison cannot pass on ranks that had room; the
answers show that blocks came back from the host tier and, in both geometries, that a prefix longer than a
context chunk crossed between the ranks whole (before that was fixed every such migration failed and was
recomputed; with windows, before windowed ledgers pinned and imported prefixes).
"""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.router_actor import RouterActorConfig, start_router
from kvledger.router.config import RouterConfig
from kvledger.worker.engine.tokenizer import decode, encode
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.messages import RankLoad
from kvledger.worker.wire.request import GREEDY, Request, Sampling

from rank_fuzz import T, scratch_result
from router_helpers import TIMEOUT, idle, wait_logged

PREFIX = "kvledger-pressure-test-rank"
MAX_SEQS, MAX_STEP_TOKENS = 6, 16
ASKS = 64
#: Every prompt begins with one of these: blocks are reused across requests, and migrate between the ranks.
STEMS = ["P: you are a terse assistant; answer in one word. ", "P: you are a terse assistant; answer in two. ",
         "P: translate into French, briefly: ", "P: summarise in a line: the KV cache of a rank"]
WORDS = ["block", "cache", "rank", "prefix", "window", "host", "tier", "router", "token", "page"]

GEOMETRIES = {
    # 32 device blocks of 4 tokens, a host tier of 16: two or three requests run at once
    "full": CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                        device="cpu", num_primary_blocks=32, num_secondary_blocks=16, context_chunk_size=8),
    # even layers slide over 8 tokens, odd ones see all; the full window gets two thirds of the bytes (32 blocks)
    "windows": CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                           device="cpu", num_primary_blocks=48, num_secondary_blocks=24, context_chunk_size=8,
                           attention_windows=(8, None), window_shares=(1, 2)),
}


@dataclass(frozen=True, slots=True)
class Ask:
    """One completion the client sends, and what it asks the engine for."""

    body: dict
    tokens: list[int]
    samplings: list[Sampling]
    """Per choice, how the reference engine samples it (choice ``i`` seeded ``seed + i``)."""


def asks(seed: int, count: int) -> list[Ask]:
    """``count`` completions on the shared stems: text or token ids, greedy or seeded, 1 to 12 tokens, a few
    with ``n`` 2 or 3 (those ask for log-probabilities, by which their later choices are compared)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = rng.choice(STEMS) + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 4))) + f" #{i}"
        tokens = encode(text)
        n = rng.choice([2, 3]) if i % 8 == 3 else 1
        body: dict = {"prompt": text if rng.random() < 0.5 else tokens, "max_tokens": rng.randrange(1, 13), "n": n}
        if rng.random() < 0.5:
            body |= {"temperature": rng.choice([0.7, 1.0, 1.3]), "seed": rng.randrange(10_000),
                     "top_k": rng.choice([0, 20]), "top_p": rng.choice([1.0, 0.9])}
        logprobs = 0 if n > 1 else None
        if n > 1:
            body["logprobs"] = logprobs
        samplings = [Sampling(logprobs=logprobs) if "seed" not in body else
                     Sampling(body["temperature"], body["top_p"], body["top_k"], body["seed"] + c, logprobs)
                     for c in range(n)]
        out.append(Ask(body, tokens, samplings))
    return out


@pytest.fixture(scope="module", params=sorted(GEOMETRIES))
def routed(request, ray_session):
    cache = GEOMETRIES[request.param]
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache, num_cpus_per_rank=0.5,
                        name_prefix=f"{PREFIX}-{request.param}", group_timeout_s=30, call_timeout_s=TIMEOUT,
                        max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_STEP_TOKENS, max_queued_requests=ASKS)
    cluster = Cluster.start(cfg)
    # migrations cheap enough that the policy pulls prefixes to the less loaded rank: imports under a batch. The
    # burst queues every rank and overfills its blocks, where kv's backlog and fit terms would keep each prefix on
    # its holder (the requests in flight there hold it already): off, so that it moves
    router = RouterConfig(tokens_per_block=T, policy="kv",
                          policy_options={"migrate_setup_s": 0.0, "backlog_weight": 0.0, "fit_weight": 0.0},
                          max_inflight_completions=ASKS, max_queued_completions=ASKS)
    handle, url = start_router(cluster, RouterActorConfig(port=0, router=router), name=f"{cfg.name_prefix}-router")
    try:
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            yield request.param, cache, cluster, client
    finally:
        ray_session.kill(handle, no_restart=True)
        cluster.shutdown()


class LoadWatch:
    """The ranks' load reports, read in a thread of its own while a burst runs: the most requests each rank had
    waiting while its batch still had seats (what only a lack of blocks makes wait)."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._done = threading.Event()
        self.waiting_for_blocks = [0] * len(cluster.clients)
        self.reports = 0
        self._thread = threading.Thread(target=self._watch, name="pressure-load-watch", daemon=True)

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(TIMEOUT)

    def _watch(self) -> None:
        for _ in range(10_000):   # bounded: a report per rank each round, a round every 20 ms at most
            for r, client in enumerate(self._cluster.clients):
                load: RankLoad = client.load()
                self.reports += 1
                if load.running_requests < MAX_SEQS:
                    self.waiting_for_blocks[r] = max(self.waiting_for_blocks[r], load.queued_requests)
            if self._done.wait(0.02):
                return


def send(client: httpx.Client, gate: threading.Barrier, ask: Ask) -> httpx.Response:
    gate.wait()
    return client.post("/v1/completions", json=ask.body)


def check_answer(cache: CacheConfig, ask: Ask, answer: dict) -> None:
    """Every choice of ``answer`` equals the request served alone on a roomy ledger."""
    assert len(answer["choices"]) == len(ask.samplings)
    for c, (choice, sampling) in enumerate(zip(answer["choices"], ask.samplings)):
        want = scratch_result(cache, Request(0, ask.tokens, ask.body["max_tokens"], sampling=sampling))
        where = f"{ask.body} choice {c}"
        if c == 0:
            assert answer["kvledger"]["output_token_ids"] == want.output_tokens, where
        assert choice["text"] == decode(want.output_tokens), where
        if sampling.logprobs is not None:
            got = choice["logprobs"]
            assert got["tokens"] == [decode([t]) for t in want.output_tokens], where
            assert got["token_logprobs"] == pytest.approx(want.logprobs.chosen, abs=1e-4), where


def warm_up(cluster: Cluster, client: httpx.Client, cache: CacheConfig) -> int:
    """Every stem served on rank 0 alone, straight to the rank: the burst crowds the rank holding every prefix, and
    the policy pulls them to the idle one (imports beside a running batch). Through the router the stems could
    spread over both ranks, and a burst split evenly between their holders need not move any. How many requests
    it served."""
    for i, stem in enumerate(STEMS):
        (outcome,) = cluster.client(0).serve([Request(10_000 + i, encode(stem), 1)]).outcomes
        assert outcome.output_tokens == scratch_result(cache, Request(0, encode(stem), 1)).output_tokens, stem
    for stem in STEMS:   # the router indexes a stem from the rank's events: the burst must find them indexed
        full = (len(encode(stem)) - 1) // T * T
        wait_logged(client, lambda: {r["rank"]: r["matched_tokens"] for r in client.post(
            "/v1/probe", json={"prompt": stem}).json()["ranks"]}.get(0) == full, f"{stem!r} indexed on rank 0")
    return len(STEMS)


def test_every_answer_under_pressure_equals_a_roomy_rank(routed):
    name, cache, cluster, client = routed
    before = [c.load() for c in cluster.clients]
    warm = warm_up(cluster, client, cache)
    work = asks(25, ASKS)
    gate = threading.Barrier(len(work), timeout=TIMEOUT)
    with LoadWatch(cluster) as watch, ThreadPoolExecutor(len(work)) as pool:
        answers = list(pool.map(lambda a: send(client, gate, a), work))
    bad = [(a.status_code, a.text) for a in answers if a.status_code != 200]
    assert not bad, f"{len(bad)} of {len(work)} accepted requests were not answered: {bad[:3]}"
    after = [c.load() for c in cluster.clients]
    assert sum(a.served_requests - b.served_requests for a, b in zip(after, before)) == \
        warm + sum(len(a.samplings) + (len(a.samplings) > 1) for a in work), "every choice (and prefill) ran once"
    got = [a.json()["kvledger"] for a in answers]
    moved = [g["migrated_blocks"] for g in got]
    onboarded = sum(g["onboarded_blocks"] for g in got)
    print(f"\n{name}: most requests waiting for blocks {watch.waiting_for_blocks} ({watch.reports} load reports), "
          f"preempted {[a.preempted_requests - b.preempted_requests for a, b in zip(after, before)]}, largest batch "
          f"{[a.peak_running_requests for a in after]}, {sum(moved)} blocks migrated ({max(moved)} at most at "
          f"once), {onboarded} onboarded, {sum(g['cached_tokens'] for g in got)} prompt tokens cached")
    assert all(watch.waiting_for_blocks), "a rank had room for every request: the burst proved nothing"
    assert onboarded, "nothing came back from the host tier"
    # a prefix longer than a context chunk crossed whole, beside a running batch (with windows too: each window's
    # blocks a request reuses, where before every such migration failed and the target computed the prefix)
    assert max(moved) > cache.context_chunk_size // T, f"blocks migrated per answer: {moved}"
    for ask, a in zip(work, answers):
        check_answer(cache, ask, a.json())
    idle(cluster)
