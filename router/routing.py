"""The routing step the live router and the replay simulator share: weigh the live ranks, let the policy pick.

Both build every rank's ``RankState`` from the same ``LoadAccount`` (what was
dispatched and not finished) and the rank's own block counts, and hand the
policy the prefix matches they probed from the index (``router.probe``), so a
policy measured by ``kvledger bench`` is the policy ``kvledger up`` runs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.policies import RouteDecision, RouteRequest, RoutingPolicy
from kvledger.router.probe import PrefixMatch


class RouteStep:
    """``policy`` over ``account`` (see the module docstring); its caller serializes calls."""

    def __init__(self, policy: RoutingPolicy, account: LoadAccount) -> None:
        self.policy = policy
        self.account = account

    def decide(self, request: RouteRequest, matches: Mapping[int, PrefixMatch], live: Sequence[int],
               blocks: Mapping[int, tuple[int, int]], now: float, record: bool,
               reported: Mapping[int, ReportedQueue] | None = None, fixed: Collection[int] = (),
               sessions: Mapping[int, int] | None = None, rates: Mapping[int, float] | None = None,
               onboard: Mapping[int, float | None] | None = None) -> RouteDecision:
        """The policy's decision among ``live`` ranks; ``blocks`` is each rank's (used, total) device blocks.

        ``reported``: engines' own counts of their queues; ``fixed``: ranks KV cannot migrate to or from;
        ``sessions``: device blocks live sessions left on each rank (``router.sessions``); ``rates``: seconds per
        uncached prompt token learned of each rank (``router.engine_rates``); ``onboard``: each rank's measured
        seconds to onboard a host block (absent or ``None``: not measured).
        With ``record`` the request is then sent where the decision says, and a
        policy with a memory of its own (``cache_aware``) learns it.
        """
        reported, sessions, rates, onboard = reported or {}, sessions or {}, rates or {}, onboard or {}
        states = [self.account.state(r, now, *blocks.get(r, (0, 0)), reported.get(r), r not in fixed,
                                     sessions.get(r, 0), rates.get(r, 0.0), onboard.get(r)) for r in live]
        decision = dataclasses.replace(self.policy.route(request, states, matches),
                                       loads={s.rank: s for s in states})
        if record:
            self.policy.on_routed(request, decision)
        return decision
