"""SGLang's (and vLLM router's) ``cache_aware`` policy: prefix affinity from its own routing history.

It hears no events. When the live ranks' loads (in-flight requests) are
imbalanced -- ``max - min > balance_abs_threshold`` and ``max >
balance_rel_threshold * min`` -- it sends the request to the least loaded rank.
Otherwise it looks the prompt up in its approximate tree of prompts it routed:
if the best rank's matched share of the prompt exceeds ``cache_threshold`` it
goes there, else to the rank with the least tree (the emptiest cache). Either
way the prompt is then recorded under the chosen rank (``on_routed``).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvledger.router.policies.approx_tree import ApproxTree
from kvledger.router.policies.base import (ConfiguredPolicy, RankState, RouteDecision, RouteRequest, live_ranks,
                                           matched_tokens, pick_best)
from kvledger.router.probe import PrefixMatch


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """sgl-router's knobs, with its current defaults."""

    cache_threshold: float = 0.3
    """Matched share of the prompt above which affinity wins."""
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tokens_per_rank: int = 2**24
    """Tree budget per rank (sgl-router's ``max_tree_size``) before LRU eviction."""

    def __post_init__(self) -> None:
        if type(self.cache_threshold) not in (int, float) or not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold!r}")
        if type(self.balance_abs_threshold) is not int or self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be an int >= 0, got {self.balance_abs_threshold!r}")
        if (type(self.balance_rel_threshold) not in (int, float) or not math.isfinite(self.balance_rel_threshold)
                or self.balance_rel_threshold < 1):
            raise ValueError(f"balance_rel_threshold must be a finite number >= 1, got {self.balance_rel_threshold!r}")
        if type(self.max_tokens_per_rank) is not int or self.max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {self.max_tokens_per_rank!r}")


class CacheAwarePolicy(ConfiguredPolicy):
    """Scores: in-flight requests when balancing (lower is better), else matched tokens per its tree
    (higher is better); the probe's matches are only reported, never used."""

    name = "cache_aware"
    config_type = CacheAwareConfig

    def __init__(self, config: CacheAwareConfig | None = None, seed: int = 0) -> None:
        super().__init__(config, seed)
        self._tree = ApproxTree(self.config.max_tokens_per_rank)

    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        live = live_ranks(ranks)
        c = self.config
        reported = matched_tokens(live, matches)
        loads = {s.rank: float(s.inflight_requests) for s in live}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold:
            return RouteDecision(pick_best(loads, True, self._rng), self.name, loads, True, reported)
        seen = self._tree.match(request.tokens, loads.keys())
        scores = {r: float(seen.get(r, 0)) for r in loads}
        best = max(scores.values())
        if best / len(request.tokens) > c.cache_threshold:
            holders = {r: loads[r] for r, v in scores.items() if v == best}
            chosen = pick_best(holders, True, self._rng)
        else:
            chosen = pick_best({r: float(self._tree.size(r)) for r in loads}, True, self._rng)
        return RouteDecision(chosen, self.name, scores, False, reported)

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._tree.insert(request.tokens, decision.rank)

    def on_rank_removed(self, rank: int) -> None:
        self._tree.remove_rank(rank)
