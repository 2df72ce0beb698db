"""Round robin over the live ranks: the load-blind baseline every router ships."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvledger.router.policies.base import (RankState, RouteDecision, RouteRequest, RoutingPolicy, live_ranks,
                                           matched_tokens)
from kvledger.router.probe import PrefixMatch


class RoundRobinPolicy(RoutingPolicy):
    """The next live rank after the last one chosen; ``seed`` sets where the cycle starts."""

    name = "round_robin"

    def __init__(self, seed: int = 0) -> None:
        self._counter = seed

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        chosen = live[self._counter % len(live)].rank
        self._counter += 1
        return RouteDecision(chosen, self.name, matched_tokens=matched_tokens(live, matches))
