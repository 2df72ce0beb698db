"""A rank's event publishing on the plain RankWorker: one numbering for polls and pushes,
replay and snapshots, the background publisher thread, and the in-process migration path."""
from __future__ import annotations

import threading

import pytest
import torch

from kvledger.router.groups import WindowedIndex
from kvledger.router.index import PrefixIndex
from kvledger.router.numbering import ApplyStatus, SequencedIndex
from kvledger.router.probe import probe
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.batches import PublishedBatch
from kvledger.worker.wire.errors import RankNotReadyError
from kvledger.worker.wire.events import BlockStored, KVCacheCreated, decode_batch
from kvledger.worker.wire.messages import ServeOutcome
from kvledger.worker.wire.request import Request

T = 4


def make_rank(rank: int = 0, world: int = 1, replay_size: int = 1024) -> RankWorker:
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=32, num_secondary_blocks=4)
    w = RankWorker(rank, world, cfg, seed=0, replay_size=replay_size)
    w.build_ledger(*w.local_block_counts())
    return w


def serve(w: RankWorker, rid: int, tokens: list[int], new: int = 0) -> ServeOutcome:
    return w.serve([Request(rid, tokens, new)]).outcomes[0]


def test_polls_replays_and_snapshots_share_one_numbering():
    w = make_rank(replay_size=2)
    b0 = w.poll_events()
    assert b0.seq == 0 and isinstance(decode_batch(b0.data).events[0], KVCacheCreated)
    assert w.poll_events() is None
    serve(w, 1, list(range(1, 14)))
    b1 = w.poll_events()
    assert b1.seq == 1 and any(isinstance(e, BlockStored) for e in decode_batch(b1.data).events)
    serve(w, 2, [20, 21, 22, 23, 24])
    b2 = w.poll_events()
    assert b2.seq == 2 and any(isinstance(e, BlockStored) for e in decode_batch(b2.data).events)
    assert [b.seq for b in w.replay_events(1)] == [1, 2]
    assert w.replay_events(0) is None        # a buffer of 2 no longer reaches batch 0
    pending, snap = w.event_snapshot()
    assert pending is None and snap.next_seq == 3 and len(snap.blocks) == 4
    index = PrefixIndex(T)
    index.load_snapshot(0, snap.blocks)
    assert probe(index, list(range(1, 14)))[0].matched_tokens == w.probe(list(range(1, 14))) == 12


def test_a_rank_without_a_ledger_says_so():
    cfg = CacheConfig(tokens_per_block=T, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      device="cpu", num_primary_blocks=4)
    w = RankWorker(0, 1, cfg)
    for call in (w.poll_events, w.event_snapshot, lambda: w.replay_events(0)):
        with pytest.raises(RankNotReadyError):
            call()
    assert w.load().ready is False


def test_the_publisher_thread_pushes_every_batch_in_order():
    w = make_rank()
    got: list[PublishedBatch] = []
    stored = threading.Event()

    def sink(batch: PublishedBatch) -> None:
        got.append(batch)
        if any(isinstance(e, BlockStored) for e in decode_batch(batch.data).events):
            stored.set()

    assert w.start_publishing(sink, interval_s=0.001, owner="router-a")
    assert not w.start_publishing(sink, interval_s=0.001, owner="router-a"), "same owner: already pushing"
    serve(w, 1, list(range(30, 50)))
    assert stored.wait(timeout=10), "the pushed batch never came"
    w.stop_publishing()
    assert [b.seq for b in got] == list(range(len(got)))
    index = SequencedIndex(WindowedIndex(T))
    for b in got:
        assert index.ingest(0, b.seq, b.data)[0].status is ApplyStatus.APPLIED
    assert probe(index.store, list(range(30, 50)))[0].matched_tokens == 16
    with pytest.raises(ValueError):
        w.start_publishing(sink, interval_s=0)


def test_blocks_move_between_ranks_of_one_process():
    a, b = make_rank(0, 2), make_rank(1, 2)
    tokens = list(range(60, 81))
    serve(a, 1, tokens)
    export = a.export_begin(tokens)
    target = b.import_begin(tokens, export.blocks)
    assert export.blocks == target.blocks == 5
    assert b.import_write(target.import_id, a.export_read(export.pin_id, export.blocks - target.blocks)) == 5
    assert b.probe(tokens) == 20 and serve(b, 2, tokens).cached_tokens == 20
    a.check_integrity()
    b.check_integrity()
    export = a.export_begin(tokens)
    target = b.import_begin(list(range(90, 111)), export.blocks)
    with pytest.raises(ValueError, match="shape"):
        b.import_write(target.import_id, torch.zeros(1))
    a.export_end(export.pin_id)
    b.check_integrity()
    a.check_integrity()


def test_a_published_serve_returns_the_batch_its_own_serve_caused():
    w = make_rank()
    assert w.poll_events().seq == 0                         # KVCacheCreated
    reply = w.serve([Request(1, list(range(5, 18)), 2)], publish=True)
    (res,), batch = reply.outcomes, reply.events
    assert res.cached_tokens == 0 and len(res.output_tokens) == 2 and res.last_logits is None
    assert batch.seq == 1 and [type(e) for e in decode_batch(batch.data).events] == [BlockStored]
    assert w.poll_events() is None, "nothing left for the publisher thread"
    reply = w.serve([Request(2, list(range(5, 17)), 0)], publish=True)
    assert reply.outcomes[0].cached_tokens == 11            # all but the last token, the last block in place
    assert reply.events.seq == 2 and w.poll_events() is None
    assert w.serve([Request(3, list(range(40, 60)))]).events is None, "unasked, the events wait for a poll"
    assert w.poll_events().seq == 3
