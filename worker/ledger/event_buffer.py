"""Bounded buffer of block events, drained oldest first."""
from __future__ import annotations

from collections import deque

from kvledger.worker.wire.events import KVEvent


class EventBuffer:
    """Keeps the newest ``capacity`` events; counts what overflow dropped so a publisher can resync."""

    __slots__ = ("_events", "dropped")

    def __init__(self, capacity: int) -> None:
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self.dropped = 0

    def put(self, event: KVEvent) -> None:
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(event)

    def put_n(self, events: list[KVEvent]) -> None:
        """``put`` each event in order."""
        over = len(self._events) + len(events) - self._events.maxlen
        if over > 0:
            self.dropped += over
        self._events.extend(events)

    def take(self) -> list[KVEvent]:
        out = list(self._events)
        self._events.clear()
        return out

    def __len__(self) -> int:
        return len(self._events)
