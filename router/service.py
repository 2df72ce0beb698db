"""The router as one plain, thread-safe object: events in, decisions and completions out.

``RouterService`` owns the global ``PrefixIndex`` (fed by ``ingest`` with each
rank's numbered batches, catching up by replay or snapshot), a routing policy,
the router's own account of each rank's load (prompt tokens and requests it
dispatched and that have not finished; KV blocks from the ranks' reports), its
counters, and a bounded log of decoded events for monitors. It reaches the
ranks only through a ``RankBackend``; it knows nothing of Ray or HTTP, so the
same object runs in tests over in-process ranks and in the router actor over
the cluster.

Locks: ``_lock`` guards the index and the accounting, and is never held
across a backend call (the event log, ``router.event_log``, locks itself). Each rank's ingest path has its own lock, held
across the replay or snapshot it may fetch, so one rank's batches are applied
in order while other ranks and probes carry on.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvledger.router.backend import RankBackend, RankDiedError, RankLoad
from kvledger.router.event_log import EventLog, EventRecord, event_to_dict
from kvledger.router.foreign import ForeignFeed
from kvledger.router.index import ApplyResult, ApplyStatus, PrefixIndex
from kvledger.router.config import RouterConfig
from kvledger.router.policies import NoLiveRankError, RankState, RouteDecision, RouteRequest, RoutingPolicy
from kvledger.router.probe import PrefixMatch, match_prefix
from kvledger.router.stats import LatencyHistogram, RateMeter
from kvledger.worker.engine.tokenizer import VOCAB_SIZE
from kvledger.worker.wire.request import Request, RetentionConfig, TokenRange
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.events import EventBatch, decode_batch

logger = logging.getLogger(__name__)

#: Foreign engines (vLLM) are indexed under ranks from here on, far above any cluster rank.
FOREIGN_RANK_BASE = 1000


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """One served request: where it ran, what the cache supplied, what it produced."""

    request_id: int
    rank: int
    output_tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV the rank reused (the ledger's own count, not the router's estimate)."""
    computed_tokens: int
    onboarded_blocks: int
    migrated_blocks: int
    """Blocks pulled from ``decision.migrate_from`` before serving."""
    decision: RouteDecision
    retries: int
    """Ranks that died with this request before one served it."""


@dataclass(frozen=True, slots=True)
class RankProbe:
    """How much of a prompt one rank holds; the tier split is known only to the index (``exact=False``)."""

    matched_tokens: int
    device_tokens: int | None = None
    host_tokens: int | None = None


@dataclass(slots=True)
class _Inflight:
    """What the router dispatched to one rank and has not seen finish."""

    requests: int = 0
    prefill_tokens: int = 0
    decode_blocks: int = 0


@dataclass(slots=True)
class _ForeignEngine:
    endpoint: str
    subscriber: object
    """``router.vllm_events.VllmEventSubscriber`` (imported only when an engine is attached: it needs zmq)."""
    thread: threading.Thread


@dataclass(slots=True)
class _RankCounters:
    events: RateMeter
    batches: int = 0
    decisions: int = 0
    completions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class ServiceStats:
    completions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    migrations: int = 0
    migrated_blocks: int = 0
    retries: int = 0
    ranks_removed: int = 0
    probe_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


def retention_for(priority: int | None) -> RetentionConfig | None:
    """The whole prompt and its decoded blocks at ``priority`` (``None``: the ledger's default)."""
    if priority is None:
        return None
    return RetentionConfig(ranges=(TokenRange(0, None, priority),), decode_priority=priority)


class RouterService:
    """See the module docstring."""

    def __init__(self, backend: RankBackend, config: RouterConfig = RouterConfig(),
                 policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.config = config
        self.clock = clock
        self.policy = policy if policy is not None else config.make_policy()
        self.index = PrefixIndex(config.tokens_per_block)
        self.stats = ServiceStats()
        self._lock = threading.Lock()
        self._feed_locks: dict[int, threading.Lock] = {}
        self._feed_locks_guard = threading.Lock()
        self._ranks: set[int] = set()              # ranks whose feed this service keeps
        self._inflight: dict[int, _Inflight] = {}
        self._loads: dict[int, RankLoad] = {}
        self._loads_at = float("-inf")
        self._counters: dict[int, _RankCounters] = {}
        self.log = EventLog(config.event_log_size)
        self._request_ids = itertools.count(1)
        self._foreign_feed: ForeignFeed | None = None
        self._foreign: dict[int, _ForeignEngine] = {}

    # ------------------------------------------------------------------ events in

    def ingest(self, rank: int, seq: int, data: bytes) -> ApplyResult:
        """Apply batch ``seq`` of ``rank`` (wire bytes); on a gap replay the rank, on a restart snapshot it.

        Malformed bytes raise ``EventDecodeError`` (a ``ValueError``) and change nothing; batches of a rank
        the backend reports down are dropped (``sync_ranks`` snapshots it when it is back).
        """
        batch = decode_batch(data)
        if rank not in self.backend.ranks():   # a late push from a rank already dropped: it rejoins by snapshot
            return ApplyResult(ApplyStatus.SNAPSHOT, 0, f"rank {rank} is down")
        with self._feed_lock(rank):
            try:
                res = self._apply(rank, seq, batch)
                if res.status is ApplyStatus.REPLAY:
                    res = self._catch_up(rank, res.next_seq)
                elif res.status is ApplyStatus.SNAPSHOT:
                    res = self._resync_locked(rank)
            except RankDiedError as e:
                self._lost(e)
                return ApplyResult(ApplyStatus.SNAPSHOT, 0, str(e))
        return res

    def resync(self, rank: int) -> ApplyResult:
        """Rebuild ``rank``'s part of the index from its snapshot (a router starting late, a rank coming back)."""
        with self._feed_lock(rank):
            return self._resync_locked(rank)

    def sync_ranks(self) -> None:
        """Match the index to the backend's live ranks: forget the gone, snapshot the new."""
        live = set(self.backend.ranks())
        with self._lock:
            known = set(self._ranks)
        for r in sorted(known - live):
            self.remove_rank(r)
        for r in sorted(live - known):
            try:
                self.resync(r)
            except RankDiedError as e:
                self._lost(e)

    def flush(self, rank: int) -> None:
        """Fetch and apply ``rank``'s pending events now (so the index reflects what it just did)."""
        try:
            batch = self.backend.poll(rank)
        except RankDiedError as e:
            self._lost(e)
            return
        if batch is not None:
            self.ingest(rank, batch.seq, batch.data)

    def _feed_lock(self, rank: int) -> threading.Lock:
        with self._feed_locks_guard:
            lock = self._feed_locks.get(rank)
            if lock is None:
                lock = self._feed_locks[rank] = threading.Lock()
            return lock

    def _apply(self, rank: int, seq: int, batch: EventBatch) -> ApplyResult:
        with self._lock:
            res = self.index.apply(rank, seq, batch)
            if res.status is ApplyStatus.APPLIED:
                self._ranks.add(rank)
                c = self._counter(rank)
                c.batches += 1
                c.events.add(len(batch.events))
                self.log.append(rank, seq, batch.ts, [event_to_dict(e) for e in batch.events])
        return res

    def _catch_up(self, rank: int, from_seq: int) -> ApplyResult:
        batches = self.backend.replay(rank, from_seq)
        if batches is None:
            logger.info("rank %d: replay from %d is gone, loading a snapshot", rank, from_seq)
            return self._resync_locked(rank)
        res = ApplyResult(ApplyStatus.APPLIED, from_seq)
        for b in batches:
            res = self._apply(rank, b.seq, decode_batch(b.data))
            if res.status in (ApplyStatus.SNAPSHOT, ApplyStatus.REPLAY):
                return self._resync_locked(rank)
        return res

    def _resync_locked(self, rank: int) -> ApplyResult:
        pending, snap = self.backend.snapshot(rank)
        self._load_snapshot(rank, pending, snap)
        return ApplyResult(ApplyStatus.SNAPSHOT, snap.next_seq, "snapshot loaded")

    def _load_snapshot(self, rank: int, pending: PublishedBatch | None, snap: Snapshot) -> None:
        pending_events = decode_batch(pending.data) if pending is not None else None
        with self._lock:
            self.index.load_snapshot(rank, snap.blocks, snap.next_seq)
            self._ranks.add(rank)
            if pending_events is not None:
                self._counter(rank).events.add(len(pending_events.events))
                self.log.append(rank, pending.seq, pending_events.ts,
                                 [event_to_dict(e) for e in pending_events.events])
            self.log.append(rank, -1, time.time(), [{"type": "Snapshot", "blocks": len(snap.blocks),
                                                      "next_seq": snap.next_seq}])

    def _counter(self, rank: int) -> _RankCounters:
        c = self._counters.get(rank)
        if c is None:
            c = self._counters[rank] = _RankCounters(RateMeter(self.config.rate_window_s, self.clock))
        return c

    # ------------------------------------------------------------------ ranks leaving

    def remove_rank(self, rank: int) -> None:
        """Forget ``rank`` at once: its blocks leave the index, its load and the policy's memory of it go."""
        with self._lock:
            known = rank in self._ranks
            self._ranks.discard(rank)
            self.index.remove_rank(rank)
            self._inflight.pop(rank, None)
            self._loads.pop(rank, None)
            self.policy.on_rank_removed(rank)
            if known:
                self.stats.ranks_removed += 1
                self.log.append(rank, -1, time.time(), [{"type": "RankRemoved"}])
        if known:
            logger.warning("rank %d left the router's index", rank)

    def _lost(self, err: RankDiedError) -> None:
        logger.warning("%s", err)
        self.remove_rank(err.rank)

    # ------------------------------------------------------------------ probing and routing

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None,
              exact: bool = False) -> dict[int, RankProbe]:
        """Matched prompt tokens per live rank: from the index, or (``exact``) from each rank's ledger.

        Attached foreign engines (``attach_vllm``) are in the index's answer only: they cannot be asked.
        """
        req = RouteRequest.of(tokens, self.config.tokens_per_block, cache_salt=cache_salt, lora_id=lora_id)
        live = self.backend.ranks()
        if exact:
            out = {}
            for r in live:
                try:
                    out[r] = RankProbe(self.backend.probe_exact(r, req.tokens, lora_id, cache_salt))
                except RankDiedError as e:
                    self._lost(e)
            return out
        tpb = self.config.tokens_per_block
        with self._lock:
            matches = self._match(req)
        out = {}
        for r in [*live, *self._foreign]:
            m = matches.get(r)
            if m is None:
                out[r] = RankProbe(0, 0, 0)
            else:
                out[r] = RankProbe(m.matched_tokens, m.device_blocks * tpb, m.host_blocks * tpb)
        return out

    def route(self, tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
              lora_id: int | None = None) -> RouteDecision:
        """Where the policy would send this prompt now (nothing is sent or recorded)."""
        req = RouteRequest.of(tokens, self.config.tokens_per_block, max_tokens=max_tokens, cache_salt=cache_salt,
                              lora_id=lora_id)
        return self._decide(req, frozenset())

    def _match(self, req: RouteRequest) -> dict[int, PrefixMatch]:
        t0 = time.perf_counter()
        matches = match_prefix(self.index, req.block_hashes)
        self.stats.probe_latency.observe(time.perf_counter() - t0)
        return matches

    def _decide(self, req: RouteRequest, exclude: frozenset[int]) -> RouteDecision:
        live = [r for r in self.backend.ranks() if r not in exclude]
        if not live:
            raise NoLiveRankError("no live rank to route to" + (f" (ranks {sorted(exclude)} died)" if exclude else ""))
        with self._lock:
            matches = self._match(req)
            states = [self._state(r) for r in live]
            return self.policy.route(req, states, matches)

    def _state(self, rank: int) -> RankState:
        """The rank's load as the router accounts it (``_lock`` held)."""
        f = self._inflight.get(rank) or _Inflight()
        load = self._loads.get(rank)
        used, total = (load.device_blocks_used, load.device_blocks) if load is not None else (0, 0)
        return RankState(rank, True, queued_requests=0, queued_prefill_tokens=f.prefill_tokens,
                         running_requests=f.requests, running_decode_blocks=f.decode_blocks,
                         kv_used_blocks=used, kv_total_blocks=total)

    # ------------------------------------------------------------------ serving

    def complete(self, prompt_tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
                 lora_id: int | None = None, priority: int | None = None) -> CompletionResult:
        """Route, migrate a prefix if the decision says so, serve; retry elsewhere if the rank dies.

        Bad input raises ``ValueError``/``TypeError`` before anything is sent.
        ``NoLiveRankError`` when no rank is left to serve it.
        """
        if type(max_tokens) is not int or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        tpb = self.config.tokens_per_block
        req = RouteRequest.of(prompt_tokens, tpb, max_tokens=max_tokens, cache_salt=cache_salt, lora_id=lora_id)
        if max(req.tokens) >= VOCAB_SIZE:
            raise ValueError(f"token {max(req.tokens)} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        request = Request(next(self._request_ids), list(req.tokens), max_tokens, lora_id, cache_salt,
                          retention=retention_for(priority))
        request.validate()
        died: set[int] = set()
        while True:
            if len(died) > self.config.max_retries:
                raise NoLiveRankError(f"request {request.request_id}: ranks {sorted(died)} died serving it")
            decision = self._decide(req, frozenset(died))
            rank = decision.rank
            migrated = 0
            if decision.migrate_from is not None:
                try:
                    # the whole prefix the source holds: the target shares what it has, receives the rest
                    migrated = self.backend.migrate(req.tokens, decision.migrate_from, rank, None, lora_id,
                                                    cache_salt)
                except RankDiedError as e:
                    self._lost(e)
                    died.add(e.rank)
                    continue
                except Exception:  # a failed transfer costs a recompute, never the request
                    logger.exception("migration %d -> %d failed; rank %d computes the prefix instead",
                                     decision.migrate_from, rank, rank)
            matched = decision.matched_tokens.get(rank, 0) + migrated * tpb
            prefill = len(req.tokens) - min(matched, len(req.tokens) - 1)
            decode_blocks = -(-(len(req.tokens) + max_tokens) // tpb)
            self._dispatched(rank, prefill, decode_blocks, +1)
            with self._lock:
                self.policy.on_routed(req, decision)
            try:
                out = self.backend.serve(rank, request)
            except RankDiedError as e:
                self._lost(e)
                died.add(rank)
                with self._lock:
                    self.stats.retries += 1
                continue
            finally:
                self._dispatched(rank, -prefill, -decode_blocks, -1)
            if out.events is not None:   # what serving did is indexed before the answer leaves
                self.ingest(rank, out.events.seq, out.events.data)
            with self._lock:
                s, c = self.stats, self._counter(rank)
                s.completions += 1
                s.prompt_tokens += len(req.tokens)
                s.cached_tokens += out.cached_tokens
                if migrated:
                    s.migrations += 1
                    s.migrated_blocks += migrated
                c.decisions += 1
                c.completions += 1
                c.prompt_tokens += len(req.tokens)
                c.cached_tokens += out.cached_tokens
            return CompletionResult(request.request_id, rank, out.output_tokens, len(req.tokens), out.cached_tokens,
                                    out.computed_tokens, out.onboarded_blocks, migrated, decision, len(died))

    def _dispatched(self, rank: int, prefill_tokens: int, decode_blocks: int, requests: int) -> None:
        with self._lock:
            f = self._inflight.get(rank)
            if f is None:
                if requests < 0:   # the rank was removed while the request ran
                    return
                f = self._inflight[rank] = _Inflight()
            f.requests += requests
            f.prefill_tokens += prefill_tokens
            f.decode_blocks += decode_blocks

    # ------------------------------------------------------------------ reports

    def refresh_loads(self, force: bool = False) -> None:
        """Ask every live rank for its block counts and hit rate (at most every ``load_refresh_s``)."""
        now = self.clock()
        if not force and now - self._loads_at < self.config.load_refresh_s:
            return
        self._loads_at = now
        loads = {}
        for r in self.backend.ranks():
            try:
                loads[r] = self.backend.load(r)
            except RankDiedError as e:
                self._lost(e)
        with self._lock:
            self._loads.update(loads)

    def cluster(self, refresh: bool = True) -> dict:
        """A JSON-ready summary: per live rank its blocks per tier, hit rate, events, load; router totals."""
        if refresh:
            self.refresh_loads()
        live = self.backend.ranks()
        with self._lock:
            ranks = []
            for r in live:
                load = self._loads.get(r)
                f = self._inflight.get(r) or _Inflight()
                c = self._counter(r)
                entry = {
                    "rank": r, "alive": True,
                    "blocks": None if load is None else {
                        "GPU": {"used": load.device_blocks_used, "free": load.device_blocks_free},
                        "CPU": {"used": load.host_blocks_used, "free": load.host_blocks_free}},
                    "cache_hit_rate": None if load is None else load.cache_hit_rate,
                    "index_blocks": self.index.num_blocks(r),
                    "next_seq": self.index.next_seq(r),
                    "events_total": c.events.total,
                    "events_per_s": c.events.rate(),
                    "batches": c.batches,
                    "decisions": c.decisions,
                    "completions": c.completions,
                    "prompt_tokens": c.prompt_tokens,
                    "cached_tokens": c.cached_tokens,
                    "inflight_requests": f.requests,
                    "queued_prefill_tokens": f.prefill_tokens,
                }
                ranks.append(entry)
            s, ix = self.stats, self.index.stats
            foreign = [{"rank": r, "endpoint": f.endpoint, "index_blocks": self.index.num_blocks(r),
                        "next_seq": self.index.next_seq(r)} for r, f in self._foreign.items()]
            return {
                "policy": self.policy.name,
                "tokens_per_block": self.config.tokens_per_block,
                "ranks": ranks,
                "foreign": foreign,
                "router": {
                    "completions": s.completions, "prompt_tokens": s.prompt_tokens,
                    "cached_tokens": s.cached_tokens,
                    "hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                    "migrations": s.migrations, "migrated_blocks": s.migrated_blocks, "retries": s.retries,
                    "ranks_removed": s.ranks_removed, "index_blocks": self.index.num_blocks(),
                    "batches_applied": ix.batches_applied, "batches_duplicate": ix.batches_duplicate,
                    "replays": ix.replays_requested, "snapshots": ix.snapshots_loaded,
                    "events_logged": self.log.next_id,
                },
            }

    def probe_latency(self) -> LatencyHistogram:
        """A copy of the probe latency histogram."""
        with self._lock:
            return _copy_hist(self.stats.probe_latency)

    # ------------------------------------------------------------------ foreign engines

    def attach_vllm(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> int:
        """Index a real vLLM engine's KV events (its ZMQ publisher) under a rank of its own; returns that rank.

        Probes report how much of a prompt the engine holds; the router never sends it requests.
        """
        from kvledger.router.vllm_events import VllmEventSubscriber

        with self._lock:
            if any(f.endpoint == endpoint for f in self._foreign.values()):
                raise ValueError(f"vLLM events from {endpoint} are already indexed")
            if self._foreign_feed is None:
                self._foreign_feed = ForeignFeed(self.index)
            rank = FOREIGN_RANK_BASE + len(self._foreign)
            sub = VllmEventSubscriber(self._foreign_feed, rank, endpoint, replay_endpoint, topic, lock=self._lock)
            thread = threading.Thread(target=sub.run, name=f"kvledger-vllm-{rank}", daemon=True)
            self._foreign[rank] = _ForeignEngine(endpoint, sub, thread)
        thread.start()
        logger.info("indexing vLLM events from %s as rank %d", endpoint, rank)
        return rank

    def foreign_engines(self) -> dict[int, str]:
        """Attached foreign engines: rank -> the endpoint it is named after."""
        with self._lock:
            return {r: f.endpoint for r, f in self._foreign.items()}

    def close(self) -> None:
        """Stop the foreign engines' subscribers."""
        with self._lock:
            engines = list(self._foreign.values())
        for f in engines:
            f.subscriber.stop()
            f.thread.join(timeout=5)
            f.subscriber.close()

    # ------------------------------------------------------------------ events out

    def events(self, since: int = 0, rank: int | None = None, limit: int = 1000) -> tuple[list[EventRecord], int]:
        """Logged events from id ``since`` on (see ``EventLog.read``)."""
        return self.log.read(since, rank, limit)

    def wait_events(self, since: int, rank: int | None = None, limit: int = 1000,
                    timeout: float = 1.0) -> tuple[list[EventRecord], int]:
        """Like ``events``, but waits up to ``timeout`` seconds for one to arrive (see ``EventLog.wait``)."""
        return self.log.wait(since, rank, limit, timeout)


def _copy_hist(h: LatencyHistogram) -> LatencyHistogram:
    out = LatencyHistogram(h.bounds)
    out.counts = list(h.counts)
    out.sum, out.count = h.sum, h.count
    return out


def parse_vllm_endpoint(spec: str) -> tuple[str, str | None]:
    """``tcp://host:port`` or ``tcp://host:port,tcp://host:replay_port`` -> (publisher, replay or None)."""
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) > 2 or not all(p.startswith(("tcp://", "ipc://")) for p in parts):
        raise ValueError(f"a vLLM events endpoint is tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT], got {spec!r}")
    return parts[0], parts[1] if len(parts) == 2 else None


__all__ = ["FOREIGN_RANK_BASE", "CompletionResult", "EventRecord", "NoLiveRankError", "RankProbe",
           "RouterService", "event_to_dict", "parse_vllm_endpoint", "retention_for"]
