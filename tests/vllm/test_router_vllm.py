"""Real vLLM servers behind the router, beside kvledger's own ranks: discovery, one index of two block sizes,
routing by prefix, proxied answers, predicted against delivered cached tokens, an engine that dies, and an
agent's turns (tool calls, their results, a JSON schema, streamed tool-call deltas) and the Responses API (hashed as
the engine renders it, streamed events, a follow-up bound to its engine, a function call's round trip) with the
``openai`` SDK.

Two engines are started once for the module (block size 32 with a publisher that binds, 64 with one that
connects, so the router binds); the router runs in this process over two in-process ranks of its own and the
two servers. Every prompt starts with a token of its own test, so no test finds another's cached blocks.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from router_helpers import INDEX_WAIT_S, over_http, wait_indexed
from vllm_engines import START_TIMEOUT_S, VllmServer, encode_like_engine
from vllm_engines import engine_prompt as prompt

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.config import RouterConfig
from kvledger.router.http import HttpServer, make_app
from kvledger.router.prompt_tokenizer import HfTokenizer
from kvledger.router.responses import input_messages, template_fields
from kvledger.router.engine import Generation
from kvledger.router.service import RouterService
from kvledger.worker.engine.reference import MODEL_NAME as OWN_MODEL
from kvledger.worker.ledger import CacheConfig

pytestmark = pytest.mark.timeout(int(START_TIMEOUT_S) + 600)   # set-up starts both engines

T = 16


@pytest.fixture(scope="module")
def router(vllm_servers: list[VllmServer]) -> Iterator[tuple[RouterService, httpx.Client]]:
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=64, num_secondary_blocks=0)
    service = RouterService(LocalCluster.build(2, cfg),
                            RouterConfig(tokens_per_block=T, vllm=tuple(e.url for e in vllm_servers), policy="kv"))
    service.feed.sync()
    with over_http(service) as client:
        yield service, client


def test_a_server_without_a_kv_connector_is_refused_as_a_prefill_server(vllm_servers) -> None:
    """It would take ``kv_transfer_params`` and ignore them (vLLM logs "no KVConnector found"), so nothing it
    prefills would reach the decode server: the router refuses it at once, saying how to start one."""
    plain, other = vllm_servers
    with pytest.raises(ValueError, match=f"vLLM server {plain.url} cannot prefill for another server: it runs no KV "
                                         "connector; start it with --kv-transfer-config"):
        RouterService(None, RouterConfig(tokens_per_block=T, vllm=(other.url,), vllm_prefill=(plain.url,)))


def complete(client: httpx.Client, tokens: list[int], model: str, **fields) -> dict:
    r = client.post("/v1/completions", json={"prompt": tokens, "max_tokens": 2, "model": model, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_router_finds_each_servers_model_block_size_tokenizer_and_events(router, vllm_servers) -> None:
    service, client = router
    model = vllm_servers[0].model_name
    models = service.models.catalogue().values()
    assert {m.name: m.ranks for m in models} == {OWN_MODEL: [0, 1], model: [1000, 1001]}
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["owned_by"]) for m in listed] == [(OWN_MODEL, "kvledger"), (model, "vllm")]
    for rank, engine in zip((1000, 1001), vllm_servers):
        info = service.engines.engine(rank).info()
        assert (info.block_size, info.max_context) == (engine.block_size, 2048)
        assert isinstance(info.tokenizer, HfTokenizer), "the model's files are readable here: its own tokenizer"
        assert service.feed.index.block_size(rank) == engine.block_size
    connected, bound = (service.feed._foreign[r].subscriber.bound for r in (1000, 1001))
    assert not connected and bound, "engine 0's publisher binds (router connects); engine 1's connects to us"
    text = "Tokenized the way the engine will."
    r = httpx.post(f"{vllm_servers[0].url}/tokenize", json={"model": model, "prompt": text}, timeout=30)
    assert service.models.encode(text, model) == (model, r.json()["tokens"]) == (model, encode_like_engine(text))
    report = client.get("/v1/cluster").json()
    assert [(f["rank"], f["endpoint"], f["live"], f["block_size"]) for f in report["foreign"]] == [
        (1000, vllm_servers[0].url, True, 32), (1001, vllm_servers[1].url, True, 64)]


def test_the_same_prefix_goes_to_the_same_engine_and_the_index_predicts_what_it_delivers(router) -> None:
    service, client = router
    model = service.engines.engine(1000).info().model
    first = prompt(5, 300)
    a = complete(client, first, model)
    rank = a["kvledger"]["rank"]
    assert rank in (1000, 1001) and a["usage"]["prompt_tokens"] == 300 and a["object"] == "text_completion"
    bs = service.feed.index.block_size(rank)
    held = (300 - 1) // bs * bs   # the full blocks before the last token: what the engine can reuse
    wait_indexed(service, rank, first, held)
    second = first[:280] + prompt(6, 40)
    b = complete(client, second, model)
    kv = b["kvledger"]
    expect = 279 // bs * bs
    assert kv["rank"] == rank, "routed to the engine holding the shared prefix"
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == kv["cached_tokens"] == expect > 0
    assert kv["predicted_cached_tokens"] == expect, "once its events have arrived the index is exact"
    stored = (len(second) - 1) // bs * bs   # the second prompt's own full blocks, stored once it was served
    wait_indexed(service, rank, second, stored)
    probe = client.post("/v1/probe", json={"prompt": second}).json()["ranks"]
    assert {p["rank"]: p["matched_tokens"] for p in probe}[rank] == stored


def test_a_salted_prompt_is_predicted_on_the_engine_that_holds_it(router) -> None:
    """vLLM publishes a prompt's salt among its first block's extra keys; the index keys the chain by it."""
    service, client = router
    model = service.engines.engine(1000).info().model
    tokens = prompt(4, 200)
    first = complete(client, tokens, model, cache_salt="tenant:acme")
    rank = first["kvledger"]["rank"]
    wait_indexed(service, rank, tokens, 192, cache_salt="tenant:acme")
    assert service.probe(tokens)[rank].matched_tokens == 0, "unsalted, the same tokens are not that prompt"
    again = complete(client, tokens, model, cache_salt="tenant:acme")["kvledger"]
    assert again["rank"] == rank and again["predicted_cached_tokens"] == again["cached_tokens"] == 192


def test_two_block_sizes_in_one_index(router) -> None:
    service, client = router
    model = service.engines.engine(1000).info().model
    tokens = prompt(7, 200)
    for rank in (1000, 1001):   # pin each engine's copy by sending it there directly
        engine = service.engines.engine(rank)
        assert engine.generate(Generation(rank, tokens, 1)).answer["usage"]["prompt_tokens"] == len(tokens)
    wait_indexed(service, 1000, tokens, 192)   # 199 tokens before the last: 6 blocks of 32
    wait_indexed(service, 1001, tokens, 192)   # ... and 3 of 64
    assert {r: p.matched_tokens for r, p in service.probe(tokens[:100]).items() if r >= 1000} == {1000: 96,
                                                                                                 1001: 64}
    d = client.post("/v1/route", json={"prompt": tokens[:100], "model": model}).json()
    assert d["rank"] == 1000, "the finer block size holds more of a 100-token prompt"


def test_own_ranks_and_engines_share_the_router_the_event_stream_and_the_metrics(router) -> None:
    service, client = router
    model = service.engines.engine(1000).info().model
    own = complete(client, list(range(1, 70)), OWN_MODEL)
    assert own["kvledger"]["rank"] in (0, 1) and own["model"] == OWN_MODEL
    theirs = complete(client, prompt(8, 100), model)
    assert theirs["kvledger"]["rank"] in (1000, 1001) and theirs["model"] == model
    wait_indexed(service, theirs["kvledger"]["rank"], prompt(8, 100), 64)
    with client.stream("GET", "/v1/events", params={"since": 0, "timeout": 2}) as r:
        ranks = {json.loads(line)["rank"] for line in r.iter_lines() if line}
    assert {0, 1} & ranks and theirs["kvledger"]["rank"] in ranks, "one stream: own ranks' and vLLM's events"
    metrics = client.get("/metrics").text
    for name in ("kvledger_predicted_cached_tokens_total", "kvledger_delivered_cached_tokens_total",
                 "kvledger_cached_tokens_gap_bucket"):
        assert name in metrics
    assert f'kvledger_events_total{{rank="{theirs["kvledger"]["rank"]}"}}' in metrics
    bad = client.post("/v1/completions", json={"prompt": [1, 999], "model": model, "max_tokens": 1})
    assert bad.status_code == 400 and "error" in bad.json(), "the engine's own refusal, as it sent it"


def test_a_streamed_completion_passes_through_chunk_by_chunk(router) -> None:
    service, client = router
    model = service.engines.engine(1000).info().model
    body = {"prompt": prompt(9, 80), "max_tokens": 5, "model": model, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = [c for c in chunks if c["choices"]]
    assert len(text) >= 2, "the engine's chunks, one by one"
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["kvledger"]["rank"] in (1000, 1001) and "predicted_cached_tokens" in usage["kvledger"]


def test_a_stream_holds_its_admission_slot_until_it_ends_and_one_past_the_bounds_gets_429(vllm_servers) -> None:
    """The router's bounds count streamed answers too: with one slot and no queue, a completion (streamed or not)
    is refused with 429 while a stream runs, and served once it has ended; a stream dropped before anyone read it
    gives its slot back."""
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=64, num_secondary_blocks=0)
    engine = vllm_servers[0]   # block size 32, its publisher binds: a second router subscribes to it as well
    service = RouterService(LocalCluster.build(1, cfg),
                            RouterConfig(tokens_per_block=T, vllm=(engine.url,), policy="kv",
                                         max_inflight_completions=1, max_queued_completions=0))
    server = HttpServer(make_app(service), port=0).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120.0) as client:
            (model,) = (m for m in service.models.catalogue() if m != OWN_MODEL)
            tokens = prompt(12, 40)
            running = service.stream(tokens, max_tokens=3, model=model)   # begun: its first event is in
            assert service.admission.counts() == (1, 0), "a stream holds its slot while it runs"
            body = {"prompt": tokens, "max_tokens": 3, "model": model, "stream": True, "temperature": 0,
                    "ignore_eos": True}
            for second in (body, {**body, "stream": False}):
                refused = client.post("/v1/completions", json=second)
                assert refused.status_code == 429 and "retry-after" in refused.headers, refused.text
            assert list(running)[-1][2] == "[DONE]"
            assert service.admission.counts() == (0, 0), "the slot is given back as the stream ends"
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
            # the stream's end is seen on the server's thread
            assert service.admission.wait_idle(INDEX_WAIT_S), f"the slot is still held: {service.admission.counts()}"
            dropped = service.stream(tokens, max_tokens=2, model=model)
            assert service.admission.counts() == (1, 0)
            del dropped
            assert service.admission.counts() == (0, 0), "a stream dropped unread gives its slot back"
            assert service.tally.stats.shed == 2
    finally:
        server.stop()
        service.close()


def test_an_engine_killed_under_load_loses_no_request_and_rejoins_after_restart(router, vllm_servers) -> None:
    service, client = router
    model = service.engines.engine(1000).info().model
    victim = vllm_servers[0]
    results: list[int] = []
    started = threading.Event()

    def one(i: int) -> int:
        started.set()
        return client.post("/v1/completions", json={"prompt": prompt(20 + i, 120), "max_tokens": 8,
                                                    "model": model}).status_code

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        assert started.wait(30)
        victim.kill()
        results = [f.result(timeout=300) for f in futures]
    assert results == [200] * 16, "every request was answered, by the engine that survived"
    service.check_health()
    assert 1000 not in service.engines.live() and service.feed.index.num_blocks(1000) == 0
    assert complete(client, prompt(40, 90), model)["kvledger"]["rank"] == 1001
    victim.restart()   # returns once its /health answers: one forced health round sees it back
    assert 1000 in service.check_health() and 1000 in service.engines.live(), "the restarted engine rejoins"
    tokens = prompt(41, 100)
    assert service.engines.engine(1000).generate(Generation(1, tokens, 1)).answer["usage"]["prompt_tokens"] == 100
    wait_indexed(service, 1000, tokens, 96)


def test_bench_replays_a_trace_through_the_servers_policy_by_policy(router, vllm_servers) -> None:
    from kvledger.replay.config import BenchConfig, TinyOptions
    from kvledger.replay.runner import run

    result = run(BenchConfig(engine="vllm", vllm=tuple(e.url for e in vllm_servers), policy="kv,round_robin", limit=40,
                             tiny=TinyOptions(max_input_tokens=600, max_output_tokens=2, concurrency=4)))
    assert result.engine == "vllm" and result.sim.tokens_per_block == 32 and set(result.runs) == {"kv", "round_robin"}
    for policy, e in result.extra["vllm"]["policies"].items():
        assert e["failed"] == 0 and e["inconsistent"] == 0, (policy, e["errors"])
        assert e["predicted_cached_tokens"] >= 0 and e["delivered_cached_tokens"] > 0, "the trace shares prefixes"
        replayed = result.runs[policy]
        assert len(replayed.prompt_tokens) == 40 and set(replayed.rank.tolist()) <= {0, 1}, "ranks counted from 0"



def test_bench_runs_sglang_router_beside_kv_on_the_same_servers_every_figure_from_the_servers(vllm_servers) -> None:
    """``kvledger bench --engine vllm --peer sglang-router``: the peer from its PyPI package (a virtual environment
    of its own, as the suite's vLLM), the same text prompts through both, the servers' caches reset before each."""
    from kvledger.replay.config import BenchConfig, TinyOptions
    from kvledger.replay.report import peer_goals
    from kvledger.replay.runner import run

    peer = "sglang-router cache_aware"
    result = run(BenchConfig(engine="vllm", vllm=tuple(e.url for e in vllm_servers), policy="kv", limit=40,
                             peer=("sglang-router",),
                             tiny=TinyOptions(max_input_tokens=600, max_output_tokens=2, concurrency=4)))
    assert set(result.runs) == {"kv", peer}
    extra = result.extra["vllm"]
    assert extra["prompts"].startswith("text") and extra["peers"] == [peer]
    assert extra["server_blocks"] and all(b > 0 for b in extra["server_blocks"])
    for name in ("kv", peer):
        e, replayed, s = extra["policies"][name], result.runs[name], result.summaries[name]
        assert e["failed"] == 0 and e["inconsistent"] == 0, (name, e["errors"])
        assert sum(x["requests"] for x in e["engines"]) == 40, (name, e["engines"])   # counted by the servers
        assert s.requests_per_rank == [x["requests"] for x in e["engines"]]
        delivered = int(replayed.cached_tokens.sum())
        assert delivered > 0, "the trace shares prefixes"
        counted = sum(x["cached_tokens"] for x in e["engines"])
        assert abs(counted - delivered) <= 0.05 * delivered, (name, counted, delivered)   # answers agree with /metrics
    assert (result.runs[peer].rank == -1).all(), "a peer does not say which server answered"
    goals = peer_goals(result.summaries, extra)
    assert "kv / best peer: hit rate" in goals and "offline bound" in goals, goals


# --- agents: tools, schemas and vLLM's own fields, through the router as sent ------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = "Before we plan the trip, tell me what the weather is like in Paris today. " * 4


def engine_tokens(direct: httpx.Client, model: str, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt's token ids as the engine renders the chat (its ``/tokenize``)."""
    r = direct.post("/tokenize", json={"model": model, "messages": messages, "tools": tools,
                                       "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def sdk_of(client: httpx.Client) -> openai.OpenAI:
    """The official SDK, pointed at the router."""
    return openai.OpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="unused", timeout=120,
                         max_retries=0)


@pytest.fixture
def direct(vllm_servers: list[VllmServer]) -> Iterator[httpx.Client]:
    """The first engine, straight (no router)."""
    with httpx.Client(base_url=vllm_servers[0].url, timeout=120) as c:
        yield c


def test_a_tool_call_and_its_result_over_three_turns_hash_as_the_engine_renders_them(router, vllm_servers, direct):
    """With the ``openai`` SDK: every turn's prompt, tool calls and results included, is hashed as the engine
    renders it (its ``/tokenize``), and once the previous turn's events are in, predicted as delivered."""
    service, client = router
    sdk, model = sdk_of(client), vllm_servers[0].model_name
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    previous_held = previous_rank = 0   # the full blocks of the turn before, and where it ran
    for turn, choice in enumerate([CALL_WEATHER, CALL_WEATHER, "none"]):
        _, tokens = service.models.encode_chat(messages, model, {"tools": TOOLS})
        assert tokens == engine_tokens(direct, model, messages, TOOLS), f"turn {turn}: hashed as the engine renders"
        if turn:
            wait_indexed(service, previous_rank, tokens, previous_held)
        got = sdk.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                          max_tokens=24, temperature=0)
        kv = got.model_extra["kvledger"]
        rank = kv["rank"]
        bs = service.feed.index.block_size(rank)
        assert got.usage.prompt_tokens == len(tokens)
        assert kv["predicted_cached_tokens"] == kv["cached_tokens"] == got.usage.prompt_tokens_details.cached_tokens
        if turn:
            assert kv["cached_tokens"] >= previous_held > 0, f"turn {turn} reuses the conversation so far"
            assert rank == previous_rank, "the conversation stays where its prefix is"
        message = got.choices[0].message
        if choice == "none":
            assert message.tool_calls is None and message.content
            break
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"sunny, {20 + turn} degrees"}]
        previous_held = (len(tokens) - 1) // bs * bs
        previous_rank = rank


def test_a_json_schema_and_vllms_own_fields_pass_through_as_sent(router, vllm_servers, direct):
    """``response_format`` with a schema and ``min_tokens`` (vLLM's): the router's answer is the engine's own."""
    sdk = sdk_of(router[1])
    body = {"model": vllm_servers[0].model_name, "messages": [{"role": "user", "content": "A JSON object, please."}],
            "max_tokens": 40, "temperature": 0, "min_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
    want = direct.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    got = sdk.chat.completions.create(**{k: v for k, v in body.items() if k != "min_tokens"},
                                      extra_body={"min_tokens": 5})
    assert got.choices[0].message.content == want and want.lstrip().startswith("{")


def test_tool_call_deltas_stream_through_chunk_by_chunk(router, vllm_servers):
    _, client = router
    stream = sdk_of(client).chat.completions.create(
        model=vllm_servers[0].model_name, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS,
        tool_choice=CALL_WEATHER, max_tokens=24, temperature=0, stream=True)
    deltas = [d for chunk in stream for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert len(deltas) > 1 and deltas[0].function.name == "get_weather", "the call arrives in pieces, as sent"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments.lstrip().startswith("{") and json.dumps(arguments)


# --- the Responses API: rendered, routed and relayed as vLLM serves it ---------------------------------------

INSTRUCTIONS = "You answer travel questions in one short sentence, and you never ask anything back. " * 3


def responses_tokens(service: RouterService, model: str, instructions: str | None, items, previous=None) -> list[int]:
    """What the router hashes for a Responses request (``previous``: the stored response it continues)."""
    fields = {"input": items, **({"instructions": instructions} if instructions else {})}
    before = () if previous is None else (previous.messages, previous.output)
    return service.models.encode_chat(input_messages(instructions, items, *before), model, template_fields(fields),
                                      add_special_tokens=True)[1]


def test_a_response_is_hashed_as_the_engine_renders_it_and_a_repeat_is_predicted_as_delivered(router, vllm_servers):
    service, client = router
    sdk, model = sdk_of(client), vllm_servers[0].model_name
    question = "Which city should I visit first, Paris or Lyon?"
    tokens = responses_tokens(service, model, INSTRUCTIONS, question)
    first = sdk.responses.create(model=model, instructions=INSTRUCTIONS, input=question, max_output_tokens=4,
                                 temperature=0)
    kv = first.model_extra["kvledger"]
    assert first.object == "response" and first.output and first.usage.input_tokens == len(tokens), \
        "rendered as the engine renders it: its own count of the prompt"
    rank, bs = kv["rank"], service.feed.index.block_size(kv["rank"])
    held = (len(tokens) - 1) // bs * bs
    wait_indexed(service, rank, tokens, held)
    again = sdk.responses.create(model=model, instructions=INSTRUCTIONS, input=question, max_output_tokens=4,
                                 temperature=0)
    kv = again.model_extra["kvledger"]
    assert kv["rank"] == rank, "the repeat goes where its prefix is"
    assert kv["predicted_cached_tokens"] == kv["cached_tokens"] == again.usage.input_tokens_details.cached_tokens
    assert kv["cached_tokens"] == held > 0
    assert again.output_text == first.output_text, "greedy: the same answer, relayed as the engine made it"


def test_a_streamed_response_relays_the_engines_named_events_and_ends_with_the_kvledger_block(router, vllm_servers):
    _, client = router
    model = vllm_servers[0].model_name
    body = {"model": model, "input": "Name one museum in Paris, please, and nothing else at all.",
            "max_output_tokens": 5, "temperature": 0, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = [b for b in r.read().decode().split("\n\n") if b.strip()]
    events = []
    for b in blocks:
        name, data = b.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert name == f"event: {events[-1]['type']}", "each event named, as vLLM names it"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds
    done = events[-1]["response"]
    assert done["kvledger"]["rank"] in (1000, 1001) and done["kvledger"]["cached_tokens"] == \
        done["usage"]["input_tokens_details"]["cached_tokens"]
    sdk_events = list(sdk_of(client).responses.create(**{k: v for k, v in body.items() if k != "stream"},
                                                      stream=True))
    assert sdk_events[-1].type == "response.completed" and sdk_events[-1].response.output_text, "the SDK reads it"


def test_a_follow_up_goes_to_the_engine_keeping_the_previous_response(router, vllm_servers):
    service, client = router
    sdk, model = sdk_of(client), vllm_servers[0].model_name
    question = "Plan a day in Lyon for me: the old town first, then the river, then dinner somewhere quiet. " * 2
    first = sdk.responses.create(model=model, instructions=INSTRUCTIONS, input=question, max_output_tokens=6,
                                 temperature=0)
    rank = first.model_extra["kvledger"]["rank"]
    stored = service.responses.get(first.id)
    assert stored.rank == rank
    follow = "And what about the evening?"
    tokens = responses_tokens(service, model, None, follow, stored)
    bs = service.feed.index.block_size(rank)
    for turn in range(2):   # the repeat finds the conversation's blocks where they are: predicted as delivered
        second = sdk.responses.create(model=model, previous_response_id=first.id, input=follow,
                                      max_output_tokens=4, temperature=0)
        kv = second.model_extra["kvledger"]
        assert kv["rank"] == rank, "only that engine keeps the previous response"
        assert second.usage.input_tokens == len(tokens), "the whole conversation hashed as the engine renders it"
        if turn:
            assert kv["predicted_cached_tokens"] == kv["cached_tokens"] == (len(tokens) - 1) // bs * bs > 0
        wait_indexed(service, rank, tokens, (len(tokens) - 1) // bs * bs)
    with pytest.raises(openai.NotFoundError) as lost:
        sdk.responses.create(model=model, previous_response_id="resp_never_made", input=follow, max_output_tokens=2)
    assert lost.value.body["param"] == "previous_response_id"


def test_a_function_call_round_trip_through_the_responses_api(router, vllm_servers):
    service, client = router
    sdk, model = sdk_of(client), vllm_servers[0].model_name
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    asked = [{"role": "user", "content": QUESTION}]
    called = sdk.responses.create(model=model, input=asked, tools=tools, max_output_tokens=24, temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"})
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id, called.output
    items = [*asked, calls[0].model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 degrees"}]
    tokens = responses_tokens(service, model, None, items)
    rank = called.model_extra["kvledger"]["rank"]
    bs = service.feed.index.block_size(rank)
    wait_indexed(service, rank, tokens, (called.usage.input_tokens - 1) // bs * bs)
    answered = sdk.responses.create(model=model, input=items, tools=tools, max_output_tokens=8, temperature=0)
    kv = answered.model_extra["kvledger"]
    assert answered.usage.input_tokens == len(tokens), "the call and its output hashed as the engine renders them"
    assert kv["rank"] == rank and kv["predicted_cached_tokens"] == kv["cached_tokens"] > 0
def test_an_agent_session_keeps_its_prefix_cached_turn_over_turn_past_other_traffic(router, vllm_servers):
    """One session (``x-session-id``) over four chat turns, the first three calling a tool (the second streamed),
    other clients' prompts in every tool gap
    and no wait for the index: each turn goes back to the session's engine and is delivered the conversation so
    far from its cache; the router holds the session as waiting on a tool until the last answer is text."""
    service, client = router
    sdk, model = sdk_of(client), vllm_servers[0].model_name
    sid = "vllm-agent-session"
    messages: list[dict] = [{"role": "user", "content": "Sessions. " + QUESTION}]
    before = client.get("/v1/cluster").json()["sessions"]
    rank = held = None
    for turn in range(4):
        args = {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 24, "temperature": 0,
                "tool_choice": "none" if turn == 3 else CALL_WEATHER, "extra_headers": {"x-session-id": sid}}
        if turn == 1:
            chunks = list(sdk.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            kv = chunks[-1].model_extra["kvledger"]
            by_index: dict[int, dict] = {}   # each call's pieces, as they streamed
            for d in (d for c in chunks for ch in c.choices for d in (ch.delta.tool_calls or [])):
                call = by_index.setdefault(d.index, {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                call["id"] = call["id"] or d.id
                call["function"]["name"] += (d.function and d.function.name) or ""
                call["function"]["arguments"] += (d.function and d.function.arguments) or ""
            calls = list(by_index.values())
            finish = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
        else:
            got = sdk.chat.completions.create(**args)
            usage, kv = got.usage, got.model_extra["kvledger"]
            calls = [c.model_dump() for c in got.choices[0].message.tool_calls or []]
            finish = [got.choices[0].finish_reason]
        if turn:
            assert kv["rank"] == rank, f"turn {turn} goes back to its session's engine"
            assert usage.prompt_tokens_details.cached_tokens >= held > 0, f"turn {turn} reuses the conversation"
            assert kv["predicted_cached_tokens"] >= held, \
                f"turn {turn}: the router promised the conversation so far, indexed or not"
        rank = kv["rank"]
        bs = service.feed.index.block_size(rank)
        held = (usage.prompt_tokens - 1) // bs * bs
        session = service.sessions.get(sid)
        assert session is not None and session.rank == rank and session.turns == turn + 1
        if turn == 3:
            assert not session.waiting_on_tool
            break
        assert calls and session.waiting_on_tool, f"turn {turn} waits on its tool ({finish}, as vLLM ends a named call)"
        for i in range(2):   # the tool runs; other clients' prompts come in meanwhile
            complete(client, prompt(200 + 2 * turn + i, 300), model)
        messages += [{"role": "assistant", "content": None, "tool_calls": calls},
                     *({"role": "tool", "tool_call_id": c["id"], "content": f"sunny, {20 + turn} degrees"}
                       for c in calls)]
    after = client.get("/v1/cluster").json()["sessions"]
    assert after["turns"] - before["turns"] == 4 and after["cached_tokens"] > before["cached_tokens"]
    assert after["waiting_on_tool"] == before["waiting_on_tool"]
