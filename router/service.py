"""The router as one plain, thread-safe object: events in, decisions and completions out.

``RouterService`` puts three parts together: the event feed
(``router.feed.EventFeed``: the global index fed by each rank's numbered
batches, with replays, snapshots and foreign engines), the routing step
(``router.routing.RouteStep`` over the router's ``LoadAccount`` of what it
dispatched, and the ranks' own block reports), and serving with retry and its
counters; ``report`` sums it all up as a typed ``ClusterReport``. It reaches
ranks only through a ``RankSet`` of typed ``RankClient``s; it knows nothing of
Ray or HTTP, so the same object runs in tests over in-process ranks and in the
router actor over the cluster.

Locks: ``_lock`` guards the accounting and the policy, and is never held
across a call to a rank; the feed has its own (``EventFeed.lock``).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvledger.router.config import RouterConfig
from kvledger.router.feed import EventFeed
from kvledger.router.index import PrefixIndex
from kvledger.router.load import LoadAccount
from kvledger.router.policies import NoLiveRankError, RouteDecision, RouteRequest, RoutingPolicy
from kvledger.router.probe import PrefixMatch
from kvledger.router.rank_client import RankDiedError, RankSet
from kvledger.router.report import ClusterReport, ForeignReport, RankReport, RouterTotals, TierBlocks
from kvledger.router.routing import RouteStep
from kvledger.router.stats import LatencyHistogram
from kvledger.worker.engine.tokenizer import VOCAB_SIZE
from kvledger.worker.wire.messages import RankLoad
from kvledger.worker.wire.request import Request, RetentionConfig, TokenRange

logger = logging.getLogger(__name__)


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
class _RankCounters:
    """What the router routed to one rank and what came back."""

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
    probe_latency: LatencyHistogram = field(default_factory=LatencyHistogram)


def retention_for(priority: int | None) -> RetentionConfig | None:
    """The whole prompt and its decoded blocks at ``priority`` (``None``: the ledger's default)."""
    if priority is None:
        return None
    return RetentionConfig(ranges=(TokenRange(0, None, priority),), decode_priority=priority)


class RouterService:
    """See the module docstring."""

    def __init__(self, ranks: RankSet, config: RouterConfig = RouterConfig(),
                 policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = ranks
        self.config = config
        self.clock = clock
        self.policy = policy if policy is not None else config.make_policy()
        self.feed = EventFeed(ranks, config.tokens_per_block, config.event_log_size, config.rate_window_s, clock,
                              on_removed=self._forget)
        self.account = LoadAccount()
        self.step = RouteStep(self.policy, self.account)
        self.stats = ServiceStats()
        self._lock = threading.Lock()
        self._loads: dict[int, RankLoad] = {}
        self._loads_at = float("-inf")
        self._counters: dict[int, _RankCounters] = {}
        self._request_ids = itertools.count(1)

    @property
    def index(self) -> PrefixIndex:
        """The feed's ``PrefixIndex`` (read it under ``feed.lock``)."""
        return self.feed.index

    def _forget(self, rank: int) -> None:
        """The feed dropped ``rank``: its load, what was dispatched to it and the policy's memory of it go."""
        with self._lock:
            self.account.forget(rank)
            self._loads.pop(rank, None)
            self.policy.on_rank_removed(rank)

    # ------------------------------------------------------------------ probing and routing

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None,
              exact: bool = False) -> dict[int, RankProbe]:
        """Matched prompt tokens per live rank: from the index, or (``exact``) from each rank's ledger.

        Attached foreign engines (``EventFeed.attach_vllm``) are in the index's answer only: they cannot be asked.
        """
        req = RouteRequest.of(tokens, self.config.tokens_per_block, cache_salt=cache_salt, lora_id=lora_id)
        live = self.ranks.live()
        if exact:
            out = {}
            for r in live:
                try:
                    out[r] = RankProbe(self.ranks.client(r).probe(req.tokens, lora_id, cache_salt))
                except RankDiedError as e:
                    self.feed.lost(e)
            return out
        tpb = self.config.tokens_per_block
        matches = self._match(req)
        out = {}
        for r in [*live, *self.feed.foreign_engines()]:
            m = matches.get(r)
            out[r] = RankProbe(0, 0, 0) if m is None else RankProbe(m.matched_tokens, m.device_blocks * tpb,
                                                                     m.host_blocks * tpb)
        return out

    def route(self, tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
              lora_id: int | None = None) -> RouteDecision:
        """Where the policy would send this prompt now (nothing is sent or recorded)."""
        req = RouteRequest.of(tokens, self.config.tokens_per_block, max_tokens=max_tokens, cache_salt=cache_salt,
                              lora_id=lora_id)
        return self._decide(req, frozenset(), record=False)

    def _match(self, req: RouteRequest) -> dict[int, PrefixMatch]:
        t0 = time.perf_counter()
        matches = self.feed.match(req.block_hashes)
        with self._lock:
            self.stats.probe_latency.observe(time.perf_counter() - t0)
        return matches

    def _decide(self, req: RouteRequest, exclude: frozenset[int], record: bool) -> RouteDecision:
        live = [r for r in self.ranks.live() if r not in exclude]
        if not live:
            raise NoLiveRankError("no live rank to route to" + (f" (ranks {sorted(exclude)} died)" if exclude else ""))
        matches = self._match(req)
        with self._lock:
            blocks = {r: (load.device_blocks_used, load.device_blocks) for r, load in self._loads.items()}
            return self.step.decide(req, matches, live, blocks, self.clock(), record)

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
            decision = self._decide(req, frozenset(died), record=True)
            rank = decision.rank
            migrated = 0
            if decision.migrate_from is not None:
                try:
                    # the whole prefix the source holds: the target shares what it has, receives the rest
                    migrated = self.ranks.migrate(req.tokens, decision.migrate_from, rank, None, lora_id, cache_salt)
                except RankDiedError as e:
                    self.feed.lost(e)
                    died.add(e.rank)
                    continue
                except Exception:  # a failed transfer costs a recompute, never the request
                    logger.exception("migration %d -> %d failed; rank %d computes the prefix instead",
                                     decision.migrate_from, rank, rank)
            matched = decision.matched_tokens.get(rank, 0) + migrated * tpb
            prefill = len(req.tokens) - min(matched, len(req.tokens) - 1)
            with self._lock:
                dispatch = self.account.dispatch(rank, prefill, -(-(len(req.tokens) + max_tokens) // tpb))
            try:
                reply = self.ranks.client(rank).serve([request], publish=True)
            except RankDiedError as e:
                self.feed.lost(e)
                died.add(rank)
                with self._lock:
                    self.stats.retries += 1
                continue
            finally:
                with self._lock:
                    self.account.finished(dispatch)
            if reply.events is not None:   # what serving did is indexed before the answer leaves
                self.feed.ingest(rank, reply.events.seq, reply.events.data)
            (out,) = reply.outcomes
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

    def _counter(self, rank: int) -> _RankCounters:
        c = self._counters.get(rank)
        if c is None:
            c = self._counters[rank] = _RankCounters()
        return c

    # ------------------------------------------------------------------ reports

    def refresh_loads(self, force: bool = False) -> None:
        """Ask every live rank for its load report (at most every ``load_refresh_s``): one call per rank."""
        now = self.clock()
        if not force and now - self._loads_at < self.config.load_refresh_s:
            return
        self._loads_at = now
        loads = {}
        for r in self.ranks.live():
            try:
                load = self.ranks.client(r).load()
            except RankDiedError as e:
                self.feed.lost(e)
                continue
            if not load.ready:
                self.ranks.mark_down(r)
                self.feed.lost(RankDiedError(r, "it has no ledger"))
                continue
            loads[r] = load
        with self._lock:
            self._loads.update(loads)

    def report(self, refresh: bool = True) -> ClusterReport:
        """The cluster as the router sees it: per live rank its blocks, hit rate, events and load; totals."""
        if refresh:
            self.refresh_loads()
        live = self.ranks.live()
        feed, index = self.feed, self.feed.index
        events = {r: feed.counters(r) for r in live}
        foreign_engines = feed.foreign_engines()
        with feed.lock:
            held = {r: (index.num_blocks(r), index.next_seq(r)) for r in [*live, *foreign_engines]}
            ix, total_blocks = index.stats, index.num_blocks()
            applied, duplicate = ix.batches_applied, ix.batches_duplicate
            replays, snapshots = ix.replays_requested, ix.snapshots_loaded
        with self._lock:
            ranks = []
            for r in live:
                load = self._loads.get(r)
                c = self._counter(r)
                inflight, queued_tokens = self.account.inflight(r)
                events_total, events_per_s, batches = events[r]
                ranks.append(RankReport(
                    r, True, None if load is None else {
                        "GPU": TierBlocks(load.device_blocks_used, load.device_blocks_free),
                        "CPU": TierBlocks(load.host_blocks_used, load.host_blocks_free)},
                    None if load is None else load.cache_hit_rate, held[r][0], held[r][1], events_total,
                    events_per_s, batches, c.decisions, c.completions, c.prompt_tokens, c.cached_tokens, inflight,
                    queued_tokens))
            s = self.stats
            totals = RouterTotals(s.completions, s.prompt_tokens, s.cached_tokens,
                                  s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0, s.migrations,
                                  s.migrated_blocks, s.retries, feed.ranks_removed, total_blocks, applied, duplicate,
                                  replays, snapshots, feed.log.next_id)
        foreign = [ForeignReport(r, endpoint, *held[r]) for r, endpoint in foreign_engines.items()]
        return ClusterReport(self.policy.name, self.config.tokens_per_block, ranks, foreign, totals)

    def probe_latency(self) -> LatencyHistogram:
        """A copy of the probe latency histogram."""
        with self._lock:
            return _copy_hist(self.stats.probe_latency)

    def close(self) -> None:
        self.feed.close()


def _copy_hist(h: LatencyHistogram) -> LatencyHistogram:
    out = LatencyHistogram(h.bounds)
    out.counts = list(h.counts)
    out.sum, out.count = h.sum, h.count
    return out


__all__ = ["CompletionResult", "RankProbe", "RouterService", "ServiceStats", "retention_for"]
