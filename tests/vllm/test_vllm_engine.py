"""Two real vLLM engines (block sizes 32 and 64; one publisher binds, one connects): what the router relies on.

Their HTTP API (token-id completions, delivered ``cached_tokens``, ``/v1/models``, ``/metrics``, ``/tokenize``,
``/reset_prefix_cache``) and their ZMQ KV events, decoded by kvledger's codec, live and replayed. The servers are
the session's (``vllm_servers``): every prompt starts with a token no other prompt sent to them starts with, so
no test finds another's cached blocks.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import zmq
from vllm_engines import START_TIMEOUT_S, TOPIC, VllmServer, encode_like_engine

from kvledger.worker.wire.events import AllBlocksCleared, BlockStored, EventBatch, decode_batch

# Set-up starts both engines (minutes on 2 cores), and pytest-timeout counts set-up.
pytestmark = pytest.mark.timeout(int(START_TIMEOUT_S) + 300)

#: vLLM's replay answer ends with this sequence number (signed -1), and empty topic and payload.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLL_MS = 5000
ATTEMPTS = 6
BIND_ATTEMPTS = 50


@pytest.fixture(scope="module", params=[0, 1], ids=["b32-bind", "b64-connect"])
def engine(request: pytest.FixtureRequest, vllm_servers: list[VllmServer]) -> VllmServer:
    return vllm_servers[request.param]


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0) as c:
        yield c


def prompt(first: int, n: int) -> list[int]:
    """``n`` token ids starting with ``first`` (a test's own), all inside the tiny vocabulary."""
    return [first, *(3 + (first * 31 + i * 7) % 256 for i in range(n - 1))]


def complete(client: httpx.Client, engine: VllmServer, tokens: list[int]) -> dict:
    r = client.post(f"{engine.url}/v1/completions",
                    json={"model": engine.model_name, "prompt": tokens, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_token_id_completion_and_its_repeat_hits_the_cache(engine: VllmServer, client: httpx.Client) -> None:
    tokens = prompt(10 + engine.block_size, 5 * engine.block_size // 2)   # 2 full blocks and a half
    first = complete(client, engine, tokens)
    assert first["usage"]["prompt_tokens"] == len(tokens)
    assert cached(first) == 0
    assert first["choices"][0]["finish_reason"] == "length"
    # vLLM always recomputes the last prompt token: every full block but a last one ending the prompt.
    assert cached(complete(client, engine, tokens)) == 2 * engine.block_size


def test_models_names_the_checkpoint_path(engine: VllmServer, client: httpx.Client) -> None:
    (model,) = client.get(f"{engine.url}/v1/models").json()["data"]
    assert model["id"] == model["root"] == str(engine.model)
    assert model["max_model_len"] == 2048


def test_metrics_report_block_size_and_load(engine: VllmServer, client: httpx.Client) -> None:
    text = client.get(f"{engine.url}/metrics").text
    info = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and f'block_size="{engine.block_size}"' in info[0], info
    for gauge in ("vllm:num_requests_waiting{", "vllm:num_requests_running{", "vllm:kv_cache_usage_perc{"):
        assert any(line.startswith(gauge) for line in text.splitlines()), gauge


def test_tokenize_is_the_checkpoints_tokenizer(engine: VllmServer, client: httpx.Client) -> None:
    r = client.post(f"{engine.url}/tokenize", json={"model": engine.model_name, "prompt": "héllo"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == encode_like_engine("héllo")


def test_kv_event_sources_name_the_publisher(engine: VllmServer, client: httpx.Client) -> None:
    sources = client.get(f"{engine.url}/kv_event_sources").json()
    assert sources["0"]["endpoint"] == engine.events_endpoint
    assert sources["0"]["replay_endpoint"] == engine.replay_endpoint
    assert sources["0"]["topic"] == TOPIC


def subscriber(engine: VllmServer) -> zmq.Socket:
    """A SUB on the engine's events: connected to its PUB, or bound where its PUB connects."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    if engine.publisher_connects:
        bind_when_free(sub, engine.events_endpoint)
    else:
        sub.connect(engine.events_endpoint)
    return sub


def bind_when_free(sock: zmq.Socket, endpoint: str) -> None:
    """Bind ``endpoint``, waiting a bounded while for the previous test's socket to let go of it.

    ZMQ closes a socket on its I/O thread, after ``close`` returns, so a bind right after may find the port
    still held.
    """
    for _ in range(BIND_ATTEMPTS - 1):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.1)
    sock.bind(endpoint)


def stored_batch(client: httpx.Client, engine: VllmServer, sub: zmq.Socket, first: int) -> tuple[int, EventBatch]:
    """Send fresh prompts until the batch storing the last one sent arrives on ``sub``; older batches are skipped.

    A bound PUB drops what it publishes before the subscription reaches it, so the first prompt's batch may
    never come; a connecting PUB keeps its pipe (and the subscription on it) across subscribers, so batches
    published while nobody was bound arrive first.
    """
    for attempt in range(ATTEMPTS):
        tokens = prompt(first + attempt, 2 * engine.block_size + 1)
        complete(client, engine, tokens)
        while sub.poll(POLL_MS):
            topic, seq, payload = sub.recv_multipart()
            assert topic == TOPIC.encode()
            batch = decode_batch(payload)
            if any(isinstance(e, BlockStored) and e.token_ids[0] == tokens[0] for e in batch.events):
                return int.from_bytes(seq, "big"), batch
    pytest.fail(f"no BlockStored of the prompts sent came from {engine.events_endpoint} ({ATTEMPTS} tries)")


def test_events_decode_with_kvledgers_codec(engine: VllmServer, client: httpx.Client) -> None:
    sub = subscriber(engine)
    try:
        _, batch = stored_batch(client, engine, sub, 100 + engine.block_size)
    finally:
        sub.close()
    assert batch.rank == 0
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert all(e.block_size == engine.block_size and len(e.token_ids) == engine.block_size * len(e.block_hashes)
               for e in stored), stored


def test_replay_resends_from_a_sequence_number(engine: VllmServer, client: httpx.Client) -> None:
    sub = subscriber(engine)
    try:
        seq, live = stored_batch(client, engine, sub, 150 + engine.block_size)
    finally:
        sub.close()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(engine.replay_endpoint)
    try:
        dealer.send_multipart([b"", seq.to_bytes(8, "big")])
        replies = []
        for _ in range(10_000):   # vLLM's replay buffer holds at most 10 000 batches
            assert dealer.poll(POLL_MS), f"replay from {engine.replay_endpoint} stopped after {len(replies)}"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                assert frames == [b"", b"", END_SEQ, b""]
                break
            replies.append(frames)
    finally:
        dealer.close()
    empty, topic, first_seq, payload = replies[0]
    assert (empty, topic, int.from_bytes(first_seq, "big")) == (b"", TOPIC.encode(), seq)
    assert decode_batch(payload) == live


def test_reset_prefix_cache_forgets_and_announces_it(engine: VllmServer, client: httpx.Client) -> None:
    tokens = prompt(232 + engine.block_size, 2 * engine.block_size + 1)
    complete(client, engine, tokens)
    assert cached(complete(client, engine, tokens)) > 0
    sub = subscriber(engine)
    try:
        stored_batch(client, engine, sub, 200 + engine.block_size)   # the subscription is live from here on
        r = client.post(f"{engine.url}/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"success": True}, r.text
        assert cached(complete(client, engine, tokens)) == 0
        # The AllBlocksCleared goes out with the engine's next step (this completion's), not at the reset.
        assert sub.poll(POLL_MS), "no batch after the reset"
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close()
    batch = decode_batch(payload)
    assert isinstance(batch.events[0], AllBlocksCleared), batch
    assert [e.token_ids for e in batch.events[1:]] == [tokens[:len(tokens) - 1]], batch
