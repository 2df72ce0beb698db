"""An agent through the router to a real vLLM server, with the official ``openai`` SDK: tool calls and their
results over three turns, a JSON schema, and streamed tool-call deltas, each passed through exactly (every field
as the client sent it; the answer as the engine gave it), and each turn hashed as the engine renders it.

One server is started for the module with tool calling on (``--enable-auto-tool-choice --tool-call-parser
pythonic``); the router runs in this process in front of it.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from router_helpers import wait_indexed
from vllm_engines import START_TIMEOUT_S, EngineSpec, VllmServer, start_engines

from kvledger.router.config import RouterConfig
from kvledger.router.http import HttpServer, make_app
from kvledger.router.service import RouterService

pytestmark = pytest.mark.timeout(int(START_TIMEOUT_S) + 300)   # set-up starts the engine

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
QUESTION = "Before we plan the trip, tell me what the weather is like in Paris today. " * 4


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory) -> VllmServer:
    (server,) = start_engines(request, tmp_path_factory, [EngineSpec(
        block_size=32, args=("--enable-auto-tool-choice", "--tool-call-parser", "pythonic"))])
    return server


@pytest.fixture(scope="module")
def router(engine: VllmServer) -> Iterator[tuple[RouterService, openai.OpenAI, httpx.Client]]:
    service = RouterService(None, RouterConfig(tokens_per_block=32, vllm=(engine.url,), policy="kv"))
    service.feed.sync()
    server = HttpServer(make_app(service), port=0).start()
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
    with httpx.Client(base_url=engine.url, timeout=120) as direct:
        yield service, sdk, direct
    server.stop()
    service.close()


def engine_tokens(direct: httpx.Client, model: str, messages: list[dict], tools: list[dict]) -> list[int]:
    """The prompt's token ids as the engine renders the chat (its ``/tokenize``)."""
    r = direct.post("/tokenize", json={"model": model, "messages": messages, "tools": tools,
                                       "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_a_tool_call_and_its_result_over_three_turns_hash_as_the_engine_renders_them(router, engine):
    service, sdk, direct = router
    model = engine.model_name
    rank = service.engines.live()[0]
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    previous_held = 0   # the full blocks of the turn before
    for turn, choice in enumerate([CALL_WEATHER, CALL_WEATHER, "none"]):
        _, tokens = service.models.encode_chat(messages, model, {"tools": TOOLS})
        assert tokens == engine_tokens(direct, model, messages, TOOLS), f"turn {turn}: hashed as the engine renders"
        if turn:
            wait_indexed(service, rank, tokens, previous_held)
        got = sdk.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice=choice,
                                          max_tokens=24, temperature=0)
        kv = got.model_extra["kvledger"]
        assert got.usage.prompt_tokens == len(tokens)
        assert kv["predicted_cached_tokens"] == kv["cached_tokens"] == got.usage.prompt_tokens_details.cached_tokens
        if turn:
            assert kv["cached_tokens"] >= previous_held > 0, f"turn {turn} reuses the conversation so far"
        message = got.choices[0].message
        if choice == "none":
            assert message.tool_calls is None and message.content
            break
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": f"sunny, {20 + turn} degrees"}]
        previous_held = (len(tokens) - 1) // 32 * 32


def test_a_json_schema_and_vllms_own_fields_pass_through_as_sent(router, engine):
    """``response_format`` with a schema and ``min_tokens`` (vLLM's): the router's answer is the engine's own."""
    _, sdk, direct = router
    body = {"model": engine.model_name, "messages": [{"role": "user", "content": "A JSON object, please."}],
            "max_tokens": 40, "temperature": 0, "min_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
    want = direct.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    got = sdk.chat.completions.create(**{k: v for k, v in body.items() if k != "min_tokens"},
                                      extra_body={"min_tokens": 5})
    assert got.choices[0].message.content == want and want.lstrip().startswith("{")


def test_tool_call_deltas_stream_through_chunk_by_chunk(router, engine):
    _, sdk, _ = router
    stream = sdk.chat.completions.create(model=engine.model_name, messages=[{"role": "user", "content": QUESTION}],
                                         tools=TOOLS, tool_choice=CALL_WEATHER, max_tokens=24, temperature=0,
                                         stream=True)
    deltas = [d for chunk in stream for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert len(deltas) > 1 and deltas[0].function.name == "get_weather", "the call arrives in pieces, as sent"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments.lstrip().startswith("{") and json.dumps(arguments)
