"""A discrete-event replay of a trace through the real router and real (metadata-only) ledgers.

Per rank: one ``KVCacheManager`` (``materialize=False``), an ``EventPublisher``
and a FIFO queue. The router is the real one: a ``SequencedIndex`` fed only by the
ranks' published batches (``ingest`` after every ledger operation, so the
index sees each change as soon as the rank makes it), ``match_prefix`` to probe,
and a policy from ``make_policy``.

The model of a rank (kept simple on purpose; ``SimCosts`` holds the figures):

- Prefill is served one request at a time, first come first served. A request
  starts when the rank is idle and its blocks fit; only then is it admitted on
  the ledger, so its cached tokens are what the ledger really reused at that
  moment. Prefill takes ``computed tokens * prefill_s_per_token + onboarded
  blocks * onboard_s_per_block`` (+ ``migrate_setup_s + moved blocks *
  migrate_s_per_block`` when the ``kv`` policy asked for a migration). The
  prompt's full blocks are stored when prefill ends; the first token is out then
  (TTFT = prefill end - arrival).
- Decode runs alongside (continuous batching, no interference with prefill):
  every running request advances one token per ``decode_s_per_token``; it ends
  after ``output_length`` tokens and releases its blocks. Its decode blocks are
  reserved at admission (``add_token`` with no token ids: they are never
  reusable), so a running request never runs out of blocks.
- When the head of the queue does not fit, the queue waits until a request on
  that rank finishes (never dropped); a request larger than a whole rank is
  refused up front.
- A migration (``RouteDecision.migrate_from``) moves metadata: when the request
  starts, the target ledger imports the prefix the source still holds (a
  prefix request admitted, stored and released), announced as ordinary
  ``BlockStored`` events, and the transfer time is charged to the target.

Router replicas (``routers`` > 1): each arriving request goes to one of
``routers`` replicas (seeded, uniformly), each with an index, a policy and a
load account of its own. Every replica's index is fed the same batches, each
``event_lag_s`` after the rank published it (the push's delay); the only state
they share is the ranks' load reports (waiting and running requests, waiting
prefill tokens), taken every ``load_report_s`` and read by every replica's
account next to its own dispatches (``router.load``), as live replicas read
their ranks' ``load()``. *Routing precision* is measured against the ranks'
ledgers at the moment of each decision: the share of requests, among those a
rank held a prefix of, sent to a rank holding the longest one.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvledger.coordinator.migration import migrate_prefix
from kvledger.replay.trace import BlockChains, Trace, TraceRequest, request_tokens
from kvledger.router.engine_rates import EngineRates
from kvledger.router.groups import WindowedArrayIndex
from kvledger.router.load import Dispatch, LoadAccount, ReportedQueue
from kvledger.router.numbering import SequencedIndex
from kvledger.router.policies import RouteRequest, RoutingPolicy, make_policy, policy_config_type
from kvledger.router.policies.base import check_nonneg_numbers
from kvledger.router.probe import PrefixMatch, match_prefix
from kvledger.router.routing import RouteStep
from kvledger.worker.ledger import CacheConfig, OutOfBlocksError, Request
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.rank.transfer import TransferEndpoints
from kvledger.worker.wire.block_key import ROOT_HASH, BlockKey, chain_hash
from kvledger.worker.wire.messages import ExportTicket, ImportTicket


@dataclass(frozen=True, slots=True)
class SimCosts:
    """Service costs of one rank; the defaults model one GPU serving an 8B-class model (Llama-3-8B, fp16 KV)."""

    prefill_tokens_per_s: float = 20_000.0
    """Prompt tokens one rank computes per second."""
    kv_bytes_per_token: int = 131_072
    """KV bytes of one token: 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 128 KiB."""
    pcie_gbytes_per_s: float = 25.0
    """Host-to-device rate for onboarding a block from the host tier (PCIe Gen4 x16, effective)."""
    nvlink_gbytes_per_s: float = 150.0
    """Rank-to-rank rate for migrating blocks (NVLink, effective)."""
    migrate_setup_s: float = 0.002
    """Fixed cost of one migration (coordinating sender and receiver)."""
    decode_s_per_token: float = 0.03
    """One decode step; each running request gets one token per step (the step is shared by the batch)."""

    def __post_init__(self) -> None:
        check_nonneg_numbers(self, prefix="SimCosts.")
        for name in ("prefill_tokens_per_s", "kv_bytes_per_token", "pcie_gbytes_per_s", "nvlink_gbytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimCosts.{name} must be > 0")

    @property
    def prefill_s_per_token(self) -> float:
        return 1.0 / self.prefill_tokens_per_s

    def onboard_s_per_block(self, tokens_per_block: int) -> float:
        return tokens_per_block * self.kv_bytes_per_token / (self.pcie_gbytes_per_s * 1e9)

    def migrate_s_per_block(self, tokens_per_block: int) -> float:
        return tokens_per_block * self.kv_bytes_per_token / (self.nvlink_gbytes_per_s * 1e9)

    def kv_policy_options(self, tokens_per_block: int) -> dict[str, float]:
        """The ``kv`` policy's cost model told the deployment's figures (as its docstring asks)."""
        return {"prefill_s_per_token": self.prefill_s_per_token,
                "onboard_s_per_block": self.onboard_s_per_block(tokens_per_block),
                "migrate_s_per_block": self.migrate_s_per_block(tokens_per_block),
                "migrate_setup_s": self.migrate_setup_s,
                "decode_s_per_block": 0.0}   # decode does not slow prefill in this model


@dataclass(frozen=True, slots=True)
class SimConfig:
    ranks: int = 4
    """Ranks (one ledger each)."""
    capacity_blocks: int = 4096
    """Device-tier blocks of the whole cluster, split evenly over the ranks."""
    host_blocks: int = 0
    """Host-tier blocks of the whole cluster (offload / onboard), split evenly."""
    tokens_per_block: int = 16
    speed: float = 1.0
    """Arrival times are divided by this."""
    partial_reuse: bool = False
    """Let ledgers reuse partly matching blocks (off: block granularity, as the router and the bounds see it)."""
    migration: bool = True
    """Let the ``kv`` policy pull a prefix from another rank."""
    seed: int = 0
    costs: SimCosts = field(default_factory=SimCosts)
    load_buckets: int = 60
    """Time buckets of the per-rank load series."""
    routers: int = 1
    """Router replicas the requests are spread over, each with its own index, policy and load account."""
    event_lag_s: float = 0.0
    """Simulated seconds from a rank's publishing a batch to every replica's index applying it."""
    load_report_s: float = 0.0
    """How often the ranks' load reports are taken for the routers (0: never; the routers' own accounts only)."""
    slowdown: tuple[float, ...] = ()
    """Per rank, how many times its prefill takes the costs' time (another tenant's work on its GPU); ranks past
    the tuple's end run at 1. The routers learn it from the queues it builds and from its answers (each replica
    fits every rank's seconds per prompt token, ``router.engine_rates``, as a live router does)."""
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Policy name -> fields of its config to set (``{"kv": {"backlog_weight": 6}}``), over what the replay tells
    it (``policy_options``)."""

    def __post_init__(self) -> None:
        if type(self.ranks) is not int or self.ranks < 1:
            raise ValueError(f"ranks must be a positive int, got {self.ranks!r}")
        if type(self.capacity_blocks) is not int or self.capacity_blocks < self.ranks:
            raise ValueError(f"capacity_blocks must be an int >= ranks ({self.ranks}), got {self.capacity_blocks!r}")
        if type(self.host_blocks) is not int or self.host_blocks < 0:
            raise ValueError(f"host_blocks must be an int >= 0, got {self.host_blocks!r}")
        if type(self.tokens_per_block) is not int or self.tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be a positive int, got {self.tokens_per_block!r}")
        if type(self.speed) not in (int, float) or not math.isfinite(self.speed) or self.speed <= 0:
            raise ValueError(f"speed must be a finite number > 0, got {self.speed!r}")
        if type(self.routers) is not int or self.routers < 1:
            raise ValueError(f"routers must be a positive int, got {self.routers!r}")
        for name in ("event_lag_s", "load_report_s"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.slowdown, tuple) or len(self.slowdown) > self.ranks or any(
                type(v) not in (int, float) or not math.isfinite(v) or v < 1 for v in self.slowdown):
            raise ValueError(f"slowdown must be a tuple of at most {self.ranks} (ranks) finite numbers >= 1, "
                             f"got {self.slowdown!r}")
        check_policy_options(self.policy_options)

    def slowed(self, rank: int) -> float:
        """How many times rank ``rank``'s prefill takes the costs' time (``slowdown``)."""
        return self.slowdown[rank] if rank < len(self.slowdown) else 1.0

    def rank_blocks(self, rank: int, total: int) -> int:
        base, extra = divmod(total, self.ranks)
        return base + (1 if rank < extra else 0)


@dataclass(slots=True)
class PolicyRun:
    """Everything one policy's replay measured; per-request arrays are in trace order."""

    policy: str
    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    computed_tokens: np.ndarray
    ttft_s: np.ndarray
    e2e_s: np.ndarray
    rank: np.ndarray
    onboarded_blocks: int
    migrated_blocks: int
    migrations: int
    work_s: list[float]
    """Busy seconds of each rank's prefill (compute, onboarding, migration)."""
    load_series: list[list[float]]
    """Per rank, the busy share of each time bucket."""
    bucket_s: float
    makespan_s: float
    wall_s: float
    output_tokens: int
    routers: int = 1
    held_prefix: int = 0
    """Requests some rank held a prefix of (full blocks) when they were routed."""
    to_longest: int = 0
    """Of those, the requests sent to a rank holding the longest such prefix."""
    requests_per_rank: list[int] | None = None
    """Requests each rank served as the engines counted them (a replay through vLLM servers); ``None``: ``rank``'s."""

    @property
    def routing_precision(self) -> float:
        """``to_longest / held_prefix`` (1.0 when no rank ever held a prefix)."""
        return self.to_longest / self.held_prefix if self.held_prefix else 1.0


class RouteHasher:
    """The prompt hashes a probe walks (``router.probe.prompt_hashes``), computed once per distinct block.

    Keyed by ``BlockChains`` ids, which are equal exactly when the block and its prefix are,
    so the memo returns what ``chain_hash`` would; the tests check it against ``prompt_hashes``.
    """

    __slots__ = ("tokens_per_block", "_memo")

    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._memo: dict[int, int] = {}

    def hashes(self, req: TraceRequest, tokens: list[int], chain: list[int]) -> tuple[int, ...]:
        T = self.tokens_per_block
        memo = self._memo
        out = []
        parent = ROOT_HASH
        for k in range((len(tokens) - 1) // T):
            h = memo.get(chain[k])
            if h is None:
                h = memo[chain[k]] = chain_hash(parent, BlockKey(tuple(tokens[k * T:(k + 1) * T]), None,
                                                                 req.lora_id, (), req.cache_salt))
            out.append(h)
            parent = h
        return tuple(out)


class _Replica:
    """One router replica: its index (fed by the ranks' batches), policy, load account, routing step, and what it
    learns of each rank's speed from the answers to its own requests (as a live router does)."""

    __slots__ = ("index", "policy", "account", "step", "rates")

    def __init__(self, index: SequencedIndex, policy: RoutingPolicy) -> None:
        self.index, self.policy = index, policy
        self.account = LoadAccount()
        self.step = RouteStep(policy, self.account)
        self.rates = EngineRates()


class _Job:
    __slots__ = ("i", "req", "tokens", "arrival", "dispatch", "replica", "migrate_from", "blocks_total",
                 "start", "duration", "cached", "onboarded", "migrated")

    def __init__(self, i: int, req: TraceRequest, tokens: list[int], arrival: float, dispatch: Dispatch,
                 replica: _Replica, migrate_from: int | None, blocks_total: int) -> None:
        self.i, self.req, self.tokens, self.arrival = i, req, tokens, arrival
        self.dispatch, self.replica = dispatch, replica
        self.migrate_from, self.blocks_total = migrate_from, blocks_total
        self.start = self.duration = 0.0
        self.cached = self.onboarded = self.migrated = 0


class _Rank:
    """One simulated rank: a metadata-only ledger and its publisher (``RankBooks``), its migration endpoints,
    its FIFO queue and the prefill in progress."""

    __slots__ = ("rank", "books", "mgr", "pub", "transfers", "queue", "current", "blocked", "work_s", "intervals",
                 "capacity", "decoding")

    def __init__(self, rank: int, books: RankBooks) -> None:
        self.rank, self.books = rank, books
        self.mgr, self.pub = books.ledger(), books.events()
        self.transfers = TransferEndpoints(books)
        self.capacity = self.mgr.num_primary
        self.queue: deque[_Job] = deque()
        self.current: _Job | None = None
        self.blocked = False
        self.work_s = 0.0
        self.intervals: list[tuple[float, float]] = []
        self.decoding = 0

    @property
    def device_blocks(self) -> tuple[int, int]:
        """(used, total) device blocks, as a rank's load report gives them."""
        return self.capacity - self.mgr.stats().free_num_blocks, self.capacity

    def report(self) -> ReportedQueue:
        """Its queue as a rank's load report gives it: waiting requests and their prompt tokens, and running
        ones (the prefill in progress and the requests decoding)."""
        return ReportedQueue(len(self.queue), self.decoding + (self.current is not None),
                             sum(j.dispatch.prefill_tokens for j in self.queue))


class _BooksMover:
    """A migration between metadata-only ledgers: no bytes to move; the target stores the blocks, the source
    lets go of its pin."""

    def __init__(self, source: _Rank, target: _Rank) -> None:
        self.source, self.target = source, target

    def move(self, export: ExportTicket, start: int, target: ImportTicket) -> int:
        self.target.transfers.import_commit(target.import_id)
        self.source.transfers.export_end(export.pin_id)
        return 0


_FINISH, _PREFILL_DONE = 0, 1   # at equal times a finish frees blocks before anything starts


class Simulator:
    """One policy's replay of one trace (see the module docstring); ``run`` returns a ``PolicyRun``."""

    def __init__(self, trace: Trace, policy: str, config: SimConfig, chains: list[list[int]] | None = None,
                 hasher: RouteHasher | None = None) -> None:
        self.trace, self.config = trace, config
        T = config.tokens_per_block
        if chains is None:
            bc = BlockChains(trace.block_size, T)
            chains = [bc.chain(r) for r in trace.requests]
        self.chains = chains
        self.hasher = hasher if hasher is not None else RouteHasher(T)
        options = {**(config.costs.kv_policy_options(T) if policy == "kv" else {}),
                   **policy_options(policy, config, config.migration)}
        self.policy_name = policy
        c = config.costs
        self.prefill_s = c.prefill_s_per_token
        self.onboard_s = c.onboard_s_per_block(T)
        self.migrate_s = c.migrate_s_per_block(T)
        self.index = SequencedIndex(WindowedArrayIndex(T))
        """The ranks' ledgers as they are now (batches applied at once): what precision is measured against."""
        # Fed the same batches at once, a replica's index would equal this one: it is shared then.
        self.lagged = config.event_lag_s > 0
        self.replicas = [_Replica(SequencedIndex(WindowedArrayIndex(T)) if self.lagged else self.index,
                                  make_policy(policy, seed=config.seed, **options))
                         for _ in range(config.routers)]
        self._rng = np.random.default_rng(config.seed)
        self._deliveries: deque[tuple[float, int, int, bytes]] = deque()
        self._reports: dict[int, ReportedQueue] | None = None
        self._reported_at = -math.inf
        self.ranks: list[_Rank] = []
        for r in range(config.ranks):
            cfg = CacheConfig(tokens_per_block=T, materialize=False, device="cpu",
                              enable_partial_reuse=config.partial_reuse)
            books = RankBooks(r, cfg, torch.device("cpu"), 1.0, replay_size=1, clock=lambda: self.now)
            books.build(config.rank_blocks(r, config.capacity_blocks), config.rank_blocks(r, config.host_blocks))
            self.ranks.append(_Rank(r, books))
        self.now = 0.0
        check_fits(trace, config)
        for rank in self.ranks:
            self._publish(rank)

    # --- events -------------------------------------------------------------------------------------

    def _publish(self, rank: _Rank) -> None:
        batch = rank.pub.poll()
        if batch is not None:
            res, _ = self.index.ingest(rank.rank, batch.seq, batch.data)
            assert res.applied, f"rank {rank.rank} batch {batch.seq}: {res.status} {res.reason}"
            if self.lagged:
                self._deliveries.append((self.now + self.config.event_lag_s, rank.rank, batch.seq, batch.data))

    def _deliver(self) -> None:
        """Every batch due by now reaches every replica's index (in publishing order, as pushes arrive)."""
        due = self._deliveries
        while due and due[0][0] <= self.now:
            _, r, seq, data = due.popleft()
            for replica in self.replicas:
                res, _ = replica.index.ingest(r, seq, data)
                assert res.applied, f"rank {r} batch {seq} at a replica: {res.status} {res.reason}"

    def _reported(self) -> dict[int, ReportedQueue] | None:
        """The ranks' load reports of the last ``load_report_s`` tick (``None`` when reports are off)."""
        every = self.config.load_report_s
        if every > 0 and self.now - self._reported_at >= every:
            self._reports = {r.rank: r.report() for r in self.ranks}
            self._reported_at = self.now
        return self._reports

    def run(self, progress: Callable[[int], None] | None = None, every: int = 250) -> PolicyRun:
        wall0 = time.perf_counter()
        reqs = self.trace.requests
        n = len(reqs)
        speed = self.config.speed
        t0 = reqs[0].timestamp_s if n else 0.0
        self._ttft = np.zeros(n)
        self._e2e = np.zeros(n)
        self._cached = np.zeros(n, dtype=np.int64)
        self._rank_of = np.zeros(n, dtype=np.int64)
        self._onboarded = self._migrated = self._migrations = 0
        self._held_prefix = self._to_longest = 0
        heap: list[tuple[float, int, int, object]] = []
        self._heap, self._tie = heap, itertools.count()
        i = 0
        while i < n or heap:
            arrival = (reqs[i].timestamp_s - t0) / speed if i < n else math.inf
            if heap and heap[0][0] <= arrival:
                at, kind, _, what = heapq.heappop(heap)
                self.now = at
                if kind == _FINISH:
                    rank = self._finish(what)
                else:
                    rank = what
                    self._prefill_done(rank)
            else:
                self.now = arrival
                rank = self._route(i, reqs[i])
                i += 1
                if progress is not None and i % every == 0:
                    progress(every)
            self._try_start(rank)
        if progress is not None and n % every:
            progress(n % every)
        self.now = math.inf
        self._deliver()
        for rank in self.ranks:
            drained = not rank.queue and rank.current is None and all(
                rep.account.inflight(rank.rank) == (0, 0) for rep in self.replicas)
            assert drained, f"rank {rank.rank} did not drain"
            rank.mgr.check_integrity()
            held = {b.block_hash for b in rank.mgr.snapshot()}
            for rep in self.replicas:
                assert rep.index.num_blocks(rank.rank) == len(held), f"rank {rank.rank}: an index disagrees with it"
        return self._result(time.perf_counter() - wall0)

    def _route(self, i: int, req: TraceRequest) -> _Rank:
        T = self.config.tokens_per_block
        tokens = request_tokens(self.trace, req)
        hashes = self.hasher.hashes(req, tokens, self.chains[i])
        rr = RouteRequest(tuple(tokens), hashes, T, req.output_length, req.cache_salt, req.lora_id)
        replica = self.replicas[int(self._rng.integers(len(self.replicas)))] if len(self.replicas) > 1 \
            else self.replicas[0]
        if self.lagged:
            self._deliver()
        matches: dict[int, PrefixMatch] = match_prefix(replica.index.store, hashes) if hashes else {}
        now = self.now
        decision = replica.step.decide(rr, matches, [r.rank for r in self.ranks],
                                       {r.rank: r.device_blocks for r in self.ranks}, now, record=True,
                                       reported=self._reported(), rates=replica.rates.prefill())
        truth = matches if not self.lagged else match_prefix(self.index.store, hashes) if hashes else {}
        longest = max((m.matched_blocks for m in truth.values()), default=0)
        if longest:
            self._held_prefix += 1
            chosen = truth.get(decision.rank)
            self._to_longest += chosen is not None and chosen.matched_blocks == longest
        rank = self.ranks[decision.rank]
        m = matches.get(decision.rank)
        have = 0 if m is None else m.matched_blocks
        if decision.migrate_from is not None:
            have += decision.migrate_blocks
        est = req.input_length - have * T
        blocks_total = -(-(req.input_length + req.output_length) // T)
        job = _Job(i, req, tokens, now, replica.account.dispatch(decision.rank, est, blocks_total, hashes), replica,
                   decision.migrate_from, blocks_total)
        rank.queue.append(job)
        self._rank_of[i] = decision.rank
        return rank

    def _try_start(self, rank: _Rank) -> _Job | None:
        if rank.current is not None or not rank.queue or rank.blocked:
            return None
        job = rank.queue[0]
        req = job.req
        mgr = rank.mgr
        # Capacity: the whole request (prompt and decode) must fit. ``blocks_total`` over-counts the
        # blocks it will share with running requests, so only when that rough test fails ask the ledger.
        free = mgr.stats().free_num_blocks
        if job.blocks_total > free:
            probe = Request(job.i, job.tokens, req.output_length, req.lora_id, req.cache_salt)
            if mgr.get_remaining_blocks_to_completion(probe) > free:
                rank.blocked = True    # nothing frees blocks on this rank until one of its requests finishes
                return None
        rank.queue.popleft()
        moved = 0
        if job.migrate_from is not None and job.migrate_from != rank.rank:
            moved = self._import_prefix(rank, self.ranks[job.migrate_from], job)
        try:
            cached = mgr.add_sequence(Request(job.i, job.tokens, req.output_length, req.lora_id, req.cache_salt))
        except OutOfBlocksError as e:   # the capacity test above makes this a bug
            raise AssertionError(f"request {job.i} passed the capacity test but: {e}") from e
        if req.output_length:
            mgr.add_token(job.i, req.output_length)
        adm = mgr.admission(job.i)
        self._publish(rank)
        job.cached, job.onboarded, job.migrated = cached, adm.onboarded_blocks, moved
        computed = req.input_length - cached
        duration = computed * self.prefill_s * self.config.slowed(rank.rank) + adm.onboarded_blocks * self.onboard_s
        if moved:
            duration += self.config.costs.migrate_setup_s + moved * self.migrate_s
        job.start, job.duration = self.now, duration
        job.replica.account.started(job.dispatch, self.now, duration)
        rank.current = job
        heapq.heappush(self._heap, (self.now + duration, _PREFILL_DONE, next(self._tie), rank))
        return job

    def _import_prefix(self, target: _Rank, source: _Rank, job: _Job) -> int:
        """Migrate (as metadata, by the cluster's one choreography) the prefix blocks ``source`` still holds and
        ``target`` lacks; returns how many moved."""
        req = job.req
        moved = migrate_prefix(source.transfers, target.transfers, _BooksMover(source, target), job.tokens,
                               source.rank, target.rank, None, req.lora_id, req.cache_salt).sent_blocks
        self._publish(source)
        self._publish(target)
        if moved:
            self._migrations += 1
        return moved

    def _finish(self, job: _Job) -> _Rank:
        rank = self.ranks[int(self._rank_of[job.i])]
        rank.mgr.remove_sequence(job.i)
        job.replica.account.finished(job.dispatch)
        rank.decoding -= 1
        rank.blocked = False
        self._publish(rank)
        return rank

    def _prefill_done(self, rank: _Rank) -> None:
        job = rank.current
        assert job is not None, f"rank {rank.rank}: prefill ended with nothing running"
        rank.current = None
        rank.mgr.store_context_blocks(job.i)
        self._publish(rank)
        rank.work_s += job.duration
        rank.intervals.append((job.start, job.duration))
        i = job.i
        self._ttft[i] = self.now - job.arrival
        decode = job.req.output_length * self.config.costs.decode_s_per_token
        self._e2e[i] = self._ttft[i] + decode
        job.replica.rates.observe(rank.rank, job.req.input_length - job.cached, job.req.output_length,
                                  float(self._ttft[i]), float(self._e2e[i]), job.arrival)
        self._cached[i] = job.cached
        self._onboarded += job.onboarded
        self._migrated += job.migrated
        job.tokens = []   # the ledger keeps its own copy; free the trace's
        job.replica.account.prefilled(job.dispatch)
        rank.decoding += 1
        heapq.heappush(self._heap, (self.now + decode, _FINISH, next(self._tie), job))

    def _result(self, wall_s: float) -> PolicyRun:
        reqs = self.trace.requests
        prompt = np.array([r.input_length for r in reqs], dtype=np.int64)
        arrivals = np.array([r.timestamp_s for r in reqs]) / self.config.speed
        arrivals -= arrivals[0] if len(arrivals) else 0.0
        finish = arrivals + self._e2e
        makespan = float(finish.max()) if len(finish) else 0.0
        nb = self.config.load_buckets
        bucket = makespan / nb if makespan > 0 else 1.0
        series = []
        for rank in self.ranks:
            busy = np.zeros(nb)
            for start, dur in rank.intervals:
                end = start + dur
                b = min(int(start / bucket), nb - 1)
                while True:
                    edge = (b + 1) * bucket if b < nb - 1 else math.inf
                    busy[b] += min(end, edge) - max(start, b * bucket)
                    if end <= edge:
                        break
                    b += 1
            series.append((busy / bucket).tolist())
        return PolicyRun(self.policy_name, prompt, self._cached.copy(), prompt - self._cached, self._ttft.copy(),
                         self._e2e.copy(), self._rank_of.copy(), self._onboarded, self._migrated, self._migrations,
                         [r.work_s for r in self.ranks], series, bucket, makespan, wall_s,
                         int(sum(r.output_length for r in reqs)), self.config.routers, self._held_prefix,
                         self._to_longest)


def check_policy_options(options: Mapping[str, Mapping[str, Any]]) -> None:
    """``ValueError`` unless each policy named has a config that takes its options (its own checks run)."""
    for name, given in options.items():
        config_type = policy_config_type(name)
        if config_type is None:
            raise ValueError(f"policy_options: policy {name!r} has no options")
        config_type(**given)


def policy_options(policy: str, config: SimConfig, migration: bool) -> dict[str, Any]:
    """What a replay tells ``policy`` beyond its defaults: ``kv`` not to migrate (without ``migration``), then the
    options given for it (``SimConfig.policy_options``), which win."""
    told = {"allow_migration": False} if policy == "kv" and not migration else {}
    return {**told, **config.policy_options.get(policy, {})}


def check_fits(trace: Trace, config: SimConfig) -> None:
    """Raise ``ValueError`` if some request (prompt and output) needs more blocks than a rank holds."""
    T = config.tokens_per_block
    smallest = config.capacity_blocks // config.ranks
    for i, req in enumerate(trace.requests):
        need = -(-(req.input_length + req.output_length) // T)
        if need > smallest:
            raise ValueError(f"request {i} needs {need} blocks of {T} tokens (prompt {req.input_length} + "
                             f"output {req.output_length}), more than a rank holds ({smallest}); "
                             f"raise --capacity-blocks or lower --ranks")


def simulate(trace: Trace, policy: str, config: SimConfig, progress: Callable[[int], None] | None = None,
             chains: list[list[int]] | None = None, hasher: RouteHasher | None = None) -> PolicyRun:
    """Replay ``trace`` under ``policy``; see ``Simulator``. ``chains`` and ``hasher`` may be shared by
    replays of the same trace at the same block size (they only cache what the trace determines)."""
    return Simulator(trace, policy, config, chains, hasher).run(progress)
