"""llm-d's inference scheduler: weighted scorers, each normalised to [0, 1], highest sum wins.

Scorers (weights as in llm-d's default profile): prefix cache (share of the
prompt's blocks the rank holds), queue depth (min-max normalised waiting
requests, fewer is better; all equal scores 1) and KV-cache utilisation
(1 - used/total). Ties are broken at random (seeded), as its max-score picker does.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvledger.router.policies.base import (ConfiguredPolicy, RankState, RouteDecision, RouteRequest,
                                           check_nonneg_numbers, live_ranks, matched_tokens, pick_best)
from kvledger.router.probe import PrefixMatch


@dataclass(frozen=True, slots=True)
class LlmDWeights:
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_utilisation_weight: float = 2.0

    def __post_init__(self) -> None:
        check_nonneg_numbers(self)


class LlmDPolicy(ConfiguredPolicy):
    """Scores are the weighted sums (higher is better)."""

    name = "llm_d"
    config_type = LlmDWeights

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        w = self.config
        blocks = len(request.block_hashes)
        queues = [s.queued_requests for s in live]
        q_min, q_max = min(queues), max(queues)
        scores: dict[int, float] = {}
        for s in live:
            m = matches.get(s.rank)
            prefix = 0.0 if m is None or blocks == 0 else m.matched_blocks / blocks
            queue = 1.0 if q_max == q_min else (q_max - s.queued_requests) / (q_max - q_min)
            kv = 1.0 - s.kv_utilisation
            scores[s.rank] = w.prefix_weight * prefix + w.queue_weight * queue + w.kv_utilisation_weight * kv
        chosen = pick_best(scores, False, self._rng)
        return RouteDecision(chosen, self.name, scores, False, matched_tokens(live, matches))
