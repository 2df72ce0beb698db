"""Routing policies behind one interface, chosen by name: ``make_policy("kv")``.

``kv`` is ours (the default); the others are the peers we compare with:
``round_robin``, ``random``, ``power_of_two``, ``cache_aware`` (SGLang / vLLM
router), ``dynamo`` (NVIDIA Dynamo's KV cost) and ``llm_d`` (llm-d's weighted
scorers).
"""
from __future__ import annotations

import dataclasses

from kvledger.router.policies.base import (NoLiveRankError, RankState, RouteDecision, RouteRequest, RoutingPolicy,
                                           SessionAt, live_ranks)
from kvledger.router.policies.cache_aware import CacheAwareConfig, CacheAwarePolicy
from kvledger.router.policies.dynamo import DynamoCostConfig, DynamoPolicy
from kvledger.router.policies.kv import KvCostModel, KvPolicy
from kvledger.router.policies.llm_d import LlmDPolicy, LlmDWeights
from kvledger.router.policies.power_of_two import PowerOfTwoPolicy
from kvledger.router.policies.random_choice import RandomPolicy
from kvledger.router.policies.round_robin import RoundRobinPolicy

DEFAULT_POLICY = "kv"

_POLICIES: dict[str, type[RoutingPolicy]] = {cls.name: cls for cls in (
    KvPolicy, RoundRobinPolicy, RandomPolicy, PowerOfTwoPolicy, CacheAwarePolicy, DynamoPolicy, LlmDPolicy)}


def policy_names() -> list[str]:
    """Every registered name, ours first."""
    return list(_POLICIES)


def policy_config_type(name: str) -> type | None:
    """The dataclass of ``name``'s options (``make_policy``'s keywords), or ``None`` when it takes none."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; choose one of {policy_names()}")
    return cls.config_type


def make_policy(name: str = DEFAULT_POLICY, *, seed: int = 0, **options: float | int | bool) -> RoutingPolicy:
    """A fresh policy; ``options`` are fields of its config dataclass (``KvCostModel`` for ``kv``, ...)."""
    config_type = policy_config_type(name)
    cls = _POLICIES[name]
    if type(seed) is not int:
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if config_type is None:
        if options:
            raise TypeError(f"policy {name!r} takes no options, got {sorted(options)}")
        return cls(seed=seed)  # type: ignore[call-arg]  # every policy takes seed
    known = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"policy {name!r} has no option(s) {unknown}; it takes {sorted(known)}")
    return cls(config_type(**options), seed=seed)  # type: ignore[call-arg]


__all__ = [
    "DEFAULT_POLICY", "CacheAwareConfig", "CacheAwarePolicy", "DynamoCostConfig", "DynamoPolicy", "KvCostModel",
    "KvPolicy", "LlmDPolicy", "LlmDWeights", "NoLiveRankError", "PowerOfTwoPolicy", "RandomPolicy", "RankState",
    "RoundRobinPolicy", "RouteDecision", "RouteRequest", "RoutingPolicy", "SessionAt", "live_ranks", "make_policy",
    "policy_config_type", "policy_names",
]
