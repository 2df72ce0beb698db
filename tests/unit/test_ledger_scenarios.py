"""Scenarios on one rank's ledger with exact expectations (4 tokens per block)."""
from __future__ import annotations


import pytest
import torch
from ledger_helpers import FakeClock, make_manager, make_request, prefill, read_kv, serve, token_value, write_kv

from kvledger.worker.ledger import (KVCacheManager, MmKey, OutOfBlocksError, Request, RetentionConfig, TokenRange,
                                    block_hashes)
from kvledger.worker.ledger.block import NO_BLOCK, PRIMARY, SECONDARY
from kvledger.worker.wire.events import BlockRemoved, BlockStored, BlockUpdated

A = list(range(100, 112))  # three full blocks


def stored_hashes(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_reuse_of_released_prompt_never_reuses_last_token():
    mgr = make_manager(enable_partial_reuse=False)
    assert serve(mgr, make_request(1, A)) == 0
    first_ids = mgr.get_block_ids(1)
    mgr.remove_sequence(1)
    events = mgr.take_events()
    assert stored_hashes(events) == block_hashes(A, 4)
    assert events[0].parent_block_hash is None and events[0].token_ids == A

    # Same 12 tokens: only the first two blocks are reused; the third holds the last token.
    assert mgr.add_sequence(make_request(2, A)) == 8
    assert mgr.get_block_ids(2)[:2] == first_ids[:2]
    assert mgr.probe_prefix_match_length(A) == 8
    summary = mgr.analyze_prefix_reuse(A)
    assert (summary.reusable_blocks_all, summary.reusable_blocks_allocated, summary.first_new_block) == (2, 2, 2)
    mgr.check_integrity()


def test_fully_cached_prompt_reuses_n_minus_one_with_partial_reuse():
    mgr = make_manager()
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)
    assert mgr.add_sequence(make_request(2, A)) == 11
    for pos in range(11):
        assert read_kv(mgr, 2, pos) == token_value(tuple(A[:pos + 1]), None, None)
    mgr.check_integrity()


def test_partial_reuse_in_place_takes_the_free_leaf():
    mgr = make_manager()
    serve(mgr, make_request(1, A[:8]))
    b0, b1 = mgr.get_block_ids(1)
    h1 = block_hashes(A[:8], 4)[1]
    mgr.remove_sequence(1)
    mgr.take_events()
    prompt = A[:6] + [7, 7, 7]
    assert mgr.add_sequence(make_request(2, prompt)) == 6
    adm = mgr.admission(2)
    assert (adm.reused_blocks, adm.partial_tokens, adm.copied_blocks) == (1, 2, 0)
    assert mgr.get_block_ids(2)[:2] == [b0, b1]
    assert mgr.take_events() == [BlockRemoved(block_hashes=[h1], medium="GPU")]
    assert mgr.probe_prefix_match_length(A[:8] + [1]) == 4
    mgr.check_integrity()


def test_partial_reuse_copies_a_block_in_use():
    mgr = make_manager()
    serve(mgr, make_request(1, A[:8] + [1]))  # still running: its block 1 is referenced
    b1 = mgr.get_block_ids(1)[1]
    prompt = A[:6] + [7, 7, 7]
    assert mgr.add_sequence(make_request(2, prompt)) == 6
    ids = mgr.get_block_ids(2)
    assert ids[1] != b1 and mgr.admission(2).copied_blocks == 1
    for pos in range(6):  # the copy carries the matched tokens' KV
        assert read_kv(mgr, 2, pos) == token_value(tuple(A[:pos + 1]), None, None)
    assert mgr.probe_prefix_match_length(A[:8] + [1]) == 8  # the original stays cached
    mgr.check_integrity()


def test_partial_reuse_refused_without_copy_when_block_in_use():
    mgr = make_manager(copy_on_partial_reuse=False)
    serve(mgr, make_request(1, A[:8] + [1]))
    assert mgr.add_sequence(make_request(2, A[:6] + [7, 7, 7])) == 4
    assert mgr.analyze_prefix_reuse(A[:6] + [7, 7, 7]).total_matched_tokens == 4


@pytest.mark.parametrize("variant", [
    dict(lora_id=3), dict(cache_salt="tenant-b"), dict(extra_ids=[1] * 12),
    dict(mm_keys=(MmKey("img-b", 0, 4),)),
])
def test_constraint_fields_isolate_reuse(variant):
    mgr = make_manager()
    base = dict(lora_id=1, cache_salt="tenant-a", extra_ids=[0] * 12, mm_keys=(MmKey("img-a", 0, 4),))
    serve(mgr, make_request(1, A, **base))
    mgr.remove_sequence(1)
    assert mgr.add_sequence(make_request(2, A, **{**base, **variant})) == 0
    assert mgr.add_sequence(make_request(3, A, **base)) == 11


def test_multimodal_key_only_affects_blocks_it_overlaps():
    mgr = make_manager()
    serve(mgr, make_request(1, A, mm_keys=(MmKey("img-a", 9, 2),)))
    mgr.remove_sequence(1)
    # A different image at positions 9..10 changes block 2 only: blocks 0 and 1 still match.
    assert mgr.add_sequence(make_request(2, A, mm_keys=(MmKey("img-b", 9, 2),))) == 8


def test_priority_eviction_order_and_descendants_kept():
    mgr = make_manager(primary=6)
    low = RetentionConfig(ranges=[TokenRange(0, None, priority=10)])
    high = RetentionConfig(ranges=[TokenRange(0, None, priority=90)])
    serve(mgr, make_request(1, A, retention=high))  # 3 blocks, priority 90
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [5] * 8, retention=low))  # 2 blocks, priority 10
    mgr.remove_sequence(2)
    mgr.take_events()
    low_hashes = block_hashes([5] * 8, 4)
    # 3 new blocks: the free empty block goes first, then priority 10 (tail first), never priority 90.
    mgr.add_sequence(make_request(3, [9] * 12))
    assert mgr.take_events() == [BlockRemoved([low_hashes[1], low_hashes[0]], "GPU")]   # one removal, in order
    assert mgr.probe_prefix_match_length(A + [0]) == 12
    mgr.remove_sequence(3)


def test_evicting_a_middle_block_keeps_its_descendants():
    mgr = make_manager(primary=4)
    serve(mgr, make_request(1, A))
    ids = mgr.get_block_ids(1)
    mgr.remove_sequence(1)
    # Raise the tail blocks' priority so the first block becomes the victim.
    mgr.add_sequence(make_request(2, A + [1], retention=RetentionConfig(ranges=[TokenRange(4, None, 80)])))
    mgr.remove_sequence(2)
    mgr.take_events()
    mgr.add_sequence(make_request(3, [9] * 5))  # the empty block, then the lowest-priority one
    hashes = block_hashes(A, 4)
    assert mgr.take_events() == [BlockRemoved([hashes[0]], "GPU")]
    assert mgr.blocks[ids[1]].node is not None and mgr.blocks[ids[2]].node is not None
    assert mgr.probe_prefix_match_length(A + [0]) == 0  # the walk stops at the hole
    mgr.remove_sequence(3)
    # Computing block 0 again re-attaches it; its descendants are reachable once more.
    serve(mgr, make_request(4, A[:4] + [1]))
    mgr.remove_sequence(4)
    assert mgr.probe_prefix_match_length(A + [0]) == 12
    mgr.check_integrity()


def kept_ten_seconds_beside_priority_50(clock: FakeClock) -> KVCacheManager:
    """A 4-block ledger holding, released, request 1's blocks at priority 90 for 10 s and request 2's at 50."""
    mgr = make_manager(primary=4, clock=clock)
    keep = RetentionConfig(ranges=[TokenRange(0, None, priority=90, duration_s=10)])
    serve(mgr, make_request(1, A[:8], retention=keep))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [5] * 8, retention=RetentionConfig(ranges=[TokenRange(0, None, priority=50)])))
    mgr.remove_sequence(2)
    return mgr


def test_retention_expires_by_injected_clock():
    clock = FakeClock()
    mgr = kept_ten_seconds_beside_priority_50(clock)
    clock.now += 11
    mgr.take_events()
    mgr.refresh_blocks()
    h = block_hashes(A[:8], 4)
    by_hash = sorted(mgr.take_events(), key=lambda e: e.block_hash)
    assert by_hash == sorted([BlockUpdated(h[0], old_priority=90, new_priority=35),
                              BlockUpdated(h[1], old_priority=90, new_priority=35)], key=lambda e: e.block_hash)
    # Priority 35 now sits below the other prompt's 50: A's blocks go first, leaf first.
    mgr.add_sequence(make_request(3, [9] * 8))
    removed = [x for e in mgr.take_events() if isinstance(e, BlockRemoved) for x in e.block_hashes]
    assert removed == [h[1], h[0]]
    mgr.check_integrity()


def test_reserve_then_commit_counts_each_free_block_once_and_changes_no_books():
    mgr = make_manager(primary=8)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)                                  # A's 3 blocks: stored and free
    serve(mgr, make_request(2, [7] * 8))                    # running: holds blocks 3, 4
    mgr.take_events()
    books = (mgr.stats(), [(b.ref_count, b.level) for b in mgr.blocks])
    mgr.start_scheduling()
    assert mgr.scheduling_num_free_blocks == 6
    first, second = make_request(10, A + [1]), make_request(11, A[:8] + [2])
    assert mgr.scheduling_add_sequence(first) == 4          # 1 new block + A's 3 blocks, free now
    assert mgr.scheduling_add_sequence(second) == 1         # its 2 reused blocks were counted already
    assert mgr.scheduling_num_free_blocks == 1
    assert mgr.scheduling_add_sequence(first) == 4          # added again: counted once, nothing more reserved
    assert mgr.scheduling_num_free_blocks == 1
    mgr.scheduling_remove_sequence(2)                       # pausing request 2 would free its 2 blocks
    assert mgr.scheduling_num_free_blocks == 3
    with pytest.raises(OutOfBlocksError, match="reserving request 12 in this round: needs 5"):
        mgr.scheduling_add_sequence(make_request(12, [9] * 20))
    assert mgr.scheduling_num_free_blocks == 3
    assert (mgr.stats(), [(b.ref_count, b.level) for b in mgr.blocks]) == books and mgr.take_events() == []
    assert mgr.add_sequences([first, second]) == [12, 8]    # the commit
    assert mgr.commit_and_get_block_hashes(10) == block_hashes(A, 4)
    mgr.add_token(10, 4, tokens=[20, 21, 22, 23])           # 17 tokens: block 3 is full, its last token unwritten
    assert mgr.commit_and_get_block_hashes(10) == block_hashes(A + [1, 20, 21, 22], 4)
    assert not any(isinstance(e, BlockStored) for e in mgr.take_events()), "hashing stores nothing"
    mgr.remove_sequence(10)
    stored = [h for e in mgr.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == block_hashes(A + [1, 20, 21, 22], 4)[3:], "only the newly stored block is announced"
    mgr.check_integrity()


def test_draft_tokens_count_in_the_budgets_and_rejected_ones_are_rewound():
    mgr = make_manager(primary=8)
    req = make_request(1, A[:6], max_new_tokens=5, num_draft_tokens=3)
    assert mgr.get_remaining_blocks_to_completion(req) == 4          # ceil((6 + 5 + 3) / 4)
    serve(mgr, req)
    assert mgr.get_block_ids(1) == [0, 1]
    assert mgr.get_needed_blocks_one_step(1) == 1                    # 6 + 1 sampled + 3 drafts = 10 tokens: 3 blocks
    mgr.add_token(1, 4, tokens=[50, 51, 52, 53])                     # the step: one sampled token, three drafts
    assert mgr.get_block_ids(1) == [0, 1, 2] and mgr.num_tokens(1) == 10
    mgr.take_events()
    mgr.rewind(1, 2)                                                 # two drafts rejected: 8 tokens, 2 blocks
    assert mgr.get_block_ids(1) == [0, 1] and mgr.num_tokens(1) == 8 and mgr.stats().free_num_blocks == 6
    assert mgr.take_events() == [], "the rewound block held nothing stored"
    assert mgr.get_needed_blocks_one_step(1) == 1
    mgr.add_token(1, 4, tokens=[60, 61, 62, 63])                     # block 2 went to the free list's tail:
    assert mgr.get_block_ids(1) == [0, 1, 3]                         # the least recently freed goes first
    mgr.rewind(1, 3)
    mgr.remove_sequence(1)
    stored = [h for e in mgr.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    # 6 prompt + 50, 51 + 60 kept: 9 tokens, the last one unwritten: blocks 0 and 1 are stored
    assert stored == block_hashes(A[:6] + [50, 51], 4)[1:2]
    mgr.check_integrity()


@pytest.mark.parametrize("n", [0, -1, 3, "2"])
def test_rewind_refuses_what_was_not_generated_and_changes_nothing(n):
    mgr = make_manager(primary=8)
    serve(mgr, make_request(1, A[:6], max_new_tokens=2))
    mgr.add_token(1, 2, tokens=[7, 8])
    before = (mgr.get_block_ids(1), mgr.num_tokens(1), mgr.stats())
    with pytest.raises(ValueError, match="rewind: n must be an int in 1..2"):
        mgr.rewind(1, n)
    assert (mgr.get_block_ids(1), mgr.num_tokens(1), mgr.stats()) == before
    with pytest.raises(ValueError, match="num_draft_tokens"):
        mgr.add_sequence(make_request(2, A, num_draft_tokens=-1))


def test_without_block_reuse_the_pool_is_a_plain_allocator():
    mgr = make_manager(primary=6, secondary=4, enable_block_reuse=False)
    assert serve(mgr, make_request(1, A)) == 0
    assert mgr.get_block_ids(1) == [0, 1, 2]                 # ascending slots, as with reuse on
    mgr.remove_sequence(1)
    assert mgr.add_sequence(make_request(2, A)) == 0, "nothing is matched"
    assert mgr.get_block_ids(2) == [3, 4, 5], "free blocks recycle in LRU order, none kept for reuse"
    mgr.store_context_blocks(2)
    mgr.remove_sequence(2)
    events = mgr.take_events()
    assert not [e for e in events if isinstance(e, (BlockStored, BlockRemoved, BlockUpdated))], events
    assert mgr.probe_prefix_match_length(A) == 0 and mgr.snapshot() == [] and mgr.pin_prefix(-1, A).slots == ([],)
    s = mgr.stats()
    assert s.reused_blocks == 0 and s.cache_hit_rate == 0.0 and s.offloaded_blocks == 0 and s.free_num_blocks == 6
    mgr.unpin_sequence(-1)
    mgr.check_integrity()


def test_release_never_stores_a_block_whose_last_token_has_no_kv():
    """An engine counts its final sampled token (as TensorRT-LLM does) before any step computes its KV: the block
    that token completes must not become reusable, or a later request would read a slot nobody wrote."""
    mgr = make_manager(primary=8)
    prompt = A[:6]
    serve(mgr, make_request(1, prompt, max_new_tokens=2))     # prefill writes positions 0..5, stores block 0
    mgr.add_token(1, 1, tokens=[50])                           # position 6: its KV is written by this step
    write_kv(mgr, make_request(1, prompt), 6, 7, prompt + [50])
    mgr.add_token(1, 1, tokens=[51])                           # position 7: the final token, never computed
    mgr.take_events()
    mgr.remove_sequence(1)
    stored = [h for e in mgr.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [], "block 1 ends in the unwritten final token: not stored"
    assert mgr.probe_prefix_match_length(prompt + [50, 51, 0]) == 4
    # one more counted token (its predecessor's KV written) and block 1 is complete and stored
    serve(mgr, make_request(2, prompt, max_new_tokens=3))
    for pos, tok in ((6, 50), (7, 51)):
        mgr.add_token(2, 1, tokens=[tok])
        write_kv(mgr, make_request(2, prompt), pos, pos + 1, prompt + [50, 51])
    mgr.take_events()
    mgr.add_token(2, 1, tokens=[52])                          # stored as soon as it is written (item 10)
    stored = [h for e in mgr.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == [block_hashes(prompt + [50, 51], 4)[1]]
    mgr.remove_sequence(2)
    assert not [e for e in mgr.take_events() if isinstance(e, BlockStored)], "nothing more at release"
    mgr.check_integrity()


def test_retention_counts_from_release_and_only_free_blocks_expire():
    """TensorRT-LLM's rule: a 10 s priority-90 range of a request still running at 11 s keeps its blocks at 90;
    the countdown starts when they are released, so they fall back 10 s after that, not before."""
    clock = FakeClock()
    mgr = make_manager(primary=4, clock=clock)
    keep = RetentionConfig(ranges=[TokenRange(0, None, priority=90, duration_s=10)])
    serve(mgr, make_request(1, A[:8], retention=keep))
    ids = mgr.get_block_ids(1)
    mgr.take_events()
    clock.now += 11
    mgr.refresh_blocks()
    assert mgr.take_events() == [] and [mgr.blocks[i].priority for i in ids] == [90, 90], "in use: no expiry"
    mgr.remove_sequence(1)                          # released at t0 + 11: expires at t0 + 21
    clock.now += 9.5
    mgr.refresh_blocks()
    assert mgr.take_events() == [] and [mgr.blocks[i].priority for i in ids] == [90, 90]
    # taken again before it expires: the countdown stops, and restarts in full at the next release
    assert mgr.add_sequence(make_request(2, A[:8] + [1])) == 8
    clock.now += 5
    mgr.refresh_blocks()
    assert mgr.take_events() == []
    mgr.remove_sequence(2)                          # released at t0 + 25.5: expires at t0 + 35.5
    clock.now += 9.9
    mgr.refresh_blocks()
    assert mgr.take_events() == []
    clock.now += 0.2
    mgr.refresh_blocks()
    h = block_hashes(A[:8], 4)
    assert sorted(mgr.take_events(), key=lambda e: e.block_hash) == sorted(
        [BlockUpdated(h[0], old_priority=90, new_priority=35), BlockUpdated(h[1], old_priority=90, new_priority=35)],
        key=lambda e: e.block_hash)
    assert all(mgr.blocks[i].expires_at is None and mgr.blocks[i].duration_s is None for i in ids)
    mgr.check_integrity()


def test_retention_holds_before_it_expires():
    clock = FakeClock()
    mgr = kept_ten_seconds_beside_priority_50(clock)
    clock.now += 9
    mgr.add_sequence(make_request(3, [9] * 8))
    assert mgr.probe_prefix_match_length(A[:8] + [0]) == 8


def test_offload_to_host_and_onboard_on_reuse_keep_the_data():
    mgr = make_manager(primary=4, secondary=4, offload_min_priority=30)
    serve(mgr, make_request(1, A))
    ids = mgr.get_block_ids(1)
    mgr.remove_sequence(1)
    mgr.take_events()
    serve(mgr, make_request(2, [9] * 16))  # needs all 4 device blocks
    h = block_hashes(A, 4)
    ev = mgr.take_events()
    offloaded = [e.block_hash for e in ev if isinstance(e, BlockUpdated) and e.new_medium == "CPU"]
    assert sorted(offloaded) == sorted(h)
    assert all(mgr.blocks[i].tier == SECONDARY for i in ids)  # same block ids, host slots
    mgr.remove_sequence(2)
    assert mgr.add_sequence(make_request(3, A)) == 11
    assert mgr.admission(3).onboarded_blocks == 3
    assert mgr.get_block_ids(3) == ids
    ev = mgr.take_events()
    # Blocks 0 and 1 come back as they were; block 2 is reused in place (3 of its 4 tokens), so it leaves the tree.
    assert sorted(e.block_hash for e in ev if isinstance(e, BlockUpdated) and e.new_medium == "GPU") == sorted(h[:2])
    assert BlockRemoved([h[2]], "CPU") in ev
    for pos in range(11):
        assert read_kv(mgr, 3, pos) == token_value(tuple(A[:pos + 1]), None, None)
    assert mgr.stats().onboarded_blocks == 3
    mgr.check_integrity()


def test_low_priority_victims_are_dropped_not_offloaded():
    mgr = make_manager(primary=3, secondary=4, offload_min_priority=50)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)
    mgr.take_events()
    serve(mgr, make_request(2, [9] * 12))
    ev = mgr.take_events()
    assert not any(isinstance(e, BlockUpdated) for e in ev)
    assert sorted(h for e in ev if isinstance(e, BlockRemoved) for h in e.block_hashes) == sorted(block_hashes(A, 4))


def test_out_of_blocks_raises_and_changes_nothing():
    mgr = make_manager(primary=4)
    serve(mgr, make_request(1, A))
    mgr.take_events()
    before = (mgr.stats(), [(b.ref_count, b.level, b.slot) for b in mgr.blocks], mgr.get_block_ids(1))
    with pytest.raises(OutOfBlocksError, match="needs 2 free primary blocks, 1 available"):
        mgr.add_sequence(make_request(2, [9] * 8))
    with pytest.raises(OutOfBlocksError):
        mgr.add_sequences([make_request(3, [8] * 3), make_request(4, [7] * 3)])
    assert (mgr.stats(), [(b.ref_count, b.level, b.slot) for b in mgr.blocks], mgr.get_block_ids(1)) == before
    assert mgr.take_events() == []
    with pytest.raises(OutOfBlocksError):
        mgr.add_token(1, 5)
    assert mgr.num_tokens(1) == 12
    mgr.check_integrity()


@pytest.mark.parametrize("bad, err", [
    (dict(tokens=[]), "empty"), (dict(tokens=[1, -2]), r"tokens\[1\]"), (dict(tokens="abc"), "sequence of ints"),
    (dict(tokens=[1, True]), r"tokens\[1\]"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(lora_id=-1), "lora_id"), (dict(cache_salt=5), "cache_salt"), (dict(extra_ids=[1]), "extra_ids"),
])
def test_bad_requests_are_refused_and_change_nothing(bad, err):
    mgr = make_manager()
    serve(mgr, make_request(1, A))
    mgr.take_events()
    before = mgr.stats()
    with pytest.raises((ValueError, TypeError), match=err):
        mgr.add_sequence(Request(**{"request_id": 2, "tokens": [1, 2, 3], **bad}))
    with pytest.raises(ValueError, match="already in the ledger"):
        mgr.add_sequence(make_request(1, [1, 2]))
    with pytest.raises(ValueError, match="already in the ledger"):
        mgr.add_sequences([make_request(5, [1, 2]), make_request(5, [3, 4])])
    assert mgr.stats() == before and mgr.take_events() == []
    with pytest.raises(KeyError):
        mgr.remove_sequence(99)
    with pytest.raises(ValueError):
        mgr.add_token(1, 2, tokens=[1])


def test_batch_add_where_two_requests_match_the_same_leaf():
    mgr = make_manager()
    serve(mgr, make_request(1, A[:8]))
    b1 = mgr.get_block_ids(1)[1]
    mgr.remove_sequence(1)
    p2, p3 = A[:6] + [1, 1, 1], A[:7] + [2, 2]
    assert mgr.add_sequences([make_request(2, p2), make_request(3, p3)]) == [6, 7]
    assert mgr.get_block_ids(2)[1] == b1  # the first takes the leaf in place
    assert mgr.get_block_ids(3)[1] != b1 and mgr.admission(3).copied_blocks == 1
    for pos in range(7):  # the copy was made before anyone overwrote the leaf
        assert read_kv(mgr, 3, pos) == token_value(tuple(A[:pos + 1]), None, None)
    mgr.check_integrity()


def test_batch_claims_matches_before_allocating():
    mgr = make_manager(primary=6)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [7] * 12))  # released after A: A's blocks are the LRU victims
    mgr.remove_sequence(2)
    # Allocating the first request's 3 blocks before the second claimed would evict A.
    got = mgr.add_sequences([make_request(3, [9] * 9), make_request(4, A[:8] + [1])])
    assert got == [0, 8]
    mgr.check_integrity()
    with pytest.raises(OutOfBlocksError):
        make_manager(primary=4).add_sequences([make_request(2, [9] * 13), make_request(3, [1])])


def test_stats_after_first_and_second_pass():
    mgr = make_manager(primary=16)
    prompts = [A + [i] for i in range(3)]
    for i, p in enumerate(prompts):
        serve(mgr, make_request(i, p))
        mgr.remove_sequence(i)
    s = mgr.stats()
    # First pass: prompt 0 computes 4 blocks; prompts 1, 2 reuse A's 3 blocks and compute 1.
    assert (s.reused_blocks, s.missed_blocks, s.alloc_total_blocks, s.alloc_new_blocks) == (6, 6, 6, 6)
    assert s.cache_hit_rate == pytest.approx(0.5)
    for i, p in enumerate(prompts):
        serve(mgr, make_request(10 + i, p))
        mgr.remove_sequence(10 + i)
    s = mgr.stats()
    # Second pass: A's 3 full blocks each; the one-token last block is never stored (not full).
    assert (s.reused_blocks, s.missed_blocks) == (6 + 9, 6 + 3)
    assert s.free_num_blocks == 16 and s.used_num_blocks == 0 and s.max_num_blocks == 16
    mgr.check_integrity()


def test_decode_grows_blocks_and_stores_decode_blocks():
    mgr = make_manager()
    serve(mgr, make_request(1, A[:6], max_new_tokens=6))
    assert mgr.get_needed_blocks_one_step(1) == 0
    mgr.add_token(1, 2, tokens=[1, 2])
    assert len(mgr.get_block_ids(1)) == 2 and mgr.get_needed_blocks_one_step(1) == 1
    mgr.add_token(1, 1, tokens=[3])
    assert len(mgr.get_block_ids(1)) == 3
    mgr.remove_sequence(1)
    # The decoded tokens filled block 1: a follow-up turn reuses it.
    assert mgr.probe_prefix_match_length(A[:6] + [1, 2, 3, 4]) == 8


def test_decode_without_token_ids_is_not_stored():
    mgr = make_manager()
    serve(mgr, make_request(1, A[:6], max_new_tokens=6))
    mgr.add_token(1, 2)
    mgr.remove_sequence(1)
    assert mgr.probe_prefix_match_length(A[:6] + [1, 2, 3]) == 4


def test_hashing_a_request_before_its_prefill_publishes_nothing():
    """``commit_and_get_block_hashes`` only hashes (TensorRT-LLM's does): storing before the prefill would announce,
    and let others reuse, blocks whose KV was never written."""
    mgr = make_manager()
    r = make_request(1, A + [1])
    mgr.add_sequence(r)
    assert mgr.commit_and_get_block_hashes(1) == block_hashes(A, 4)
    assert mgr.take_events() == [] and mgr.probe_prefix_match_length(A + [1]) == 0
    prefill(mgr, r)
    mgr.store_context_blocks(1)
    assert [h for e in mgr.take_events() if isinstance(e, BlockStored) for h in e.block_hashes] == block_hashes(A, 4)
    assert mgr.probe_prefix_match_length(A + [1]) == 12


def test_block_table_and_budgets():
    mgr = make_manager()
    serve(mgr, make_request(1, A, max_new_tokens=5))
    serve(mgr, make_request(2, A[:4] + [1], max_new_tokens=0))
    table = mgr.block_table([1, 2])
    assert table.dtype == torch.int32 and table.shape == (2, 3)
    assert table[0].tolist() == [mgr.blocks[i].slot for i in mgr.get_block_ids(1)]
    assert table[1, 1].item() != NO_BLOCK and table[1, 2].item() == NO_BLOCK   # the shorter row is padded
    # 12 + 5 tokens need 5 blocks; 3 held.
    assert mgr.get_remaining_blocks_to_completion(make_request(1, A, max_new_tokens=5)) == 2
    # A new request sharing A's first two blocks (held by request 1) needs the rest.
    assert mgr.get_remaining_blocks_to_completion(make_request(9, A[:8] + [1], max_new_tokens=4)) == 4 - 2


def test_two_phase_scheduling():
    mgr = make_manager()
    serve(mgr, make_request(1, A))
    serve(mgr, make_request(2, A[:8] + [1]))
    mgr.start_scheduling()
    free = mgr.scheduling_num_free_blocks
    mgr.scheduling_remove_sequence(2)  # shares two blocks with 1: only its own block would free
    assert mgr.scheduling_num_free_blocks == free + 1
    mgr.scheduling_remove_sequence(1)
    assert mgr.scheduling_num_free_blocks == free + 4
    assert mgr.stats().free_num_blocks == free  # the real books are untouched


def test_pinned_blocks_stay_held_until_unpinned():
    mgr = make_manager(primary=4)
    serve(mgr, make_request(1, A))
    pinned = mgr.remove_sequence(1, pin=True)
    assert len(pinned) == 3
    with pytest.raises(OutOfBlocksError):
        mgr.add_sequence(make_request(2, [9] * 8))
    mgr.unpin_sequence(1)
    mgr.add_sequence(make_request(2, [9] * 8))
    mgr.check_integrity()


def test_clear_announces_all_cleared():
    mgr = make_manager()
    serve(mgr, make_request(1, A))
    with pytest.raises(RuntimeError):
        mgr.clear()
    mgr.remove_sequence(1)
    mgr.take_events()
    mgr.clear()
    assert type(mgr.take_events()[-1]).__name__ == "AllBlocksCleared"
    assert mgr.probe_prefix_match_length(A) == 0
    mgr.check_integrity()


def test_snapshot_lists_every_stored_block_with_tier():
    mgr = make_manager(primary=4, secondary=4)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [9] * 8))
    snap = {s.block_hash: s for s in mgr.snapshot()}
    h = block_hashes(A, 4)
    assert snap[h[1]].parent_hash == h[0] and snap[h[0]].parent_hash is None
    assert {snap[x].medium for x in h} == {"CPU", "GPU"} or {snap[x].medium for x in h} == {"CPU"}
    assert snap[h[2]].token_ids == A[8:12]


def test_primary_blocks_stay_on_primary_tier_while_held():
    mgr = make_manager(primary=4, secondary=2)
    serve(mgr, make_request(1, A))
    assert all(mgr.blocks[i].tier == PRIMARY for i in mgr.get_block_ids(1))


def test_abort_releases_without_storing():
    mgr = make_manager()
    mgr.add_sequence(make_request(1, A))
    mgr.take_events()
    mgr.remove_sequence(1, store=False)
    assert mgr.take_events() == [] and mgr.probe_prefix_match_length(A + [0]) == 0
    assert mgr.stats().free_num_blocks == 8
    mgr.check_integrity()


def test_fresh_blocks_trade_slots_and_shared_or_stored_ones_are_refused_unchanged():
    """``arrange_slots`` (a migration target lining its fresh blocks up with the source's slots) reorders the slots
    of blocks only the request holds and nothing reads yet; anything else is refused and changes nothing."""
    mgr = make_manager(primary=12)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)                       # A's three blocks are stored and free
    mgr.add_sequence(make_request(2, A + list(range(200, 213))))
    ids = mgr.get_block_ids(2)
    assert mgr.admission(2).reused_blocks == 3 and len(ids) == 7   # three reused blocks, then four fresh ones
    slots = [mgr.blocks[b].slot for b in ids]
    mgr.arrange_slots(2, 3, slots[3:][::-1])
    assert [mgr.blocks[b].slot for b in ids] == slots[:3] + slots[3:][::-1]
    assert mgr.get_block_ids(2) == ids
    before = [mgr.blocks[b].slot for b in ids]
    for at, bad in ((0, before[:3][::-1]), (3, [before[3], before[3], before[4]]), (4, before[3:6]), (-1, [])):
        with pytest.raises(ValueError, match="arrange_slots"):
            mgr.arrange_slots(2, at, bad)
        assert [mgr.blocks[b].slot for b in ids] == before
    mgr.remove_sequence(2)
    mgr.check_integrity()


def test_a_reservation_counts_a_host_tier_block_once_as_the_admission_takes_it():
    """A's 3 blocks offloaded to the host tier: reserving a request that reuses them counts a primary block per
    onboard, once (not also as a free primary block it would claim), and the commit takes exactly that."""
    mgr = make_manager(primary=6, secondary=8)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [7] * 24))                   # 6 blocks: A's 3 go to the host tier
    mgr.remove_sequence(2)
    assert sum(1 for b in mgr.blocks if b.tier == SECONDARY and b.node is not None) >= 3
    mgr.start_scheduling()
    r = make_request(3, A + [1])
    free = mgr.stats().free_num_blocks
    taken = mgr.scheduling_add_sequence(r)
    mgr.add_sequences([r])
    assert taken == free - mgr.stats().free_num_blocks == 4   # 3 onboards and 1 new block


def test_a_partial_block_is_computed_instead_of_copied_when_the_copy_would_not_fit():
    """The pool holds exactly what a request needs; its first 3 tokens match a stored block that has children,
    so reusing them means copying it, which holds the source beside the copy: one block too many. The request
    is admitted computing those tokens instead, rather than refused for ever."""
    mgr = make_manager(primary=5, enable_partial_reuse=True, copy_on_partial_reuse=True)
    serve(mgr, make_request(1, A))                          # A's 3 blocks stored, a chain: the first has children
    mgr.remove_sequence(1)
    r = make_request(2, A[:3] + list(range(1, 18)))         # 20 tokens: all 5 blocks of the pool
    assert mgr.add_sequence(r) == 0 and mgr.stats().free_num_blocks == 0
    mgr.check_integrity()
