"""The router's event feed: every rank's numbered batches into the global index, gaps closed, restarts resynced.

``EventFeed`` owns the index (a ``SequencedIndex``: the numbering in front of
the block store) and the ``EventLog`` monitors read. Every batch of an own rank
takes one route, ``ingest``, however it came (with the serve reply, pushed,
or pulled to close a gap): its number is checked before anything else, so a
duplicate is dropped undecoded, and the next batch is decoded once and applied.
On a gap the feed replays the rank from where it lost track, on a restart (or
when the rank's replay buffer no longer reaches back) it loads its snapshot.
A rank lost on any call leaves the index at once (``remove_rank``), and the
owner is told (``on_removed``) so its own account of the rank goes too.
Foreign engines (real vLLMs) feed the same index through their ZMQ publisher
(``attach_vllm``), re-hashed by ``ForeignFeed``, each at its own block size;
one that leaves the live ranks leaves the index at once, its subscriber paused,
and rejoins with a resync of its events (``sync``). Whatever the index cannot
take is counted per rank and reason in ``rejections``.

Locks: ``lock`` guards the index, the counters and the foreign engines, and is
never held across a call to a rank (the event log locks itself). Each rank's
ingest path has its own lock, held across the replay or snapshot it may fetch,
so one rank's batches are applied in order while other ranks and probes go on.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvledger.router.event_log import EventLog, EventRecord
from kvledger.router.foreign import ForeignFeed
from kvledger.router.groups import WindowedArrayIndex
from kvledger.router.index import BlockSizeError
from kvledger.router.numbering import ApplyResult, ApplyStatus, SequencedIndex
from kvledger.router.probe import PrefixMatch, match_all_sizes
from kvledger.router.rank_client import RankDiedError, RankSet
from kvledger.router.rejections import BLOCK_SIZE, INVALID, MALFORMED, Rejections
from kvledger.router.stats import RateMeter
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.events import BatchView, EventBatch, EventDecodeError, decode_view

logger = logging.getLogger(__name__)

#: Foreign engines (vLLM) are indexed under ranks from here on, far above any cluster rank.
FOREIGN_RANK_BASE = 1000


@dataclass(slots=True)
class FeedCounters:
    """What one rank's feed applied."""

    events: RateMeter
    batches: int = 0


@dataclass(slots=True)
class _ForeignEngine:
    endpoint: str
    name: str
    """What the engine is called in reports: its server's URL, or its events endpoint."""
    subscriber: object
    """``router.vllm_events.VllmEventSubscriber`` (imported only when an engine is attached: it needs zmq)."""
    routed: bool
    """A rank of the ``RankSet`` (requests go to it), not only indexed: it follows the set's liveness."""
    thread: threading.Thread
    dp_rank: int | None = None
    """Its data-parallel rank among its server's engine cores (``None``: the server runs one)."""


class EventFeed:
    """See the module docstring."""

    def __init__(self, ranks: RankSet, tokens_per_block: int, log_size: int, rate_window_s: float,
                 clock: Callable[[], float], on_removed: Callable[[int], None]) -> None:
        self.ranks = ranks
        self.index = SequencedIndex(WindowedArrayIndex(tokens_per_block))
        self.log = EventLog(log_size)
        self.lock = threading.Lock()
        self.ranks_removed = 0
        self.rejections = Rejections()
        self._clock = clock
        self._rate_window_s = rate_window_s
        self._on_removed = on_removed
        self._known: set[int] = set()              # ranks whose feed this router keeps
        self._published: dict[int, int] = {}       # rank -> batches it said it had published, last round
        self._counters: dict[int, FeedCounters] = {}
        self._rank_locks: dict[int, threading.Lock] = {}
        self._rank_locks_guard = threading.Lock()
        self._foreign_feed: ForeignFeed | None = None
        self._foreign: dict[int, _ForeignEngine] = {}

    # ------------------------------------------------------------------ batches in

    def ingest(self, rank: int, seq: int, data: bytes) -> ApplyResult:
        """Apply batch ``seq`` of ``rank`` (wire bytes); on a gap replay the rank, on a restart snapshot it.

        Malformed bytes raise ``EventDecodeError`` (a ``ValueError``) and change nothing; batches of a rank
        reported down are dropped (``sync`` snapshots it when it is back).
        """
        if rank not in self.ranks.live():   # a late push from a rank already dropped: it rejoins by snapshot
            return ApplyResult(ApplyStatus.SNAPSHOT, 0, f"rank {rank} is down")
        with self._rank_lock(rank):
            try:
                res = self._take(rank, seq, data)
                if res.status is ApplyStatus.REPLAY:
                    res = self._catch_up(rank, res.next_seq)
                elif res.status is ApplyStatus.SNAPSHOT:
                    res = self._resync_locked(rank)
            except RankDiedError as e:
                self.lost(e)
                return ApplyResult(ApplyStatus.SNAPSHOT, 0, str(e))
        return res

    def resync(self, rank: int) -> ApplyResult:
        """Rebuild ``rank``'s part of the index from its snapshot (a router starting late, a rank coming back)."""
        with self._rank_lock(rank):
            return self._resync_locked(rank)

    def sync(self) -> None:
        """Match the index to the live ranks: forget the gone, snapshot the new; pause foreign engines that
        left, resync those that are back."""
        live = set(self.ranks.live())
        with self.lock:
            known = set(self._known)
            foreign = dict(self._foreign)
        for r in sorted(known - live):
            self.remove_rank(r)
        for r in sorted(live - known - set(foreign)):
            try:
                self.resync(r)
            except RankDiedError as e:
                self.lost(e)
        for r, f in sorted(foreign.items()):
            if not f.routed:
                continue
            if r not in live and not f.subscriber.paused:
                self.remove_rank(r)
            elif r in live and f.subscriber.paused:
                logger.info("vLLM engine %s (rank %d) answers again: resyncing its events", f.name, r)
                f.subscriber.resync()

    def close_gap(self, rank: int, published: int) -> None:
        """``rank`` says it has published ``published`` batches (called every health round): fetch what the
        index still lacks of what it had published a round earlier (lost on the way, or held back; a later
        batch would show the gap, but the last one may have none after it). Batches published since are
        likely on their way, so they get a round to arrive before they cost a replay."""
        with self._rank_lock(rank):
            with self.lock:
                start = self.index.next_seq(rank)
                behind = rank in self._known and start < self._published.get(rank, 0)
                self._published[rank] = published
            if not behind:
                return
            logger.info("rank %d published %d batches, the index has %d: replaying the rest", rank, published, start)
            try:
                self._catch_up(rank, start)
            except RankDiedError as e:
                self.lost(e)

    def flush(self, rank: int) -> None:
        """Fetch and apply ``rank``'s pending events now (so the index reflects what it just did)."""
        try:
            batch = self.ranks.client(rank).poll_events()
        except RankDiedError as e:
            self.lost(e)
            return
        if batch is not None:
            self.ingest(rank, batch.seq, batch.data)

    def _rank_lock(self, rank: int) -> threading.Lock:
        lock = self._rank_locks.get(rank)   # a dict read is atomic: the guard is for making one only
        if lock is None:
            with self._rank_locks_guard:
                lock = self._rank_locks.setdefault(rank, threading.Lock())
        return lock

    def _take(self, rank: int, seq: int, data: bytes) -> ApplyResult:
        """The one route of an own rank's batch into the index (see the module docstring)."""
        with self.lock:
            try:
                res, batch = self.index.ingest(rank, seq, data)
            except EventDecodeError as e:
                self.rejections.add(rank, MALFORMED, f"batch {seq}: {e}")
                raise
            except BlockSizeError as e:
                self.rejections.add(rank, BLOCK_SIZE, f"batch {seq}: {e}")
                raise
            except (TypeError, ValueError) as e:
                self.rejections.add(rank, INVALID, f"batch {seq}: {e}")
                raise
            if res.status is ApplyStatus.APPLIED:
                self._known.add(rank)
                self._applied(rank, seq, batch, data)
        return res

    def _applied(self, rank: int, seq: int, batch: EventBatch | BatchView, data: bytes | None = None) -> None:
        """Count and log an applied batch (under ``lock``): own ranks' by their wire bytes ``data``, foreign
        engines' as translated."""
        c = self._counter(rank)
        c.batches += 1
        c.events.add(len(batch.events))
        if data is None:
            self.log.append(rank, seq, batch.ts, batch.events)
        else:
            self.log.append_wire(rank, seq, batch.ts, data, len(batch.events))

    def _catch_up(self, rank: int, from_seq: int) -> ApplyResult:
        batches = self.ranks.client(rank).replay_events(from_seq)
        if batches is None:
            logger.info("rank %d: replay from %d is gone, loading a snapshot", rank, from_seq)
            return self._resync_locked(rank)
        res = ApplyResult(ApplyStatus.APPLIED, from_seq)
        for b in batches:
            res = self._take(rank, b.seq, b.data)
            if res.status in (ApplyStatus.SNAPSHOT, ApplyStatus.REPLAY):
                return self._resync_locked(rank)
        return res

    def _resync_locked(self, rank: int) -> ApplyResult:
        pending, snap = self.ranks.client(rank).event_snapshot()
        self._load_snapshot(rank, pending, snap)
        return ApplyResult(ApplyStatus.SNAPSHOT, snap.next_seq, "snapshot loaded")

    def _load_snapshot(self, rank: int, pending: PublishedBatch | None, snap: Snapshot) -> None:
        pending_events = decode_view(pending.data) if pending is not None else None   # counted and logged
        with self.lock:
            self.index.load_snapshot(rank, snap.blocks, snap.next_seq)
            self._known.add(rank)
            if pending_events is not None:
                self._counter(rank).events.add(len(pending_events.events))
                self.log.append_wire(rank, pending.seq, pending_events.ts, pending.data, len(pending_events.events))
            self.log.append(rank, -1, time.time(), [{"type": "Snapshot", "blocks": len(snap.blocks),
                                                     "next_seq": snap.next_seq}])

    def _counter(self, rank: int) -> FeedCounters:
        c = self._counters.get(rank)
        if c is None:
            c = self._counters[rank] = FeedCounters(RateMeter(self._rate_window_s, self._clock))
        return c

    # ------------------------------------------------------------------ ranks leaving

    def remove_rank(self, rank: int) -> None:
        """Forget ``rank`` at once: its blocks leave the index, and the owner forgets its account of it.

        A foreign engine's subscriber pauses until ``sync`` sees the engine live again.
        """
        with self.lock:
            engine = self._foreign.get(rank)
            known = rank in self._known or (engine is not None and not engine.subscriber.paused)
            self._known.discard(rank)
            self._published.pop(rank, None)   # a rank that comes back numbers its batches from 0 again
            if engine is not None:
                engine.subscriber.pause()
                self._foreign_feed.remove_rank(rank)
            else:
                self.index.remove_rank(rank)
            if known:
                self.ranks_removed += 1
                self.log.append(rank, -1, time.time(), [{"type": "RankRemoved"}])
        self._on_removed(rank)
        if known:
            logger.warning("rank %d left the router's index", rank)

    def lost(self, err: RankDiedError) -> None:
        """A call found ``err.rank`` gone: it leaves the index now."""
        logger.warning("%s", err)
        self.remove_rank(err.rank)

    # ------------------------------------------------------------------ reading

    def match(self, tokens: Sequence[int], hashes: Sequence[int], lora_id: int | None = None,
              cache_salt: str | None = None) -> dict[int, PrefixMatch]:
        """Every rank's longest held prefix of prompt ``tokens`` at its block size (ranks holding none are
        absent); ``hashes`` are the prompt's at the index's default size."""
        with self.lock:
            return match_all_sizes(self.index.store, tokens, hashes, lora_id=lora_id, cache_salt=cache_salt)

    def counters(self, rank: int) -> tuple[int, float, int]:
        """``rank``'s events applied (total and per second) and batches applied."""
        with self.lock:
            c = self._counter(rank)
            return c.events.total, c.events.rate(), c.batches

    def events(self, since: int = 0, rank: int | None = None, limit: int = 1000) -> tuple[list[EventRecord], int]:
        """Logged events from id ``since`` on (see ``EventLog.read``)."""
        return self.log.read(since, rank, limit)

    def wait_events(self, since: int, rank: int | None = None, limit: int = 1000,
                    timeout: float = 1.0) -> tuple[list[EventRecord], int]:
        """Like ``events``, but waits up to ``timeout`` seconds for one to arrive (see ``EventLog.wait``)."""
        return self.log.wait(since, rank, limit, timeout)

    # ------------------------------------------------------------------ foreign engines

    def next_foreign_rank(self) -> int:
        """The rank the next attached engine gets."""
        with self.lock:
            return FOREIGN_RANK_BASE + len(self._foreign)

    def attach_vllm(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                    bind: bool | None = False, block_size: int | None = None, name: str | None = None,
                    routed: bool = False, dp_rank: int | None = None) -> int:
        """Index a real vLLM engine's KV events (its ZMQ publisher) under a rank of its own; returns that rank.

        ``bind``: ``True``, the engine's publisher connects, so the router binds ``endpoint``; ``None``, bind
        if the address is free here, else connect (``router.vllm_events``). ``block_size``: the engine's, when
        its server told it; otherwise its first store does.
        ``routed``: the engine is also a rank of the ``RankSet`` (``router.engines``). ``dp_rank``: which of its
        server's data-parallel engine cores it is (each publishes on an endpoint of its own).
        """
        from kvledger.router.vllm_events import VllmEventSubscriber

        with self.lock:
            if any(f.endpoint == endpoint for f in self._foreign.values()):
                raise ValueError(f"vLLM events from {endpoint} are already indexed")
            if self._foreign_feed is None:
                self._foreign_feed = ForeignFeed(self.index, self.rejections, self._applied)
            rank = FOREIGN_RANK_BASE + len(self._foreign)
            if block_size is None:
                self._foreign_feed.learn_block_size(rank)
            else:
                self.index.store.set_block_size(rank, block_size)
            sub = VllmEventSubscriber(self._foreign_feed, rank, endpoint, replay_endpoint, topic, lock=self.lock,
                                      bind=bind)
            thread = threading.Thread(target=sub.run, name=f"kvledger-vllm-{rank}", daemon=True)
            self._foreign[rank] = _ForeignEngine(endpoint, name or endpoint, sub, routed, thread, dp_rank)
        thread.start()
        logger.info("indexing vLLM events from %s as rank %d (%s)", endpoint, rank,
                    "bound" if sub.bound else "connected")
        return rank

    def move_foreign(self, rank: int, endpoint: str, replay_endpoint: str | None, bind: bool | None) -> None:
        """A foreign engine came back publishing at ``endpoint``: its subscriber moves there and resyncs."""
        with self.lock:
            engine = self._foreign[rank]
            engine.endpoint = endpoint
        engine.subscriber.resync(endpoint, replay_endpoint, bind)

    def foreign_engines(self) -> dict[int, str]:
        """Attached foreign engines: rank -> its name (its server's URL, or the events endpoint)."""
        with self.lock:
            return {r: f.name for r, f in self._foreign.items()}

    def foreign_dp_ranks(self) -> dict[int, int]:
        """Attached foreign engines that are one data-parallel rank of their server: rank -> that DP rank."""
        with self.lock:
            return {r: f.dp_rank for r, f in self._foreign.items() if f.dp_rank is not None}

    def close(self) -> None:
        """Stop the foreign engines' subscribers."""
        with self.lock:
            engines = list(self._foreign.values())
        for f in engines:
            f.subscriber.stop()
            f.thread.join(timeout=5)
            f.subscriber.close()


def parse_vllm_endpoint(spec: str) -> tuple[str, str | None]:
    """``tcp://host:port`` or ``tcp://host:port,tcp://host:replay_port`` -> (publisher, replay or None)."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) > 2 or not all(p.startswith(("tcp://", "ipc://")) for p in parts):
        raise ValueError(f"a vLLM events endpoint is tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], got {spec!r}")
    return parts[0], parts[1] if len(parts) == 2 else None
