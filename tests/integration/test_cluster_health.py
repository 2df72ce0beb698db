"""Health on a real local Ray: a rank killed mid-request loses no request, restarts, rejoins the group."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.router.config import RouterConfig
from kvledger.router.service import RouterService
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.batch import BatchDriver
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.request import Request

T = 4
TIMEOUT = 60


def gated_worker_class() -> type[RankWorker]:
    """``RankWorker`` whose batch driver can hold one request mid-decode, at a gate the test opens.

    The request is admitted, prefilled and running (its blocks held, ``running_requests`` 1) while it waits,
    so a test can kill its rank mid-request without racing the decode. Unarmed, the rank serves as any other
    (a restarted actor starts unarmed). Built in a function so that Ray ships the classes by value: a rank
    actor's process does not have tests/ on its path.
    """

    class GatedDriver(BatchDriver):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.armed = False
            self.holding = False
            self.wake = threading.Event()   # set when a request is held, or when the gate opens
            self.gate = threading.Event()

        def step(self, manager, batch, sampler, max_tokens=None):
            if self.armed and any(r.prefilled for r in batch):
                self.armed, self.holding = False, True
                self.wake.set()
                self.gate.wait(timeout=2 * TIMEOUT)   # bounded: an unopened gate still lets the request finish
                self.holding = False
            return super().step(manager, batch, sampler, max_tokens)

    class GatedWorker(RankWorker):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.gated = self.server.scheduler.driver = GatedDriver(self.engine)

        def hold_next_decode(self) -> None:
            self.gated.armed, self.gated.holding = True, False
            self.gated.wake.clear()
            self.gated.gate.clear()

        def wait_held(self, timeout_s: float) -> bool:
            """Whether a request is held at the gate (waits up to ``timeout_s`` for one, or for the gate to open)."""
            self.gated.wake.wait(timeout_s)
            return self.gated.holding

        def open_gate(self) -> None:
            self.gated.armed = False
            self.gated.gate.set()
            self.gated.wake.set()

    return GatedWorker


GATED_WORKER = gated_worker_class()   # one class: the actor class built from it is cached per worker class


@pytest.fixture(scope="module")
def cluster(ray_session):
    cache = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                        device="cpu", num_primary_blocks=256)
    cfg = ClusterConfig(num_ranks=2, device="cpu", cache=cache, name_prefix="kvledger-health-rank",
                        max_restarts=2, group_timeout_s=30, call_timeout_s=TIMEOUT)
    c = Cluster.start(cfg, worker_cls=GATED_WORKER)
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
    # the gate: whichever rank the long request goes to holds it mid-decode until that rank is killed
    ray.get([a.hold_next_decode.remote() for a in cluster.actors], timeout=TIMEOUT)
    t = threading.Thread(target=lambda: long_result.append(service.complete(long_prompt, max_tokens=900)))
    t.start()
    killed = False
    try:
        held = {r: a.wait_held.remote(TIMEOUT) for r, a in enumerate(cluster.actors)}
        ready, _ = ray.wait(list(held.values()), num_returns=1, timeout=TIMEOUT + 10)
        busy = [r for r, ref in held.items() if ref in ready and ray.get(ref, timeout=TIMEOUT)]
        assert busy, "the long request never reached a rank's gate"
        (victim,) = busy
        survivor = 1 - victim
        ray.get(cluster.actors[survivor].open_gate.remote(), timeout=TIMEOUT)   # the retry must not wait
        assert ray.get(held[survivor], timeout=TIMEOUT) is False
        load = cluster.health()[victim]
        assert load is not None and load.running_requests == 1, "held mid-request: the rank says it is running"
        victim_pid = ray.get(cluster.actors[victim].pid.remote(), timeout=TIMEOUT)
        ray.kill(cluster.actors[victim], no_restart=False)
        killed = True
    finally:
        if not killed:   # a check above failed: let the held request finish rather than wait out its gate
            ray.get([a.open_gate.remote() for a in cluster.actors], timeout=TIMEOUT)
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
