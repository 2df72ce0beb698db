"""Subscribe to a real vLLM engine's KV events over ZMQ and index them under a rank of their own.

vLLM's ``ZmqEventPublisher`` sends ``(topic, seq: 8-byte big-endian, payload)``
on a PUB socket, and answers replays on a ROUTER socket: a DEALER sends
``("", start_seq)`` and reads ``("", topic, seq, payload)`` frames until the
8-byte all-ones end marker. Payloads are msgpack batches that
``kvledger.worker.wire.events.decode_batch`` reads (map or array layout); ``ForeignFeed``
re-hashes their blocks so probes see them as ours.

A vLLM engine keeps no snapshot: when a replay cannot reach back, the rank is
reset empty at the current number and fills again as the engine stores blocks.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import zmq

from kvledger.router.foreign import ForeignFeed
from kvledger.router.index import ApplyStatus
from kvledger.worker.wire.events import EventBatch, EventDecodeError, decode_batch

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8


@dataclass(slots=True)
class SubscriberStats:
    batches_applied: int = 0
    batches_replayed: int = 0
    batches_malformed: int = 0
    resets: int = 0


class VllmEventSubscriber:
    """Feeds one vLLM engine's events into the router's index (see the module docstring).

    ``lock`` guards the index, which the router's other threads read; the ZMQ
    sockets belong to the thread that calls ``poll_once`` (or ``run``).
    """

    def __init__(self, feed: ForeignFeed, rank: int, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", lock: threading.Lock | None = None, replay_timeout_ms: int = 2000) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"endpoint must be a ZMQ address like tcp://host:port, got {endpoint!r}")
        self.feed, self.rank, self.endpoint = feed, rank, endpoint
        self.replay_endpoint = replay_endpoint
        self.lock = lock or threading.Lock()
        self.replay_timeout_ms = replay_timeout_ms
        self.stats = SubscriberStats()
        self._ctx = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._stop = threading.Event()

    def close(self) -> None:
        self._stop.set()
        self._sub.close(linger=0)

    def run(self, poll_ms: int = 100) -> None:
        """Apply batches until ``stop`` (call from a thread of its own)."""
        while not self._stop.is_set():
            self.poll_once(poll_ms)

    def stop(self) -> None:
        self._stop.set()

    def poll_once(self, timeout_ms: int) -> bool:
        """Apply at most one published batch; whether one arrived within ``timeout_ms``."""
        if not self._sub.poll(timeout_ms):
            return False
        frames = self._sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.batches_malformed += 1
            logger.warning("vLLM events from %s: unexpected frames %d", self.endpoint, len(frames))
            return True
        self._handle(int.from_bytes(frames[1], "big"), frames[2])
        return True

    def _decode(self, seq: int, payload: bytes) -> EventBatch | None:
        """The batch under our rank number (vLLM's own is its data-parallel rank); ``None`` if malformed."""
        try:
            batch = decode_batch(payload)
        except EventDecodeError as e:
            self.stats.batches_malformed += 1
            logger.warning("vLLM events from %s: batch %d rejected: %s", self.endpoint, seq, e)
            return None
        return EventBatch(batch.ts, batch.events, self.rank)

    def _handle(self, seq: int, payload: bytes) -> None:
        batch = self._decode(seq, payload)
        if batch is None:
            return
        with self.lock:
            result = self.feed.apply(self.rank, seq, batch)
        if result.status is ApplyStatus.APPLIED:
            self.stats.batches_applied += 1
        elif result.status is ApplyStatus.REPLAY:
            self._catch_up(result.next_seq, seq, payload)
        elif result.status is ApplyStatus.SNAPSHOT:
            self._reset_and_apply(seq, payload)

    def _catch_up(self, start: int, seq: int, payload: bytes) -> None:
        """Fetch ``start..seq-1`` from the replay socket; without them, start over at ``seq``."""
        missed = self._replay(start) if self.replay_endpoint else None
        if missed is None or [s for s, _ in missed if s < seq] != list(range(start, seq)):
            self._reset_and_apply(seq, payload)
            return
        for s, data in missed:
            if s < seq:
                self._apply_raw(s, data)
                self.stats.batches_replayed += 1
        self._apply_raw(seq, payload)

    def _reset_and_apply(self, seq: int, payload: bytes) -> None:
        with self.lock:
            self.feed.reset(self.rank, seq)
        self.stats.resets += 1
        self._apply_raw(seq, payload)

    def _apply_raw(self, seq: int, payload: bytes) -> None:
        batch = self._decode(seq, payload)
        if batch is None:
            return
        with self.lock:
            if self.feed.apply(self.rank, seq, batch).status is ApplyStatus.APPLIED:
                self.stats.batches_applied += 1

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the engine for its buffered batches from ``start``; ``None`` if it does not answer in time."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            out: list[tuple[int, bytes]] = []
            while sock.poll(self.replay_timeout_ms):
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    return None
                _, _, seq_bytes, data = frames
                if seq_bytes == END_SEQ:
                    return out
                out.append((int.from_bytes(seq_bytes, "big"), data))
            return None
        finally:
            sock.close(linger=0)
