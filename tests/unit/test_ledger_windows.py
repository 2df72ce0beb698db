"""Attention windows (VSWA): one window manager per window, one prefix tree, placeholders, the safe-prefix rule."""
from __future__ import annotations

import dataclasses

import pytest
from ledger_helpers import make_request, make_windowed_manager, serve, window_pool, write_kv
from msgspec.structs import astuple

from kvledger.router.groups import WindowedIndex
from kvledger.router.numbering import SequencedIndex
from kvledger.worker.ledger import NO_BLOCK, CacheConfig, ContextBudget, KVCacheManager, OutOfBlocksError, block_hashes
from kvledger.worker.wire.events import BlockRemoved, BlockStored, EventBatch, KVCacheCreated, decode_batch
from kvledger.worker.wire.events import decode_view, encode_batch

T = 4
X = NO_BLOCK   # a placeholder's id and slot


def ids(mgr: KVCacheManager, rid: int) -> list[list[int]]:
    return [mgr.get_block_ids(rid, window=w) for w in range(2)]


def test_windows_cycle_over_the_layers_and_split_the_budget_by_shares() -> None:
    cfg = CacheConfig(num_layers=4, attention_windows=(512, None), num_primary_blocks=100, device="cpu")
    assert cfg.layer_windows == (512, None, 512, None)
    assert [(g.window, g.layers, g.kind) for g in cfg.window_layouts] == [(512, (0, 2), "sliding_window"),
                                                                          (None, (1, 3), "full_attention")]
    assert cfg.window_block_counts() == ((100, 0), (100, 0))   # equal shares of bytes, half the layers each
    shared = CacheConfig(num_layers=4, attention_windows=(512, None), num_primary_blocks=100, device="cpu",
                         window_shares=(1, 3))
    assert shared.window_block_counts() == ((50, 0), (150, 0))
    assert CacheConfig(device="cpu").window_block_counts() == ((1024, 0),)


@pytest.mark.parametrize("field, value, message", [
    ("attention_windows", (0, None), "attention_windows must be"),
    ("attention_windows", (8, None, 8), "attention_windows must be"),
    ("attention_windows", [8], "attention_windows must be"),
    ("window_shares", (1,), "window_shares must be"),
    ("window_shares", (1, -1), "window_shares must be"),
    ("window_blocks", ((1, 0),), "window_blocks must be"),
    ("window_blocks", ((0, 0), (4, 0)), "at least one block"),
])
def test_bad_window_settings_are_refused_naming_the_field(field: str, value: object, message: str) -> None:
    kw = {"attention_windows": (8, None), field: value}
    with pytest.raises(ValueError, match=message):
        CacheConfig(num_layers=2, device="cpu", **kw)


def test_decode_releases_what_slid_out_and_leaves_placeholders() -> None:
    mgr = make_windowed_manager()
    r = make_request(1, list(range(10)))
    assert mgr.add_sequence(r) == 0
    assert ids(mgr, 1) == [[0, 1, 2], [0, 1, 2]]
    mgr.store_context_blocks(1)
    stored = mgr.take_events()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, len(e.block_hashes))
                for e in stored if isinstance(e, BlockStored)] == [(0, "sliding_window", 8, 2),
                                                               (1, "full_attention", None, 2)]
    for t in range(10, 17):   # the step at 16 attends to 9..16: blocks 0 and 1 of window 0 are needed no more
        mgr.add_token(1, 1, tokens=[t])
    assert ids(mgr, 1) == [[X, X, 2, 3, 4], [0, 1, 2, 3, 4]]
    assert mgr.block_table([1]).tolist() == [[[X, X, 2, 3, 4], [0, 1, 2, 3, 4]]]
    per = mgr.stats().windows
    assert [(w.window, w.used_num_blocks, w.free_num_blocks) for w in per] == [(8, 3, 5), (None, 5, 3)]
    assert (mgr.stats().used_num_blocks, mgr.stats().free_num_blocks) == (8, 8)
    with pytest.raises(ValueError, match="rewind: n must be an int in 1..1"):   # not below the last step's start
        mgr.rewind(1, 2)
    mgr.remove_sequence(1)
    assert mgr.stats().used_num_blocks == 0


def test_reading_a_placeholder_raises_instead_of_reading_the_last_block() -> None:
    """A slot or id of -1 wraps to the pool's (the block list's) last entry and hands back another block's data
    without a word; the placeholder's are past every pool, so a read that forgot to mask it fails where it reads."""
    mgr = make_windowed_manager()
    mgr.add_sequence(make_request(1, list(range(10))))
    for t in range(10, 17):   # window 0 lets blocks 0 and 1 slide out
        mgr.add_token(1, 1, tokens=[t])
    pool = window_pool(mgr, 0)
    pool[-1] = 7.0   # what a wrapped index would read
    slot, block_id = int(mgr.block_table([1])[0, 0, 0]), mgr.get_block_ids(1, window=0)[0]
    assert (slot, block_id) == (NO_BLOCK, NO_BLOCK)
    with pytest.raises(IndexError):
        pool[slot]
    with pytest.raises(IndexError):
        mgr.window_blocks(0)[block_id]


def test_a_match_counts_only_as_far_as_every_window_can_serve_it() -> None:
    mgr = make_windowed_manager(blocks=((5, 0), (8, 0)))
    prompt = list(range(17))   # 4 full blocks + 1 token
    mgr.add_sequence(make_request(1, prompt))
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)
    assert mgr.probe_prefix_match_length(prompt) == 16
    mgr.take_events()
    mgr.add_sequence(make_request(2, [99] * 9))   # 3 blocks of window 0: its clean one, then blocks 3 and 2
    evicted = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.group_idx, len(e.block_hashes)) for e in evicted] == [(0, 2)]   # one removal of both
    assert mgr.get_block_ids(2, window=0) == [4, 3, 2]
    # window 1 holds all four blocks; window 0 only blocks 0 and 1. Four blocks would need window 0's
    # blocks 2 and 3 (tokens 9..15), three its blocks 1 and 2 (tokens 5..11), two its blocks 0 and 1 (1..7).
    assert mgr.probe_prefix_match_length(prompt) == 8
    assert mgr.analyze_prefix_reuse(prompt[:13]).reusable_blocks_all == 2
    mgr.remove_sequence(2)
    assert mgr.add_sequence(make_request(3, prompt)) == 8
    assert ids(mgr, 3)[1][:2] == [0, 1] and ids(mgr, 3)[0][:2] == [0, 1]


def test_reuse_with_placeholders_holds_only_the_window_tail() -> None:
    mgr = make_windowed_manager()
    prompt = list(range(21))   # 5 full blocks + 1 token
    mgr.add_sequence(make_request(1, prompt))
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)
    assert mgr.add_sequence(make_request(2, prompt)) == 20
    # window 0 needs tokens 13..19 for the query at 20: blocks 3 and 4; window 1 all five
    assert ids(mgr, 2) == [[X, X, X, 3, 4, 6], [0, 1, 2, 3, 4, 6]]   # 5 (wiped) queues behind 6, 7
    assert mgr.stats().windows[0].used_num_blocks == 3


def test_a_refused_growth_changes_nothing_in_any_window() -> None:
    mgr = make_windowed_manager(blocks=((8, 0), (3, 0)))
    mgr.add_sequence(make_request(1, list(range(12))))
    before = (ids(mgr, 1), mgr.stats())
    with pytest.raises(OutOfBlocksError, match="in attention window 1"):
        mgr.add_token(1, 1, tokens=[12])
    assert (ids(mgr, 1), mgr.stats()) == before
    with pytest.raises(ValueError, match="beam search is not supported"):
        mgr.add_sequence(make_request(2, [1, 2, 3], beam_width=2))


def test_snapshot_and_hashes_cover_every_window() -> None:
    mgr = make_windowed_manager()
    prompt = list(range(21))
    mgr.add_sequence(make_request(1, prompt))
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)
    stored = [e.block_hashes for e in mgr.take_events() if isinstance(e, BlockStored) and e.group_idx == 1]
    mgr.add_sequence(make_request(2, prompt))   # window 0 takes blocks 3 and 4 only
    assert [mgr.commit_and_get_block_hashes(2)] == stored
    assert mgr.take_events() == []   # hashing stores nothing
    snap = mgr.snapshot()
    assert sorted((s.group_idx, s.kv_cache_spec_kind, s.kv_cache_spec_sliding_window) for s in snap) == \
        [(0, "sliding_window", 8)] * 5 + [(1, "full_attention", None)] * 5
    assert {s.block_hash for s in snap if s.group_idx == 0} == {s.block_hash for s in snap if s.group_idx == 1}


def test_budgets_count_every_window_and_a_sliding_window_holds_at_most_its_span() -> None:
    mgr = make_windowed_manager(blocks=((8, 0), (16, 0)))
    r = make_request(1, list(range(10)), max_new_tokens=30)
    # window 0 holds the prompt's 3 blocks, then at most the 8 tokens' 2 blocks and the one filling; window 1 all 10
    assert mgr.get_remaining_blocks_to_completion(r) == 3 + 10
    assert mgr.get_context_budget(r).blocks == 3 + 3
    mgr.add_sequence(r)
    mgr.add_token(1, 1, tokens=[10])
    mgr.add_token(1, 1, tokens=[11])   # the step at 11 reads 4..11: window 0 lets block 0 go
    assert ids(mgr, 1) == [[X, 1, 2], [0, 1, 2]]
    assert mgr.get_needed_blocks_one_step(1) == 1 + 1   # position 12 starts block 3 in each window
    assert mgr.get_remaining_blocks_to_completion(r) == (3 - 2) + (10 - 3)


def test_the_context_budget_does_not_depend_on_the_order_of_the_windows() -> None:
    """The same model, its windows listed in both orders: each window is priced against its own pool, less the
    matched blocks running requests hold in that window (the reuse figure was window 0's: 18 or 2 blocks)."""
    seen = []
    for windows in ((8, None), (None, 8)):
        mgr = make_windowed_manager(blocks=((64, 0), (64, 0)), windows=windows)
        prompt = list(range(41))
        serve(mgr, make_request(1, prompt))   # running: it holds the prompt's blocks in both windows
        r = make_request(2, prompt, max_new_tokens=4)
        seen.append((mgr.get_context_budget(r), dict(zip(windows, mgr.context_budget_by_window(r))),
                     mgr.analyze_prefix_reuse(prompt).reusable_blocks_allocated,
                     dict(zip(windows, mgr.remaining_blocks_by_window(r)))))
    assert seen[0] == seen[1]
    total, by_window, allocated, remaining = seen[0]
    # full attention: the prompt's 11 blocks less the 10 request 1 holds; the sliding window: 11 less the 2 of the
    # window's tail it holds (the positions before them are placeholders, held by no one)
    assert by_window == {None: ContextBudget(1, 40), 8: ContextBudget(9, 40)} and total == ContextBudget(10, 40)
    assert allocated == 10 and remaining == {None: 12 - 10, 8: 11}


def test_chunked_prefill_slides_the_window_and_holds_what_the_budget_prices() -> None:
    """A 40-token prompt in chunks of 8, window 8: a chunk's queries attend 7 tokens back, so window 0 lets go of
    the blocks before that, stored first, and holds 4 blocks where it held the whole prompt's 10: the 4 + 10 the
    budget prices are what is held (20 were)."""
    mgr = make_windowed_manager(blocks=((16, 0), (16, 0)), context_chunk_size=8)
    r = make_request(1, list(range(40)))
    assert mgr.context_budget_by_window(r) == (ContextBudget(4, 0), ContextBudget(10, 0))
    mgr.add_sequence(r)
    held = []
    for _ in range(5):
        start, end = mgr.context_chunk(1)
        write_kv(mgr, r, start, end, r.tokens)
        held.append(tuple(w.used_num_blocks for w in mgr.stats().windows))
        if end < 40:
            mgr.add_context_chunk(1)
    assert held == [(2, 2), (4, 4), (4, 6), (4, 8), (4, 10)]
    assert ids(mgr, 1) == [[X] * 6 + [6, 7, 8, 9], list(range(10))]
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)
    assert mgr.probe_prefix_match_length(r.tokens + [99]) == 40   # what slid out was stored before it went


def test_each_window_announces_its_own_pool_when_the_ledger_is_created() -> None:
    """One ``KVCacheCreated`` per window, its own pool's counts (TensorRT-LLM's one created event per window size),
    where one event said 47 device blocks, the sum of two pools; the codec and the router's index take them."""
    mgr = KVCacheManager(CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=1, head_dim=2, device="cpu",
                                     attention_windows=(32, None), window_blocks=((38, 4), (9, 2))))
    created = mgr.take_events()
    assert created == mgr.created_events() == [
        KVCacheCreated({"GPU": 38, "CPU": 4}, T, group_idx=0, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=32),
        KVCacheCreated({"GPU": 9, "CPU": 2}, T, group_idx=1, kv_cache_spec_kind="full_attention")]
    assert KVCacheManager(CacheConfig(tokens_per_block=T, device="cpu", num_primary_blocks=8)).take_events() == [
        KVCacheCreated({"GPU": 8, "CPU": 0}, T)]   # one window: as before, no group described
    data = encode_batch(EventBatch(0.0, created, 0))
    assert decode_batch(data).events == created
    assert [astuple(e) for e in decode_view(data).events] == [dataclasses.astuple(e) for e in created]
    mgr.add_sequence(make_request(1, list(range(13))))
    mgr.store_context_blocks(1)
    index = SequencedIndex(WindowedIndex(T))
    assert index.apply(0, 0, EventBatch(0.0, created + mgr.take_events(), 0)).applied
    assert index.store.longest_prefixes(block_hashes(list(range(13)), T))[0] == (3, 0)


def test_a_scheduling_round_reserves_in_every_window() -> None:
    mgr = make_windowed_manager(blocks=((8, 0), (4, 0)))
    mgr.add_sequence(make_request(1, list(range(8))))   # 2 blocks in each window
    mgr.start_scheduling()
    assert mgr.scheduling_num_free_blocks == 6 + 2
    with pytest.raises(OutOfBlocksError, match=r"\(window 1\)"):
        mgr.scheduling_add_sequence(make_request(2, list(range(50, 62))))   # 3 blocks: window 1 has 2 free
    mgr.scheduling_remove_sequence(1)
    assert mgr.scheduling_add_sequence(make_request(2, list(range(50, 62)))) == 3 + 3
    assert mgr.scheduling_num_free_blocks == 8 + 4 - 6
    assert mgr.stats().used_num_blocks == 4   # the books did not change
