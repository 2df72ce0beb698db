"""The router's event log: batches logged as decoded, records made when read, the oldest past its size gone."""
from __future__ import annotations

from kvledger.router.event_log import EventLog
from kvledger.worker.wire.events import BlockRemoved, BlockStored, EventBatch, decode_view, encode_batch


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


def test_a_decoded_batch_reads_as_its_events_with_their_token_ids():
    ev = BlockStored([1, 2], None, list(range(8)), 4)
    log = EventLog(10)
    log.append(0, 0, 2.0, decode_view(encode_batch(EventBatch(2.0, [ev], 0))).events)
    (rec,), _ = log.read(0)
    assert rec.to_dict() == {"id": 0, "rank": 0, "seq": 0, "ts": 2.0, "type": "BlockStored",
                             **{k: getattr(ev, k) for k in ev.__dataclass_fields__}}
