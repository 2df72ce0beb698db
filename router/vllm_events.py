"""Subscribe to a real vLLM engine's KV events over ZMQ and index them under a rank of their own.

vLLM's ``ZmqEventPublisher`` sends ``(topic, seq: 8-byte big-endian, payload)``
on a PUB socket, and answers replays on a ROUTER socket: a DEALER sends
``("", start_seq)`` and reads ``("", topic, seq, payload)`` frames until the
8-byte all-ones end marker. Payloads are msgpack batches that
``kvledger.worker.wire.events.decode_batch`` reads (map or array layout); ``ForeignFeed``
re-hashes their blocks so probes see them as ours.

vLLM's publisher binds its PUB socket when its endpoint's host is a wildcard
(``tcp://*:5557``) and *connects* it to the endpoint otherwise; the subscriber
does the opposite. An endpoint that names a host is ambiguous once vLLM has
bound ``tcp://*:0`` (it reports the address it got), so ``bind=None`` binds
if the address is free here and connects if it is taken or not ours (vLLM
holds it); resubscribing where it bound, it waits for its own closed socket to
let go of the port first. The replay socket is always the engine's to bind.

A batch can be lost with nothing after it to show the gap: a SUB that binds
before the engine's PUB connects misses what the PUB sends before it learns of
the subscription (ZMQ's slow joiner; measured: an engine's first batch), and a
quiet engine sends nothing more. So a subscriber that has heard nothing for
``quiet_check_s`` asks the replay socket for anything past the last batch it
applied (an empty answer costs one round trip).

A vLLM engine keeps no snapshot: when a replay cannot reach back, the rank is
reset empty at the current number and fills again as the engine stores blocks.
A batch the index cannot take is counted in the feed's ``Rejections`` (and
logged once), never dropped in silence. A subscriber of an engine that left
the live ranks is paused (it drops what arrives); ``resync`` takes it back: the
engine's rank starts empty and is filled from the engine's replay buffer.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq

from kvledger.router.foreign import ForeignFeed
from kvledger.router.index import BlockSizeError
from kvledger.router.numbering import ApplyResult, ApplyStatus
from kvledger.router.rejections import BLOCK_SIZE, INVALID, MALFORMED
from kvledger.worker.wire.events import EventBatch, EventDecodeError, decode_batch

logger = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
#: How long a subscriber waits for its own just-closed socket to let go of the endpoint it binds again: ZMQ
#: closes a socket on its I/O thread after ``close`` returns (measured here: 4 of 500 immediate rebinds failed).
REBIND_WAIT_S = 2.0


@dataclass(slots=True)
class SubscriberStats:
    batches_applied: int = 0
    batches_replayed: int = 0
    batches_malformed: int = 0
    quiet_checks: int = 0
    resets: int = 0


class VllmEventSubscriber:
    """Feeds one vLLM engine's events into the router's index (see the module docstring).

    ``lock`` guards the index, which the router's other threads read; the ZMQ
    sockets belong to the thread that calls ``poll_once`` (or ``run``).
    """

    def __init__(self, feed: ForeignFeed, rank: int, endpoint: str, replay_endpoint: str | None = None,
                 topic: str = "", lock: threading.Lock | None = None, replay_timeout_ms: int = 2000,
                 bind: bool | None = False, quiet_check_s: float = 1.0) -> None:
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"endpoint must be a ZMQ address like tcp://host:port, got {endpoint!r}")
        self.feed, self.rank, self.endpoint = feed, rank, endpoint
        self.replay_endpoint = replay_endpoint
        self.lock = lock or threading.Lock()
        self.replay_timeout_ms = replay_timeout_ms
        self.quiet_check_s = quiet_check_s
        self._heard_at = time.monotonic()
        self.stats = SubscriberStats()
        self.topic = topic
        self._ctx = zmq.Context.instance()
        self._sub = self._subscribe(endpoint, bind)
        self._stop = threading.Event()
        self._paused = False
        self._resync = threading.Event()
        self._moved_to: tuple[str, str | None, bool | None] | None = None

    def _subscribe(self, endpoint: str, bind: bool | None, rebinding: bool = False) -> zmq.Socket:
        """A SUB on ``endpoint``; ``rebinding``: this subscriber's own socket, just closed, bound it, so the
        address being in use means that socket is still letting go, not that the engine bound it."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self.bound = False
        if bind is not False:
            deadline = time.monotonic() + (REBIND_WAIT_S if rebinding else 0.0)
            while True:
                try:
                    sub.bind(endpoint)
                    self.bound = True
                    break
                except zmq.ZMQError as e:
                    if e.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                        time.sleep(0.01)
                        continue
                    if bind:
                        sub.close(linger=0)
                        raise
                    break  # in use (the engine bound it) or another host's address: the engine listens there
        if not self.bound:
            sub.connect(endpoint)
        return sub

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """Drop what arrives until ``resync`` (the engine left the index)."""
        self._paused = True

    def resync(self, endpoint: str | None = None, replay_endpoint: str | None = None,
               bind: bool | None = False) -> None:
        """Start the rank over from the engine's replay buffer, on the subscriber's own thread; with ``endpoint``,
        subscribe there from now on (a restarted engine may publish elsewhere)."""
        if endpoint is not None and (endpoint, replay_endpoint) != (self.endpoint, self.replay_endpoint):
            self._moved_to = (endpoint, replay_endpoint, bind)
        self._resync.set()
        self._paused = False

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
        if self._resync.is_set():
            self._resync.clear()
            self._start_over()
        if not self._sub.poll(timeout_ms):
            if self.replay_endpoint and not self._paused and time.monotonic() - self._heard_at >= self.quiet_check_s:
                self._check_quiet()
            return False
        self._heard_at = time.monotonic()
        frames = self._sub.recv_multipart()
        if self._paused:
            return True
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.batches_malformed += 1
            self.feed.rejections.add(self.rank, MALFORMED, f"{self.endpoint} sent {len(frames)} frames, not "
                                     "(topic, 8-byte seq, payload)")
            return True
        self._handle(int.from_bytes(frames[1], "big"), frames[2])
        return True

    def _apply(self, seq: int, payload: bytes) -> ApplyResult:
        """Decode and apply batch ``seq`` under our rank number (vLLM's own is its data-parallel rank).

        A batch the index cannot take is counted, and an empty one stands in for it so the numbering goes
        on (a replay would only fetch it again).
        """
        try:
            decoded = decode_batch(payload)
            with self.lock:
                result = self.feed.apply_decoded(self.rank, seq, EventBatch(decoded.ts, decoded.events, self.rank))
            if result.applied:
                self.stats.batches_applied += 1
            return result
        except EventDecodeError as e:
            self.stats.batches_malformed += 1
            self.feed.rejections.add(self.rank, MALFORMED, f"batch {seq} from {self.endpoint}: {e}")
        except BlockSizeError as e:
            self.feed.rejections.add(self.rank, BLOCK_SIZE, f"batch {seq} from {self.endpoint}: {e}")
        except (TypeError, ValueError) as e:
            self.feed.rejections.add(self.rank, INVALID, f"batch {seq} from {self.endpoint}: {e}")
        with self.lock:
            return self.feed.apply_decoded(self.rank, seq, EventBatch(0.0, [], self.rank))

    def _handle(self, seq: int, payload: bytes) -> None:
        result = self._apply(seq, payload)
        if result.status is ApplyStatus.REPLAY:
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
                self._apply(s, data)
                self.stats.batches_replayed += 1
        self._apply(seq, payload)

    def _check_quiet(self) -> None:
        """Apply what the engine published past the last batch applied and never delivered (module docstring)."""
        self._heard_at = time.monotonic()
        self.stats.quiet_checks += 1
        with self.lock:
            start = self.feed.next_seq(self.rank)
        for seq, data in self._replay(start) or ():
            if seq >= start:
                self._handle(seq, data)
                self.stats.batches_replayed += 1

    def _start_over(self) -> None:
        """Empty the rank and apply whatever the engine's replay buffer still holds, from its oldest batch."""
        moved, self._moved_to = self._moved_to, None
        if moved is not None:
            self._sub.close(linger=0)
            rebinding = self.bound and moved[0] == self.endpoint
            self.endpoint, self.replay_endpoint, bind = moved
            self._sub = self._subscribe(self.endpoint, bind, rebinding)
            logger.info("vLLM engine rank %d publishes on %s now", self.rank, self.endpoint)
        missed = self._replay(0) if self.replay_endpoint else None
        with self.lock:
            self.feed.reset(self.rank, missed[0][0] if missed else 0)
        self.stats.resets += 1
        for s, data in missed or ():
            self._apply(s, data)
            self.stats.batches_replayed += 1

    def _reset_and_apply(self, seq: int, payload: bytes) -> None:
        with self.lock:
            self.feed.reset(self.rank, seq)
        self.stats.resets += 1
        self._apply(seq, payload)

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
