"""NVIDIA Dynamo's KV router cost, as its default worker selector computes it (temperature 0).

Per worker, in blocks (``lib/kv-router`` ``DefaultWorkerSelector``)::

    raw_prefill   = (active prefill tokens + prompt tokens) / block size
    credit        = device overlap * overlap_score_credit + host overlap * host_cache_hit_weight
    logit         = overlap_score_weight * max(raw_prefill - credit, 0) + decode blocks

where decode blocks are the worker's active blocks plus the request's own.
Lowest logit wins; ties are broken at random (seeded), as Dynamo does.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvledger.router.policies.base import (ConfiguredPolicy, RankState, RouteDecision, RouteRequest,
                                           check_nonneg_numbers, live_ranks, matched_tokens, pick_best)
from kvledger.router.probe import PrefixMatch


@dataclass(frozen=True, slots=True)
class DynamoCostConfig:
    """Dynamo's knobs, with its defaults."""

    overlap_score_weight: float = 1.0
    """``--kv-overlap-score-weight``: the prefill term's weight against decode load."""
    overlap_score_credit: float = 1.0
    """Credit per device-tier block already held."""
    host_cache_hit_weight: float = 0.75
    """Credit per host-tier (pinned CPU) block that continues the match."""

    def __post_init__(self) -> None:
        check_nonneg_numbers(self)


class DynamoPolicy(ConfiguredPolicy):
    """Scores are Dynamo's logits (blocks; lower is better)."""

    name = "dynamo"
    config_type = DynamoCostConfig

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        c = self.config
        bs, n = request.tokens_per_block, len(request.tokens)
        scores: dict[int, float] = {}
        for s in live:
            m = matches.get(s.rank)
            credit = 0.0 if m is None else (m.device_blocks * c.overlap_score_credit
                                            + m.host_blocks * c.host_cache_hit_weight)
            raw_prefill = (s.queued_prefill_tokens + n) / bs
            decode = s.running_decode_blocks + request.num_blocks
            scores[s.rank] = c.overlap_score_weight * max(raw_prefill - credit, 0.0) + decode
        chosen = pick_best(scores, True, self._rng)
        return RouteDecision(chosen, self.name, scores, True, matched_tokens(live, matches))
