"""The routing step the live router and the replay simulator share: weigh the live ranks, let the policy pick.

Both build every rank's ``RankState`` from the same ``LoadAccount`` (what was
dispatched and not finished) and the rank's own block counts, and hand the
policy the prefix matches they probed from the index (``router.probe``), so a
policy measured by ``kvledger bench`` is the policy ``kvledger up`` runs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from kvledger.router.disaggregation import Link, SplitPlanner
from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.policies import RankState, RouteDecision, RouteRequest, RoutingPolicy
from kvledger.router.probe import PrefixMatch


class RouteStep:
    """``policy`` over ``account`` (see the module docstring); its caller serializes calls."""

    def __init__(self, policy: RoutingPolicy, account: LoadAccount, planner: SplitPlanner | None = None) -> None:
        self.policy = policy
        self.account = account
        self.planner = planner
        """Splits prefill from decode where that pays (``router.disaggregation``), given prefill ranks."""

    def decide(self, request: RouteRequest, matches: Mapping[int, PrefixMatch], live: Sequence[int],
               blocks: Mapping[int, tuple[int, int]], now: float, record: bool,
               reported: Mapping[int, ReportedQueue] | None = None, fixed: Collection[int] = (),
               sessions: Mapping[int, int] | None = None, rates: Mapping[int, float] | None = None,
               onboard: Mapping[int, float | None] | None = None, prefill: Sequence[int] = (),
               links: Mapping[int, Link] | None = None) -> RouteDecision:
        """The policy's decision among ``live`` ranks; ``blocks`` is each rank's (used, total) device blocks.

        ``reported``: engines' own counts of their queues; ``fixed``: ranks KV cannot migrate to or from;
        ``sessions``: device blocks live sessions left on each rank (``router.sessions``); ``rates``: seconds per
        uncached prompt token learned of each rank (``router.engine_rates``); ``onboard``: each rank's measured
        seconds to onboard a host block (absent or ``None``: not measured); ``prefill``: live ranks that only
        prefill, which the policy never picks: the planner may send the prompt there first, then its KV to a
        serving rank on the same ``links`` path (each rank's ``Link``: one absent has none).
        With ``record`` the request is then sent where the decision says, and a
        policy with a memory of its own (``cache_aware``) learns it.
        """
        reported, sessions, rates, onboard = reported or {}, sessions or {}, rates or {}, onboard or {}

        def state(r: int) -> RankState:
            return self.account.state(r, now, *blocks.get(r, (0, 0)), reported.get(r), r not in fixed,
                                      sessions.get(r, 0), rates.get(r, 0.0), onboard.get(r), request.block_hashes)

        states = [state(r) for r in live]
        loads = {s.rank: s for s in states}
        decision = dataclasses.replace(self.policy.route(request, states, matches), loads=loads)
        links = links or {}
        prefilling = [state(r) for r in prefill if r in links]
        if self.planner is not None and prefilling:
            decision = self.planner.plan(request, decision, loads, prefilling, matches, rates, links)
            if decision.split is not None:
                decision = dataclasses.replace(decision, migrate_from=None, migrate_blocks=0,
                                               loads={**loads, **{s.rank: s for s in prefilling}})
        if record:
            self.policy.on_routed(request, decision)
        return decision
