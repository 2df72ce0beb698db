"""The router's HTTP API over real HTTP: uvicorn on 127.0.0.1 (a free port) in a thread, httpx as the client,
in-process ranks behind it."""
from __future__ import annotations

import http.client
import json
import threading
import time

import httpx
import pytest
import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.config import RouterConfig
from kvledger.router.http import HttpServer, make_app
from kvledger.router.service import RouterService
from kvledger.worker.engine.tokenizer import decode, encode
from kvledger.worker.ledger.config import CacheConfig

from fake_vllm import FakeVllmPublisher, vllm_stored

T = 4
PREFIX = "The quick brown fox jumps over the lazy dog. "   # 45 bytes: 11 full blocks


def prefix(tag: str) -> str:
    """A prefix as long as ``PREFIX`` (45 bytes: 11 full blocks) that is this test's own.

    The router and its ranks live as long as the module, so a test that counts cached tokens or matched
    blocks must not find what another test left: each test's prompts start with a token of their own (each
    test's tag begins with a letter no other prompt of the module begins with: the ranks reuse even part of a
    block, so a shared first byte would show as a cached token).
    """
    p = f"{tag}: {PREFIX}"[:len(PREFIX) - 1] + " "
    assert len(encode(p)) == len(encode(PREFIX)), p
    return p


@pytest.fixture(scope="module")
def router():
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=96, num_secondary_blocks=16)
    backend = LocalCluster.build(2, cfg)
    service = RouterService(backend, RouterConfig(tokens_per_block=T))
    service.feed.sync()
    server = HttpServer(make_app(service), port=0).start()
    with httpx.Client(base_url=server.url, timeout=20.0) as client:
        yield service, backend, client
    server.stop()


def test_binds_loopback_and_reports_health(router):
    service, _, client = router
    assert str(client.base_url).startswith("http://127.0.0.1:")
    r = client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "live_ranks": [0, 1]}


def test_a_kept_alive_connection_still_answers_after_six_idle_seconds(router):
    """uvicorn's own keep-alive (5 s) lost requests: a request sent on a kept-alive connection while the router's
    event loop was held up found the connection closed by the late timer (``http.KEEP_ALIVE_S``)."""
    _, _, client = router
    host, port = client.base_url.host, client.base_url.port
    conn = http.client.HTTPConnection(host, port, timeout=10.0)
    try:
        conn.connect()
        sock = conn.sock
        for wait_s in (0.0, 6.0):
            time.sleep(wait_s)
            conn.request("GET", "/health")   # http.client reopens only a socket it closed itself
            answer = conn.getresponse()
            assert answer.status == 200 and json.loads(answer.read())["status"] == "ok", wait_s
            assert conn.sock is sock
    finally:
        conn.close()


def test_completions_report_the_real_reused_count(router):
    _, backend, client = router
    shared = prefix("reuse")   # nothing before this test holds it, whatever ran first
    first = client.post("/v1/completions", json={"prompt": shared + "Alpha?", "max_tokens": 5}).json()
    second = client.post("/v1/completions", json={"prompt": shared + "Beta!", "max_tokens": 5,
                                                  "model": "kvledger-reference"}).json()
    unknown = client.post("/v1/completions", json={"prompt": shared, "model": "anything"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert unknown.json()["error"]["type"] == "not_found_error" and unknown.json()["error"]["param"] == "model"
    assert "'anything' is not served here" in unknown.json()["error"]["message"]
    assert first["object"] == "text_completion" and first["usage"]["completion_tokens"] == 5
    assert first["usage"]["prompt_tokens"] == len(encode(shared + "Alpha?"))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["text"] == decode(first["kvledger"]["output_token_ids"])
    kv = second["kvledger"]
    assert kv["rank"] == first["kvledger"]["rank"], "routed to the rank holding the shared prefix"
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == kv["cached_tokens"] >= 44
    assert kv["computed_tokens"] + kv["cached_tokens"] == second["usage"]["prompt_tokens"]
    assert set(kv) >= {"rank", "cached_tokens", "computed_tokens", "onboarded_blocks", "migrated_blocks"}
    ids = client.post("/v1/completions", json={"prompt": encode(shared + "Alpha?"), "max_tokens": 5,
                                               "cache_salt": None, "priority": 80}).json()
    assert ids["kvledger"]["output_token_ids"] == first["kvledger"]["output_token_ids"]
    salted = client.post("/v1/completions", json={"prompt": shared + "Alpha?", "max_tokens": 1,
                                                  "cache_salt": "tenant-b-reuse"}).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "a salt never shares another's KV"


def test_route_and_probe_agree_with_the_ranks(router):
    _, _, client = router
    shared = prefix("probe")   # held by the one rank this test's completion went to, by no other
    client.post("/v1/completions", json={"prompt": shared + "Gamma", "max_tokens": 0})
    prompt = shared + "Delta and more"
    d = client.post("/v1/route", json={"prompt": prompt}).json()
    assert d["policy"] == "kv" and d["rank"] in (0, 1) and len(d["ranks"]) == 2
    best = max(d["ranks"], key=lambda r: r["matched_tokens"])
    assert best["matched_tokens"] == 44 and best["rank"] == d["rank"]
    assert all(isinstance(r["score"], float) for r in d["ranks"])
    approx = client.post("/v1/probe", json={"prompt": prompt}).json()
    exact = client.post("/v1/probe", json={"prompt": prompt, "exact": True}).json()
    assert exact["exact"] and not approx["exact"]
    assert [(r["rank"], r["matched_tokens"]) for r in approx["ranks"]] == \
           [(r["rank"], r["matched_tokens"]) for r in exact["ranks"]]
    held = next(r for r in approx["ranks"] if r["rank"] == d["rank"])
    assert held["tiers"] == {"GPU": 44, "CPU": 0} and exact["ranks"][0]["tiers"] is None


def test_models_and_a_streamed_completion_as_server_sent_events(router):
    _, _, client = router
    models = client.get("/v1/models").json()
    assert [(m["id"], m["owned_by"], m["kvledger"]["ranks"]) for m in models["data"]] == [
        ("kvledger-reference", "kvledger", [0, 1])]
    body = {"prompt": prefix("stream"), "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text, usage = chunks
    whole = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert text["choices"][0]["text"] == whole["choices"][0]["text"] and "usage" not in text
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["kvledger"]["rank"] in (0, 1) and usage["kvledger"]["cached_tokens"] == \
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("body, param, needle", [
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"prompt": [1, -1]}, "prompt[1]", "greater than or equal to 0"),
    ({"prompt": [1, 2], "max_tokens": -3}, "max_tokens", "greater than or equal to 0"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens", "less than or equal to 4096"),
    ({"prompt": "x", "n": 1000}, "n", "less than or equal to 16"),
    ({"prompt": "x", "priority": 101}, "priority", "less than or equal to 100"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "the kvledger-reference ranks apply no penalties"),
    ({"prompt": "x", "temperature": True}, "temperature", "valid number"),
    ({"prompt": "x", "top_p": 0}, "top_p", "greater than 0"),
    ({"prompt": "x", "stream": "yes"}, "stream", "valid boolean"),
    ({"prompt": [1, 600]}, "prompt", "vocabulary"),
    ({"prompt": list(range(1, 400)), "max_tokens": 4096}, "prompt", "the request needs 4495 (399 in the prompt"),
    ({"max_tokens": 3}, "prompt", "Field required"),
    ({"prompt": "x", "n": 2, "use_beam_search": True, "temperature": 0.5}, "temperature", "samples nothing"),
    ({"prompt": "x", "n": 2, "use_beam_search": True, "max_tokens": 0}, "max_tokens", "a token at least"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, "response_format", "ranks do not serve it"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias", "ranks do not serve it"),
])
def test_bad_requests_get_400_naming_the_field_and_change_nothing(router, body, param, needle):
    service, _, client = router
    before = service.report(refresh=False).to_dict()
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error", err
    after = service.report(refresh=False).to_dict()
    assert after["router"] == before["router"]


def test_a_beam_search_answers_its_beams_as_the_n_choices(router):
    _, _, client = router
    r = client.post("/v1/completions", json={"prompt": prefix("b") + "beams", "max_tokens": 5, "n": 3,
                                             "use_beam_search": True})
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["text"] for c in body["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 3 and body["usage"]["completion_tokens"] == 15
    assert decode(body["kvledger"]["output_token_ids"]) == texts[0], "the best beam first"


def test_malformed_json_and_bad_queries_are_400_too(router):
    _, _, client = router
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "json_invalid"
    assert client.get("/v1/events", params={"since": -1}).status_code == 400
    ignored = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "user": "me", "echo": False})
    assert ignored.status_code == 200, "a label, and a field that asks for nothing, pass"
    refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "echo": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "echo", "never dropped silently"


def test_events_stream_as_ndjson_and_follow_live(router):
    service, _, client = router
    _, nxt = service.feed.events(0, limit=10**6)
    lines: list[dict] = []

    def read() -> None:
        with client.stream("GET", "/v1/events", params={"since": nxt, "limit": 1, "timeout": 15}) as resp:
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            for line in resp.iter_lines():
                if line:
                    lines.append(json.loads(line))

    reader = threading.Thread(target=read)
    reader.start()
    out = client.post("/v1/completions", json={"prompt": "events: a new text, nothing shared here.",
                                               "max_tokens": 1}).json()
    reader.join(timeout=20)
    assert not reader.is_alive()
    assert len(lines) == 1 and lines[0]["type"] == "BlockStored" and lines[0]["id"] == nxt
    assert lines[0]["rank"] == out["kvledger"]["rank"] and lines[0]["block_size"] == T
    # history, one rank only, bounded by a timeout when fewer than asked exist
    rank = out["kvledger"]["rank"]
    r = client.get("/v1/events", params={"since": 0, "rank": rank, "timeout": 0.3})
    got = [json.loads(x) for x in r.text.splitlines()]
    assert got and {e["rank"] for e in got} == {rank}
    assert [e["id"] for e in got] == sorted(e["id"] for e in got)


def test_cluster_and_metrics(router):
    _, _, client = router
    before = client.get("/v1/cluster").json()["router"]["completions"]   # whatever other tests served
    client.post("/v1/completions", json={"prompt": prefix("metrics") + "metrics", "max_tokens": 1})
    c = client.get("/v1/cluster").json()
    assert c["policy"] == "kv" and [r["rank"] for r in c["ranks"]] == [0, 1]
    assert c["router"]["completions"] == before + 1 and c["ranks"][0]["blocks"]["GPU"]["free"] >= 0
    m = client.get("/metrics")
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    text = m.text
    for family in ('kvledger_blocks{rank="0",state="used",tier="GPU"}',
                   'kvledger_blocks{rank="1",state="free",tier="CPU"}', 'kvledger_cache_hit_rate{rank="0"}', 'kvledger_events_per_second{rank="1"}',
                   'kvledger_events_total{rank="0"}', 'kvledger_routing_decisions_total{policy="kv",rank=',
                   "kvledger_router_hit_rate ", "kvledger_probe_latency_seconds_bucket{le=",
                   "kvledger_probe_latency_seconds_count ", "kvledger_completions_total "):
        assert family in text, family
    served = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("kvledger_routing_decisions_total{"))
    assert served == c["router"]["completions"]


def test_a_real_vllm_engines_events_show_in_probes_but_never_get_requests():
    """A publisher written to vLLM's ZMQ framing (tests/unit/test_router_vllm_events.py), indexed under its own rank."""

    from kvledger.router.feed import FOREIGN_RANK_BASE

    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=32)
    service = RouterService(LocalCluster.build(1, cfg), RouterConfig(tokens_per_block=T))
    service.feed.sync()
    engine = FakeVllmPublisher()
    server = HttpServer(make_app(service), port=0).start()
    try:
        rank = service.feed.attach_vllm(f"tcp://127.0.0.1:{engine.pub_port}", f"tcp://127.0.0.1:{engine.replay_port}")
        assert rank == FOREIGN_RANK_BASE
        with pytest.raises(ValueError, match="already"):
            service.feed.attach_vllm(f"tcp://127.0.0.1:{engine.pub_port}")
        engine.wait_subscribed()
        tokens = encode("vLLM holds this prefix, its own way.")      # 36 tokens: 8 full blocks before the last
        engine.publish([vllm_stored([9001, 9002], None, tokens[:8])])
        with httpx.Client(base_url=server.url, timeout=20.0) as client:
            deadline = time.monotonic() + 10
            while True:
                got = client.post("/v1/probe", json={"prompt": tokens}).json()["ranks"]
                if got[-1]["matched_tokens"]:
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.02)   # another thread's socket: nothing to wait on here
            assert got == [{"rank": 0, "matched_tokens": 0, "tiers": {"GPU": 0, "CPU": 0}},
                           {"rank": rank, "matched_tokens": 8, "tiers": {"GPU": 8, "CPU": 0},
                            "vllm": f"tcp://127.0.0.1:{engine.pub_port}"}]
            out = client.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1}).json()
            assert out["kvledger"]["rank"] == 0, "a foreign engine is indexed, never routed to"
            foreign = client.get("/v1/cluster").json()["foreign"]
            assert foreign == [{"rank": rank, "endpoint": f"tcp://127.0.0.1:{engine.pub_port}", "index_blocks": 2,
                                "next_seq": 1, "live": True, "block_size": T, "rejected": {},
                                "data_parallel_rank": None, "host_blocks": 0, "prefill_only": False}]
    finally:
        server.stop()
        service.close()
        engine.close()


def test_a_router_rebuilding_its_index_answers_503_with_retry_after(router):
    service, _, _ = router
    ready = threading.Event()
    server = HttpServer(make_app(service, ready=ready), port=0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=20.0) as client:
            for call in (lambda: client.get("/health"), lambda: client.post("/v1/completions", json={"prompt": "x"})):
                r = call()
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "starting"
            ready.set()
            assert client.get("/health").status_code == 200
    finally:
        server.stop()


def test_a_response_from_own_ranks_in_the_responses_shape_whole_and_streamed(router):
    """Own ranks serve a text input: the answer in the Responses shape, a repeat routed to its prefix, and the
    same answer streamed as named events ending with ``response.completed`` and its kvledger block."""
    _, _, client = router
    body = {"input": prefix("resp"), "instructions": "Be terse.", "max_output_tokens": 3}
    first = client.post("/v1/responses", json=body)
    assert first.status_code == 200, first.text
    a = first.json()
    assert a["object"] == "response" and a["status"] == "incomplete" and a["output"][0]["type"] == "message"
    again = client.post("/v1/responses", json=body).json()
    kv = again["kvledger"]
    n = again["usage"]["input_tokens"]
    assert kv["rank"] == a["kvledger"]["rank"] and kv["predicted_cached_tokens"] == (n - 1) // T * T > 0
    assert kv["cached_tokens"] == again["usage"]["input_tokens_details"]["cached_tokens"] == n - 1, \
        "the whole prompt but its last token: the ranks reuse part of a block too"
    with client.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b.split("\n") for b in r.read().decode().split("\n\n") if b.strip()]
    events = [json.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert [name for name, _ in blocks] == [f"event: {e['type']}" for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == \
        a["output"][0]["content"][0]["text"]
    done = events[-1]
    assert done["type"] == "response.completed" and done["response"]["kvledger"]["cached_tokens"] == \
        done["response"]["usage"]["input_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("body, status, param, needle", [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, 400, "tools", "ranks do not serve it"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, 400, "input[0].type",
     "serve text messages"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, 400, "input[0].name", "Field required"),
    ({"input": [{"type": "image_generation_call"}]}, 400, "input[0]", "an input item is an object of a type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type", "'text', 'input_text' or 'output_text'"),
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens", "greater than or equal to 0"),
    ({"input": "x", "previous_response_id": "resp_never"}, 404, "previous_response_id",
     "Response with id 'resp_never' not found."),
    ({"instructions": "x"}, 400, "input", "Field required"),
])
def test_bad_responses_get_their_status_naming_the_field_and_change_nothing(router, body, status, param, needle):
    service, _, client = router
    before = service.report(refresh=False).to_dict()
    r = client.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert service.report(refresh=False).to_dict()["router"] == before["router"]


def test_a_follow_up_to_an_own_ranks_response_is_refused_by_name(router):
    """Own ranks keep no responses (as vLLM without its store): the follow-up is bound to the rank that answered,
    which refuses ``previous_response_id``; a response asked not to be stored is not known at all."""
    service, _, client = router
    first = client.post("/v1/responses", json={"input": "w: hi", "max_output_tokens": 1}).json()
    assert service.responses.get(first["id"]).rank == first["kvledger"]["rank"]
    r = client.post("/v1/responses", json={"input": "w: more", "previous_response_id": first["id"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id", r.text
    unkept = client.post("/v1/responses", json={"input": "w: hi", "max_output_tokens": 1, "store": False}).json()
    r = client.post("/v1/responses", json={"input": "w: more", "previous_response_id": unkept["id"]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id", r.text
def _stored(client: httpx.Client, since: int, rank: int) -> list[dict]:
    """The blocks ``rank`` stored, updated and removed since event ``since`` (what its ledger announced)."""
    r = client.get("/v1/events", params={"since": since, "rank": rank, "timeout": 0.3})
    assert r.status_code == 200
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_an_agent_sessions_turn_after_a_tool_gap_finds_its_prefix_past_other_traffic():
    """Pools of 32 blocks, a session of 16: while its tool runs, eight other prompts of 16 blocks each fill both
    ranks several times over. Its next turn goes back to its rank and reuses its whole prompt there: its blocks
    were stored at the session priority, and other traffic's were evicted first."""
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=32, num_secondary_blocks=0)
    service = RouterService(LocalCluster.build(2, cfg), RouterConfig(tokens_per_block=T, load_refresh_s=0.0))
    service.feed.sync()
    server = HttpServer(make_app(service), port=0).start()
    agent = {"x-session-id": "agent-7"}
    try:
        with httpx.Client(base_url=server.url, timeout=20.0) as client:
            since = client.get("/v1/cluster").json()["router"]["events_logged"]   # and the ranks' block counts
            task = encode("Agent: plan the trip to Paris; call the weather tool, then read it.")[:60]
            first = client.post("/v1/completions", headers=agent, json={"prompt": task, "max_tokens": 4}).json()
            rank = first["kvledger"]["rank"]
            for i in range(8):   # the tool runs; other clients' prompts of 60 tokens come in meanwhile
                other = encode(f"{chr(ord('a') + i)}: other traffic, a prompt of its own, {i} of eight")[:60]
                r = client.post("/v1/completions", json={"prompt": other + [32] * (60 - len(other)), "max_tokens": 4})
                assert r.status_code == 200, r.text
                client.get("/v1/cluster")   # the ranks' loads, as the router's upkeep asks them
            turn = task + first["kvledger"]["output_token_ids"] + encode(" Tool: sunny, 21 C. Next?")
            second = client.post("/v1/completions", headers=agent, json={"prompt": turn, "max_tokens": 4}).json()
            assert second["kvledger"]["rank"] == rank, "the turn goes back to its session's rank"
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(task) // T * T
            events = _stored(client, since, rank)
            roots = [e for e in events if e["type"] == "BlockStored" and e["parent_block_hash"] is None]
            mine = {e["priority"] for e in roots if e["token_ids"][:T] == task[:T]}
            assert mine == {60}, "the session's prompt stored at RouterConfig.session_priority"
            assert {e["priority"] for e in roots if e["token_ids"][:T] != task[:T]} == {35}, "other traffic's at 35"
            assert any(e["type"] == "BlockRemoved" for e in events), "other traffic was evicted there"
            explicit = client.post("/v1/completions", headers=agent,
                                   json={"prompt": turn, "max_tokens": 1, "priority": 90}).json()
            assert explicit["kvledger"]["rank"] == rank
            later = _stored(client, since + len(_stored(client, since, 0)) + len(events), rank)
            assert {e["new_priority"] for e in later if e["type"] == "BlockUpdated"} == {90}, "a client's priority wins"
            s = client.get("/v1/cluster").json()["sessions"]
            assert (s["live"], s["waiting_on_tool"], s["turns"]) == (1, 0, 3)
            assert s["cached_tokens"] > 0 and s["hit_rate"] == s["cached_tokens"] / s["prompt_tokens"]
            metrics = client.get("/metrics").text
            assert "kvledger_sessions_live 1.0" in metrics and "kvledger_sessions_waiting_on_tool 0.0" in metrics
            assert f"kvledger_session_cached_tokens_total {float(s['cached_tokens'])}" in metrics
            for headers, body, param in (({"x-session-id": "x" * 257}, {}, "x-session-id"),
                                         ({}, {"metadata": {"session_id": 7}}, "metadata.session_id")):
                bad = client.post("/v1/completions", headers=headers, json={"prompt": turn, "max_tokens": 1, **body})
                assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
            assert client.get("/v1/cluster").json()["sessions"]["turns"] == 3, "a refused request changes nothing"
    finally:
        server.stop()
        service.close()
