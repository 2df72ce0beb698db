"""Keep-alive HTTP/1.1 connections to one server, for the router's hot path: a completion per request.

A request is one ``sendall`` of its bytes; its answer is read off the socket
by ``httptools``' C parser (the one uvicorn serves with). Measured per
one-token completion's answer (JSON in and out included): about 410 µs of the
router's CPU through an ``httpx.Client``, 80 µs through ``http.client`` (whose
header parsing is the ``email`` package), 23 µs here; the router pays it on
the machine its engine runs on. Threads share the pool: each takes an idle connection (or opens
one), and gives it back once the answer is read whole. A connection the server
closed while it sat idle fails before the server read anything from it; that
request goes once more on a new connection. A server that cannot be reached,
or that breaks the protocol, raises ``ConnectionError``; one that does not
answer in time, ``TimeoutError``.
"""
from __future__ import annotations

import socket
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import httptools

_READ = 65536


class _Connection:
    """One socket and the answer being parsed off it (``httptools`` calls the ``on_*`` methods)."""

    __slots__ = ("_parser", "chunks", "done", "keep_alive", "sock", "status")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.keep_alive = False

    def send(self, data: bytes) -> None:
        self.status, self.chunks, self.done = 0, deque(), False
        self._parser = httptools.HttpResponseParser(self)
        self.sock.sendall(data)

    def receive(self) -> bool:
        """Parse what the socket has; ``False`` when the server closed it."""
        data = self.sock.recv(_READ)
        if not data:
            return False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            raise ConnectionError(f"malformed HTTP answer: {e}") from e
        return True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()

    def on_body(self, data: bytes) -> None:
        self.chunks.append(data)

    def on_message_complete(self) -> None:
        self.done, self.keep_alive = True, self._parser.should_keep_alive()


class Answer:
    """A response whose status is in; its body (de-chunked) comes as it arrives."""

    __slots__ = ("_conn",)

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn

    @property
    def status(self) -> int:
        return self._conn.status

    def chunks(self) -> Iterator[bytes]:
        c = self._conn
        while True:
            while c.chunks:
                yield c.chunks.popleft()
            if c.done:
                return
            if not c.receive():
                raise ConnectionError("the server closed the connection mid-answer")

    def read(self) -> bytes:
        return b"".join(self.chunks())


class HttpPool:
    """See the module docstring. ``headers`` go with every request."""

    def __init__(self, host: str, port: int, connect_timeout_s: float, read_timeout_s: float,
                 headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self._connect_s, self._read_s = connect_timeout_s, read_timeout_s
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {host}:{port}\r\nContent-Type: application/json\r\n{extra}Content-Length: "
        self._idle: deque[_Connection] = deque()   # append and pop are atomic: no lock

    def _connect(self) -> _Connection:
        sock = socket.create_connection((self.host, self.port), timeout=self._connect_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self._read_s)
        return _Connection(sock)

    def _started(self, conn: _Connection, data: bytes) -> bool:
        """Send ``data`` and wait for the answer's status; ``False`` when the server closed the connection
        before answering anything."""
        try:
            conn.send(data)
            while not conn.status and not conn.done:
                if not conn.receive():
                    return False
        except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            return False
        return True

    @contextmanager
    def post(self, path: str, body: bytes) -> Iterator[Answer]:
        """``POST path`` with the JSON ``body``: the answer, its status in, to be read within the block."""
        data = f"POST {path} HTTP/1.1\r\n{self._head}{len(body)}\r\n\r\n".encode() + body
        try:
            conn, reused = self._idle.pop(), True
        except IndexError:
            conn, reused = self._connect(), False
        try:
            if not self._started(conn, data):
                conn.sock.close()
                if not reused:
                    raise ConnectionError(f"{self.host}:{self.port} closed the connection without answering")
                conn = self._connect()   # it had closed the idle connection: once more, on a new one
                if not self._started(conn, data):
                    raise ConnectionError(f"{self.host}:{self.port} closed the connection without answering")
            yield Answer(conn)
        except BaseException:
            conn.sock.close()
            raise
        if conn.done and conn.keep_alive:
            self._idle.append(conn)
        else:
            conn.sock.close()   # the server ends it, or the caller left the answer unread

    def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``POST path`` with the JSON ``body``: the status and the body, read whole."""
        with self.post(path, body) as answer:
            return answer.status, answer.read()

    def close(self) -> None:
        while self._idle:
            self._idle.pop().sock.close()
