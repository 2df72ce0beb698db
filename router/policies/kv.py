"""Ours: the rank with the lowest estimated time to first token, optionally after pulling the prefix over.

Cost of serving on rank r, in seconds::

    queued_prefill_tokens * prefill + running_decode_blocks * decode        (its load)
    + (prompt tokens - matched blocks * block size) * prefill               (what it must compute)
    + host blocks of the match * onboard                                    (what it must copy up)

When the best-matching rank is loaded, another rank may do better by first
receiving the blocks it lacks from it (KV migration): its own load and its own
matched host blocks, the tokens beyond the source's match to compute, plus
``migrate_setup_s + blocks moved * migrate_s_per_block``. That option is only
taken when it beats every plain option, which includes computing the moved
blocks on the same rank, so a transfer is never chosen when recomputing is
cheaper.
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
    """Copy one block from the rank's host tier to its device tier (about 2 MiB over PCIe)."""
    migrate_s_per_block: float = 1e-4
    """Send one block from another rank (NCCL), per block."""
    migrate_setup_s: float = 2e-3
    """Fixed cost of one migration (coordinating sender and receiver)."""
    decode_s_per_block: float = 1e-6
    """How much each running decode block delays a new prefill (batch interference)."""
    allow_migration: bool = True
    """Consider pulling a prefix from the best-matching rank."""

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
        scores = {r: load[r] + (n - m.matched_tokens) * c.prefill_s_per_token
                  + m.host_blocks * c.onboard_s_per_block for r, m in match.items()}
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
                cost = (load[r] + tail + m.host_blocks * c.onboard_s_per_block
                        + c.migrate_setup_s + moved * c.migrate_s_per_block)
                if cost < scores[r]:
                    scores[r] = cost
                    migrations[r] = (src, moved)
        chosen = pick_best(scores, True, self._rng)
        src, moved = migrations.get(chosen, (None, 0))
        return RouteDecision(chosen, self.name, scores, True, matched_tokens(live, matches), src, moved)
