"""A uniformly random live rank (seeded, so a run repeats)."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvledger.router.policies.base import (RankState, RouteDecision, RouteRequest, RoutingPolicy, live_ranks,
                                           matched_tokens)
from kvledger.router.probe import PrefixMatch


class RandomPolicy(RoutingPolicy):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        return RouteDecision(self._rng.choice(live).rank, self.name, matched_tokens=matched_tokens(live, matches))
