"""Prefill apart from decode on a real local Ray cluster: rank 0 only prefills, ranks 1 and 2 decode, the KV of
split requests crossing between rank actors over gloo.

Under concurrent load every answer, split or whole, equals the one computed from scratch (tokens and
log-probabilities); a rank killed mid-transfer (the prefill rank sending, a decode rank receiving) costs a
recompute or a retry, never a request, and leaves every survivor's books balanced.
"""
from __future__ import annotations

import concurrent.futures as cf
import random

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.router.config import RouterConfig
from kvledger.router.service import RouterService
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.request import Request, Sampling
from rank_fuzz import scratch_result

T = 4
TIMEOUT = 60
CACHE = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                    device="cpu", num_primary_blocks=128)


@pytest.fixture(scope="module")
def cluster(ray_session):
    cfg = ClusterConfig(num_ranks=3, prefill_ranks=1, device="cpu", cache=CACHE, name_prefix="kvledger-pd-rank",
                        max_restarts=5, group_timeout_s=20, call_timeout_s=TIMEOUT)
    c = Cluster.start(cfg)
    yield c
    c.shutdown()


def service(cluster: Cluster, mode: str = "always") -> RouterService:
    svc = RouterService(cluster, RouterConfig(tokens_per_block=T, prefill_rank_ids=(0,), split_mode=mode,
                                              min_split_tokens=16, engine_timeout_s=TIMEOUT))
    svc.feed.sync()
    return svc


def prompt(n: int, seed: int, prefix: list[int] = ()) -> list[int]:
    rng = random.Random(seed)
    return [*prefix, *(rng.randrange(1, 256) for _ in range(n - len(prefix)))]


def assert_from_scratch(result, tokens: list[int], max_tokens: int) -> None:
    ref = scratch_result(CACHE, Request(0, tokens, max_tokens, sampling=Sampling(logprobs=0)))
    assert result.output_tokens == ref.output_tokens, (result.rank, result.decision.split)
    got = result.answer["choices"][0]["logprobs"]["token_logprobs"]
    assert got == pytest.approx(ref.logprobs.chosen, abs=1e-4)


def test_under_load_split_and_whole_answers_equal_the_ones_computed_from_scratch(cluster):
    svc = service(cluster)
    shared = prompt(40, seed=99)
    jobs = [(prompt(41 + 4 * i, seed=i, prefix=shared if i % 2 else []), 4) for i in range(10)]
    jobs += [(prompt(9, seed=100 + i), 3) for i in range(4)]   # short: served whole
    with cf.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda j: svc.complete(j[0], max_tokens=j[1], fields={"logprobs": 0}), jobs))
    for (tokens, max_tokens), r in zip(jobs, results):
        assert_from_scratch(r, tokens, max_tokens)
        assert r.rank in (1, 2), "the prefill rank never decodes"
    split = [r for r in results if r.decision.split is not None]
    assert len(split) >= 8 and all(r.phases.prefill_rank == 0 and r.migrated_blocks > 0 for r in split)
    assert all(r.decision.split is None for r in results[10:])
    for c in cluster.clients:
        c.check_integrity()
    assert all(cluster.client(r).load().device_blocks_used == 0 for r in (1, 2)), "no block stays referenced"


def test_the_prefill_rank_killed_mid_transfer_leaves_the_decode_rank_to_compute_it(cluster):
    svc = service(cluster)
    tokens = prompt(61, seed=207)
    cluster.arm_crash(0, "migration_source")
    got = svc.complete(tokens, max_tokens=4, fields={"logprobs": 0})
    assert_from_scratch(got, tokens, 4)
    assert got.rank in (1, 2) and got.migrated_blocks == 0 and got.computed_tokens == 61
    assert cluster.client(got.rank).load().device_blocks_used == 0, "the aborted import left no block behind"
    cluster.client(got.rank).check_integrity()
    assert cluster.heal(timeout_s=TIMEOUT) == [0]


def test_a_decode_rank_killed_mid_transfer_has_the_request_decided_again(cluster):
    svc = service(cluster)
    tokens = prompt(61, seed=208)
    first = svc.route(tokens, max_tokens=4).rank   # where the split would decode: it dies receiving
    assert first in (1, 2)
    cluster.arm_crash(first, "migration_target")
    got = svc.complete(tokens, max_tokens=4, fields={"logprobs": 0})
    assert_from_scratch(got, tokens, 4)
    assert got.retries == 1 and got.rank == 3 - first and got.decision.split is not None
    assert got.migrated_blocks == 15
    assert cluster.client(0).load().device_blocks_used == 0, "the prefill rank's export pin was released"
    cluster.client(0).check_integrity()
    assert cluster.heal(timeout_s=TIMEOUT) == [first]
