"""Numbered batches, replay and snapshots of one rank's events."""
from __future__ import annotations

import pytest
from ledger_helpers import make_manager, make_request, serve

from kvledger.worker.rank.publisher import EventPublisher
from kvledger.worker.wire.events import BlockStored, KVCacheCreated, decode_batch


def test_batches_are_numbered_from_zero_and_replayable():
    mgr = make_manager()
    pub = EventPublisher(mgr, rank=3, replay_size=2, clock=lambda: 5.0)
    assert pub.poll() is None
    serve(mgr, make_request(1, list(range(8))))
    b0 = pub.poll()
    assert b0.seq == 0
    batch = decode_batch(b0.data)
    assert batch.rank == 3 and batch.ts == 5.0 and isinstance(batch.events[0], BlockStored)
    for rid in (2, 3):
        serve(mgr, make_request(rid, [rid] * 8))
        pub.poll()
    assert [b.seq for b in pub.replay(1)] == [1, 2]
    assert pub.replay(0) is None  # the buffer of 2 no longer reaches batch 0
    assert pub.replay(3) == []
    with pytest.raises(ValueError, match="numbered"):
        pub.replay(7)


def test_snapshot_publishes_pending_events_first():
    mgr = make_manager()
    pub = EventPublisher(mgr, rank=0)
    serve(mgr, make_request(1, list(range(8))))
    pending, snap = pub.snapshot()
    assert pending.seq == 0 and snap.next_seq == 1
    assert len(snap.blocks) == 2 and {b.medium for b in snap.blocks} == {"GPU"}


def test_ledger_overflow_opens_the_next_batch_with_created():
    mgr = make_manager(event_buffer_size=1)
    pub = EventPublisher(mgr, rank=0)
    serve(mgr, make_request(1, list(range(4)) + [9]))
    serve(mgr, make_request(2, list(range(10, 14)) + [9]))
    events = decode_batch(pub.poll().data).events
    assert isinstance(events[0], KVCacheCreated)
    assert pub.poll() is None
