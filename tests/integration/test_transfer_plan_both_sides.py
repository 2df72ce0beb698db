"""A migration whose target answers with its slots first: the pieces both sides cut alike (straight from one pool
into the other wherever either side's slots stop running), the store that runs under the books' lock after the
target returned, and a real local Ray's pair of ranks moving blocks into a target whose free slots have a gap."""
from __future__ import annotations

import logging
import random
import threading

import pytest
import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.worker.ledger import CacheConfig, OutOfBlocksError
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.rank.transfer_plan import MAX_PIECES, aligned_slots, is_run, plan_pieces
from kvledger.worker.wire.request import Request

T = 4
TIMEOUT = 60


def small_cache(blocks: int = 16) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=blocks)


def prompt(n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n_tokens)]


# ---------------------------------------------------------------------- the plan, cut at both sides' gaps

@pytest.mark.parametrize("seed", range(6))
def test_pieces_run_on_both_sides_and_are_cut_only_where_one_side_stops(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 80)
    src = rng.sample(range(200), n) if seed % 2 else list(range(30, 30 + n))
    fresh = sorted(rng.sample(range(120), n))   # a target's free slots, gaps anywhere
    dst = aligned_slots(src, fresh)
    pieces = plan_pieces(src, chunk_blocks=8, dst=dst)
    assert sorted(i for p in pieces for i in p) == list(range(n)), "every block travels once"
    order = [i for p in pieces for i in p]
    assert [dst[i] for i in order] == fresh, "the target's slots ascend in the order the blocks travel"
    breaks = sum(any(s[b] != s[a] + 1 for s in (src, dst)) for a, b in zip(order, order[1:]))
    if breaks + 1 + n // 8 <= MAX_PIECES:
        for p in pieces:
            assert is_run([src[i] for i in p]) and is_run([dst[i] for i in p]), "straight from pool to pool"
            assert len(p) <= 8
        assert len(pieces) == sum(-(-r // 8) for r in _run_lengths(order, src, dst))
    assert len(pieces) <= MAX_PIECES


def _run_lengths(order: list[int], src: list[int], dst: list[int]) -> list[int]:
    out = [1]
    for a, b in zip(order, order[1:]):
        if src[b] == src[a] + 1 and dst[b] == dst[a] + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def test_a_source_run_is_cut_where_the_target_has_a_gap():
    src = list(range(10, 16))
    dst = [0, 1, 2, 7, 8, 9]
    assert plan_pieces(src, chunk_blocks=64) == [list(range(6))]
    assert plan_pieces(src, chunk_blocks=64, dst=dst) == [[0, 1, 2], [3, 4, 5]]


def test_a_plan_with_a_target_slot_missing_is_refused():
    with pytest.raises(ValueError, match="one target slot per source slot"):
        plan_pieces([1, 2, 3], chunk_blocks=4, dst=[5, 6])


# ---------------------------------------------------------------------- the store after the caller returned

def books() -> RankBooks:
    b = RankBooks(0, small_cache(), torch.device("cpu"), 1.0, replay_size=4)
    b.build(16, 0)
    return b


def test_a_deferred_step_holds_the_lock_from_the_call_until_it_is_done():
    b = books()
    release, done = threading.Event(), []

    def step() -> None:
        assert release.wait(TIMEOUT), "the test never let the step finish"
        done.append(True)

    b.defer(step)
    assert not b.lock.acquire(blocking=False), "the lock is taken before defer returns"
    release.set()
    assert b.lock.acquire(timeout=TIMEOUT), "the books thread releases the lock once the step is done"
    try:
        assert done == [True], "whoever takes the lock next sees the step's work"
    finally:
        b.lock.release()


def test_a_deferred_step_that_fails_is_logged_and_frees_the_lock(caplog):
    b = books()

    def broken() -> None:
        raise RuntimeError("the ledger refused")

    with caplog.at_level(logging.ERROR, logger="kvledger.worker.rank.books"):
        b.defer(broken)
        assert b.lock.acquire(timeout=TIMEOUT), "a failed step still releases the lock"
        b.lock.release()
    assert any("deferred ledger step failed" in r.getMessage() and r.exc_info for r in caplog.records)
    ran = []
    b.defer(lambda: ran.append(1))   # the books thread goes on with the next step
    assert b.lock.acquire(timeout=TIMEOUT)
    b.lock.release()
    assert ran == [1]


# ---------------------------------------------------------------------- over a real process group

@pytest.fixture(scope="module")
def pair(ray_session):
    c = Cluster.start(ClusterConfig(num_ranks=2, device="cpu", cache=small_cache(), name_prefix="kvledger-cut-rank",
                                    group_timeout_s=30, call_timeout_s=TIMEOUT))
    yield c
    c.shutdown()


def test_a_target_with_a_gap_in_its_free_slots_receives_every_piece_straight_and_shows_them_at_once(pair):
    c = pair
    p = prompt(7 * T + 1, seed=11)
    (scratch,) = c.client(0).serve([Request(1, p, 1)], logits=True).outcomes   # source slots: one run
    held = prompt(2 * T + 1, seed=12)
    c.client(1).serve([Request(2, prompt(10 * T + 1, seed=13), 1), Request(3, held, 1)])
    pin = c.client(1).export_begin(held)   # the target keeps two blocks among the slots it hands out next
    try:
        before = [client.info().transfers for client in c.clients]
        m = c.migrator.migrate(p, src=0, dst=1)
        assert (m.matched_blocks, m.sent_blocks) == (7, 7)
        assert c.client(1).probe(p) == 7 * T, "stored by the time migrate returned"
        sent, received = (client.info().transfers for client in c.clients)
        pieces = sent["sent_pieces"] - before[0]["sent_pieces"]
        assert pieces == received["received_pieces"] - before[1]["received_pieces"]
        assert pieces >= 2, "the source's one run is cut where the target's fresh slots have a gap"
        assert received["received_direct"] == before[1]["received_direct"] + 1
        assert received["scatter_copies"] == before[1]["scatter_copies"], "no piece went through the staging buffer"
        assert sent["gather_copies"] == before[0]["gather_copies"]
    finally:
        c.client(1).export_end(pin.pin_id)
    (moved,) = c.client(1).serve([Request(4, p, 1)], logits=True).outcomes
    assert moved.cached_tokens == 7 * T and moved.output_tokens == scratch.output_tokens
    assert torch.allclose(torch.tensor(moved.last_logits), torch.tensor(scratch.last_logits), atol=1e-4, rtol=1e-4)
    for client in c.clients:
        client.check_integrity()


def test_a_target_without_room_answers_no_so_the_source_lets_go_and_the_channel_stays_clean(pair):
    c = pair
    p = prompt(5 * T + 1, seed=21)
    c.client(0).serve([Request(11, p, 1)])
    full = prompt(14 * T + 1, seed=22)
    c.client(1).serve([Request(12, full, 1)])
    pin = c.client(1).export_begin(full)   # 14 of the target's 16 blocks held: 5 fresh ones do not fit
    try:
        with pytest.raises(OutOfBlocksError):
            c.migrator.migrate(p, src=0, dst=1)
        assert [client.load().device_blocks_used for client in c.clients] == [0, 14], "only the target's pin holds"
        assert c.client(1).probe(p) == 0, "nothing was stored"
    finally:
        c.client(1).export_end(pin.pin_id)
    for client in c.clients:
        client.check_integrity()
    assert c.migrator.migrate(p, src=0, dst=1).sent_blocks == 5, "the refusal left the pair's channel clean"
    assert c.client(1).probe(p) == 5 * T
