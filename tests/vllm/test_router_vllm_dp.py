"""A real data-parallel vLLM server behind the router: one server, ``--data-parallel-size 2``, two engine cores
(a core each, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``), each its own rank of the router: its own events, its own
requests (the ``X-data-parallel-rank`` header), its own load (its ``engine`` label in ``/metrics``).

The router runs in this process with no ranks of its own. Every prompt starts with a token of its own test.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from router_helpers import over_http, wait_indexed
from vllm_engines import START_TIMEOUT_S, EngineSpec, VllmServer, start_engines
from vllm_engines import engine_prompt as prompt

from kvledger.router.config import RouterConfig
from kvledger.router.engine import Generation
from kvledger.router.service import RouterService

pytestmark = pytest.mark.timeout(int(START_TIMEOUT_S) + 600)   # set-up starts the server

BLOCK = 32
LOAD_WAIT_S = 60.0
ATTEMPTS = 3
"""Generations ``test_each_cores_load_is_its_own`` runs at most, until its sampler takes a sample of one."""


@pytest.fixture(scope="module")
def dp_server(request, tmp_path_factory) -> VllmServer:
    (server,) = start_engines(request, tmp_path_factory, [EngineSpec(block_size=BLOCK, data_parallel_size=2)])
    return server


@pytest.fixture(scope="module")
def router(dp_server: VllmServer) -> Iterator[tuple[RouterService, httpx.Client]]:
    service = RouterService(None, RouterConfig(tokens_per_block=16, vllm=(dp_server.url,), policy="kv"))
    with over_http(service) as client:
        yield service, client


def held(service: RouterService, tokens: list[int]) -> dict[int, int]:
    return {r: p.matched_tokens for r, p in service.probe(tokens).items()}


def test_each_data_parallel_rank_is_a_rank_with_events_of_its_own(router, dp_server) -> None:
    service, client = router
    assert sorted(service.engines.added()) == [1000, 1001]
    infos = {r: service.engines.engine(r).info() for r in (1000, 1001)}
    assert {r: i.data_parallel_rank for r, i in infos.items()} == {1000: 0, 1001: 1}
    assert infos[1000].events.endpoint != infos[1001].events.endpoint, "each core publishes on a port of its own"
    assert [m.ranks for m in service.models.catalogue().values()] == [[1000, 1001]]
    report = client.get("/v1/cluster").json()
    assert [(f["rank"], f["endpoint"], f["data_parallel_rank"], f["live"]) for f in report["foreign"]] == [
        (1000, dp_server.url, 0, True), (1001, dp_server.url, 1, True)]


@pytest.mark.parametrize("rank", [1000, 1001])
def test_a_request_for_one_data_parallel_rank_is_served_and_indexed_there_only(router, rank) -> None:
    """The engine names its core in the header: the blocks come back in that core's events, not the other's."""
    service, _ = router
    engine = service.engines.engine(rank)
    tokens = prompt(4 + rank % 2, 200)
    got = engine.generate(Generation(rank, tokens, 1, fields={"temperature": 0}))
    assert got.answer["usage"]["prompt_tokens"] == 200
    want = (200 - 1) // BLOCK * BLOCK
    wait_indexed(service, rank, tokens, want)
    other = 1001 if rank == 1000 else 1000
    assert held(service, tokens) == {rank: want, other: 0}
    again = engine.generate(Generation(rank + 2, tokens, 1, fields={"temperature": 0}))
    assert again.cached_tokens == want, "the same core serves it again, from its cache"


def test_the_router_sends_a_shared_prefix_to_the_core_holding_it(router, dp_server) -> None:
    service, client = router
    tokens = prompt(6, 300)
    r = client.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1, "model": dp_server.model_name})
    assert r.status_code == 200, r.text
    rank = r.json()["kvledger"]["rank"]
    wait_indexed(service, rank, tokens, 299 // BLOCK * BLOCK)
    second = tokens[:280] + prompt(7, 30)
    probe = client.post("/v1/probe", json={"prompt": second}).json()["ranks"]
    assert {p["rank"]: (p["data_parallel_rank"], p["matched_tokens"]) for p in probe} == {
        rank: (rank - 1000, 279 // BLOCK * BLOCK), 2001 - rank: (1 - (rank - 1000), 0)}
    r = client.post("/v1/completions", json={"prompt": second, "max_tokens": 1, "model": dp_server.model_name})
    kv = r.json()["kvledger"]
    assert kv["rank"] == rank
    assert kv["cached_tokens"] == kv["predicted_cached_tokens"] == 279 // BLOCK * BLOCK


def test_each_cores_load_is_its_own(router) -> None:
    """Long generations run on core 1 (one request of four choices, which vLLM runs as four): while they do,
    core 1's load shows them and core 0's does not.

    Four choices of 1900 tokens, not streamed: the server is busy streaming otherwise, and its ``/metrics``
    then answers in seconds (measured: 2 s), after a shorter generation has ended. The sampler runs in this
    process beside the router's threads: in the whole suite its first 0.1 s wait once returned only after the 2.8 s
    generation had ended (the process stalled; why is not known), and once it took one sample, both gauges at 0,
    before the generation ended (a fresh clone's run, 2026-12-08), so a generation no sample saw running runs
    again, at most ``ATTEMPTS`` times."""
    service, _ = router
    busy, idle = service.engines.engine(1001), service.engines.engine(1000)
    stalls = []
    for attempt in range(ATTEMPTS):
        took, seen = _sample_loads(busy, idle, Generation(10 + attempt * 10, prompt(8, 50), 1900, n=4,
                                                          fields={"temperature": 1.0, "ignore_eos": True}))
        if any(b.running_requests for b, _ in seen):
            break
        stalls.append((took, len(seen)))
    running = [(b.running_requests, i.running_requests + i.queued_requests) for b, i in seen]
    assert any(b >= 1 and i == 0 for b, i in running), (
        f"core 1 never reported its requests alone: {running}; generations no sample saw running (seconds, "
        f"samples): {stalls}")


def _sample_loads(busy, idle, job: Generation) -> tuple[float, list]:
    """Run ``job`` on ``busy`` and sample both engines' loads every 0.1 s while it runs, until one shows it running:
    the generation's seconds, and the samples (busy's load, idle's load)."""
    done = threading.Event()
    failed: list[BaseException] = []
    t0 = time.monotonic()

    def run() -> None:
        try:
            busy.generate(job)
        except BaseException as e:
            failed.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    seen = []
    while not done.wait(0.1) and not any(b.running_requests for b, _ in seen):   # bounded: the generation's end
        seen.append((busy.load(), idle.load()))
    thread.join(timeout=LOAD_WAIT_S)
    assert done.is_set(), f"the generation did not end within {LOAD_WAIT_S:g} s"
    assert not failed, f"the generation failed: {failed[0]!r}"
    return time.monotonic() - t0, seen
