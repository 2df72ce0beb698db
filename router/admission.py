"""The router's bounded admission: at most so many completions on the ranks at once, a bounded queue before them.

A completion holds a slot from its routing decision to its answer; one that
finds every slot taken waits in a first-come-first-served queue (each waiter
its own event, woken in arrival order), and one that finds the queue full, or
waits longer than ``queue_timeout_s``, is refused with ``AdmissionRefused``
(the HTTP API answers 429 with ``Retry-After``) without anything having been
sent. A streamed answer holds its slot until its stream ends. The slots keep
the ranks' own queues short, so routing decides with fresh loads; the queue
absorbs a burst without holding a thread per request on a rank.
"""
from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class AdmissionRefused(RuntimeError):
    """No slot and no room in the queue (or no slot within the queue's timeout): the request was not taken."""


class Held:
    """One taken slot, given back exactly once: by ``release``, or when dropped unreleased. A streamed answer
    releases its slot when its stream ends, but a stream whose client left before it started never runs, so
    nothing but its being dropped gives the slot back."""

    __slots__ = ("_leave", "_once")

    def __init__(self, leave: Callable[[], None]) -> None:
        self._leave = leave
        self._once = threading.Lock()

    def release(self) -> None:
        if self._once.acquire(blocking=False):
            self._leave()

    __del__ = release


class AdmissionGate:
    """See the module docstring; thread-safe."""

    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_inflight, self.max_queued, self.queue_timeout_s = max_inflight, max_queued, queue_timeout_s
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._queue: collections.deque[threading.Event] = collections.deque()
        self.refused = 0

    def hold(self) -> Held:
        """Take a slot (waiting in the queue for one first if need be); it is the caller's until released."""
        self._enter()
        return Held(self._leave)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Hold a slot for the duration of the block."""
        held = self.hold()
        try:
            yield
        finally:
            held.release()

    def counts(self) -> tuple[int, int]:
        """Completions holding a slot, completions queued."""
        with self._lock:
            return self._inflight, len(self._queue)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no completion holds or waits for a slot (a router draining; a caller that must know a stream
        ended on the server's thread); ``False`` if that takes longer than ``timeout_s``."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0 and not self._queue, timeout_s)

    def _enter(self) -> None:
        with self._lock:
            if self._inflight < self.max_inflight and not self._queue:
                self._inflight += 1
                return
            if len(self._queue) >= self.max_queued:
                self.refused += 1
                raise AdmissionRefused(f"the router is full: {self._inflight} completions running and "
                                       f"{len(self._queue)} queued (max_queued_completions={self.max_queued})")
            turn = threading.Event()
            self._queue.append(turn)
        if turn.wait(self.queue_timeout_s):
            return   # ``_leave`` handed its slot over
        with self._lock:
            if turn.is_set():   # handed over just as the wait ended
                return
            self._queue.remove(turn)
            self.refused += 1
        raise AdmissionRefused(f"no slot within {self.queue_timeout_s:g} s: {self.max_inflight} completions running")

    def _leave(self) -> None:
        with self._lock:
            if self._queue:
                self._queue.popleft().set()   # the slot passes to the first in line
            else:
                self._inflight -= 1
                self._idle.notify_all()
