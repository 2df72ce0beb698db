"""The router's bounded log of decoded events, for monitors: numbered records, read from any point, waited on.

Each record gets the next id, router-wide; a reader asks for the records from
an id on (optionally one rank's) and gets the id to ask from next, so a
follower never misses or repeats one while the log still holds it. The oldest
records fall off when the log is full. A batch is logged whole, in one entry,
and its records are made when someone reads them: the event route pays one
append per batch. An own rank's batch is kept as its wire bytes (a reader
decodes what it reads), so the route holds on to nothing it decoded.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvledger.worker.wire.events import KVEvent, decode_batch


@dataclass(frozen=True, slots=True)
class EventRecord:
    """One decoded event as monitors see it; ``id`` increases by one per record, router-wide."""

    id: int
    rank: int
    seq: int
    """The rank's batch number (-1 for the record of a snapshot or a removal)."""
    ts: float
    event: dict

    def to_dict(self) -> dict:
        return {"id": self.id, "rank": self.rank, "seq": self.seq, "ts": self.ts, **self.event}


_EVENT_FIELDS: dict[type, tuple[str, ...]] = {}


@dataclass(slots=True)
class _Entry:
    """One logged batch of ``n`` records from id ``first``: its events (or ready dicts), or its wire bytes."""

    first: int
    rank: int
    seq: int
    ts: float
    events: list | bytes
    n: int

    def records(self, skip: int) -> list[EventRecord]:
        events = decode_batch(self.events).events if type(self.events) is bytes else self.events
        return [EventRecord(i, self.rank, self.seq, self.ts, event_to_dict(ev))
                for i, ev in enumerate(events[skip:], self.first + skip)]


def event_to_dict(ev: KVEvent | dict) -> dict:
    """An event as JSON-ready fields, ``type`` first (the class name, as on the wire); a dict is taken as it is."""
    if type(ev) is dict:
        return ev
    t = type(ev)
    names = _EVENT_FIELDS.get(t)
    if names is None:
        names = _EVENT_FIELDS[t] = tuple(f.name for f in dataclasses.fields(t))
    out: dict = {"type": t.__name__}
    for n in names:
        out[n] = getattr(ev, n)
    return out


class EventLog:
    """The last ``size`` records (see the module docstring); thread-safe."""

    def __init__(self, size: int) -> None:
        if type(size) is not int or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self._size = size
        self._log: deque[_Entry] = deque()
        self._held = 0   # records in ``_log``, the oldest of which may be past ``size`` (not read)
        self._next_id = 0
        self._changed = threading.Condition()

    @property
    def next_id(self) -> int:
        """The id the next record will get (= records logged so far)."""
        return self._next_id

    def append(self, rank: int, seq: int, ts: float, events: list[KVEvent | dict]) -> None:
        """Log one batch's events (``event_to_dict`` takes each when it is read)."""
        self._add(rank, seq, ts, events, len(events))

    def append_wire(self, rank: int, seq: int, ts: float, data: bytes, n: int) -> None:
        """Log a batch of ``n`` events by its wire bytes (``decode_batch`` reads them when they are read)."""
        self._add(rank, seq, ts, data, n)

    def _add(self, rank: int, seq: int, ts: float, events: list | bytes, n: int) -> None:
        if not n:
            return
        with self._changed:
            log = self._log
            log.append(_Entry(self._next_id, rank, seq, ts, events, n))
            self._next_id += n
            self._held += n
            while self._held - log[0].n >= self._size:
                self._held -= log.popleft().n
            self._changed.notify_all()

    def read(self, since: int = 0, rank: int | None = None, limit: int = 1000) -> tuple[list[EventRecord], int]:
        """Records with ``id >= since`` (of ``rank`` only, if given), at most ``limit``; and the id to ask from
        next. Records older than the log's size are gone: the first one returned says where it starts."""
        if type(since) is not int or since < 0:
            raise ValueError(f"since must be an int >= 0, got {since!r}")
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be an int >= 1, got {limit!r}")
        with self._changed:
            return self._since(since, rank, limit)

    def wait(self, since: int, rank: int | None = None, limit: int = 1000,
             timeout: float = 1.0) -> tuple[list[EventRecord], int]:
        """Like ``read``, but waits up to ``timeout`` seconds for at least one record to arrive."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                out, nxt = self._since(since, rank, limit)
                left = deadline - time.monotonic()
                if out or left <= 0:
                    return out, nxt
                self._changed.wait(left)
                since = nxt

    def _since(self, since: int, rank: int | None, limit: int) -> tuple[list[EventRecord], int]:
        log = self._log
        if since >= self._next_id or not log:
            return [], since
        start = max(since, self._next_id - self._size)   # the oldest record still held
        back = 0   # entries after the one holding ``start``, counted from the end: followers read near it
        for entry in reversed(log):
            if entry.first <= start:
                break
            back += 1
        out: list[EventRecord] = []
        nxt = since
        for entry in itertools.islice(log, max(0, len(log) - 1 - back), None):
            if rank is not None and entry.rank != rank:
                nxt = entry.first + entry.n
                continue
            recs = entry.records(max(0, start - entry.first))[:limit - len(out)]
            out += recs
            nxt = recs[-1].id + 1
            if len(out) >= limit:
                break
        return out, nxt
