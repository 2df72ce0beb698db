"""The router's HTTP client of a vLLM server (``router.vllm_server``) against a server that drops a kept-alive
connection as the next request arrives, as uvicorn does with one idle for its keep-alive timeout."""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

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
