"""Ours: the rank with the lowest estimated time to first token, optionally after pulling the prefix over.

Cost of serving on rank r, in seconds (``prefill`` is the configured figure; with ``speed_spread`` above 1 it is
scaled by the rank's speed relative to the others', once the router has learned every rank's from its answers:
``RankState.prefill_s_per_token``)::

    queued_prefill_tokens * prefill + running_decode_blocks * decode        (its load)
    + (prompt tokens - matched blocks * block size) * prefill * backlog     (what it must compute)
    + host blocks of the match * onboard                                    (what it must copy up)

``backlog`` is ``1 + backlog_weight * k``, ``k`` the fewest requests queued on any live rank: when every rank has a
queue, what one computes delays the requests waiting behind it, so computing is weighed against waiting by more
than the request's own time to first token (the recompute of what a placement evicts, below, too).

``onboard`` is the rank's own measurement where it has one (``RankState.onboard_s_per_block``: a vLLM
engine's from its offloading metrics, ``router.vllm_onboard``), else ``KvCostModel.onboard_s_per_block``: a
prefix found only on a rank's host tier is credited its prefill less what copying it up costs there.

When the best-matching rank is loaded, another rank may do better by first
receiving the blocks it lacks from it (KV migration): its own load and its own
matched host blocks, the tokens beyond the source's match to compute, plus
``migrate_setup_s + blocks moved * migrate_s_per_block``, and the moved blocks take room on the target as
computed ones would (the capacity terms below count them). That option is only
taken when it beats every plain option, which includes computing the moved
blocks on the same rank, so a transfer is never chosen when recomputing is
cheaper.

Sessions (``router.sessions``) are weighed, not pinned:

- *affinity*: a turn of a live session (``RouteRequest.session``) is credited on its own rank with the prompt
  tokens the rank held of it at its last turn when the index shows none of them yet (the engine's events still
  on their way), ``affinity_weight`` times their prefill; once the index shows them, its match is the credit;
- *protection*: live sessions' blocks (``RankState.session_blocks``, less the request's own session's) count as
  occupied. A placement whose blocks to completion, less its match, do not fit the rank's device blocks beside
  what is in use (the larger of its report and the router's dispatches) and those sessions' blocks, evicts
  session blocks: it pays their recompute, ``protection_weight`` times ``blocks * block size * prefill``. An
  engine's LRU evicts free blocks, session blocks among them: this keeps other traffic off a rank where a waiting
  agent's prefix would go, unless every rank is as full.

Fit: a placement whose blocks to completion (less those its prompt shares with the requests in flight on the rank)
do not fit beside what those requests hold (the distinct blocks the router dispatched there, or the rank's report
of its blocks in use) cannot run at once: the engine holds it back, or preempts a running request and computes its
blocks again. It pays ``fit_weight`` times the overflowing blocks' prefill, so that a burst does not pile onto the
rank holding its prefixes past what that rank can run together.

Capacity (``router.policies.cache_model``): the policy keeps each rank's LRU order of the blocks it sent there. A
placement whose blocks to completion, less its match, exceed a rank's free blocks (its device blocks less the larger
of the model's and the rank's count in use) pushes out that many of the rank's oldest blocks, and pays their
expected reuses' prefill, ``eviction_weight`` times ``reuses * block size * prefill``. So a prompt that matches
nowhere goes where there is room or where what it displaces is cold, and a rank that cannot hold its share of the
working set stops taking more of it: the cluster's caches together hold what one of them cannot. Room itself has a
price before anything is evicted: each block a placement adds pays ``occupancy_weight`` times its prefill times the
share of the rank then in use, so new prefixes go to the emptier caches first.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvledger.router.policies.base import (ConfiguredPolicy, RankState, RouteDecision, RouteRequest,
                                           check_nonneg_numbers, live_ranks, matched_tokens, pick_best)
from kvledger.router.policies.cache_model import CacheModel
from kvledger.router.probe import PrefixMatch


@dataclass(frozen=True, slots=True)
class KvCostModel:
    """The parameters of the cost estimate, in seconds; the defaults are rough figures for an 8B model
    with 16-token blocks on one GPU, to be replaced by measurements of the deployment."""

    prefill_s_per_token: float = 5e-5
    """Compute one prompt token (what a cache hit saves)."""
    onboard_s_per_block: float = 8e-5
    """Copy one block from the rank's host tier to its device tier (about 2 MiB over PCIe), for a rank that has
    measured none of its own."""
    migrate_s_per_block: float = 1e-4
    """Send one block from another rank (NCCL), per block."""
    migrate_setup_s: float = 2e-3
    """Fixed cost of one migration (coordinating sender and receiver)."""
    decode_s_per_block: float = 1e-6
    """How much each running decode block delays a new prefill (batch interference)."""
    allow_migration: bool = True
    """Consider pulling a prefix from the best-matching rank."""
    affinity_weight: float = 1.0
    """A live session's turn is credited on its rank with what the rank held of it at its last turn, while the
    index shows none of it, at this multiple of its prefill (0: the index alone decides)."""
    protection_weight: float = 1.0
    """A placement that would evict live sessions' blocks pays this multiple of their recompute (0: session blocks
    are no more protected than any other free block)."""
    eviction_weight: float = 0.3
    """A placement that would push a rank's least recently used blocks out pays this multiple of their expected
    reuses' prefill (0: what a placement evicts is not weighed). In the simulator 0.3 gains the most on ``docs``
    and ``powerlaw`` under load without costing the chat trace; at 1 its later turns start leaving full ranks."""
    queue_weight: float = 0.0
    """A prompt's prefill on a rank also delays the requests in flight there that run beside it: its compute is
    weighed at ``1 + queue_weight * in-flight requests`` times its seconds (0, the default: its own seconds only;
    at 0.1 the simulator's chat trace loses 4 points of hit rate, its turns leaving the busy rank that holds them)."""
    backlog_weight: float = 3.0
    """When every rank has requests waiting, a token computed anywhere delays the requests queued behind it: a
    placement's compute (its uncached prompt tokens, and the recompute of what it evicts) is weighed at
    ``1 + backlog_weight * k`` times its seconds, ``k`` the fewest requests queued (not yet running) on any live rank.
    The factor is the same on every rank, so it shifts the trade between waiting and computing, not the ranks'
    order: under a burst a prefix stays where it is held unless the queues differ by more than its recompute delays
    the backlog. In the simulator, at 150 and 400 requests/s on ``docs`` and ``powerlaw``, 3 keeps every document on
    one rank (0 moved them to the shorter queue: 9 to 16 points of hit rate lost, twice the p90), while the chat
    and conversation traces, whose ranks rarely all have a queue, route as at 0 (0: a placement's own time to first
    token alone)."""
    recent_requests: int = 32
    """A prefix the router sent to a rank within this many requests counts as held there though the index does not
    show it yet: its request may still be computing it, and the engine publishes it after (0: the index alone). A
    replica sees only its own requests; in the simulator 4 replicas still gain from it."""
    speed_spread: float = 1.0
    """How far apart the engines' learned speeds (``router.engine_rates``) may set their prefill figures: each rank's
    is the configured one times its learned seconds per token over the median rank's, within this factor either way
    (1, the default: the configured figure for every rank). Off until the fit is trusted: on two real vLLM CPU
    servers it read an engine another tenant slowed as 10x faster than its twin (the first token of a short prompt
    there is mostly overhead and batch interference), and at 4 ``kv`` moved most documents onto one engine."""
    fit_weight: float = 0.5
    """A placement whose blocks to completion, less those its prompt shares with the requests in flight on the rank,
    do not fit the rank's device blocks beside what those requests hold (``RankState.blocks_in_use``) cannot run
    there at once: the engine holds it back until blocks free, or preempts a running request, whose blocks are
    computed again. It pays this multiple of the overflowing blocks' prefill (0: what runs at once is not weighed).
    In the simulator's bursts (2 ranks of 200 blocks, one of them slowed or not) 0.5 gains up to 5.5 points of hit
    rate on ``docs``, ``powerlaw``, ``conversation`` and ``agents`` and loses none; at 2 the even conversation
    burst's p90 grows by a third."""
    occupancy_weight: float = 0.5
    """Each block a placement adds to a rank pays this multiple of a block's prefill times the share of the rank's
    blocks then in use: room is worth more where little is left, so new prefixes spread over the cluster's caches
    before any of them has to evict (0: free room is free)."""

    def __post_init__(self) -> None:
        if type(self.recent_requests) is not int:
            raise TypeError(f"recent_requests must be an int, got {type(self.recent_requests).__name__}")
        if type(self.allow_migration) is not bool:
            raise TypeError(f"allow_migration must be a bool, got {type(self.allow_migration).__name__}")
        check_nonneg_numbers(self, skip=("allow_migration",))
        if self.speed_spread < 1:
            raise ValueError(f"speed_spread must be >= 1 (1: learned speeds unused), got {self.speed_spread!r}")
        if self.prefill_s_per_token == 0:
            raise ValueError("prefill_s_per_token must be > 0: a free prefill makes every cache worthless")


class KvPolicy(ConfiguredPolicy):
    """Lowest estimated cost wins (see the module docstring); scores are seconds."""

    name = "kv"
    config_type = KvCostModel

    def __init__(self, config: KvCostModel | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._cache = CacheModel()

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        c = self.config
        bs, n = request.tokens_per_block, len(request.tokens)
        empty = PrefixMatch(0, 0, 0)
        match = {s.rank: matches.get(s.rank, empty) for s in live}
        prefill = _prefill_rates(live, c.prefill_s_per_token, c.speed_spread)
        load = {s.rank: s.queued_prefill_tokens * prefill[s.rank]
                + s.running_decode_blocks * c.decode_s_per_block for s in live}
        held = {r: max(m.matched_tokens, self._cache.recent_prefix(r, request.block_hashes, c.recent_requests) * bs)
                for r, m in match.items()}
        onboard = {s.rank: c.onboard_s_per_block if s.onboard_s_per_block is None else s.onboard_s_per_block
                   for s in live}
        backlog = 1.0 + c.backlog_weight * min(s.queued_requests for s in live)
        delays = {s.rank: (1.0 + c.queue_weight * s.inflight_requests) * backlog for s in live}
        scores = {r: load[r] + (n - held[r]) * prefill[r] * delays[r] + m.host_blocks * onboard[r]
                  for r, m in match.items()}
        own = request.session
        if own is not None and held.get(own.rank) == 0:
            lag = min(own.held_tokens, n - 1)
            held[own.rank] = lag
            scores[own.rank] -= lag * prefill[own.rank] * delays[own.rank] * c.affinity_weight
        evicts = _Evictions(request, c, {s.rank: s for s in live}, self._cache, prefill)
        for r in scores:
            scores[r] += evicts.cost(r, held[r]) * backlog
        migrations: dict[int, tuple[int, int]] = {}   # target -> (source, blocks moved)
        movable = {s.rank for s in live if s.migratable}
        if c.allow_migration and len(movable) > 1:
            src = max(movable, key=lambda r: (match[r].matched_blocks, -scores[r]))
            top = match[src].matched_blocks
            for r, m in match.items():
                moved = top - m.matched_blocks
                if r not in movable:
                    continue
                if moved <= 0:
                    continue
                cost = (load[r] + (n - top * bs) * prefill[r] * delays[r] + m.host_blocks * onboard[r]
                        + c.migrate_setup_s + moved * c.migrate_s_per_block + evicts.cost(r, held[r]) * backlog)
                if cost < scores[r]:
                    scores[r] = cost
                    migrations[r] = (src, moved)
        chosen = pick_best(scores, True, self._rng)
        src, moved = migrations.get(chosen, (None, 0))
        return RouteDecision(chosen, self.name, scores, True, matched_tokens(live, matches), src, moved)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        state = decision.loads.get(decision.rank)
        blocks = -(-(len(request.tokens) + request.max_tokens) // request.tokens_per_block)
        self._cache.touch(decision.rank, request.block_hashes, blocks - len(request.block_hashes),
                          state.kv_total_blocks if state is not None else 0)

    def on_rank_removed(self, rank: int) -> None:
        self._cache.forget(rank)


def _prefill_rates(live: Sequence[RankState], prior: float, spread: float) -> dict[int, float]:
    """Each rank's seconds per prompt token: ``prior`` scaled by its learned speed relative to the median rank's,
    within ``spread``, once every live rank has one (``RankState.prefill_s_per_token``); until then ``prior`` for
    all, so that the rank answering first does not look faster than the rest for want of their answers."""
    learned = [s.prefill_s_per_token for s in live]
    if spread == 1 or len(live) < 2 or not all(learned):
        return {s.rank: prior for s in live}
    median = sorted(learned)[len(learned) // 2]
    return {s.rank: prior * min(spread, max(1 / spread, s.prefill_s_per_token / median)) for s in live}


class _Evictions:
    """What placing ``request`` on a rank costs in the blocks it would evict there: live sessions' (protection) and
    the rank's least recently used (capacity); see the module docstring."""

    __slots__ = ("blocks", "cache", "config", "keep", "prefill", "request", "states")

    def __init__(self, request: RouteRequest, config: KvCostModel, states: Mapping[int, RankState],
                 cache: CacheModel, prefill: Mapping[int, float]) -> None:
        self.request, self.config, self.states, self.cache = request, config, states, cache
        self.prefill = prefill
        """Each rank's seconds per prompt token: what recomputing an evicted block costs there."""
        self.blocks = -(-(len(request.tokens) + request.max_tokens) // request.tokens_per_block)
        """The request's blocks to completion."""
        self.keep = frozenset(request.block_hashes)

    def cost(self, rank: int, held_tokens: int) -> float:
        """Seconds of recompute evicted by serving on ``rank``, which holds ``held_tokens`` of the prompt."""
        s, c, own = self.states[rank], self.config, self.request.session
        if not s.kv_total_blocks:
            return 0.0
        bs, p = self.request.tokens_per_block, self.prefill[rank]
        new = self.blocks - held_tokens // bs
        seconds = 0.0
        protected = s.session_blocks - (own.blocks if own is not None and own.rank == rank else 0)
        if protected > 0 and c.protection_weight:
            free = s.kv_total_blocks - s.blocks_in_use - protected
            evicted = min(protected, max(0, new - max(free, 0)))
            seconds += evicted * bs * p * c.protection_weight
        if c.fit_weight:
            need = self.blocks - s.shared_prompt_blocks
            over = min(need, s.blocks_in_use + need - s.kv_total_blocks)
            if over > 0:
                seconds += over * bs * p * c.fit_weight
        if new <= 0:
            return seconds
        used = max(self.cache.held(rank), s.kv_used_blocks)
        filled = min(1.0, (used + new) / s.kv_total_blocks)
        if c.eviction_weight:
            now = new - max(s.kv_total_blocks - used, 0)
            evicted = self.cache.eviction_value(rank, now, self.keep)
            later = self.cache.eviction_value(rank, new, self.keep) - evicted
            seconds += (evicted + filled * later) * bs * p * c.eviction_weight
        if c.occupancy_weight:
            seconds += new * bs * p * c.occupancy_weight * filled
        return seconds
