"""Ranks crashing at named points of their work, on a real local Ray: migration source, migration target, mid-publish.

Each crash is armed (``Cluster.start(crashes=...)`` or ``Cluster.arm_crash``) and fires as ``os._exit`` in the rank's
process. After each: the operation fails with a clear error (never a hang), the surviving rank's books balance (its
blocks in use back to what they were, no pin or import left, ``check_integrity``), Ray restarts the crashed rank and
the cluster re-forms its group, the router's index agrees with every rank's exact probe, and nothing accepted was
lost.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.router.config import RouterConfig
from kvledger.router.rank_client import RankDiedError
from kvledger.router.service import RouterService
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.faults import CrashSpec
from kvledger.worker.wire.request import Request

T = 4
TIMEOUT = 60


@pytest.fixture(scope="module")
def cluster(ray_session):
    cache = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                        device="cpu", num_primary_blocks=64)
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache, name_prefix="kvledger-crash-rank", max_restarts=5,
                        group_timeout_s=20, call_timeout_s=TIMEOUT)
    c = Cluster.start(cfg, crashes=[CrashSpec(0, "migration_source")])   # armed by the config: the first test's
    yield c
    c.shutdown()


def prompt(n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n_tokens)]


def books(cluster: Cluster, rank: int) -> tuple[int, int]:
    """(device blocks in use, running requests): a pin or an import left behind shows in the first."""
    load = cluster.client(rank).load()
    return load.device_blocks_used, load.running_requests


def pid(cluster: Cluster, ray, rank: int) -> int:
    return ray.get(cluster.actors[rank].pid.remote(), timeout=TIMEOUT)


def index_agrees(cluster: Cluster, prompts: list[list[int]]) -> None:
    """A router built now indexes exactly what every rank holds, for every prompt."""
    service = RouterService(cluster, RouterConfig(tokens_per_block=T, policy="round_robin"))
    service.feed.sync()
    for p in prompts:
        index = {r: m.matched_tokens for r, m in service.probe(p).items()}
        exact = {r: m.matched_tokens for r, m in service.probe(p, exact=True).items()}
        assert index == exact and set(exact) == {0, 1}, p


def crash_migration(cluster: Cluster, ray, victim: int, src: int, dst: int, p: list[int]) -> None:
    """Migrate ``p`` from ``src`` to ``dst`` while ``victim`` is armed to crash in it; check what must hold."""
    survivor = 1 - victim
    before = books(cluster, survivor)
    victim_pid = pid(cluster, ray, victim)
    with pytest.raises(RankDiedError) as died:
        cluster.migrator.migrate(p, src=src, dst=dst)
    assert died.value.rank == victim
    assert books(cluster, survivor) == before, "the survivor's pin or import was released"
    cluster.client(survivor).check_integrity()
    held = (len(p) - 1) // T * T if survivor == src else 0   # the source keeps its blocks; the target stored none
    assert cluster.client(survivor).probe(p) == held
    assert cluster.live() == [survivor], "the crashed rank left the cluster's live ranks at once"

    assert cluster.heal(timeout_s=TIMEOUT) == [victim]
    assert pid(cluster, ray, victim) != victim_pid and cluster.live() == [0, 1]
    assert cluster.client(victim).probe(p) == 0, "the restarted rank came back with an empty ledger"


def test_a_source_crashing_mid_send_fails_the_migration_and_leaks_nothing(cluster, ray_session):
    p = prompt(5 * T + 1, seed=1)
    (scratch,) = cluster.client(0).serve([Request(1, p, 2)], logits=True).outcomes
    crash_migration(cluster, ray_session, victim=0, src=0, dst=1, p=p)
    # armed at start, the crash fired once: the restarted rank migrates again, and the blocks are the right ones
    cluster.client(0).serve([Request(2, p, 2)])
    assert cluster.migrator.migrate(p, src=0, dst=1).sent_blocks == 5
    (moved,) = cluster.client(1).serve([Request(3, p, 2)], logits=True).outcomes
    assert moved.cached_tokens == 5 * T and moved.output_tokens == scratch.output_tokens
    assert torch.allclose(torch.tensor(moved.last_logits), torch.tensor(scratch.last_logits), atol=1e-4)
    index_agrees(cluster, [p])


def test_a_target_crashing_mid_receive_fails_the_migration_and_leaks_nothing(cluster, ray_session):
    p = prompt(4 * T + 1, seed=2)
    cluster.client(1).serve([Request(11, p, 2)])
    assert cluster.arm_crash(0, "migration_target") == {"migration_target": 1}
    crash_migration(cluster, ray_session, victim=0, src=1, dst=0, p=p)
    assert cluster.migrator.migrate(p, src=1, dst=0).sent_blocks == 4, "the restarted rank is not armed"
    index_agrees(cluster, [p])


def test_a_rank_crashing_mid_publish_loses_no_request(cluster, ray_session):
    ray = ray_session
    service = RouterService(cluster, RouterConfig(tokens_per_block=T, policy="round_robin"))
    service.feed.sync()
    prompts = [prompt(3 * T + 1, seed=20 + i) for i in range(6)]
    victim_pid = pid(cluster, ray, 1)
    cluster.arm_crash(1, "mid_publish")
    # each request's serve publishes its batch; rank 1's first one numbers and keeps the batch, then crashes
    results = [service.complete(p, max_tokens=2) for p in prompts]
    assert all(len(r.output_tokens) == 2 for r in results), "every request was answered"
    assert sum(r.retries for r in results) == 1, "the one request on the crashed rank was retried elsewhere"
    assert cluster.heal(timeout_s=TIMEOUT) == [1] and pid(cluster, ray, 1) != victim_pid
    service.check_health()
    for i in range(2):   # served once more on both ranks: the restarted one publishes from a fresh numbering
        assert len(service.complete(prompts[i], max_tokens=2).output_tokens) == 2
    index_agrees(cluster, prompts)
    for c in cluster.clients:
        c.check_integrity()


def test_bad_crash_specs_are_refused_before_anything_starts(cluster):
    with pytest.raises(ValueError, match="unknown crash point"):
        CrashSpec(0, "mid_nap")
    with pytest.raises(ValueError, match="after"):
        CrashSpec(0, "mid_publish", after=0)
    with pytest.raises(ValueError, match="ranks 0..1"):
        Cluster.start(ClusterConfig(num_ranks=2, device="cpu"), crashes=[CrashSpec(2, "mid_publish")])
    with pytest.raises(ValueError, match="unknown crash point"):
        cluster.arm_crash(0, "nowhere")
