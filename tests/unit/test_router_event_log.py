"""The router's event log: one entry per batch (own ranks' by their wire bytes), records made when read, the
oldest past its size gone."""
from __future__ import annotations

from kvledger.router.event_log import EventLog
from kvledger.worker.wire.events import BlockRemoved, BlockStored, EventBatch, encode_batch


def test_reads_keep_ids_sizes_ranks_and_limits_across_batches():
    log = EventLog(5)
    for rank in (0, 1, 0):
        log.append(rank, 7, 1.0, [BlockRemoved([rank]), BlockRemoved([rank + 10]), {"type": "Snapshot"}])
    assert log.next_id == 9
    recs, nxt = log.read(0)
    assert [r.id for r in recs] == [4, 5, 6, 7, 8] and nxt == 9, "only the last 5 records are held"
    assert [r.event["type"] for r in recs] == ["BlockRemoved", "Snapshot", "BlockRemoved", "BlockRemoved", "Snapshot"]
    recs, nxt = log.read(4, rank=1)
    assert [(r.id, r.rank) for r in recs] == [(4, 1), (5, 1)] and nxt == 9
    recs, nxt = log.read(5, limit=2)
    assert [r.id for r in recs] == [5, 6] and nxt == 7
    assert log.read(9) == ([], 9)


def test_a_batch_logged_by_its_wire_bytes_reads_as_its_events():
    ev = BlockStored([1, 2], None, list(range(8)), 4)
    log = EventLog(10)
    log.append_wire(0, 3, 2.0, encode_batch(EventBatch(2.0, [ev, BlockRemoved([2])], 0)), 2)
    log.append(1, 0, 5.0, [BlockRemoved([9])])
    assert log.next_id == 3
    recs, nxt = log.read(1)
    assert [r.to_dict() for r in recs] == [{"id": 1, "rank": 0, "seq": 3, "ts": 2.0, "type": "BlockRemoved",
                                            "block_hashes": [2], "medium": "GPU", "group_idx": 0},
                                           {"id": 2, "rank": 1, "seq": 0, "ts": 5.0, "type": "BlockRemoved",
                                            "block_hashes": [9], "medium": "GPU", "group_idx": 0}]
    (rec,), _ = log.read(0, limit=1)
    assert rec.event == {"type": "BlockStored", **{k: getattr(ev, k) for k in ev.__dataclass_fields__}}
