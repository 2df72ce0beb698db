"""The router's keep-alive connections to a vLLM server (``router.http_pool``), against a plain HTTP/1.1 server on
127.0.0.1: answers whole and chunked, a connection kept between requests, one the server closed while idle
replaced without losing the request, and a server that is not there."""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kvledger.router.http_pool import HttpPool


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen.append((self.path, body, self.client_address[1], self.headers.get("X-Rank")))
        if self.path == "/chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
            return
        answer = b'{"echo": ' + body + b"}"
        self.send_response(404 if self.path == "/missing" else 200)
        self.send_header("Content-Length", str(len(answer)))
        if self.path == "/close":
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(answer)
        if self.path in ("/close", "/drop"):   # /drop: closed while the client thinks it kept alive
            self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen = []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _pool(srv: ThreadingHTTPServer) -> HttpPool:
    return HttpPool("127.0.0.1", srv.server_address[1], 5.0, 5.0, {"X-Rank": "1"})


def test_answers_come_whole_and_one_connection_serves_request_after_request(server) -> None:
    pool = _pool(server)
    assert pool.post_json("/v1/completions", b'{"a":1}') == (200, b'{"echo": {"a":1}}')
    assert pool.post_json("/missing", b"[]") == (404, b'{"echo": []}'), "a refusal is an answer, status and all"
    ports = {port for _, _, port, _ in server.seen}
    assert len(ports) == 1 and {rank for *_, rank in server.seen} == {"1"}, "kept alive, headers on every request"
    pool.close()


def test_a_chunked_answer_comes_piece_by_piece_and_the_connection_is_kept(server) -> None:
    pool = _pool(server)
    with pool.post("/chunked", b"{}") as answer:
        assert answer.status == 200 and answer.read() == b"data: 1\n\ndata: [DONE]\n\n"
    pool.post_json("/v1/completions", b"1")
    assert len({port for _, _, port, _ in server.seen}) == 1
    pool.close()


def test_a_connection_the_server_ends_is_not_reused(server) -> None:
    pool = _pool(server)
    assert pool.post_json("/close", b"2")[0] == 200
    assert pool.post_json("/v1/completions", b"3")[0] == 200
    assert len({port for _, _, port, _ in server.seen}) == 2
    pool.close()


def test_an_idle_connection_the_server_closed_is_replaced_and_the_request_sent_once(server) -> None:
    pool = _pool(server)
    pool.post_json("/drop", b"4")
    assert len(pool._idle) == 1, "the answer said keep-alive"
    assert pool.post_json("/v1/completions", b"5") == (200, b'{"echo": 5}')
    assert [body for _, body, _, _ in server.seen] == [b"4", b"5"], "sent once more, served once"
    assert len({port for _, _, port, _ in server.seen}) == 2
    pool.close()


def test_a_server_that_is_not_there_is_a_connection_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, not listening: connections are refused
        with pytest.raises(ConnectionError):
            HttpPool("127.0.0.1", port, 1.0, 1.0).post_json("/v1/completions", b"{}")
