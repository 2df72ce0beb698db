"""Prefill apart from decode (``router.disaggregation``): when the router splits, and that a split request's
answer is the one computed from scratch.

The planner is checked on rank states alone; the service over real in-process ranks (ledger, reference engine,
migration through the rank interface), rank 0 only prefilling.
"""
from __future__ import annotations

import pytest
import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.config import RouterConfig
from kvledger.router.disaggregation import Link, SplitConfig, SplitPlanner, TransferRate
from kvledger.router.policies import RankState, RouteDecision, RouteRequest
from kvledger.router.probe import PrefixMatch
from kvledger.router.service import RouterService
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.wire.request import Request, Sampling
from rank_fuzz import scratch_result
from router_helpers import over_http

T = 4
ATOL = 1e-4


def planner(**kw) -> SplitPlanner:
    cfg = SplitConfig(**kw)
    return SplitPlanner(cfg, TransferRate(cfg.transfer_setup_s, cfg.transfer_s_per_block))


def request(n: int, max_tokens: int = 8) -> RouteRequest:
    return RouteRequest.of(list(range(1, n + 1)), T, max_tokens=max_tokens)


def states(*specs: tuple[int, dict]) -> dict[int, RankState]:
    return {r: RankState(r, **kw) for r, kw in specs}


def test_a_short_prompt_is_served_whole_and_a_long_one_beside_running_decodes_is_split():
    plan = planner(min_split_tokens=64)
    serving = states((1, {"running_requests": 6}), (2, {"running_requests": 6}))
    prefill = [RankState(0)]
    short = plan.plan(request(40), RouteDecision(1, "kv"), serving, prefill, {}, {})
    assert short.split is None and short.rank == 1
    long = plan.plan(request(400), RouteDecision(1, "kv"), serving, prefill, {}, {})
    assert long.split is not None and long.split.prefill_rank == 0 and long.split.whole_rank == 1
    assert long.split.split_s < long.split.whole_s
    idle = plan.plan(request(400), RouteDecision(1, "kv"), states((1, {}), (2, {})), prefill, {}, {})
    assert idle.split is None, "with nothing decoding beside it, a transfer only adds to the first token"


def test_a_prompt_the_whole_rank_holds_is_not_split():
    plan = planner(mode="always", min_split_tokens=64)
    req = request(400)
    held = {1: PrefixMatch(99, 396, 0)}
    d = plan.plan(req, RouteDecision(1, "kv"), states((1, {}), (2, {})), [RankState(0)], held, {})
    assert d.split is None, "only 3 tokens are uncached there"


def test_the_split_picks_the_prefill_rank_by_prefix_and_queue_and_the_decode_rank_by_decode_load():
    plan = planner(mode="always", min_split_tokens=64)
    req = request(400)
    serving = states((2, {"running_requests": 3}), (3, {"running_requests": 1}),
                     (4, {"running_requests": 0, "kv_total_blocks": 100, "kv_used_blocks": 90}))
    prefill = [RankState(0, queued_prefill_tokens=50), RankState(1, queued_prefill_tokens=50)]
    d = plan.plan(req, RouteDecision(2, "kv"), serving, prefill, {1: PrefixMatch(50, 200, 0)}, {})
    assert d.split.prefill_rank == 1, "rank 1 holds half the prompt"
    assert d.rank == 3, "rank 4 decodes nothing but has no room for the request's 102 blocks"
    busy = plan.plan(req, RouteDecision(2, "kv"), serving, [RankState(0), RankState(1, queued_prefill_tokens=10_000)],
                     {1: PrefixMatch(50, 200, 0)}, {})
    assert busy.split.prefill_rank == 0, "rank 1's queue outweighs its prefix"


def test_a_prefill_rank_pairs_only_with_decode_ranks_on_its_own_link():
    """A vLLM prefill server's KV reaches vLLM decode servers through their connector, never an own rank, and an
    own prefill rank's only own ranks; a rank on no link is served whole only."""
    plan = planner(mode="always", min_split_tokens=64)
    req = request(400)
    serving = states((2, {}), (1000, {"queued_prefill_tokens": 5000}), (1001, {}))
    links = {0: Link.MIGRATION, 2: Link.MIGRATION, 1002: Link.CONNECTOR, 1000: Link.CONNECTOR}
    vllm = plan.plan(req, RouteDecision(1000, "kv"), serving, [RankState(1002)], {}, {}, links)
    assert (vllm.rank, vllm.split.prefill_rank) == (1000, 1002), "1001 runs no connector; 2 is an own rank"
    own = plan.plan(req, RouteDecision(1000, "kv"), serving, [RankState(0)], {}, {}, links)
    assert (own.rank, own.split.prefill_rank) == (2, 0)
    both = plan.plan(req, RouteDecision(1000, "kv"), serving, [RankState(0), RankState(1002)], {}, {}, links)
    assert (both.rank, both.split.prefill_rank) == (2, 0), "the connector's decode rank has a queue, the migration's none"
    alone = plan.plan(req, RouteDecision(1001, "kv"), states((1001, {})), [RankState(1002)], {}, {}, links)
    assert alone.split is None and alone.rank == 1001


def test_the_transfer_rate_is_fitted_from_timed_migrations():
    rate = TransferRate(setup_s=0.5, per_block_s=0.5)
    assert rate.seconds(0) == 0 and rate.seconds(10) == pytest.approx(5.5), "the priors until measured"
    rate.observe(10, 0.012)
    assert rate.figures() == pytest.approx((0.5, 0.0)), "one size seen: the prior setup, per block clamped"
    for blocks in (10, 20, 40):
        rate.observe(blocks, 0.002 + blocks * 0.001)
    setup, per_block = rate.figures()
    assert per_block == pytest.approx(0.001, rel=0.2) and setup < 0.01
    rate.observe(0, 1.0)   # a migration that moved nothing says nothing of the bandwidth
    assert rate.figures() == pytest.approx((setup, per_block))


def test_bad_split_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="split mode"):
        SplitConfig(mode="sometimes")
    with pytest.raises(ValueError, match="min_split_tokens"):
        RouterConfig(min_split_tokens=0)
    with pytest.raises(ValueError, match="prefill_rank_ids"):
        RouterConfig(prefill_rank_ids=(0, 0))


def cache(primary: int = 96) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=primary, num_secondary_blocks=0)


@pytest.fixture
def split_service():
    svc = RouterService(LocalCluster.build(3, cache()), RouterConfig(
        tokens_per_block=T, prefill_rank_ids=(0,), split_mode="always", min_split_tokens=16))
    svc.feed.sync()
    yield svc
    svc.close()


def test_a_split_request_decodes_from_the_moved_blocks_and_answers_as_from_scratch(split_service):
    svc = split_service
    prompt = [(7 * i) % 250 + 1 for i in range(63)]
    got = svc.complete(prompt, max_tokens=6, fields={"logprobs": 0})
    assert got.decision.split is not None and got.decision.split.prefill_rank == 0
    assert got.rank in (1, 2) and got.migrated_blocks == 15
    assert got.cached_tokens == 60 and got.computed_tokens == 3, "the decode rank computes the tail only"
    ph = got.phases
    assert ph.prefill_rank == 0 and ph.transferred_blocks == 15 and ph.prefill_s > 0 and ph.transfer_s > 0
    assert ph.first_token_s >= ph.prefill_s + ph.transfer_s and len(ph.inter_token_s) == 5
    ref = scratch_result(cache(), Request(0, prompt, 6, sampling=Sampling(logprobs=0)))
    assert got.output_tokens == ref.output_tokens
    lp = [c["logprob"] for c in got.answer["choices"][0]["logprobs"]["content"]] \
        if "content" in got.answer["choices"][0]["logprobs"] else got.answer["choices"][0]["logprobs"]["token_logprobs"]
    assert lp == pytest.approx(ref.logprobs.chosen, abs=ATOL)
    for r in range(3):
        svc.engines.client(r).worker.check_integrity()
    for r in (0, got.rank):
        assert svc.engines.client(r).worker.manager.stats().used_num_blocks == 0, "nothing stays referenced"


def test_a_short_prompt_and_a_cached_one_are_served_whole(split_service):
    svc = split_service
    short = svc.complete(list(range(1, 10)), max_tokens=2)
    assert short.decision.split is None and short.rank in (1, 2) and short.phases.prefill_rank is None
    prompt = list(range(100, 160))
    first = svc.complete(prompt, max_tokens=2)
    again = svc.complete(prompt + [3], max_tokens=2)
    assert first.decision.split is not None
    assert again.decision.split is None and again.rank == first.rank and again.cached_tokens == 60


def test_the_route_endpoint_shows_the_split_and_both_estimates(split_service):
    with over_http(split_service) as client:
        d = client.post("/v1/route", json={"prompt": list(range(1, 80)), "max_tokens": 4}).json()
        short = client.post("/v1/route", json={"prompt": [1, 2, 3], "max_tokens": 4}).json()
    assert d["rank"] in (1, 2) and d["split"]["prefill_rank"] == 0 and d["split"]["whole_rank"] in (1, 2)
    assert d["split"]["split_s"] > 0 and d["split"]["whole_s"] > 0
    assert short["split"] is None
