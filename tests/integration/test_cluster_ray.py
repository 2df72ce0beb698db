"""The cluster on a real local Ray: 3 CPU ranks with different budgets, gloo, migrations, the oracle."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.worker.ledger import CacheConfig, block_hashes
from kvledger.worker.wire.events import BlockStored, decode_batch
from kvledger.worker.wire.messages import ServeOutcome
from kvledger.worker.wire.request import Request

T = 4
BLOCK_BYTES = 2 * 2 * T * 2 * 8 * 4  # layers * K|V * tokens * heads * head_dim * float32
BUDGETS = [64 * BLOCK_BYTES, 48 * BLOCK_BYTES, 80 * BLOCK_BYTES]
TIMEOUT = 60
PREFIX = "kvledger-test-rank"


@pytest.fixture(scope="module")
def cluster(ray_session):
    cache = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                        device="cpu", num_primary_blocks=1, num_secondary_blocks=8)
    cfg = ClusterConfig(num_ranks=3, device="cpu", cache=cache, primary_bytes_per_rank=BUDGETS,
                        num_cpus_per_rank=0.5, name_prefix=PREFIX, group_timeout_s=30, call_timeout_s=TIMEOUT)
    c = Cluster.start(cfg)
    yield c
    c.shutdown()


def prompt(n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n_tokens)]


def get(ray, ref):
    return ray.get(ref, timeout=TIMEOUT)


def serve(cluster: Cluster, rank: int, *requests: Request) -> list[ServeOutcome]:
    """Serve on one rank through its typed client, with the logits the oracle compares."""
    return cluster.client(rank).serve(list(requests), logits=True).outcomes


def same_logits(a: ServeOutcome, b: ServeOutcome) -> bool:
    return torch.allclose(torch.tensor(a.last_logits), torch.tensor(b.last_logits), atol=1e-4, rtol=1e-4)


def test_ranks_agree_on_the_smallest_budget(cluster):
    assert cluster.block_counts == (48, 8)
    st = cluster.status()
    assert [r["alive"] for r in st["ranks"]] == [True, True, True]
    assert {(r["device_blocks"], r["host_blocks"], r["backend"], r["in_group"]) for r in st["ranks"]} == {
        (48, 8, "gloo", True)}
    assert st["agreed_blocks"] == {"device": 48, "host": 8} and st["device"] == "cpu"


def test_actors_are_named_and_placed_in_one_placement_group(cluster, ray_session):
    ray = ray_session
    a = ray.get_actor(f"{PREFIX}-1", namespace="kvledger")
    assert get(ray, a.ping.remote()) == 1
    table = ray.util.placement_group_table(cluster.placement)
    assert table["strategy"] == "PACK" and len(table["bundles"]) == 3 and table["state"] == "CREATED"
    found = Cluster.connect(ClusterConfig(name_prefix=PREFIX))
    assert len(found.actors) == 3 and found.block_counts == (48, 8)


def test_serve_and_exact_probe(cluster):
    p = prompt(4 * T + 2, seed=1)
    (res,) = serve(cluster, 1, Request(11, p, 2))
    assert res.rank == 1 and res.cached_tokens == 0 and len(res.output_tokens) == 2
    assert len(res.last_logits) == 512
    assert cluster.probe(p) == [0, 4 * T, 0]


def test_migrated_blocks_give_the_logits_computed_from_scratch(cluster, ray_session):
    p = prompt(6 * T + 3, seed=2)
    (scratch,) = serve(cluster, 0, Request(21, p, 4))
    assert scratch.cached_tokens == 0
    for _ in range(100):  # drain what rank 2 published before the migration
        if get(ray_session, cluster.actors[2].poll_events.remote()) is None:
            break
    m = cluster.migrator.migrate(p, src=0, dst=2)
    assert (m.matched_blocks, m.sent_blocks, m.bytes) == (6, 6, 6 * BLOCK_BYTES)
    assert cluster.probe(p)[2] == 6 * T
    batch = get(ray_session, cluster.actors[2].poll_events.remote())
    stored = [h for e in decode_batch(batch.data).events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == block_hashes(p[:6 * T], T), "migrated blocks are stored and announced on the target"
    (migrated,) = serve(cluster, 2, Request(22, p, 4))
    assert migrated.cached_tokens == 6 * T and migrated.computed_tokens == 3
    assert same_logits(migrated, scratch)
    assert migrated.output_tokens == scratch.output_tokens
    for a in cluster.actors:
        get(ray_session, a.check_integrity.remote())


def test_migration_sends_only_what_the_target_lacks(cluster):
    p = prompt(5 * T + 1, seed=3)
    serve(cluster, 2, Request(31, p))
    serve(cluster, 1, Request(32, p[:2 * T + 1]))
    m = cluster.migrator.migrate(p, src=2, dst=1)
    assert (m.matched_blocks, m.sent_blocks) == (5, 3)
    assert cluster.migrator.migrate(p, src=2, dst=1).sent_blocks == 0, "a second migration has nothing to send"
    assert cluster.probe(p)[1] == 5 * T
    assert cluster.status()["ranks"][1]["device_blocks_used"] == 0, "the import released its blocks"


def test_bad_migrations_change_nothing(cluster):
    mig = cluster.migrator
    with pytest.raises(ValueError, match="two different ranks"):
        mig.migrate([1, 2, 3], src=0, dst=0)
    with pytest.raises(ValueError):
        mig.migrate([1, 2, 3], src=0, dst=7)
    p = prompt(3 * T + 1, seed=4)
    assert mig.migrate(p, src=0, dst=1).matched_blocks == 0
    assert cluster.probe(p) == [0, 0, 0]
    with pytest.raises(ValueError, match="max_blocks"):
        mig.migrate(p, src=0, dst=1, max_blocks=-1)
    serve(cluster, 0, Request(45, p))
    with pytest.raises((TypeError, ValueError), match="cache_salt"):   # both sides refuse it, and say so
        mig.migrate(p, src=0, dst=1, cache_salt=5)
    assert cluster.status()["ranks"][0]["device_blocks_used"] == 0, "the source let go of what it pinned"
    assert mig.migrate(p, src=0, dst=1).sent_blocks == 3, "the refusal left the pair's channel clean"


def test_a_rank_blocked_in_a_receive_still_serves(cluster, ray_session):
    ray = ray_session
    src, dst = cluster.actors[0], cluster.actors[1]
    p = prompt(3 * T + 1, seed=5)
    serve(cluster, 0, Request(41, p))
    recv = dst.receive_prefix.remote(p, 0)
    ready, _ = ray.wait([recv], timeout=0.5)
    assert not ready, "nothing was sent yet"
    # While rank 1 waits in recv, it answers probes, reports load and serves.
    assert get(ray, dst.load.remote()).ready
    other = prompt(2 * T + 1, seed=6)
    (res,) = get(ray, dst.serve.remote([Request(42, other)])).outcomes
    assert res.computed_tokens == len(other)
    sent = get(ray, src.send_prefix.remote(p, 1))
    received = get(ray, recv)
    assert (sent.matched_blocks, sent.moved_blocks, sent.bytes) == (3, 3, 3 * BLOCK_BYTES)
    assert (received.matched_blocks, received.moved_blocks, received.bytes) == (3, 3, 3 * BLOCK_BYTES)
    assert cluster.probe(p)[1] == 3 * T


def test_concurrent_migrations_on_one_pair_do_not_interleave(cluster):
    mig = cluster.migrator
    prompts = [prompt(k * T + 1, seed=50 + k) for k in (2, 3, 4, 5)]
    scratch = serve(cluster, 2, *[Request(60 + i, p, 1) for i, p in enumerate(prompts)])
    results: list = [None] * len(prompts)

    def move(i: int) -> None:
        # four threads, one pair: the pair's lock runs the transfers one after another
        results[i] = mig.migrate(prompts[i], src=2, dst=0)

    threads = [threading.Thread(target=move, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert [r.sent_blocks for r in results] == [2, 3, 4, 5]
    served = serve(cluster, 0, *[Request(70 + i, p, 1) for i, p in enumerate(prompts)])
    for p, s, m in zip(prompts, scratch, served):
        assert m.cached_tokens == len(p) - 1
        assert same_logits(m, s)


def test_scattered_source_blocks_travel_straight_from_the_pool(cluster, ray_session):
    # Two requests decoding together get interleaved decode blocks: a prefix running through them is not one run.
    a, b = prompt(2 * T + 1, seed=80), prompt(2 * T + 1, seed=81)
    res = serve(cluster, 0, Request(81, a, 3 * T), Request(82, b, 3 * T))
    longer = a + res[0].output_tokens[:2 * T] + [7]  # 4 full blocks: 2 prompt + 2 decode blocks
    assert cluster.probe(longer)[0] == 4 * T
    before = [c.info().transfers for c in cluster.clients[:2]]
    m = cluster.migrator.migrate(longer, src=0, dst=1)
    assert m.sent_blocks == 4
    sent, received = (c.info().transfers for c in cluster.clients[:2])
    assert sent["sent_direct"] == before[0]["sent_direct"] + 1 and sent["gather_copies"] == before[0]["gather_copies"]
    pieces = sent["sent_pieces"] - before[0]["sent_pieces"]
    assert 1 < pieces == received["received_pieces"] - before[1]["received_pieces"]
    (scratch,) = serve(cluster, 2, Request(83, longer))
    (moved,) = serve(cluster, 1, Request(84, longer))
    assert scratch.cached_tokens == 0 and moved.cached_tokens == 4 * T
    assert same_logits(moved, scratch)
