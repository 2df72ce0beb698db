"""Health on a real local Ray: a rank killed mid-request loses no request, restarts, rejoins the group."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.router.config import RouterConfig
from kvledger.router.service import RouterService
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.request import Request

T = 4
TIMEOUT = 60


@pytest.fixture(scope="module")
def cluster(ray_session):
    cache = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                        device="cpu", num_primary_blocks=256)
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache, name_prefix="kvledger-health-rank",
                        max_restarts=2, group_timeout_s=30, call_timeout_s=TIMEOUT)
    c = Cluster.start(cfg)
    yield c
    c.shutdown()


def test_a_killed_rank_loses_no_request_restarts_and_rejoins(cluster, ray_session):
    ray = ray_session
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(3 * T + 1)] for _ in range(12)]
    service = RouterService(cluster, RouterConfig(tokens_per_block=T, policy="round_robin"))
    service.feed.sync()
    long_prompt = [rng.randrange(256) for _ in range(3 * T + 1)]
    long_result: list = []
    t = threading.Thread(target=lambda: long_result.append(service.complete(long_prompt, max_tokens=900)))
    t.start()
    try:
        # the gate: the long request is running on a rank (the rank says so) before that rank is killed
        for _ in range(400):
            busy = [r for r, load in enumerate(cluster.health()) if load is not None and load.running_requests]
            if busy:
                break
            time.sleep(0.025)   # another process's state: nothing local to wait on
        assert busy, "the long request never showed up running"
        (victim,) = busy
        victim_pid = ray.get(cluster.actors[victim].pid.remote(), timeout=TIMEOUT)
        ray.kill(cluster.actors[victim], no_restart=False)
    finally:
        t.join(timeout=2 * TIMEOUT)
    assert not t.is_alive() and long_result, "the request whose rank was killed was answered"
    (moved,) = long_result
    assert moved.retries == 1 and moved.rank != victim and len(moved.output_tokens) == 900
    results = [service.complete(p, max_tokens=2) for p in prompts]   # the survivor serves everything meanwhile
    assert {r.rank for r in results} == {1 - victim} and all(len(r.output_tokens) == 2 for r in results)

    restarted = cluster.heal(timeout_s=TIMEOUT)
    assert restarted == [victim]
    assert ray.get(cluster.actors[victim].pid.remote(), timeout=TIMEOUT) != victim_pid
    st = cluster.status()
    assert [r["alive"] and r["in_group"] for r in st["ranks"]] == [True, True]
    assert {r["device_blocks"] for r in st["ranks"]} == {256} and cluster.generation == 2
    assert cluster.live() == [0, 1]

    # The re-formed group carries KV: the survivor's prefix migrates to the restarted rank, and the oracle holds.
    p, survivor = prompts[0], 1 - victim
    assert cluster.probe(p)[survivor] == 3 * T
    m = cluster.migrator.migrate(p, src=survivor, dst=victim)
    assert m.sent_blocks == 3
    (again,) = cluster.client(victim).serve([Request(99, p, 2)], logits=True).outcomes
    (scratch,) = cluster.client(survivor).serve([Request(100, p, 2, cache_salt="from-scratch")], logits=True).outcomes
    assert again.cached_tokens == 3 * T and scratch.cached_tokens == 0
    assert torch.allclose(torch.tensor(again.last_logits), torch.tensor(scratch.last_logits), atol=1e-4, rtol=1e-4)
    assert again.output_tokens == scratch.output_tokens == results[0].output_tokens
