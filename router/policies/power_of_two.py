"""Power of two choices: sample two live ranks, take the less loaded (in-flight requests, as sgl-router counts)."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvledger.router.policies.base import (RankState, RouteDecision, RouteRequest, RoutingPolicy, live_ranks,
                                           matched_tokens)
from kvledger.router.probe import PrefixMatch


class PowerOfTwoPolicy(RoutingPolicy):
    """Scores are the two sampled ranks' in-flight requests; ties keep the first sampled."""

    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        pair = self._rng.sample(live, 2) if len(live) > 1 else live
        scores = {s.rank: float(s.inflight_requests) for s in pair}
        chosen = min(pair, key=lambda s: s.inflight_requests).rank
        return RouteDecision(chosen, self.name, scores, True, matched_tokens(live, matches))
