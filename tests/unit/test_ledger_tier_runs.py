"""Tier moves booked a run at a time: the same victims, host slots, events and data as one block after another.

An admission takes its victims together and moves those that earn it to the
host tier in one pass; where a victim moved earlier in the run could come back
as a later one's host slot (host blocks of a higher priority, too few host
slots, an onboard vacating the slot), the ledger must still behave exactly as
LRU with priorities says, block after block.
"""
from __future__ import annotations

from ledger_helpers import make_manager, make_request, read_kv, serve, token_value

from kvledger.worker.ledger import RetentionConfig, TokenRange, block_hashes
from kvledger.worker.ledger.block import PRIMARY, SECONDARY
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.kv_pool import merge_runs, merge_slot_runs
from kvledger.worker.wire.events import BlockRemoved, BlockUpdated

K = list(range(100, 109))   # two full blocks and a partial one
N = [9] * 12                # three full blocks
HK, HN = block_hashes(K, 4), block_hashes(N, 4)


def keep(priority: int) -> RetentionConfig:
    return RetentionConfig(ranges=[TokenRange(0, None, priority=priority)])


def offloaded(h: int) -> BlockUpdated:
    return BlockUpdated(block_hash=h, old_medium="GPU", new_medium="CPU")


def onboarded(h: int) -> BlockUpdated:
    return BlockUpdated(block_hash=h, old_medium="CPU", new_medium="GPU")


def placement(mgr) -> list[tuple[int, int]]:
    return [(b.tier, b.slot) for b in mgr.blocks]


def test_a_run_of_victims_moves_to_free_host_slots_in_one_slice_copy_and_keeps_its_data():
    mgr = make_manager(primary=3, secondary=4, offload_min_priority=30)
    serve(mgr, make_request(1, N))
    assert mgr.get_block_ids(1) == [0, 1, 2]
    mgr.remove_sequence(1)
    mgr.take_events()
    copies = mgr.pools.copies_issued
    mgr.add_sequence(make_request(2, [7] * 12))
    assert mgr.take_events() == [offloaded(HN[2]), offloaded(HN[1]), offloaded(HN[0])]
    assert mgr.pools.copies_issued == copies + 1   # device slots 0-2 to host slots 1-3: one run
    assert mgr.get_block_ids(2) == [6, 5, 4]       # the host blocks swapped in, as clean device blocks
    assert placement(mgr)[:3] == [(SECONDARY, 1), (SECONDARY, 2), (SECONDARY, 3)]
    mgr.remove_sequence(2)
    assert mgr.add_sequence(make_request(3, N)) == 11
    assert mgr.get_block_ids(3) == [0, 1, 2]
    for pos in range(11):
        assert read_kv(mgr, 3, pos) == token_value(tuple(N[:pos + 1]), None, None)


def test_victims_moved_in_one_admission_displace_lower_priority_host_blocks_first():
    mgr = make_manager(primary=3, secondary=2, offload_min_priority=30)
    serve(mgr, make_request(1, K, retention=keep(80)))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, N))   # offloads K's two blocks: the host tier is full, at priority 80
    assert mgr.get_block_ids(2) == [2, 4, 3]
    mgr.remove_sequence(2)
    mgr.take_events()
    mgr.add_sequence(make_request(3, [7] * 12))
    # The first victim takes the least recently freed priority-80 host block's slot; each later one takes the slot
    # of the victim moved just before it (priority 35 goes before 80), which leaves the host tier again.
    assert mgr.take_events() == [BlockRemoved([HK[1]], "CPU"), offloaded(HN[2]), BlockRemoved([HN[2]], "CPU"),
                                 offloaded(HN[1]), BlockRemoved([HN[1]], "CPU"), offloaded(HN[0])]
    assert mgr.get_block_ids(3) == [1, 3, 4]
    assert [(b.tier, b.priority) for b in mgr.blocks if b.tier == SECONDARY] == [(SECONDARY, 80), (SECONDARY, 35)]
    assert mgr.blocks[2].block_hash == HN[0] and mgr.blocks[0].block_hash == HK[0]


def test_a_host_tier_smaller_than_the_run_keeps_the_last_victim():
    mgr = make_manager(primary=3, secondary=1, offload_min_priority=30)
    serve(mgr, make_request(1, N))
    mgr.remove_sequence(1)
    mgr.take_events()
    mgr.add_sequence(make_request(2, [7] * 12))
    assert mgr.take_events() == [offloaded(HN[2]), BlockRemoved([HN[2]], "CPU"), offloaded(HN[1]),
                                 BlockRemoved([HN[1]], "CPU"), offloaded(HN[0])]
    assert mgr.get_block_ids(2) == [3, 2, 1]
    assert placement(mgr) == [(SECONDARY, 0), (PRIMARY, 0), (PRIMARY, 1), (PRIMARY, 2)]
    assert mgr.stats().num_free_secondary_blocks == 1 and mgr.blocks[0].block_hash == HN[0]


def test_onboarding_moves_each_device_victim_into_the_host_slot_just_vacated():
    mgr = make_manager(primary=3, secondary=2, offload_min_priority=30)
    serve(mgr, make_request(1, K))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [9] * 9))   # offloads K's blocks 0 and 1: the host tier is full
    mgr.remove_sequence(2)
    mgr.take_events()
    hm = block_hashes([9] * 9, 4)
    assert mgr.add_sequence(make_request(3, K)) == 8
    assert mgr.admission(3).onboarded_blocks == 2
    # No host slot is free until K's block 0 comes back; then each device victim (priority 35) earns a move to the
    # slot the onboard before it vacated, instead of being dropped.
    assert mgr.take_events() == [onboarded(HK[0]), offloaded(hm[1]), onboarded(HK[1]), offloaded(hm[0])]
    assert mgr.get_block_ids(3) == [0, 1, 3]
    assert placement(mgr) == [(PRIMARY, 0), (PRIMARY, 1), (SECONDARY, 1), (PRIMARY, 2), (SECONDARY, 0)]
    for pos in range(8):
        assert read_kv(mgr, 3, pos) == token_value(tuple(K[:pos + 1]), None, None)


def test_onboarding_drops_low_priority_victims_in_order():
    mgr = make_manager(primary=3, secondary=2, offload_min_priority=30)
    serve(mgr, make_request(1, K))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [9] * 9, retention=keep(10)))   # below offload_min_priority: dropped when evicted
    mgr.remove_sequence(2)
    mgr.take_events()
    hm = block_hashes([9] * 9, 4)
    assert mgr.add_sequence(make_request(3, K)) == 8
    # the onboard's dropped victim announced before its moves; the last block's allocation drops the other
    assert mgr.take_events() == [BlockRemoved([hm[1]], "GPU"), onboarded(HK[0]), onboarded(HK[1]),
                                 BlockRemoved([hm[0]], "GPU")]
    assert mgr.get_block_ids(3) == [0, 1, 2]   # a dropped victim keeps its id
    assert mgr.probe_prefix_match_length([9] * 9) == 0
    for pos in range(8):
        assert read_kv(mgr, 3, pos) == token_value(tuple(K[:pos + 1]), None, None)


def test_events_put_as_a_run_overflow_as_one_by_one():
    buf = EventBuffer(3)
    buf.put(offloaded(1))
    buf.put_n([offloaded(h) for h in (2, 3, 4, 5)])
    assert buf.take() == [offloaded(3), offloaded(4), offloaded(5)]
    assert buf.dropped == 2
    buf.put_n([])
    assert buf.take() == [] and buf.dropped == 2


def test_planned_copies_merge_into_runs_adjacent_on_both_sides():
    assert merge_slot_runs([5, 1, 2, 6, 9], [10, 3, 4, 11, 0]) == [(1, 3, 2), (5, 10, 2), (9, 0, 1)]
    assert merge_runs([(6, 11), (2, 4), (1, 3), (5, 12)]) == [(1, 3, 2), (5, 12, 1), (6, 11, 1)]
    assert merge_slot_runs([], []) == []
