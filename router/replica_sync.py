"""Router replicas tell each other what they dispatch, as Dynamo's replica events do.

Each replica's ``RouterService`` reports every dispatch it makes and every one
that finishes (``DispatchEvent``) to its ``ReplicaSync``, which sends them to
every peer in order, batched: one call to a peer is in flight at a time and
the next one carries whatever came meanwhile. A peer applies them to its
``LoadAccount`` under the sender's name, so each replica weighs the others'
requests from the moment they are sent, not from a rank's load report of
unknown age.

A sender's first batch to a peer, its first after the peer could not be
reached, and its first after the peer restarted is a reset: the sender's whole
open set, which replaces what the peer held of it. A replica knows a peer
restarted from the peer's own first batch, which comes from a new
``incarnation``. So a replica that restarts starts its peers' view of it
afresh and learns their open requests. A peer found gone has its dispatches
dropped at once (``PeerSink.drop_peer``). When there is nothing to send, a
peer is called every ``heartbeat_s`` anyway: that is how a replica notices a
peer gone while it had nothing to tell it.

``flush`` calls every peer at once and returns when each has answered (then
it has applied everything sent before) or was found unreachable: what a test
waits on instead of sleeping.
The transport is injected (``Send``); the router actor's goes through Ray
(``coordinator.replica_link``), the tests' calls a peer in process.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

logger = logging.getLogger(__name__)


DispatchKind = Literal["dispatched", "finished"]


@dataclass(frozen=True, slots=True)
class DispatchEvent:
    """A request a replica sent to ``rank`` (``dispatched``), or one of them that ended (``finished``)."""

    kind: DispatchKind
    id: int
    """Unique among the sending replica's dispatches."""
    rank: int
    prefill_tokens: int
    blocks: int


DispatchListener = Callable[[DispatchEvent], None]
"""What ``RouterService`` tells of each dispatch it makes and finishes; called under its lock, so it must not
block or call back into the service."""


@dataclass(frozen=True, slots=True)
class PeerBatch:
    """Events from replica ``sender``, in the order it made them."""

    sender: str
    incarnation: str
    """The sender's process: a new one has lost what it was sent before."""
    reset: bool
    """``events`` are the sender's whole open set: they replace what the receiver holds of it."""
    events: tuple[DispatchEvent, ...]


class PeerGone(Exception):
    """The peer's process is gone, and its requests with it."""


Send = Callable[[str, PeerBatch], int]
"""Delivers a batch to the named peer and returns its answer (``ReplicaSync.receive``); ``PeerGone`` when it is
gone, any other exception when it could not be reached now."""


class PeerSink(Protocol):
    """Where a replica keeps its peers' dispatches (``RouterService``)."""

    def peer_events(self, peer: str, events: Sequence[DispatchEvent], reset: bool) -> None: ...

    def drop_peer(self, peer: str) -> None: ...


@dataclass(slots=True)
class _Outbox:
    """What this replica owes one peer."""

    pending: list[DispatchEvent] = field(default_factory=list)
    reset: bool = True
    """The next batch is the whole open set (first contact, or the peer may have lost what it got)."""
    started: int = 0
    """Calls to the peer begun."""
    ended: int = 0
    """Calls to the peer that ended, well or not (in the order they began: one at a time)."""
    reachable: bool = False
    applied: int = 0
    """What the peer last said it has applied of ours."""
    wake: bool = True
    """Call the peer now instead of at the next heartbeat (first contact, a restart seen, a flush waiting)."""


class ReplicaSync:
    """One replica's side of sharing dispatches (see the module docstring): a thread per peer sends, ``receive``
    takes the peers' batches into ``sink``."""

    def __init__(self, name: str, peers: Sequence[str], send: Send, sink: PeerSink, heartbeat_s: float = 1.0,
                 call_timeout_s: float = 10.0) -> None:
        """``name`` and ``peers``: the replicas' names (what ``send`` reaches them by); ``call_timeout_s``: the
        longest ``send`` takes (how long ``close`` waits for a call in flight)."""
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s!r}")
        if name in peers:
            raise ValueError(f"replica {name} is among its own peers {list(peers)}")
        self.name = name
        self.incarnation = uuid.uuid4().hex
        self.heartbeat_s = heartbeat_s
        self.call_timeout_s = call_timeout_s
        self._send = send
        self._sink = sink
        self._cond = threading.Condition()
        self._open: dict[int, DispatchEvent] = {}
        self._out = {peer: _Outbox() for peer in peers}
        self._applied: dict[str, int] = {}
        self._incarnations: dict[str, str] = {}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(peer,), name=f"kvledger-replica-sync-{peer}",
                                          daemon=True) for peer in peers]

    def start(self) -> ReplicaSync:
        """Begin calling the peers (first, each with a reset)."""
        for t in self._threads:
            t.start()
        return self

    def __call__(self, event: DispatchEvent) -> None:
        """The service's ``DispatchListener``: queue ``event`` for every peer."""
        with self._cond:
            if event.kind == "dispatched":
                self._open[event.id] = event
            else:
                self._open.pop(event.id, None)
            for out in self._out.values():
                if not out.reset:
                    out.pending.append(event)
            self._cond.notify_all()

    def receive(self, batch: PeerBatch) -> int:
        """A peer's batch, applied before this returns (batches from one sender come one at a time); the events
        applied from it since its last reset. A sender's new process is sent this replica's open set."""
        self._sink.peer_events(batch.sender, batch.events, batch.reset)
        peer = batch.sender
        with self._cond:
            applied = self._applied[peer] = len(batch.events) + (0 if batch.reset else self._applied.get(peer, 0))
            out = self._out.get(peer)
            if self._incarnations.get(peer) != batch.incarnation:
                self._incarnations[peer] = batch.incarnation
                if out is not None:
                    logger.info("router replica %s (re)started: sending it our open dispatches", peer)
                    self._reset(out)
                    out.wake = True
        return applied

    def flush(self, timeout_s: float) -> dict[str, int]:
        """Call every peer now and wait for the answers; each peer that answered (it has applied everything
        this replica queued before the call), with how many of this replica's events it has applied since its
        last reset. A peer missing was found unreachable (and, if gone, its dispatches dropped).

        ``TimeoutError`` when a peer has not answered after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            goal = {peer: out.started + 1 for peer, out in self._out.items()}
            for out in self._out.values():
                out.wake = True
            self._cond.notify_all()
            while late := [p for p, n in goal.items() if self._out[p].ended < n]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"replica {self.name}: peers {late} did not answer in {timeout_s} s")
                self._cond.wait(left)
            return {p: out.applied for p, out in self._out.items() if out.reachable}

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=self.call_timeout_s)

    def _run(self, peer: str) -> None:
        out = self._out[peer]
        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(lambda: self._stop.is_set() or out.wake or out.pending, self.heartbeat_s)
                if self._stop.is_set():
                    return
                reset = out.reset
                events = tuple(self._open.values()) if reset else tuple(out.pending)
                out.pending.clear()
                out.reset = out.wake = False
                out.started += 1
                known = self._incarnations.get(peer)
            self._call(peer, out, PeerBatch(self.name, self.incarnation, reset, events), known)

    def _call(self, peer: str, out: _Outbox, batch: PeerBatch, known: str | None) -> None:
        """Send ``batch``; ``known``: the peer's process as this replica knew it when the batch was made."""
        try:
            applied = self._send(peer, batch)
        except PeerGone as e:
            with self._cond:
                # a new process that introduced itself meanwhile has replaced the dead one's dispatches already
                dead = self._incarnations.get(peer) == known
            if dead:
                logger.info("router replica %s is gone (%s): its dispatches no longer count", peer, e)
                self._sink.drop_peer(peer)
            self._failed(out)
            return
        except Exception as e:  # slow or restarting: try again, from a reset, at the next heartbeat
            logger.warning("router replica %s did not take %d dispatch events: %s", peer, len(batch.events), e)
            self._failed(out)
            return
        with self._cond:
            out.applied, out.reachable = applied, True
            out.ended += 1
            self._cond.notify_all()

    def _failed(self, out: _Outbox) -> None:
        with self._cond:
            out.ended += 1
            out.reachable = False
            self._reset(out)   # sent at the next heartbeat, or a flush's call

    def _reset(self, out: _Outbox) -> None:
        """The peer may lack what it was sent: the next batch is the whole open set (under ``_cond``)."""
        out.reset = True
        out.pending.clear()
        self._cond.notify_all()
