"""A streamed answer's chunks, drained on a thread and served on the event loop (``router.thread_stream``): every
chunk in order, the engine's stream closed however the client's ends, and more streams at once than anyio's pool."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvledger.router.thread_stream import ThreadedStream

TIMEOUT_S = 10.0


class Engine:
    """A blocking stream of chunks as the service hands one over: it records whether it was closed (its ``finally``
    gives the admission slot back) and can hold a chunk until released."""

    def __init__(self, chunks: list[bytes], fail_at: int | None = None, gate: threading.Event | None = None) -> None:
        self.chunks, self.fail_at, self.gate = chunks, fail_at, gate
        self.closed = threading.Event()
        self.sent = 0

    def __iter__(self):
        try:
            for i, c in enumerate(self.chunks):
                if i == self.fail_at:
                    raise ConnectionError("the engine went away mid-stream")
                if self.gate is not None:
                    assert self.gate.wait(TIMEOUT_S), "the test never let the chunk go"
                self.sent += 1
                yield c
        finally:
            self.closed.set()


def drain(stream: ThreadedStream, limit: int | None = None) -> list[bytes]:
    async def run() -> list[bytes]:
        out = []
        it = stream.__aiter__()
        try:
            async for piece in it:
                out.append(piece)
                if limit is not None and len(out) >= limit:
                    break
        finally:
            await it.aclose()
        return out
    return asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(64) as p:
        yield p


def test_every_chunk_arrives_in_order_and_the_stream_is_closed_at_its_end(pool):
    chunks = [f"data: {i}\n\n".encode() for i in range(500)]
    engine = Engine(chunks)
    got = drain(ThreadedStream(iter(engine), pool))
    assert b"".join(got) == b"".join(chunks)   # chunks that piled up go out together, none lost or reordered
    assert all(got)
    assert engine.closed.wait(TIMEOUT_S)


def test_an_engine_failure_reaches_the_client_after_what_came_before(pool):
    engine = Engine([b"a", b"b", b"c"], fail_at=2)
    got: list[bytes] = []

    async def run() -> None:
        async for piece in ThreadedStream(iter(engine), pool):
            got.append(piece)
    with pytest.raises(ConnectionError, match="mid-stream"):
        asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert b"".join(got) == b"ab"
    assert engine.closed.wait(TIMEOUT_S)


def test_a_client_that_leaves_closes_the_engines_stream_at_its_next_chunk(pool):
    gate = threading.Event()
    engine = Engine([b"x"] * 100, gate=gate)
    gate.set()
    got = drain(ThreadedStream(iter(engine), pool, max_pending=4), limit=1)
    assert got and engine.closed.wait(TIMEOUT_S)
    assert engine.sent < 100   # it stopped: the producer was waiting for room, or saw the consumer gone


def test_a_slow_client_holds_the_engine_back_at_max_pending(pool):
    engine = Engine([b"y"] * 50)

    async def run() -> tuple[int, int]:
        stream = ThreadedStream(iter(engine), pool, max_pending=8)
        it = stream.__aiter__()
        first = await it.__anext__()
        for _ in range(100):   # bounded: the producer fills what it may, then waits
            await asyncio.sleep(0.01)
        held = engine.sent
        rest = b"".join([piece async for piece in it])
        assert first + rest == b"y" * 50
        return len(first), held
    taken, held = asyncio.run(asyncio.wait_for(run(), TIMEOUT_S))
    assert held <= taken + 8 + 1   # what was taken, the pending bound, and the chunk waiting for room
    assert engine.closed.wait(TIMEOUT_S)


def test_more_streams_advance_at_once_than_anyios_forty_threads(pool):
    """Each engine sends its first chunk only once all 48 streams are under way: a per-chunk hop to a pool of 40
    would leave 8 waiting for a thread forever."""
    together = threading.Barrier(48, timeout=TIMEOUT_S)

    def engine(i: int):
        together.wait()
        yield f"{i}".encode()

    async def run() -> list[bytes]:
        async def one(i: int) -> bytes:
            return b"".join([piece async for piece in ThreadedStream(engine(i), pool)])
        return await asyncio.gather(*(one(i) for i in range(48)))
    assert asyncio.run(asyncio.wait_for(run(), TIMEOUT_S)) == [f"{i}".encode() for i in range(48)]
