"""Prefill and decode on two real vLLM servers through their KV connector: vLLM's disaggregated protocol.

The CPU build runs the example shared-storage connector (``ExampleConnector``): the prefill server (role
``kv_producer``) writes each prompt's KV under a folder both servers share, and the decode server (role
``kv_consumer``) loads it from there instead of computing it. The router sends the prefill request with
``kv_transfer_params`` and one output token, then the client's request to the decode server with what the
prefill answered (``router.kv_connector``); the decode server's own counters say what it took over.

Each server runs on a core of its own. Every prompt starts with a token of its own test.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import over_http
from vllm_engines import START_TIMEOUT_S, EngineSpec, VllmServer, start_engines
from vllm_engines import engine_prompt as prompt

from kvledger.router.config import RouterConfig
from kvledger.router.service import RouterService

pytestmark = pytest.mark.timeout(int(START_TIMEOUT_S) + 600)   # set-up starts the servers

BLOCK = 32
MIN_SPLIT = 64


def connector(role: str, store: Path) -> tuple[str, ...]:
    return ("--kv-transfer-config", json.dumps({"kv_connector": "ExampleConnector", "kv_role": role,
                                                "kv_connector_extra_config": {"shared_storage_path": str(store)}}))


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def servers(request, tmp_path_factory, store) -> tuple[VllmServer, VllmServer]:
    prefill, decode = start_engines(request, tmp_path_factory, [
        EngineSpec(block_size=BLOCK, args=connector("kv_producer", store)),
        EngineSpec(block_size=BLOCK, args=connector("kv_consumer", store))])
    return prefill, decode


@pytest.fixture(scope="module")
def router(servers) -> Iterator[tuple[RouterService, httpx.Client]]:
    prefill, decode = servers
    config = RouterConfig(tokens_per_block=16, vllm=(decode.url,), vllm_prefill=(prefill.url,), policy="kv",
                          split_mode="always", min_split_tokens=MIN_SPLIT)
    service = RouterService(None, config)
    with over_http(service) as client:
        yield service, client


def counter(server: VllmServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def ranks(service: RouterService) -> tuple[int, int]:
    """The prefill server's rank and the decode server's."""
    by_url = {service.engines.engine(r).info().url: r for r in service.engines.added()}
    return by_url[service.config.vllm_prefill[0]], by_url[service.config.vllm[0]]


def scratch(server: VllmServer, store: Path, body: dict) -> dict:
    """``body`` computed from scratch on ``server``, its KV then forgotten by the server and the shared folder."""
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "model": server.model_name}, timeout=120.0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=10.0).raise_for_status()
    for folder in store.iterdir():
        shutil.rmtree(folder)
    return r.json()


def test_a_split_prompt_is_computed_on_the_prefill_server_and_decoded_from_its_kv(router, servers, store) -> None:
    """The prefill server computes the prompt, the decode server takes its full blocks over from the connector
    (its external hits count them) and answers what the prompt computed from scratch answers."""
    service, client = router
    prefill, decode = servers
    p, d = ranks(service)
    tokens = prompt(1, 300)
    body = {"prompt": tokens, "max_tokens": 6, "temperature": 0, "logprobs": 3, "return_token_ids": True}
    want = scratch(prefill, store, body)
    before = {name: (counter(prefill, name), counter(decode, name)) for name in (
        "vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")}
    r = client.post("/v1/completions", json={**body, "model": decode.model_name})
    assert r.status_code == 200, r.text
    got = r.json()
    after = {name: (counter(prefill, name) - p0, counter(decode, name) - d0) for name, (p0, d0) in before.items()}
    kv = got["kvledger"]
    assert (kv["rank"], kv["phases"]["prefill_rank"]) == (d, p)
    handed = 299 // BLOCK * BLOCK
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == handed
    assert after == {"vllm:external_prefix_cache_hits_total": (0, handed), "vllm:prefix_cache_hits_total": (0, 0),
                     "vllm:prompt_tokens_total": (300, 300)}, "computed on the prefill server, taken over by decode"
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-3)
    assert kv["predicted_cached_tokens"] == handed, "the router counted on the blocks the connector hands over"


def test_a_streamed_chat_is_split_too(router, servers) -> None:
    """The prefill goes out as the same chat (both servers render the same prompt); the decode streams."""
    service, client = router
    prefill, decode = servers
    _, d = ranks(service)
    text = " ".join(f"w{i}" for i in range(200))
    body = {"model": decode.model_name, "messages": [{"role": "user", "content": f"chat split {text}"}],
            "max_tokens": 4, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    computed = counter(prefill, "vllm:prompt_tokens_total")
    external = counter(decode, "vllm:external_prefix_cache_hits_total")
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    usage = [e for e in events if e.get("usage")][-1]["usage"]
    assert usage["prompt_tokens"] > MIN_SPLIT
    assert counter(prefill, "vllm:prompt_tokens_total") - computed == usage["prompt_tokens"], "the same prompt"
    handed = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
    assert usage["prompt_tokens_details"]["cached_tokens"] == handed
    assert counter(decode, "vllm:external_prefix_cache_hits_total") - external == handed
    assert {e["kvledger"]["rank"] for e in events if "kvledger" in e} == {d}


def test_the_cluster_report_names_the_prefill_server(router, servers) -> None:
    _, client = router
    prefill, decode = servers
    foreign = {f["endpoint"]: f["prefill_only"] for f in client.get("/v1/cluster").json()["foreign"]}
    assert foreign == {prefill.url: True, decode.url: False}


def test_a_short_prompt_is_served_whole_on_the_decode_server(router, servers) -> None:
    service, client = router
    _, decode = servers
    _, d = ranks(service)
    r = client.post("/v1/completions", json={"model": decode.model_name, "prompt": prompt(2, MIN_SPLIT // 2),
                                             "max_tokens": 2})
    assert r.status_code == 200, r.text
    kv = r.json()["kvledger"]
    assert (kv["rank"], kv["phases"]["prefill_rank"]) == (d, None)


def test_the_route_preview_names_the_prefill_server(router, servers) -> None:
    service, client = router
    _, decode = servers
    p, d = ranks(service)
    r = client.post("/v1/route", json={"model": decode.model_name, "prompt": prompt(3, 200)})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["rank"] == d and got["split"]["prefill_rank"] == p


def test_a_server_whose_connector_only_consumes_cannot_prefill(servers) -> None:
    _, decode = servers
    with pytest.raises(ValueError, match="cannot prefill for another server: it runs ExampleConnector as kv_consumer"):
        RouterService(None, RouterConfig(tokens_per_block=16, vllm_prefill=(decode.url,)))


def test_a_prefill_server_needs_a_decode_server_that_takes_its_kv(servers) -> None:
    prefill, _ = servers
    with pytest.raises(ValueError, match="need a vllm server whose KV connector takes their KV"):
        RouterService(None, RouterConfig(tokens_per_block=16, vllm_prefill=(prefill.url,)))


def test_a_request_whose_prefill_server_is_lost_is_served_whole(router, servers) -> None:
    """Last: the prefill server is killed; the request is computed on the decode server, nothing is lost."""
    service, client = router
    prefill, decode = servers
    p, d = ranks(service)
    prefill.kill()
    r = client.post("/v1/completions", json={"model": decode.model_name, "prompt": prompt(4, 200), "max_tokens": 2})
    assert r.status_code == 200, r.text
    kv = r.json()["kvledger"]
    assert (kv["rank"], kv["phases"]["prefill_rank"]) == (d, None)
    assert p not in service.engines.live()
