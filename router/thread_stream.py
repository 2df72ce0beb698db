"""A blocking iterator of bytes as an async one, for a streamed answer, with no thread hop per chunk.

Starlette serves a plain iterator by handing each ``next`` to anyio's thread pool
and back: two thread switches per chunk, and no more than 40 streams advancing
at once (anyio's default limiter). An engine's stream is a chunk per token, so
that was most of the router's CPU for a streamed completion (about 170 µs a
chunk on two cores shared with the engine). Here one thread of the app's own
pool drains the iterator for the whole stream and hands chunks to the event
loop through a deque, waking the loop only when it waits; chunks that piled up
meanwhile go out as one write (SSE events concatenate).

The producer stops, closing the iterator on its own thread (its ``finally``
gives the admission slot back), once the consumer is gone: at its next chunk,
or at once where it waits for room (``max_pending`` chunks unsent).
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor

#: Chunks a stream may hold unsent before its producer waits for the client (a slow reader holds the engine back
#: rather than the router's memory).
MAX_PENDING = 1024


class _Failed:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class ThreadedStream:
    """``chunks`` drained on a thread of ``executor``, iterated with ``async for`` once (see the module
    docstring)."""

    def __init__(self, chunks: Iterator[bytes], executor: Executor, max_pending: int = MAX_PENDING) -> None:
        self._chunks, self._executor, self._max = chunks, executor, max_pending
        self._items: deque = deque()
        self._lock = threading.Lock()   # a C lock on the per-chunk path: the condition's is Python-level
        self._room = threading.Condition(threading.Lock())   # the producer's wait at ``max_pending``
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped = False

    def _push(self, item: object) -> None:
        with self._lock:
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

    def _produce(self) -> None:
        chunks = self._chunks
        try:
            for chunk in chunks:
                if len(self._items) >= self._max:
                    with self._room:
                        while len(self._items) >= self._max and not self._stopped:
                            self._room.wait()
                if self._stopped:
                    break
                self._push(chunk)
        except BaseException as e:  # handed to the consumer, raised there
            self._push(_Failed(e))
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            self._push(_END)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        self._loop = loop = asyncio.get_running_loop()
        loop.run_in_executor(self._executor, self._produce)
        try:
            while True:
                with self._lock:
                    taken = list(self._items)
                    self._items.clear()
                    if not taken:
                        self._waiter = waiter = loop.create_future()
                if not taken:
                    await waiter
                    continue
                if len(taken) >= self._max:
                    with self._room:
                        self._room.notify()
                out = []
                for item in taken:
                    if item is _END or isinstance(item, _Failed):
                        break
                    out.append(item)
                if out:   # what came before an end or a failure reaches the client first
                    yield b"".join(out)
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
        finally:
            with self._room:
                self._stopped = True
                self._room.notify()
