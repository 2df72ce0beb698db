"""The router service over real in-process ranks (RankWorker: ledger, reference engine, event publisher).

No Ray, no HTTP: every rank call is a direct call, so what is checked here is
the router's logic -- events to index, catch-up by replay and snapshot, routing
on the index, migration, and a rank dying mid-request.
"""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.config import RouterConfig
from kvledger.router.numbering import ApplyStatus
from kvledger.router.policies import NoLiveRankError, make_policy
from kvledger.router.served import OverloadedError
from kvledger.router.service import RouterService
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.rank.scheduler import BatchingConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.request import Request

T = 4


def make_backend(ranks: int = 2, primary: int = 48, secondary: int = 16, replay_size: int = 1024) -> LocalCluster:
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=primary, num_secondary_blocks=secondary)
    return LocalCluster.build(ranks, cfg, replay_size=replay_size)


def make_service(backend: LocalCluster, policy: str = "kv", **kw) -> RouterService:
    svc = RouterService(backend, RouterConfig(tokens_per_block=T, policy=policy, **kw))
    svc.feed.sync()
    return svc


def assert_index_agrees(svc: RouterService, prompts, **kw) -> None:
    for p in prompts:
        approx = {r: m.matched_tokens for r, m in svc.probe(p, exact=False, **kw).items()}
        exact = {r: m.matched_tokens for r, m in svc.probe(p, exact=True, **kw).items()}
        assert approx == exact, f"index {approx} vs ledgers {exact} for prompt of {len(p)} tokens"


def test_shared_prefix_goes_where_it_is_cached_and_reuses_it():
    svc = make_service(make_backend())
    prefix = list(range(1, 33))
    first = svc.complete(prefix + [40, 41, 42], max_tokens=4)
    second = svc.complete(prefix + [50, 51], max_tokens=4)
    assert first.cached_tokens == 0 and first.computed_tokens == 35
    assert second.rank == first.rank, "the kv policy sends the prompt to the rank holding its prefix"
    assert second.cached_tokens >= 32 and second.decision.matched_tokens[first.rank] == 32
    assert second.prompt_tokens == 34 and len(second.output_tokens) == 4
    again = svc.complete(prefix + [40, 41, 42], max_tokens=4)
    assert again.output_tokens == first.output_tokens, "reused KV gives the same greedy tokens"
    summary = svc.report()
    assert summary.router.completions == 3 and summary.router.cached_tokens > 0
    busy = next(r for r in summary.ranks if r.rank == first.rank)
    assert busy.completions == 3 and busy.index_blocks > 0 and busy.events_total > 0
    assert busy.blocks["GPU"].free == 48 and busy.cache_hit_rate > 0


def test_a_stream_stops_counting_as_queued_prefill_once_its_first_chunk_is_in():
    svc = make_service(make_backend())
    events = svc.stream(list(range(1, 30)), max_tokens=6)
    rank, _, _ = next(events)
    # its prompt is computed: the policies see it decoding on its rank, no longer as prefill waiting there
    s = svc.account.state(rank, svc.clock())
    assert (s.queued_requests, s.queued_prefill_tokens, s.running_requests) == (0, 0, 1)
    assert [ev for _, _, ev in events][-1] == "[DONE]"
    s = svc.account.state(rank, svc.clock())
    assert (s.queued_requests, s.queued_prefill_tokens, s.running_requests) == (0, 0, 0)


def test_a_decision_counts_in_the_load_before_the_next_decision_can_see_the_rank():
    svc = make_service(make_backend())
    seen = []
    place = svc._place

    def placed(*args, **kwargs):   # the moment another thread may decide: the placement made, nothing sent yet
        p = place(*args, **kwargs)
        s = svc.account.state(p.decision.rank, svc.clock())
        seen.append((s.queued_requests, s.queued_prefill_tokens))
        return p

    svc._place = placed
    prompt = list(range(1, 30))
    first = svc.complete(prompt, max_tokens=2)
    assert seen == [(1, 29)], "concurrent requests would see the rank idle and herd onto it"
    events = svc.stream(prompt, max_tokens=2)
    rank, _, _ = next(events)
    assert rank == first.rank and seen[1] == (1, 1), "the second is counted at the one token its rank lacks"
    assert [ev for _, _, ev in events][-1] == "[DONE]"
    s = svc.account.state(rank, svc.clock())
    assert (s.queued_requests, s.running_requests) == (0, 0), "each dispatch is counted once and finished"


def test_index_equals_the_ledgers_after_a_mixed_workload():
    """The issue's check: with no events in flight, probe(exact=False) == probe(exact=True)."""
    backend = make_backend(ranks=3, primary=40, secondary=12)
    svc = make_service(backend)
    rng = random.Random(7)
    stems = [[rng.randrange(256) for _ in range(rng.randrange(8, 30))] for _ in range(5)]
    prompts = []
    for i in range(40):
        p = rng.choice(stems) + [rng.randrange(256) for _ in range(rng.randrange(1, 14))]
        kw = rng.choice([{}, {}, {"cache_salt": "tenant-a"}, {"lora_id": 3}])
        svc.complete(p, max_tokens=rng.randrange(0, 6), priority=rng.choice([None, 10, 35, 80]), **kw)
        prompts.append((p, kw))
        if i % 9 == 4:   # a rank serving outside the router: its events arrive by the push path, out of order
            w = backend.worker(i % 3)
            w.serve([Request(10_000 + i, p[::-1], 2)])
            a = w.poll_events()
            w.serve([Request(20_000 + i, p[::-1] + [9] * 8, 1)])
            b = w.poll_events()
            assert svc.feed.ingest(w.rank, b.seq, b.data).status is ApplyStatus.APPLIED   # caught up by replay
            assert svc.feed.ingest(w.rank, a.seq, a.data).status is ApplyStatus.DUPLICATE
            prompts.append((p[::-1], {}))
    stats = [backend.worker(r).manager.stats() for r in range(3)]
    assert sum(s.offloaded_blocks for s in stats) > 0, "the workload must push blocks to the host tier"
    assert svc.index.stats.replays_requested > 0
    for p, kw in prompts[::2] + [(s + [1, 2, 3], {}) for s in stems]:
        assert_index_agrees(svc, [p], **kw)
    for r in range(3):
        backend.worker(r).check_integrity()


def test_a_router_that_starts_late_rebuilds_from_snapshots_and_replays():
    backend = make_backend(replay_size=2)
    early = make_service(backend)
    prompts = [[k] * 5 + list(range(k, k + 20)) for k in range(1, 6)]
    for p in prompts:
        early.complete(p, max_tokens=2)
    late = RouterService(backend, RouterConfig(tokens_per_block=T))
    assert late.probe(prompts[0])[0].matched_tokens == 0   # has heard nothing yet
    late.feed.sync()
    assert_index_agrees(late, prompts)
    # a rank's batch number far ahead of the (gone) replay buffer: snapshot again
    w = backend.worker(0)
    for i in range(4):
        w.serve([Request(500 + i, [200 + i] * 9, 0)])
        batch = w.poll_events()
    fresh = RouterService(backend, RouterConfig(tokens_per_block=T))
    res = fresh.feed.ingest(0, batch.seq, batch.data)
    assert res.status is ApplyStatus.SNAPSHOT and res.next_seq == batch.seq + 1
    assert fresh.probe([203] * 9)[0].matched_tokens == 8


def test_a_rank_that_dies_is_dropped_at_once_and_its_request_served_elsewhere():
    backend = make_backend(ranks=3)
    svc = make_service(backend)
    prefix = list(range(100, 140))
    home = svc.complete(prefix + [1], max_tokens=2).rank
    assert svc.index.num_blocks(home) > 0
    backend.crash(home)                       # the backend learns only on its next call to that rank
    out = svc.complete(prefix + [2], max_tokens=2)
    assert out.rank != home and out.retries == 1 and len(out.output_tokens) == 2
    assert svc.index.num_blocks(home) == 0 and home not in svc.index.ranks()
    assert home not in [r.rank for r in svc.report().ranks]
    assert svc.probe(prefix + [3])[out.rank].matched_tokens == 40
    assert [e.event["type"] for e in svc.feed.events(0, rank=home)[0]][-1] == "RankRemoved"
    # it comes back restarted, with an empty ledger numbered from 0 again
    backend.restart(home)
    svc.feed.sync()
    assert home in svc.index.ranks() and svc.index.num_blocks(home) == 0
    assert_index_agrees(svc, [prefix + [4]])


def test_no_live_rank_and_bad_input_change_nothing():
    backend = make_backend(ranks=1)
    svc = make_service(backend)
    before = svc.report().router
    for bad, exc in [([], ValueError), ([1, -2, 3], ValueError), ([1, 512], ValueError), ("text", TypeError)]:
        with pytest.raises(exc):
            svc.complete(bad)
    with pytest.raises(ValueError, match="max_tokens"):
        svc.complete([1, 2, 3], max_tokens=-1)
    with pytest.raises(ValueError):
        svc.complete([1, 2, 3], priority=101)
    assert svc.report().router == before
    backend.crash(0)
    with pytest.raises(NoLiveRankError):
        svc.complete([1, 2, 3])
    with pytest.raises(NoLiveRankError):
        svc.route([1, 2, 3])


def test_a_loaded_best_rank_hands_its_prefix_over_by_migration():
    backend = make_backend(ranks=2, primary=200)
    policy = make_policy("kv", migrate_setup_s=0.0, migrate_s_per_block=1e-9)
    svc = RouterService(backend, RouterConfig(tokens_per_block=T), policy=policy)
    svc.feed.sync()
    shared = list(range(10, 58))                        # 12 blocks
    home = svc.complete(shared + [1], max_tokens=1).rank
    other = 1 - home
    backend.worker(other).serve([Request(900, shared[:16] + [1])])
    svc.feed.flush(other)                                    # the other rank holds the first 4 blocks itself
    # The gate: the busy request waits at the home rank's door, before serving takes the ledger lock (which the
    # migration below needs), so it stays in flight -- dispatched, unanswered -- until the checks are done.
    busy_prompt = shared + [2] * 8
    worker = backend.worker(home)
    serve = worker.serve
    at_door, gate = threading.Event(), threading.Event()

    def gated_serve(requests, logits=False, publish=False):
        if any(r.tokens == busy_prompt for r in requests):
            at_door.set()
            assert gate.wait(timeout=30), "the test never opened the gate"
        return serve(requests, logits, publish)

    worker.serve = gated_serve
    answered: list = []
    busy = threading.Thread(target=lambda: answered.append(svc.complete(busy_prompt, max_tokens=400)))
    busy.start()                                       # the same prefix: the kv policy sends it home too
    try:
        assert at_door.wait(timeout=30), "the long request never reached the home rank"
        assert svc.report(refresh=False).ranks[home].inflight_requests == 1
        decision = svc.route(shared + [3], max_tokens=1)
        out = svc.complete(shared + [3], max_tokens=1)
        assert svc.report(refresh=False).ranks[home].inflight_requests == 1, "still held at the gate"
    finally:
        gate.set()
        busy.join(timeout=30)
    assert not busy.is_alive() and answered, "the gated request was answered once the gate opened"
    assert answered[0].rank == home and len(answered[0].output_tokens) == 400
    assert decision.rank == other and decision.migrate_from == home and decision.migrate_blocks == 8
    assert out.rank == other and out.migrated_blocks == 8 and out.cached_tokens >= 48
    assert_index_agrees(svc, [shared + [3]])
    assert svc.report().router.migrated_blocks == 8


def test_events_are_logged_for_monitors_and_can_be_waited_for():
    svc = make_service(make_backend())
    recs, nxt = svc.feed.events(0)
    assert {r.event["type"] for r in recs} == {"KVCacheCreated", "Snapshot"}
    got: list = []
    t = threading.Thread(target=lambda: got.append(svc.feed.wait_events(nxt, timeout=5)))
    t.start()
    out = svc.complete(list(range(1, 20)), max_tokens=1)
    t.join(timeout=10)
    (recs2, nxt2), = got
    assert recs2 and recs2[0].id == nxt and recs2[0].event["type"] == "BlockStored"
    assert all(r.rank == out.rank for r in recs2)
    assert svc.feed.events(nxt2)[0] == [] and svc.feed.wait_events(nxt2, timeout=0.05) == ([], nxt2)
    only_other, _ = svc.feed.events(0, rank=1 - out.rank)
    assert {r.rank for r in only_other} == {1 - out.rank}
    d = recs2[0].to_dict()
    assert d["type"] == "BlockStored" and d["rank"] == out.rank and d["block_size"] == T
    with pytest.raises(ValueError):
        svc.feed.events(-1)


def test_a_full_rank_queue_is_a_429_to_the_client_and_what_was_taken_is_served():
    """A rank whose batch (one request) and queue (one more) are full refuses the rest; the router answers them
    ``OverloadedError`` (429) and counts them shed, and every request it took is served in full."""
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=512)
    w = RankWorker(0, 1, cfg, batching=BatchingConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                                      max_queued_requests=1))
    w.build_ledger(512, 0)
    svc = make_service(LocalCluster([w]), policy="round_robin")
    gate = threading.Barrier(6, timeout=60)
    got: list = [None] * gate.parties

    def send(i: int) -> None:
        gate.wait()
        try:
            got[i] = svc.complete([1 + i] * 9, max_tokens=400)
        except OverloadedError as e:
            got[i] = e

    threads = [threading.Thread(target=send, args=(i,)) for i in range(gate.parties)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    served = [g for g in got if not isinstance(g, OverloadedError)]
    shed = [g for g in got if isinstance(g, OverloadedError)]
    assert served and shed and len(served) + len(shed) == gate.parties
    assert all("busy" in str(e) and e.retry_after_s == 1 for e in shed)
    assert all(len(r.output_tokens) == 400 for r in served)
    assert svc.tally.stats.shed == len(shed) and svc.tally.stats.completions == len(served)
    assert w.load().served_requests == len(served) and w.load().refused_requests == len(shed)


def test_a_prompt_no_full_attention_window_can_hold_is_bad_input_with_the_limit():
    """The issue's rank: windows of 32 tokens and full attention, 47 device blocks of 8 in all but 4 in the full
    window. A request of more than 32 tokens can never be held: a 400 at once naming the limit, not a 429 after
    it waited; one that fits is served."""
    cfg = CacheConfig(tokens_per_block=8, num_layers=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=24, attention_windows=(32, None), window_shares=(9, 1))
    svc = RouterService(LocalCluster.build(1, cfg), RouterConfig(tokens_per_block=8))
    svc.feed.sync()
    for prompt, max_tokens in ((30, 12), (50, 1)):
        with pytest.raises(ValueError, match=f"maximum context length is 32 tokens; the request needs "
                                             f"{prompt + max_tokens}"):
            svc.complete(list(range(1, prompt + 1)), max_tokens=max_tokens)
    assert len(svc.complete(list(range(1, 25)), max_tokens=8).output_tokens) == 8
    svc.close()
