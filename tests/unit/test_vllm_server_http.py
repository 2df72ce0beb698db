"""The router's HTTP client of a vLLM server (``router.vllm_server``) against a server that drops a kept-alive
connection as the next request arrives, as uvicorn does with one idle for its keep-alive timeout."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from kvledger.router.openai_types import sse
from kvledger.router.vllm_server import EngineUnreachableError, VllmServer

METRICS = b'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 3.0\n'


class DroppingServer:
    """Answers the first request on each connection with keep-alive, then closes the connection unanswered
    when a second request comes on it; ``drop_all``: closes every connection unanswered."""

    def __init__(self, drop_all: bool = False) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.drop_all = drop_all
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10.0)
            if not self.drop_all and conn.recv(65536):
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(METRICS), METRICS))
            conn.recv(65536)   # the next request on it goes unanswered: the connection closes

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def dropping() -> Iterator[DroppingServer]:
    server = DroppingServer()
    yield server
    server.close()


def test_a_get_on_a_connection_the_server_dropped_is_sent_once_more_on_a_fresh_one(dropping) -> None:
    client = VllmServer(dropping.url, timeout_s=5.0)
    try:
        assert [client.load().running for _ in range(3)] == [3, 3, 3]
        assert dropping.connections == 3, "each drop cost one fresh connection, no error"
    finally:
        client.close()


def test_a_server_that_never_answers_is_unreachable_not_retried_forever() -> None:
    server = DroppingServer(drop_all=True)
    client = VllmServer(server.url, timeout_s=5.0)
    try:
        with pytest.raises(EngineUnreachableError, match="GET /metrics"):
            client.load()
        assert server.connections == 2, "one retry"
        assert client.healthy() is False
    finally:
        client.close()
        server.close()


#: A stream as an engine may write it: spaces after separators, text unescaped, a log-probability only Python's
#: encoder writes (``-Infinity``), an event split over two writes.
STREAMED = [b'{"id": "c1", "choices": [{"index": 0, "text": "caf\xc3\xa9"}]}',
            b'{"id":"c1","choices":[{"index":0,"text":" ok","logprobs":{"token_logprobs":[-Infinity]}}]}',
            b'{"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}']


def serve_stream(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(10.0)
        conn.recv(65536)
        body = b"".join(b"data: " + c + b"\n\n" for c in STREAMED) + b"data: [DONE]\n\n"
        half = len(body) // 2
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for part in (body[:half], body[half:]):
            conn.sendall(b"%x\r\n%s\r\n" % (len(part), part))
        conn.sendall(b"0\r\n\r\n")


def test_a_streamed_chunk_reaches_the_client_as_the_engine_wrote_it() -> None:
    """The router reads each chunk (its usage, a tool call) but relays the engine's bytes, not its own encoding of
    them: ``-Infinity`` survives, which a JSON encoder would have written otherwise or refused."""
    sock = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=lambda: serve_stream(sock.accept()[0]), daemon=True).start()
    client = VllmServer(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_s=5.0)
    try:
        events = list(client.stream({"prompt": "x", "stream": True}))
    finally:
        client.close()
        sock.close()
    assert events[-1] == "[DONE]"
    assert [json.loads(c) for c in STREAMED] == events[:-1]   # read as JSON, NaN and infinities included
    assert b"".join(sse(e) for e in events) == b"".join(b"data: " + c + b"\n\n" for c in STREAMED) + b"data: [DONE]\n\n"
    changed = sse({**events[-2], "kvledger": {"rank": 0}})   # the router's addition to the usage chunk: encoded anew
    assert json.loads(changed.removeprefix(b"data: ")) == {**json.loads(STREAMED[-1]), "kvledger": {"rank": 0}}
