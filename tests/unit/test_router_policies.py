"""Routing policies: contract tests over every registered policy, then each policy's own rule."""
from __future__ import annotations

import dataclasses
import random

import pytest

from kvledger.router.index import PrefixIndex
from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.policies import (CacheAwarePolicy, KvCostModel, KvPolicy, NoLiveRankError, RankState,
                                      RouteDecision, RouteRequest, make_policy, policy_names)
from kvledger.router.policies.approx_tree import ApproxTree
from kvledger.router.policies.cache_model import CacheModel
from kvledger.router.probe import PrefixMatch, match_prefix
from kvledger.worker.wire.events import BlockStored

TPB = 4
CACHE_AWARE = ["kv", "cache_aware", "dynamo", "llm_d"]


def req(tokens, max_tokens=8):
    return RouteRequest.of(tokens, TPB, max_tokens=max_tokens)


def ranks(n, **load):
    return [RankState(r, **load) for r in range(n)]


def held(blocks, host=0):
    return PrefixMatch(blocks, blocks * TPB, host)


def prime(policy, request, rank):
    """Tell a history-keeping policy that ``request`` went to ``rank`` (others ignore it)."""
    policy.on_routed(request, RouteDecision(rank, policy.name))


# --- contract: every policy ---------------------------------------------------------------------

def test_registry_has_ours_first_and_every_peer():
    assert policy_names() == ["kv", "round_robin", "random", "power_of_two", "cache_aware", "dynamo", "llm_d"]


@pytest.mark.parametrize("name", policy_names())
def test_never_routes_to_a_dead_rank(name):
    rng = random.Random(1)
    policy = make_policy(name, seed=3)
    for i in range(200):
        states = [RankState(r, alive=rng.random() < 0.5, queued_requests=rng.randrange(100),
                            queued_prefill_tokens=rng.randrange(5000), running_requests=rng.randrange(100),
                            running_decode_blocks=rng.randrange(200), kv_used_blocks=rng.randrange(50),
                            kv_total_blocks=50) for r in range(5)]
        states[i % 5] = RankState(i % 5, alive=True)
        tokens = [rng.randrange(20) for _ in range(rng.randrange(1, 60))]
        request = req(tokens)
        # dead ranks hold the longest prefixes and have routing history: a policy must still skip them
        matches = {s.rank: held(len(request.block_hashes), host=1 if s.rank == 4 else 0)
                   for s in states if not s.alive and request.block_hashes}
        decision = policy.route(request, states, matches)
        assert states[decision.rank].alive
        assert set(decision.matched_tokens) == {s.rank for s in states if s.alive}
        assert set(decision.scores) <= set(decision.matched_tokens)
        policy.on_routed(request, decision)
        for s in states:
            if not s.alive:
                prime(policy, request, s.rank)


@pytest.mark.parametrize("name", policy_names())
def test_no_live_rank_is_a_clear_error(name):
    policy = make_policy(name)
    with pytest.raises(NoLiveRankError, match="no live rank"):
        policy.route(req([1, 2, 3]), [RankState(0, alive=False), RankState(1, alive=False)], {})
    with pytest.raises(NoLiveRankError, match="no ranks"):
        policy.route(req([1, 2, 3]), [], {})


@pytest.mark.parametrize("name", policy_names())
def test_bad_rank_lists_are_rejected(name):
    policy = make_policy(name)
    with pytest.raises(ValueError, match="twice"):
        policy.route(req([1, 2, 3]), [RankState(0), RankState(0)], {})
    with pytest.raises(TypeError):
        policy.route(req([1, 2, 3]), [0, 1], {})


@pytest.mark.parametrize("name", policy_names())
def test_deterministic_with_a_seed(name):
    def run(seed):
        rng = random.Random(7)
        policy = make_policy(name, seed=seed)
        out = []
        for _ in range(60):
            states = [RankState(r, queued_requests=rng.randrange(3), queued_prefill_tokens=rng.randrange(3) * 64,
                                running_decode_blocks=rng.randrange(3)) for r in range(6)]
            request = req([rng.randrange(4) for _ in range(rng.randrange(2, 40))])
            matches = {r: held(min(len(request.block_hashes), rng.randrange(4))) for r in range(6)}
            d = policy.route(request, states, matches)
            policy.on_routed(request, d)
            out.append((d.rank, d.migrate_from, d.migrate_blocks))
        return out
    assert run(11) == run(11)


@pytest.mark.parametrize("name", CACHE_AWARE)
def test_cache_aware_policies_prefer_the_rank_holding_the_prefix(name):
    policy = make_policy(name, seed=0)
    prefix = list(range(100, 140))
    prime(policy, req(prefix + [1]), 2)
    request = req(prefix + [7, 8, 9])
    matches = {2: held(10), 0: held(1)}
    states = ranks(4, queued_requests=1, queued_prefill_tokens=32, running_decode_blocks=4,
                   kv_used_blocks=10, kv_total_blocks=100)
    assert policy.route(request, states, matches).rank == 2


def _simulate(policy_name: str) -> int:
    """Prompt tokens computed over a workload with shared system prompts, on an index fed by the choices."""
    rng = random.Random(4)
    index = PrefixIndex(TPB)
    policy = make_policy(policy_name, seed=0)
    systems = [[rng.randrange(1000) for _ in range(12 * TPB)] for _ in range(6)]
    computed = 0
    for _ in range(60):
        tokens = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(1, 3 * TPB))]
        request = req(tokens)
        decision = policy.route(request, ranks(4), match_prefix(index, request.block_hashes))
        policy.on_routed(request, decision)
        computed += len(tokens) - decision.matched_tokens[decision.rank]
        hs = list(request.block_hashes)
        assert index.apply(decision.rank, [BlockStored(hs, None, tokens[:len(hs) * TPB], TPB)]) is None
    return computed


def test_kv_beats_round_robin_when_prefixes_are_held():
    kv, rr = _simulate("kv"), _simulate("round_robin")
    assert kv < 0.5 * rr, (kv, rr)


# --- kv (ours) --------------------------------------------------------------------------------------

PROMPT41 = list(range(200, 241)) + [5]         # 42 tokens: 10 full blocks before the last token


def test_kv_cost_counts_prefill_onboard_queue_and_decode_exactly():
    cost = KvCostModel(prefill_s_per_token=1e-3, onboard_s_per_block=1e-4, decode_s_per_block=1e-5,
                       allow_migration=False)
    policy = KvPolicy(cost)
    states = [RankState(0, queued_prefill_tokens=10, running_decode_blocks=100), RankState(1)]
    d = policy.route(req(PROMPT41), states, {0: held(10, host=4), 1: held(2)})
    assert d.scores[0] == pytest.approx(10 * 1e-3 + 100 * 1e-5 + (42 - 40) * 1e-3 + 4 * 1e-4)
    assert d.scores[1] == pytest.approx((42 - 8) * 1e-3)
    assert d.rank == 0 and d.lower_is_better and d.matched_tokens == {0: 40, 1: 8}


def test_kv_host_blocks_cost_an_onboard_not_a_prefill():
    d = KvPolicy().route(req(PROMPT41), ranks(2), {0: held(10, host=10), 1: held(10)})
    assert d.rank == 1
    assert d.scores[0] - d.scores[1] == pytest.approx(10 * KvCostModel().onboard_s_per_block)
    none = KvPolicy().route(req(PROMPT41), ranks(2), {1: held(10)}).scores[0]
    assert d.scores[0] < none      # onboarding beats recomputing


BUSY = [RankState(0, queued_prefill_tokens=100_000), RankState(1), RankState(2, queued_prefill_tokens=50)]
#: A slow prefill (1 ms per token) makes the arithmetic of these small prompts easy to follow.
COST = KvCostModel(prefill_s_per_token=1e-3, onboard_s_per_block=1e-4, migrate_s_per_block=1e-4,
                   migrate_setup_s=1e-3, decode_s_per_block=1e-5)


def test_kv_migrates_the_prefix_off_an_overloaded_rank_when_the_transfer_is_cheaper():
    d = KvPolicy(COST).route(req(PROMPT41), BUSY, {0: held(10), 2: held(3)})
    assert (d.rank, d.migrate_from, d.migrate_blocks) == (1, 0, 10)
    assert d.scores[1] == pytest.approx(2 * 1e-3 + 1e-3 + 10 * 1e-4)       # 2 tokens + setup + 10 blocks
    assert d.scores[2] == pytest.approx(50e-3 + 2e-3 + 1e-3 + 7 * 1e-4)    # its queue; only 7 blocks to move
    # a rank already holding part of the prefix only needs the rest
    d = KvPolicy(COST).route(req(PROMPT41), [BUSY[0], BUSY[2]], {0: held(10), 2: held(3)})
    assert (d.rank, d.migrate_from, d.migrate_blocks) == (2, 0, 7)


def test_kv_recomputes_when_the_transfer_costs_more():
    # moving a block now costs a little more than computing its 4 tokens
    slow = dataclasses.replace(COST, migrate_s_per_block=TPB * 1e-3 * 1.01)
    d = KvPolicy(slow).route(req(PROMPT41), BUSY, {0: held(10), 2: held(3)})
    assert (d.rank, d.migrate_from, d.migrate_blocks) == (1, None, 0)
    assert d.scores[1] == pytest.approx(42 * 1e-3)


def test_kv_stays_on_the_holder_when_it_is_not_overloaded_or_migration_is_off():
    states = [RankState(0, queued_prefill_tokens=1, running_decode_blocks=20), RankState(1)]
    d = KvPolicy(COST).route(req(PROMPT41), states, {0: held(10)})
    assert (d.rank, d.migrate_from) == (0, None)
    no_moves = dataclasses.replace(COST, allow_migration=False)
    d = KvPolicy(no_moves).route(req(PROMPT41), BUSY, {0: held(10)})
    assert (d.rank, d.migrate_from) == (1, None)


def test_kv_weighs_compute_by_the_backlog_when_every_rank_has_a_queue():
    """Under a burst every rank has a queue, and what one computes delays the requests waiting behind it: a request
    waits on the rank holding its prefix for a queue gap (60 ms) that its own time to first token alone (42 ms
    recomputed elsewhere) would not wait for. One rank without a queue makes the factor 1 again."""
    cost = dataclasses.replace(COST, allow_migration=False)
    busy = [RankState(0, queued_prefill_tokens=100, queued_requests=3),
            RankState(1, queued_prefill_tokens=40, queued_requests=2)]
    d = KvPolicy(cost).route(req(PROMPT41), busy, {0: held(10)})
    backlog = 1 + cost.backlog_weight * 2
    assert d.scores == pytest.approx({0: 100e-3 + 2e-3 * backlog, 1: 40e-3 + 42e-3 * backlog})
    assert d.rank == 0
    own_time_only = dataclasses.replace(cost, backlog_weight=0.0)
    assert KvPolicy(own_time_only).route(req(PROMPT41), busy, {0: held(10)}).rank == 1
    idle = [busy[0], RankState(1)]
    d = KvPolicy(cost).route(req(PROMPT41), idle, {0: held(10)})
    assert d.scores == pytest.approx({0: 100e-3 + 2e-3, 1: 42e-3}) and d.rank == 1


def test_kv_never_migrates_to_or_from_a_rank_kv_cannot_move_to_and_counts_its_tokens_at_its_block_size():
    vllm_busy = [dataclasses.replace(BUSY[0], migratable=False), *BUSY[1:]]
    d = KvPolicy(COST).route(req(PROMPT41), vllm_busy, {0: held(10), 2: held(3)})
    assert (d.rank, d.migrate_from, d.migrate_blocks) == (1, 2, 3), "the movable holder is the source"
    assert d.scores[1] == pytest.approx(30 * 1e-3 + 1e-3 + 3 * 1e-4)
    # a vLLM server at 8 tokens per block holding 5 blocks holds 40 tokens: counted as tokens, not our blocks
    d = KvPolicy(COST).route(req(PROMPT41), [RankState(0, migratable=False), RankState(1)],
                             {0: PrefixMatch(5, 40, 0), 1: held(9)})
    assert d.rank == 0 and d.scores[0] == pytest.approx(2e-3) and d.scores[1] == pytest.approx(6e-3)


def test_an_engines_own_queue_count_wins_where_it_is_larger():
    account = LoadAccount()
    account.dispatch(0, 100, 4)
    mine = account.state(0, 0.0)
    assert (mine.queued_requests, mine.running_requests, mine.queued_prefill_tokens) == (1, 0, 100)
    theirs = account.state(0, 0.0, 10, 20, ReportedQueue(waiting=5, running=3), migratable=False)
    assert (theirs.queued_requests, theirs.running_requests, theirs.queued_prefill_tokens) == (5, 3, 100)
    assert (theirs.kv_used_blocks, theirs.kv_total_blocks, theirs.migratable) == (10, 20, False)


def test_kv_cost_model_rejects_bad_values():
    with pytest.raises(ValueError):
        KvCostModel(prefill_s_per_token=0)
    with pytest.raises(ValueError):
        KvCostModel(onboard_s_per_block=-1.0)
    with pytest.raises(ValueError):
        KvCostModel(migrate_s_per_block=float("nan"))
    with pytest.raises(TypeError):
        KvCostModel(allow_migration=1)


# --- peers --------------------------------------------------------------------------------------------

def test_dynamo_logit_matches_its_formula():
    states = [RankState(0, queued_prefill_tokens=8, running_decode_blocks=5), RankState(1, running_decode_blocks=30)]
    d = make_policy("dynamo").route(req(PROMPT41), states, {0: held(8, host=2)})
    blocks = 11                                   # 42 tokens in blocks of 4
    assert d.scores[0] == pytest.approx(max((8 + 42) / 4 - (6 * 1.0 + 2 * 0.75), 0) + 5 + blocks)
    assert d.scores[1] == pytest.approx(42 / 4 + 30 + blocks)
    assert d.rank == 0
    w = make_policy("dynamo", overlap_score_weight=0.0).route(req(PROMPT41), states, {}).scores
    assert w == {0: 5 + blocks, 1: 30 + blocks}


def test_llm_d_weighted_scorers():
    states = [RankState(0, queued_requests=4, kv_used_blocks=50, kv_total_blocks=100),
              RankState(1, queued_requests=0, kv_used_blocks=90, kv_total_blocks=100),
              RankState(2, queued_requests=2, kv_used_blocks=0, kv_total_blocks=100)]
    d = make_policy("llm_d").route(req(PROMPT41), states, {0: held(10), 2: held(5)})
    assert d.scores == pytest.approx({0: 3 * 1.0 + 2 * 0.0 + 2 * 0.5, 1: 0 + 2 * 1.0 + 2 * 0.1,
                                      2: 3 * 0.5 + 2 * 0.5 + 2 * 1.0})
    assert d.rank == 2 and not d.lower_is_better
    same_queue = make_policy("llm_d").route(req(PROMPT41), ranks(2), {})
    assert same_queue.scores == {0: 4.0, 1: 4.0}


def test_cache_aware_balances_when_loads_are_imbalanced():
    policy = CacheAwarePolicy()
    prime(policy, req(PROMPT41), 0)
    states = [RankState(0, running_requests=200), RankState(1, running_requests=100), RankState(2, running_requests=9)]
    d = policy.route(req(PROMPT41), states, {})
    assert d.rank == 2 and d.scores == {0: 200, 1: 100, 2: 9}
    # imbalance must be both absolute (> 64) and relative (> 1.5x)
    states = [RankState(0, running_requests=200), RankState(1, running_requests=140)]
    assert policy.route(req(PROMPT41), states, {}).rank == 0


def test_cache_aware_affinity_above_threshold_else_emptiest_tree():
    policy = CacheAwarePolicy()
    prime(policy, req(PROMPT41), 1)
    prime(policy, req(list(range(900, 1000))), 0)
    d = policy.route(req(PROMPT41[:20] + [1] * 10), ranks(3), {})    # 20 of 30 tokens seen on rank 1
    assert d.rank == 1 and d.scores == {0: 0.0, 1: 20.0, 2: 0.0}
    d = policy.route(req(PROMPT41[:5] + [1] * 25), ranks(3), {})     # 5/30 <= 0.3: the emptiest rank
    assert d.rank == 2
    policy.on_rank_removed(1)
    assert policy.route(req(PROMPT41[:20] + [1] * 10), ranks(3), {}).rank == 2


def test_round_robin_cycles_over_live_ranks():
    policy = make_policy("round_robin")
    states = [RankState(0), RankState(1, alive=False), RankState(2)]
    assert [policy.route(req([1, 2]), states, {}).rank for _ in range(4)] == [0, 2, 0, 2]


def test_power_of_two_takes_the_less_loaded_of_its_pair():
    policy = make_policy("power_of_two", seed=2)
    states = [RankState(r, running_requests=10 * r) for r in range(4)]
    for _ in range(30):
        d = policy.route(req([1, 2]), states, {})
        assert len(d.scores) == 2 and d.rank == min(d.scores, key=d.scores.get)
    assert {policy.route(req([1]), [RankState(5)], {}).rank} == {5}


def test_random_spreads_over_live_ranks():
    policy = make_policy("random", seed=0)
    states = ranks(3) + [RankState(3, alive=False)]
    assert {policy.route(req([1]), states, {}).rank for _ in range(100)} == {0, 1, 2}


# --- registry and request/state validation ---------------------------------------------------------

def test_make_policy_builds_configs_from_options():
    assert make_policy("kv", migrate_s_per_block=1.0).config.migrate_s_per_block == 1.0
    assert make_policy("cache_aware", cache_threshold=0.5).config.cache_threshold == 0.5
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(TypeError, match="no option"):
        make_policy("kv", prefil_s_per_token=1.0)
    with pytest.raises(TypeError, match="takes no options"):
        make_policy("round_robin", cache_threshold=0.5)
    with pytest.raises(ValueError):
        make_policy("cache_aware", cache_threshold=2.0)


def test_route_request_and_rank_state_validate():
    assert len(req(PROMPT41).block_hashes) == 10
    with pytest.raises(ValueError, match="block hashes"):
        RouteRequest(tuple(PROMPT41), (1, 2), TPB)
    with pytest.raises(ValueError, match="at least one token"):
        RouteRequest.of([], TPB)
    with pytest.raises(ValueError):
        RouteRequest.of([1, -2, 3], TPB)
    with pytest.raises(ValueError):
        RankState(-1)
    with pytest.raises(ValueError, match="exceeds"):
        RankState(0, kv_used_blocks=5, kv_total_blocks=4)
    with pytest.raises(TypeError):
        RankState(0, alive=1)


# --- the approximate tree behind cache_aware -----------------------------------------------------------

def test_approx_tree_splits_matches_and_evicts_least_recently_used():
    tree = ApproxTree(max_tokens_per_rank=20)
    tree.insert((1, 2, 3, 4, 5, 6), 0)
    tree.insert((1, 2, 3, 9, 9), 1)
    tree.insert((1, 2, 3, 4, 7), 0)
    assert tree.match((1, 2, 3, 4, 5, 6, 8), {0, 1}) == {0: 6, 1: 3}
    assert tree.match((1, 2, 3, 4, 5), {1}) == {1: 3}
    assert tree.size(0) == 7 and tree.size(1) == 5
    tree.insert(tuple(range(100, 115)), 0)               # 22 tokens > 20: oldest leaves go first
    assert tree.size(0) <= 16
    assert tree.match((1, 2, 3, 4, 5, 6), {0}) == {}
    assert tree.match(tuple(range(100, 115)), {0}) == {0: 15}
    assert tree.match((1, 2, 3, 9), {1}) == {1: 4}
    tree.remove_rank(1)
    assert tree.match((1, 2, 3, 9), {0, 1}) == {} and tree.size(1) == 0


# --- kv: capacity (router.policies.cache_model) ------------------------------------------------------

def test_cache_model_keeps_each_ranks_lru_order_within_its_capacity_and_values_only_reused_blocks():
    m = CacheModel()
    m.touch(0, [1, 2, 3], 1, capacity=6)
    m.touch(0, [1, 2, 4], 0, capacity=6)   # 1 and 2 reused, now most recent; 3 and the other block oldest
    assert m.held(0) == 5 and m.now == 2
    assert m.eviction_value(0, 2, keep=()) == 0.0   # the oldest two (3 and the anonymous block) were seen once
    assert m.eviction_value(0, 5, keep=()) > 0.0
    assert m.eviction_value(0, 5, keep={1, 2}) == 0.0
    m.touch(0, [5, 6, 7], 0, capacity=6)   # two fall out, oldest first
    assert m.held(0) == 6
    m.forget(0)
    assert m.held(0) == 0 and m.eviction_value(0, 3, ()) == 0.0


def _serve(policy, tokens, states):
    r = req(tokens, max_tokens=0)
    d = dataclasses.replace(policy.route(r, states, {}), loads={s.rank: s for s in states})
    policy.on_routed(r, d)
    return d.rank


def test_kv_spreads_new_prefixes_over_the_caches_before_any_has_to_evict():
    """Four documents of 11 blocks on two ranks of 24, rank 1 a token busier: priced by load alone, all four go to
    rank 0, which holds two; room has a price, so each rank gets two and both hold their share."""
    states = [RankState(0, kv_total_blocks=24), RankState(1, queued_prefill_tokens=1, kv_total_blocks=24)]
    docs = [list(range(1000 * d, 1000 * d + 41)) for d in range(1, 5)]
    policy = KvPolicy(KvCostModel(allow_migration=False, occupancy_weight=0.5))
    assert sorted(_serve(policy, d, states) for d in docs) == [0, 0, 1, 1]
    off = KvPolicy(KvCostModel(allow_migration=False, occupancy_weight=0))
    assert [_serve(off, d, states) for d in docs] == [0, 0, 0, 0]


def test_kv_weighs_the_reuse_a_placement_would_evict():
    """Rank 0 is full of a document asked again and again, rank 1 of blocks seen once: a new prompt goes to rank 1,
    though rank 0 is a little less loaded; without the eviction term it goes to rank 0."""
    hot, cold = list(range(100, 141)), [list(range(300 + 50 * i, 341 + 50 * i)) for i in range(3)]
    new = list(range(5000, 5041))

    def placed(cost):
        policy = KvPolicy(cost)
        full = [RankState(0, kv_total_blocks=13), RankState(1, kv_total_blocks=13)]
        for _ in range(3):
            policy.on_routed(req(hot, 0), RouteDecision(0, "kv", loads={0: full[0]}))
        for c in cold:
            policy.on_routed(req(c, 0), RouteDecision(1, "kv", loads={1: full[1]}))
        states = [RankState(0, kv_total_blocks=13), RankState(1, queued_prefill_tokens=2, kv_total_blocks=13)]
        return policy.route(req(new, 0), states, {}).rank

    assert placed(KvCostModel(allow_migration=False, eviction_weight=1)) == 1
    assert placed(KvCostModel(allow_migration=False, eviction_weight=0)) == 0


def test_kv_counts_migrated_blocks_as_taking_room_on_the_target():
    """Rank 0 holds the prompt's 10 blocks and is swamped, so the prefix moves. Rank 1 is full of a hot document,
    rank 2 of blocks seen once and a little busier: the 10 moved blocks would push the hot ones out of rank 1, so
    they go to rank 2 (were only the blocks computed beyond them to take room, rank 1 would look cheaper)."""
    hot, cold = list(range(100, 141)), [list(range(300 + 50 * i, 341 + 50 * i)) for i in range(3)]
    policy = KvPolicy(dataclasses.replace(COST, eviction_weight=1, occupancy_weight=0, recent_requests=0))
    full = [RankState(r, kv_total_blocks=13) for r in range(3)]
    for _ in range(3):
        policy.on_routed(req(hot, 0), RouteDecision(1, "kv", loads={1: full[1]}))
    for c in cold:
        policy.on_routed(req(c, 0), RouteDecision(2, "kv", loads={2: full[2]}))
    states = [RankState(0, queued_prefill_tokens=10_000, kv_total_blocks=13), RankState(1, kv_total_blocks=13),
              RankState(2, queued_prefill_tokens=8, kv_total_blocks=13)]
    d = policy.route(req(PROMPT41, 0), states, {0: held(10)})
    assert (d.rank, d.migrate_from, d.migrate_blocks) == (2, 0, 10)


def test_kv_does_not_pile_a_burst_past_what_the_holder_can_run_at_once():
    """Rank 0 holds the prompt's 10 blocks, but the requests in flight there hold 20 of its 24 blocks, none of them
    this prompt's: its 13 blocks to completion cannot run beside them, so the engine would hold it back or preempt.
    It goes to the idle rank 1 and computes the prompt there; without the fit term it stays on the holder. A prompt
    whose blocks the requests in flight share (another question on their document) still fits there."""
    cost = KvCostModel(prefill_s_per_token=1e-3, allow_migration=False, eviction_weight=0, occupancy_weight=0,
                       fit_weight=2)
    states = [RankState(0, running_requests=4, kv_total_blocks=24, dispatched_blocks=20),
              RankState(1, kv_total_blocks=24)]
    d = KvPolicy(cost).route(req(PROMPT41), states, {0: held(10)})
    over = 13 - (24 - 20)   # 42 tokens + 8 to decode: 13 blocks of 4
    assert d.scores == pytest.approx({0: (42 - 40) * 1e-3 + 2 * over * TPB * 1e-3, 1: 42e-3}) and d.rank == 1
    assert KvPolicy(dataclasses.replace(cost, fit_weight=0)).route(req(PROMPT41), states, {0: held(10)}).rank == 0
    shared = [dataclasses.replace(states[0], shared_prompt_blocks=10), states[1]]
    d = KvPolicy(cost).route(req(PROMPT41), shared, {0: held(10)})
    assert d.scores[0] == pytest.approx(2e-3) and d.rank == 0, "3 more blocks fit beside what runs"
    # the engine's own count of its blocks in use wins where it is larger
    reported = [dataclasses.replace(states[0], dispatched_blocks=0, kv_used_blocks=20), states[1]]
    assert KvPolicy(cost).route(req(PROMPT41), reported, {0: held(10)}).scores[0] == pytest.approx(
        (42 - 40) * 1e-3 + 2 * over * TPB * 1e-3)


def test_the_load_account_counts_the_blocks_in_flight_once_however_many_requests_share_them():
    """Two questions on one 10-block document in flight on rank 0 hold its blocks once, each its own output; a
    prompt on the same document shares its 10 blocks with them (a prompt on another document none), and the blocks
    go when the last request holding them ends."""
    account = LoadAccount()
    doc = req(PROMPT41).block_hashes
    a = account.dispatch(0, 42, 13, doc)
    b = account.dispatch(0, 2, 13, doc)
    peer = account.dispatch(0, 20, 6)   # no hashes (a peer's, another block size): every block its own
    other = req(list(range(500, 542))).block_hashes
    state = account.state(0, 0.0, prompt=doc)
    assert (state.dispatched_blocks, state.shared_prompt_blocks) == (10 + 3 + 3 + 6, 10)
    assert account.state(0, 0.0, prompt=other).shared_prompt_blocks == 0
    assert account.state(1, 0.0, prompt=doc).shared_prompt_blocks == 0
    account.prefilled(a)
    account.finished(a)
    assert account.state(0, 0.0, prompt=doc).dispatched_blocks == 10 + 3 + 6
    account.finished(b)
    account.finished(peer)
    state = account.state(0, 0.0, prompt=doc)
    assert (state.dispatched_blocks, state.shared_prompt_blocks) == (0, 0)
    with pytest.raises(ValueError, match="10 block hashes for a dispatch of 4 blocks"):
        account.dispatch(0, 42, 4, doc)
    assert account.state(0, 0.0).inflight_requests == 0, "a refused dispatch counts nowhere"
