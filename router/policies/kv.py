"""Ours: the rank with the lowest estimated time to first token, optionally after pulling the prefix over.

Cost of serving on rank r, in seconds::

    queued_prefill_tokens * prefill + running_decode_blocks * decode        (its load)
    + (prompt tokens - matched blocks * block size) * prefill               (what it must compute)
    + host blocks of the match * onboard                                    (what it must copy up)

``onboard`` is the rank's own measurement where it has one (``RankState.onboard_s_per_block``: a vLLM
engine's from its offloading metrics, ``router.vllm_onboard``), else ``KvCostModel.onboard_s_per_block``: a
prefix found only on a rank's host tier is credited its prefill less what copying it up costs there.

When the best-matching rank is loaded, another rank may do better by first
receiving the blocks it lacks from it (KV migration): its own load and its own
matched host blocks, the tokens beyond the source's match to compute, plus
``migrate_setup_s + blocks moved * migrate_s_per_block``. That option is only
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
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvledger.router.policies.base import (ConfiguredPolicy, RankState, RouteDecision, RouteRequest,
                                           check_nonneg_numbers, live_ranks, matched_tokens, pick_best)
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

    def __post_init__(self) -> None:
        if type(self.allow_migration) is not bool:
            raise TypeError(f"allow_migration must be a bool, got {type(self.allow_migration).__name__}")
        check_nonneg_numbers(self, skip=("allow_migration",))
        if self.prefill_s_per_token == 0:
            raise ValueError("prefill_s_per_token must be > 0: a free prefill makes every cache worthless")


class KvPolicy(ConfiguredPolicy):
    """Lowest estimated cost wins (see the module docstring); scores are seconds."""

    name = "kv"
    config_type = KvCostModel

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        c = self.config
        bs, n = request.tokens_per_block, len(request.tokens)
        empty = PrefixMatch(0, 0, 0)
        match = {s.rank: matches.get(s.rank, empty) for s in live}
        load = {s.rank: s.queued_prefill_tokens * c.prefill_s_per_token
                + s.running_decode_blocks * c.decode_s_per_block for s in live}
        onboard = {s.rank: c.onboard_s_per_block if s.onboard_s_per_block is None else s.onboard_s_per_block
                   for s in live}
        scores = {r: load[r] + (n - m.matched_tokens) * c.prefill_s_per_token
                  + m.host_blocks * onboard[r] for r, m in match.items()}
        held = {r: m.matched_tokens for r, m in match.items()}
        own = request.session
        if own is not None and held.get(own.rank) == 0:
            lag = min(own.held_tokens, n - 1)
            held[own.rank] = lag
            scores[own.rank] -= lag * c.prefill_s_per_token * c.affinity_weight
        evicts = _Protection(request, c, {s.rank: s for s in live})
        for r in scores:
            scores[r] += evicts.cost(r, held[r])
        migrations: dict[int, tuple[int, int]] = {}   # target -> (source, blocks moved)
        movable = {s.rank for s in live if s.migratable}
        if c.allow_migration and len(movable) > 1:
            src = max(movable, key=lambda r: (match[r].matched_blocks, -scores[r]))
            top = match[src].matched_blocks
            tail = (n - top * bs) * c.prefill_s_per_token
            for r, m in match.items():
                moved = top - m.matched_blocks
                if r not in movable:
                    continue
                if moved <= 0:
                    continue
                cost = (load[r] + tail + m.host_blocks * onboard[r]
                        + c.migrate_setup_s + moved * c.migrate_s_per_block + evicts.cost(r, top * bs))
                if cost < scores[r]:
                    scores[r] = cost
                    migrations[r] = (src, moved)
        chosen = pick_best(scores, True, self._rng)
        src, moved = migrations.get(chosen, (None, 0))
        return RouteDecision(chosen, self.name, scores, True, matched_tokens(live, matches), src, moved)


class _Protection:
    """What placing ``request`` on a rank costs in live sessions' blocks it would evict there (module docstring)."""

    __slots__ = ("blocks", "config", "request", "states")

    def __init__(self, request: RouteRequest, config: KvCostModel, states: Mapping[int, RankState]) -> None:
        self.request, self.config, self.states = request, config, states
        self.blocks = -(-(len(request.tokens) + request.max_tokens) // request.tokens_per_block)
        """The request's blocks to completion."""

    def cost(self, rank: int, held_tokens: int) -> float:
        """Seconds of session recompute evicted by serving on ``rank``, which holds ``held_tokens`` of the prompt."""
        s, c, own = self.states[rank], self.config, self.request.session
        protected = s.session_blocks - (own.blocks if own is not None and own.rank == rank else 0)
        if protected <= 0 or not s.kv_total_blocks or not c.protection_weight:
            return 0.0
        bs = self.request.tokens_per_block
        free = s.kv_total_blocks - max(s.kv_used_blocks, s.dispatched_blocks) - protected
        evicted = min(protected, max(0, self.blocks - held_tokens // bs - max(free, 0)))
        return evicted * bs * c.prefill_s_per_token * c.protection_weight
