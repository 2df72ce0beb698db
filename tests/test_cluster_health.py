"""Health on a real local Ray: a rank killed mid-workload loses no request, restarts, rejoins the group."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.migration import Migrator
from kvledger.worker.ledger import CacheConfig

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
    requests = [{"request_id": i, "tokens": [rng.randrange(256) for _ in range(3 * T + 1)], "max_new_tokens": 2}
                for i in range(24)]
    results: dict[int, dict] = {}
    errors: list[BaseException] = []
    started = threading.Event()

    def workload() -> None:
        try:
            for i, r in enumerate(requests):
                if i == 4:
                    started.set()
                (res,) = cluster.serve([r], rank=i % 2)
                results[r["request_id"]] = res
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)
        finally:
            started.set()

    t = threading.Thread(target=workload)
    t.start()
    assert started.wait(timeout=TIMEOUT)
    victim_pid = ray.get(cluster.actors[1].pid.remote(), timeout=TIMEOUT)
    ray.kill(cluster.actors[1], no_restart=False)
    t.join(timeout=2 * TIMEOUT)
    assert not t.is_alive() and not errors, errors
    assert sorted(results) == [r["request_id"] for r in requests], "every request was served, none lost"
    assert any(res["rank"] == 0 and i % 2 == 1 for i, res in results.items()), "rank 1's requests were retried"

    restarted = cluster.heal(timeout_s=TIMEOUT)
    assert restarted == [1]
    assert ray.get(cluster.actors[1].pid.remote(), timeout=TIMEOUT) != victim_pid
    st = cluster.status()
    assert [r["alive"] and r["in_group"] for r in st["ranks"]] == [True, True]
    assert {r["device_blocks"] for r in st["ranks"]} == {256} and cluster.generation == 2

    # The re-formed group carries KV: rank 0's prefix migrates to the restarted rank 1, and the oracle holds.
    p = requests[0]["tokens"]
    assert cluster.probe(p)[0] == 3 * T
    m = Migrator(cluster).migrate(p, src=0, dst=1)
    assert m.sent_blocks == 3
    (again,) = cluster.serve([{"request_id": 99, "tokens": p, "max_new_tokens": 2}], rank=1)
    assert again["cached_tokens"] == 3 * T
    assert torch.allclose(again["last_logits"], results[0]["last_logits"], atol=1e-4, rtol=1e-4)
    assert again["output_tokens"] == results[0]["output_tokens"]
