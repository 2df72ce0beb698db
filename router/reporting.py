"""The ``ClusterReport`` put together from what the router's parts know: engines, the feed, loads and the tally."""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from kvledger.router.engine_rates import EngineRates
from kvledger.router.admission import TenantAdmission
from kvledger.router.engines import Engines
from kvledger.router.feed import EventFeed
from kvledger.router.report import (ClusterReport, ForeignReport, RankReport, RouterTotals, SessionsReport,
                                    TenantReport, TierBlocks)
from kvledger.router.sessions import SessionStats
from kvledger.router.tally import Tally
from kvledger.worker.wire.messages import RankLoad


def cluster_report(policy: str, tokens_per_block: int, live: Sequence[int], engines: Engines, feed: EventFeed,
                   loads: Mapping[int, RankLoad], inflight: Mapping[int, tuple[int, int]], tally: Tally,
                   tenants: Sequence[TenantAdmission], sessions: SessionStats, rates: EngineRates,
                   prefill_only: Collection[int] = ()) -> ClusterReport:
    """Per live rank its blocks, hit rate, events, load and what was routed to it; per ZMQ-fed engine its index
    view; the router's totals; per tenant its admission; its sessions. ``inflight``: per live rank, requests
    dispatched and their queued tokens; ``rates``: what the router learned of each engine's speed; ``prefill_only``:
    the vLLM ranks that only prefill."""
    index = feed.index
    events = {r: feed.counters(r) for r in live}
    foreign_engines = feed.foreign_engines()
    dp_ranks = feed.foreign_dp_ranks()
    rejected = feed.rejections.by_rank()
    infos = {r: e.info() for r, e in engines.live_engines().items()}
    with feed.lock:
        held = {r: (index.num_blocks(r), index.next_seq(r), index.block_size(r)) for r in [*live, *foreign_engines]}
        host_only = {r: index.store.host_only_blocks(r) for r in foreign_engines}
        ix, total_blocks = index.stats, index.num_blocks()
        applied, duplicate = ix.batches_applied, ix.batches_duplicate
        replays, snapshots = ix.replays_requested, ix.snapshots_loaded
    ranks = []
    for r in live:
        load, c, info = loads.get(r), tally.rank(r), infos.get(r)
        events_total, events_per_s, batches = events[r]
        rate = rates.rate(r)
        ranks.append(RankReport(
            r, True, None if load is None else {
                "GPU": TierBlocks(load.device_blocks_used, load.device_blocks_free),
                "CPU": TierBlocks(load.host_blocks_used, load.host_blocks_free)},
            None if load is None else load.cache_hit_rate, held[r][0], held[r][1], events_total, events_per_s,
            batches, c.decisions, c.completions, c.prompt_tokens, c.cached_tokens, *inflight.get(r, (0, 0)),
            c.predicted_tokens, info.model if info else "", held[r][2], info.url if info else None,
            rejected.get(r, {}), rate.prefill_s_per_token if rate else None,
            rate.decode_s_per_token if rate else None, dp_ranks.get(r),
            None if load is None else load.onboard_s_per_block))
    with tally.lock:
        s = tally.stats
        totals = RouterTotals(s.completions, s.prompt_tokens, s.cached_tokens,
                              s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0, s.migrations,
                              s.migrated_blocks, s.retries, feed.ranks_removed, total_blocks, applied, duplicate,
                              replays, snapshots, feed.log.next_id, s.predicted_tokens,
                              s.cached_tokens / s.predicted_tokens if s.predicted_tokens else None,
                              feed.rejections.total())
    added, live_set = engines.added(), set(live)
    foreign = [ForeignReport(r, name, *held[r][:2], r in live_set or r not in added, held[r][2], rejected.get(r, {}),
                             dp_ranks.get(r), host_only[r], r in prefill_only)
               for r, name in foreign_engines.items()]
    s = sessions
    return ClusterReport(policy, tokens_per_block, ranks, foreign, totals, tenant_reports(tenants),
                         SessionsReport(s.live, s.waiting_on_tool, s.turns, s.prompt_tokens, s.cached_tokens,
                                        s.hit_rate))


def tenant_reports(tenants: Sequence[TenantAdmission]) -> list[TenantReport]:
    """Each tenant's admission, with its share of the tokens let onto the ranks."""
    total = sum(t.served_tokens for t in tenants)
    return [TenantReport(t.tenant, t.limits.weight, t.limits.max_inflight, t.limits.tokens_per_s, t.running, t.queued,
                         t.shed, t.served, t.served_tokens, t.served_tokens / total if total else 0.0,
                         t.queue_seconds.sum / t.queue_seconds.count if t.queue_seconds.count else None)
            for t in tenants]
