"""The rank interface's contract, run over every implementation the router can be given.

``RankClient`` / ``RankSet`` (``kvledger.router.rank_client``) are what the
router, the coordinator and the bench call; the same tests run over ranks in
this process (``LocalCluster``) and over rank actors on a real local Ray
(``Cluster``), so both answer every question the same way: typed replies,
numbered batches, migrations in steps, bad input refused unchanged, lost ranks
reported as ``RankDiedError``.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.rank_client import RankDiedError
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.block_key import block_hashes
from kvledger.worker.wire.events import BlockStored, decode_batch
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankLoad, ServeReply
from kvledger.worker.wire.request import Request

T = 4
BLOCKS = 64
TIMEOUT = 60


def cache() -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=BLOCKS, num_secondary_blocks=8)


@pytest.fixture(scope="module", params=["in-process", "ray"])
def ranks(request):
    """Two ranks behind the rank interface: in this process, or as actors of a real local Ray."""
    if request.param == "in-process":
        yield LocalCluster.build(2, cache())
        return
    request.getfixturevalue("ray_session")
    cluster = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=cache(), name_prefix="kvledger-contract",
                                          group_timeout_s=30, call_timeout_s=TIMEOUT))
    try:
        yield cluster
    finally:
        cluster.shutdown()


_ids = iter(range(10**6, 10**7))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def drain(client) -> None:
    """Publish whatever the rank has pending, so the next batch is the next test's own."""
    for _ in range(100):
        if client.poll_events() is None:
            return
    raise AssertionError("the rank kept publishing")


def test_load_is_one_typed_report(ranks):
    for r in ranks.live():
        load = ranks.client(r).load()
        assert isinstance(load, RankLoad) and load.rank == r and load.ready
        assert load.device_blocks == BLOCKS and load.host_blocks_used + load.host_blocks_free == 8
        assert load.queued_requests == load.running_requests == 0


def test_serve_answers_in_order_and_publishes_what_it_stored(ranks):
    client = ranks.client(0)
    drain(client)
    a, b = prompt(3 * T + 2, 1), prompt(2 * T + 1, 2)
    reply = client.serve([Request(next(_ids), a, 2), Request(next(_ids), b, 0)], publish=True)
    assert isinstance(reply, ServeReply) and [o.rank for o in reply.outcomes] == [0, 0]
    first, second = reply.outcomes
    assert first.cached_tokens == 0 and first.computed_tokens == len(a) and len(first.output_tokens) == 2
    assert second.output_tokens == [] and first.last_logits is None
    stored = [h for e in decode_batch(reply.events.data).events if isinstance(e, BlockStored)
              for h in e.block_hashes]
    assert set(block_hashes(a[:3 * T], T)) | set(block_hashes(b[:2 * T], T)) <= set(stored)
    assert client.poll_events() is None, "the published events are not published twice"
    (again,) = client.serve([Request(next(_ids), a, 2)], logits=True).outcomes
    assert again.cached_tokens == 3 * T and again.output_tokens == first.output_tokens
    assert len(again.last_logits) == 512 and all(isinstance(v, float) for v in again.last_logits)
    assert client.probe(a) == 3 * T and ranks.client(1).probe(a) == 0


def test_batches_are_numbered_and_replayed_and_snapshots_say_where_they_stand(ranks):
    client = ranks.client(1)
    drain(client)
    p = prompt(4 * T + 1, 3)
    client.serve([Request(next(_ids), p)])
    batch = client.poll_events()
    assert batch is not None and client.poll_events() is None
    assert [b.seq for b in client.replay_events(batch.seq)] == [batch.seq]
    assert client.replay_events(batch.seq + 1) == []
    with pytest.raises(ValueError):
        client.replay_events(batch.seq + 2)
    pending, snap = client.event_snapshot()
    assert pending is None and snap.next_seq == batch.seq + 1
    assert set(block_hashes(p[:4 * T], T)) <= {b.block_hash for b in snap.blocks}


def test_migration_steps_pin_allocate_and_release(ranks):
    src, dst = ranks.client(0), ranks.client(1)
    p = prompt(5 * T + 1, 4)
    src.serve([Request(next(_ids), p)])
    dst.serve([Request(next(_ids), p[:2 * T + 1])])
    export = src.export_begin(p)
    assert isinstance(export, ExportTicket) and export.blocks == 5 and src.load().device_blocks_used == 5
    target = dst.import_begin(p, export.blocks)
    assert isinstance(target, ImportTicket) and target.blocks == 3, "the target shares the 2 blocks it holds"
    dst.import_abort(target.import_id)
    dst.import_abort(target.import_id)        # idempotent
    src.export_end(export.pin_id)
    src.export_end(export.pin_id)
    assert src.load().device_blocks_used == dst.load().device_blocks_used == 0
    assert dst.probe(p) == 2 * T, "an aborted import stores nothing"
    assert ranks.migrate(p, 0, 1) == 3 and dst.probe(p) == 5 * T
    assert ranks.migrate(p, 0, 1) == 0, "nothing left to send"
    (moved,) = dst.serve([Request(next(_ids), p, 1)], logits=True).outcomes
    (scratch,) = src.serve([Request(next(_ids), p, 1, cache_salt="scratch")], logits=True).outcomes
    assert moved.cached_tokens == 5 * T and scratch.cached_tokens == 0
    assert torch.allclose(torch.tensor(moved.last_logits), torch.tensor(scratch.last_logits), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad, exc, what", [
    ({"request_id": 1, "tokens": [1, 2]}, TypeError, "Request"),
    (Request(1, [1, 2, 700]), ValueError, "vocabulary"),
    (Request(1, [1, 2], 0, beam_width=2), ValueError, "no new tokens"),
])
def test_bad_input_is_refused_as_itself_and_changes_nothing(ranks, bad, exc, what):
    client = ranks.client(0)
    drain(client)
    before = client.load()
    with pytest.raises(exc, match=what):
        client.serve([bad])
    with pytest.raises(ValueError, match="tokens"):
        client.probe([1, -5, 2])
    assert client.load() == before and client.poll_events() is None
    with pytest.raises(ValueError):
        ranks.migrate([1, 2, 3], 0, 0)
    with pytest.raises(ValueError):
        ranks.client(7)


def test_a_rank_reported_down_is_unreachable_until_its_health_check_sees_it(ranks):
    ranks.mark_down(1)
    assert ranks.live() == [0]
    with pytest.raises(RankDiedError) as e:
        ranks.client(1)
    assert e.value.rank == 1 and "down" in str(e.value)
    assert ranks.check_health() == [1] and ranks.live() == [0, 1]
    assert ranks.client(1).load().ready
