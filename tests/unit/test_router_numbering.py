"""Each rank's batch numbering, in front of the block store, and the feed's one event route over it: duplicates
dropped before decoding, a gap closed by replay, a restart by snapshot."""
from __future__ import annotations

import time

import pytest
from index_helpers import H, TPB, batch, ingest, make_index, state, stored

from kvledger.router.feed import EventFeed
from kvledger.router.numbering import ApplyStatus
from kvledger.router.snapshot import SnapshotBlock
from kvledger.worker.wire.batches import PublishedBatch, Snapshot, StoredBlock
from kvledger.worker.wire.events import EventDecodeError, KVCacheCreated, encode_batch


@pytest.fixture
def index():
    return make_index()


# --- numbering ------------------------------------------------------------------------------------

def test_gap_asks_for_replay_and_applies_nothing(index):
    index.apply(0, 0, batch(stored(H[:1])))
    before = state(index)
    r = index.apply(0, 2, batch(stored(H[1:2])))
    assert (r.status, r.replay_from, r.next_seq) == (ApplyStatus.REPLAY, 1, 1)
    assert state(index) == before
    assert index.apply(0, 1, batch(stored(H[2:3]))).applied     # the replayed batch
    assert index.apply(0, 2, batch(stored(H[1:2]))).applied
    assert index.next_seq(0) == 3
    assert index.stats.replays_requested == 1

def test_first_batch_seen_late_asks_for_replay_from_zero(index):
    r = index.apply(3, 5, batch(stored(H[:1])))
    assert r.status is ApplyStatus.REPLAY and r.replay_from == 0

def test_duplicate_is_ignored(index):
    index.apply(0, 0, batch(stored(H[:1])))
    index.apply(0, 1, batch(stored(H[1:2])))
    before = state(index)
    r = index.apply(0, 1, batch(stored(H[1:2])))
    assert r.status is ApplyStatus.DUPLICATE and r.replay_from is None
    assert state(index) == before

@pytest.mark.parametrize("restart", ["renumbered", "created"])
def test_restart_purges_the_rank_and_waits_for_a_snapshot(index, restart):
    index.apply(0, 0, batch(KVCacheCreated({"GPU": 8}, TPB), stored(H[:3])))
    index.apply(0, 1, batch(stored(H[3:4], parent=H[2])))
    index.apply(1, 0, batch(stored(H[:2])))
    r = (index.apply(0, 0, batch(KVCacheCreated({"GPU": 8}, TPB))) if restart == "renumbered"
         else index.apply(0, 2, batch(KVCacheCreated({"GPU": 8}, TPB), stored(H[:1]))))
    assert r.status is ApplyStatus.SNAPSHOT and r.next_seq == 0
    assert index.num_blocks(0) == 0 and index.store.holders(H[0]) == [1]    # purged at once
    assert index.awaiting_snapshot(0)
    assert index.apply(0, 1, batch(stored(H[:1]))).status is ApplyStatus.SNAPSHOT   # still waiting
    index.load_snapshot(0, [SnapshotBlock(H[0]), SnapshotBlock(H[1], "CPU")], next_seq=4)
    assert not index.awaiting_snapshot(0)
    assert index.store.refs(0, H[1]) == (0, 1)
    assert index.apply(0, 4, batch(stored(H[2:3], parent=H[1]))).applied
    assert index.store.longest_prefixes(H[:3]) == {0: (3, 1), 1: (2, 0)}

def test_kv_cache_created_opens_a_fresh_rank(index):
    assert index.apply(2, 0, batch(KVCacheCreated({"GPU": 8, "CPU": 4}, TPB), stored(H[:2]))).applied
    assert index.num_blocks(2) == 2

def test_wrong_rank_or_numbering_is_a_caller_error(index):
    with pytest.raises(ValueError, match="rank 2"):
        index.apply(1, 0, batch(stored(H[:1]), rank=2))
    with pytest.raises(ValueError, match="seq"):
        index.apply(1, -1, batch())
    with pytest.raises(TypeError):
        index.apply(1, 0, [stored(H[:1])])
    assert index.ranks() == []

def test_ingest_round_trip_and_malformed_bytes(index):
    data = encode_batch(batch(KVCacheCreated({"GPU": 4}, TPB), stored(H[:3]), rank=0))
    assert ingest(index, 0, 0, data).applied
    assert index.store.longest_prefixes(H[:3]) == {0: (3, 0)}
    before = state(index)
    with pytest.raises(EventDecodeError):
        ingest(index, 0, 1, data[:-3])
    assert state(index) == before

def test_ingest_reads_no_token_ids_but_rejects_what_is_not_an_array(index):
    good = stored(H[:1])
    data = encode_batch(batch(good, rank=0))
    assert ingest(index, 0, 0, data).applied
    not_an_array = data.replace(bytes([0x94]) + bytes([7]) * 4, bytes([7]))   # token_ids [7, 7, 7, 7] -> 7
    assert not_an_array != data
    with pytest.raises(EventDecodeError, match="token_ids"):
        ingest(index, 0, 1, not_an_array)
    assert index.next_seq(0) == 1


# --- the feed's route: in-memory ranks whose batches are wire bytes ------------------------------------------------


class FakeRank:
    """A rank as the feed asks it: its published batches (a replay buffer of ``keep``) and a snapshot."""

    def __init__(self, rank: int, keep: int = 100) -> None:
        self.rank, self.keep = rank, keep
        self.published: list[PublishedBatch] = []
        self.held: list[int] = []
        self.replays: list[int] = []

    def publish(self, *events) -> PublishedBatch:
        b = PublishedBatch(len(self.published), encode_batch(batch(*events, rank=self.rank)))
        self.published.append(b)
        for ev in events:
            self.held += getattr(ev, "block_hashes", [])
        return b

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        self.replays.append(from_seq)
        return self.published[from_seq:] if len(self.published) - from_seq <= self.keep else None

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        blocks = [StoredBlock(h, None, [7] * TPB, "GPU", None, None, 35) for h in self.held]
        return None, Snapshot(len(self.published), blocks)


class FakeRanks:
    def __init__(self, *ranks: FakeRank) -> None:
        self.ranks = {r.rank: r for r in ranks}

    def live(self) -> list[int]:
        return sorted(self.ranks)

    def client(self, rank: int) -> FakeRank:
        return self.ranks[rank]


def make_feed(*ranks: FakeRank) -> EventFeed:
    return EventFeed(FakeRanks(*ranks), TPB, 1000, 10.0, time.monotonic, lambda rank: None)


def test_a_duplicate_is_dropped_by_its_number_before_it_is_decoded():
    rank = FakeRank(0)
    feed = make_feed(rank)
    for b in (rank.publish(stored(H[:2])), rank.publish(stored(H[2:3], H[1]))):
        assert feed.ingest(0, b.seq, b.data).applied
    logged = feed.log.next_id
    res = feed.ingest(0, 1, b"not a batch at all")   # batch 1 again, as the push brings what the reply did
    assert res.status is ApplyStatus.DUPLICATE and res.next_seq == 2
    assert feed.index.stats.batches_duplicate == 1 and feed.rejections.total() == 0
    assert feed.log.next_id == logged and feed.counters(0)[2] == 2
    with pytest.raises(EventDecodeError):
        feed.ingest(0, 2, b"not a batch at all")   # the next number is decoded, and refused
    assert feed.rejections.total() == 1


def test_a_gap_is_closed_by_replay_on_the_same_route():
    rank = FakeRank(0)
    feed = make_feed(rank)
    batches = [rank.publish(stored(H[i:i + 1], H[i - 1] if i else None)) for i in range(4)]
    assert feed.ingest(0, 0, batches[0].data).applied
    res = feed.ingest(0, 3, batches[3].data)   # 1 and 2 lost on the way
    assert res.status is ApplyStatus.APPLIED and res.next_seq == 4 and rank.replays == [1]
    assert feed.index.stats.replays_requested == 1 and feed.index.num_blocks(0) == 4
    assert [r.seq for r in feed.events(0)[0]] == [0, 1, 2, 3]   # each batch logged once, in order


@pytest.mark.parametrize("why", ["replay gone", "restart"])
def test_a_replay_that_no_longer_reaches_back_or_a_restart_loads_a_snapshot(why):
    rank = FakeRank(0, keep=1)
    feed = make_feed(rank)
    batches = [rank.publish(stored(H[i:i + 1], H[i - 1] if i else None)) for i in range(4)]
    assert feed.ingest(0, 0, batches[0].data).applied
    if why == "restart":
        rank.published, rank.held = [], []
        again = rank.publish(KVCacheCreated({"GPU": 8}, TPB), stored(H[5:6]))
        res = feed.ingest(0, again.seq, again.data)   # numbered from 0 again
    else:
        res = feed.ingest(0, 3, batches[3].data)
    assert res.status is ApplyStatus.SNAPSHOT and res.next_seq == len(rank.published)
    assert feed.index.stats.snapshots_loaded == 1 and not feed.index.awaiting_snapshot(0)
    assert sorted(h for h in H if feed.index.store.refs(0, h) != (0, 0)) == sorted(rank.held)
