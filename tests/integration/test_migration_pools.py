"""How a migration's bytes travel: the pieces ``transfer_plan`` cuts, the buffers each side sends from and receives
into (pool slices, or staging it gathers into and scatters from), and ledgers with one pool per KV head count
migrating in this process and over a real local Ray's process group."""
from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from migration_helpers import HEADS, TIMEOUT, T, mixed_cache, prompt, same_logits, served_as_scratch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.worker.rank.transfer import _PieceBuffers, _Staging
from kvledger.worker.rank.transfer_plan import MAX_PIECES, aligned_slots, is_run, plan_pieces
from kvledger.worker.wire.request import Request


# ---------------------------------------------------------------------- the plan

def freed_backwards(start: int, n: int) -> list[int]:
    """Slots as a free list hands them out after a sequence was freed last block first."""
    return list(range(start + n - 1, start - 1, -1))


@pytest.mark.parametrize("src", [
    list(range(10, 40)),                                   # one run: one piece per chunk
    freed_backwards(0, 30),                                # descending: sorted, one run again
    list(range(50, 60)) + freed_backwards(0, 20),          # two runs
    random.Random(1).sample(range(500), 300),              # scattered: fixed chunks, gathered
])
def test_every_block_travels_once_in_few_pieces(src):
    pieces = plan_pieces(src, chunk_blocks=8)
    assert sorted(i for p in pieces for i in p) == list(range(len(src)))
    assert len(pieces) <= MAX_PIECES
    runs = len({s for s in src} - {s + 1 for s in src})   # slots that do not follow another one start a run
    if runs <= MAX_PIECES:
        assert all(is_run([src[i] for i in p]) for p in pieces), "each piece goes straight from the pool"
        assert len(pieces) == sum(-(-n // 8) for n in _run_lengths(sorted(src)))
    assert all(len(p) <= max(8, -(-len(src) // MAX_PIECES)) for p in pieces)


def _run_lengths(slots: list[int]) -> list[int]:
    out = [1]
    for a, b in zip(slots, slots[1:]):
        if b == a + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def test_a_bad_plan_request_is_refused():
    assert plan_pieces([], chunk_blocks=4) == []
    with pytest.raises(ValueError, match="chunk_blocks"):
        plan_pieces([1, 2], chunk_blocks=0)


@pytest.mark.parametrize("seed", range(4))
def test_fresh_target_slots_ascend_along_the_source_pieces(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 60)
    src = rng.sample(range(100), n) if seed % 2 else freed_backwards(20, n)
    fresh = freed_backwards(5, n)   # a target's free list backwards: every piece would be scattered block by block
    dst = aligned_slots(src, fresh)
    assert [dst[i] for i in sorted(range(n), key=src.__getitem__)] == sorted(fresh), \
        "each fresh slot is used once, ascending in the source's slot order"
    for p in plan_pieces(src, chunk_blocks=8):
        piece = [src[i] for i in p]
        assert not is_run(piece) or is_run([dst[i] for i in p]), "a piece that runs on the source runs on the target"
    with pytest.raises(ValueError, match="one target slot per source slot"):
        aligned_slots([1, 2], [3])


# ---------------------------------------------------------------------- the buffers, with the wire in between

def pools(num_blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand((num_blocks, 2, 2, T, 2, 8), generator=g), torch.rand((num_blocks, 1, 2, T, 1, 8), generator=g)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_pieces", [MAX_PIECES, 2])
def test_pieces_carry_each_block_into_its_slot_in_every_pool(seed, max_pieces):
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    src_slots, dst_slots = rng.sample(range(64), n), rng.sample(range(64), n)
    if seed % 2:   # the target's free list backwards, as sequences freed last block first leave it
        dst_slots = freed_backwards(3, n)
    a, b = pools(64, seed), pools(64, 100 + seed)
    b_before = [p.clone() for p in b]
    pieces = plan_pieces(src_slots, chunk_blocks=3, max_pieces=max_pieces)
    sent = _PieceBuffers(a, [[src_slots[i] for i in p] for p in pieces], _Staging())
    got = _PieceBuffers(b, [[dst_slots[i] for i in p] for p in pieces], _Staging())
    for i in range(len(pieces)):
        sent.gather(i)
        for out, into in zip(sent.views[i], got.views[i]):
            into.copy_(out)   # one message
        got.scatter(i)
    for pa, pb, pb0 in zip(a, b, b_before):
        for s, d in zip(src_slots, dst_slots):
            assert torch.equal(pb[d], pa[s])
        untouched = sorted(set(range(64)) - set(dst_slots))
        assert torch.equal(pb[untouched], pb0[untouched])
    assert sent.nbytes == got.nbytes == n * sum(p[0].numel() * 4 for p in a)


# ---------------------------------------------------------------------- ledgers with several pools

def test_read_and_write_blocks_cover_every_pool():
    cluster = LocalCluster.build(2, mixed_cache())
    a, b = (cluster.reach(r).manager.pools for r in (0, 1))
    for p in a.primary_pools:
        p.copy_(torch.rand(p.shape))
    data = a.read_blocks([5, 2, 9])
    assert data.shape == (3, a.elements_per_block) and a.elements_per_block == sum(p[0].numel() for p in a.primary_pools)
    b.write_blocks([7, 8, 1], data)
    for pa, pb in zip(a.primary_pools, b.primary_pools):
        assert torch.equal(pb[[7, 8, 1]], pa[[5, 2, 9]])


def test_a_mixed_head_ledger_migrates_in_this_process():
    cluster = LocalCluster.build(2, mixed_cache())
    p = prompt(5 * T + 2, seed=1)
    (scratch,) = cluster.client(0).serve([Request(1, p, 3)], logits=True).outcomes
    assert cluster.migrator.migrate(p, src=0, dst=1).sent_blocks == 5
    (moved,) = cluster.client(1).serve([Request(2, p, 3)], logits=True).outcomes
    assert moved.cached_tokens == 5 * T and moved.output_tokens == scratch.output_tokens
    assert same_logits(moved, scratch)


def two_ranks(name_prefix: str, blocks: int = 48) -> Iterator[Cluster]:
    """A cluster of two ranks of ``mixed_cache(blocks)`` on the session's Ray, for one module."""
    c = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=mixed_cache(blocks), name_prefix=name_prefix,
                                    group_timeout_s=30, call_timeout_s=TIMEOUT))
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def mixed_cluster(ray_session):
    yield from two_ranks("kvledger-pools-rank")


def test_a_mixed_head_ledger_migrates_over_the_process_group(mixed_cluster):
    c = mixed_cluster
    p = prompt(6 * T + 1, seed=2)
    (scratch,) = c.client(0).serve([Request(1, p, 3)], logits=True).outcomes
    c.client(1).serve([Request(2, p[:2 * T + 1])])   # the target shares two blocks already
    m = c.migrator.migrate(p, src=0, dst=1)
    block_bytes = sum(h * 2 * T * 8 * 4 for h in HEADS)
    assert (m.matched_blocks, m.sent_blocks, m.bytes) == (6, 4, 4 * block_bytes)
    served_as_scratch(c, p, scratch)


@pytest.fixture(scope="module")
def fresh_pair(ray_session):
    """Two ranks no other test touched, so that the slots their free lists hand out are known."""
    yield from two_ranks("kvledger-fresh-rank", blocks=16)


def test_a_target_whose_free_slots_run_backwards_receives_straight_into_its_pool(fresh_pair):
    c = fresh_pair
    p = prompt(6 * T + 1, seed=3)
    (scratch,) = c.client(0).serve([Request(1, p, 3)], logits=True).outcomes   # source slots 0..6, ascending
    # The target's every block is stored once released, last block first: its next allocation evicts them from the
    # tail, slots 15, 14, 13, ...: opposite to the source's run, so each block would land in a slot of its own.
    c.client(1).serve([Request(2, prompt(15 * T + 1, seed=4), 1)])
    before = c.client(1).info().transfers
    assert c.migrator.migrate(p, src=0, dst=1).sent_blocks == 6
    after = c.client(1).info().transfers
    assert after["received_direct"] == before["received_direct"] + 1, "received straight into the pool"
    assert after["scatter_copies"] == before["scatter_copies"]
    (moved,) = c.client(1).serve([Request(3, p, 3)], logits=True).outcomes
    assert moved.cached_tokens == 6 * T and moved.output_tokens == scratch.output_tokens
    assert same_logits(moved, scratch)
    for client in c.clients:
        client.check_integrity()
