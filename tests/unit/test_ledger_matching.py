"""Matching a prompt without building its keys: along a chain, at a branching node, under constraints.

The walk compares a block's tokens with the one child's key where a node has
one child, looks the plain tuple of the key's fields up where it has several,
and keeps the matched nodes' own keys; the rest of a prompt's keys are built
when the store needs them. Each of these must match, store and announce
exactly what a key per block would.
"""
from __future__ import annotations

import pytest
from ledger_helpers import make_manager, make_request

from kvledger.worker.ledger import block_hashes
from kvledger.worker.wire.block_key import BlockKey, block_keys, validate_prompt
from kvledger.worker.wire.events import BlockStored

A = list(range(100, 113))          # three full blocks and one token
B = A[:8] + [7, 7, 7, 7, 1]        # A's first two blocks, then its own third


def stored_hashes(events) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def test_a_key_is_the_tuple_of_its_fields_so_the_tree_finds_a_child_by_that_tuple():
    key = BlockKey((1, 2, 3, 4), None, 7, (), "salt")
    assert key == ((1, 2, 3, 4), None, 7, (), "salt") and hash(key) == hash(((1, 2, 3, 4), None, 7, (), "salt"))
    assert {key: "node"}.get(((1, 2, 3, 4), None, 7, (), "salt")) == "node"
    assert key != ((1, 2, 3, 4), None, None, (), "salt")
    assert block_keys([1, 2, 3, 4, 5, 6], 4, include_partial=True, lora_id=3) == [
        BlockKey((1, 2, 3, 4), None, 3), BlockKey((5, 6), None, 3)]
    assert block_keys(list(range(12)), 4, start_block=1) == [BlockKey((4, 5, 6, 7)), BlockKey((8, 9, 10, 11))]


def test_a_prompt_that_misses_stores_every_block_with_its_chained_hash():
    mgr = make_manager(primary=16)
    mgr.add_sequence(make_request(1, A))            # nothing matches: no key past the first is built here
    mgr.store_context_blocks(1)
    assert stored_hashes(mgr.take_events()) == block_hashes(A, 4)[:3]
    assert mgr.probe_prefix_match_length(A) == 12


def test_a_chain_then_a_branch_matches_exact_blocks_and_stores_only_the_new_one():
    mgr = make_manager(primary=16)
    mgr.add_sequence(make_request(1, A))
    mgr.store_context_blocks(1)
    a_ids = mgr.get_block_ids(1)
    mgr.take_events()
    mgr.add_sequence(make_request(2, B))            # the chain's first two blocks, then a miss
    assert mgr.get_block_ids(2)[:2] == a_ids[:2] and mgr.admission(2).reused_blocks == 2
    mgr.store_context_blocks(2)
    assert stored_hashes(mgr.take_events()) == block_hashes(B, 4)[2:3]
    mgr.add_sequence(make_request(3, B[:12] + [5]))  # the second block's node now has two children
    assert mgr.get_block_ids(3)[:3] == mgr.get_block_ids(2)[:3] and mgr.admission(3).reused_blocks == 3
    mgr.add_sequence(make_request(4, A[:12] + [5]))
    assert mgr.get_block_ids(4)[:3] == a_ids[:3] and mgr.admission(4).reused_blocks == 3
    mgr.check_integrity()


@pytest.mark.parametrize("kw", [dict(lora_id=1), dict(cache_salt="tenant-b")])
def test_a_constraint_keeps_a_prompt_off_a_chain_stored_without_it(kw):
    mgr = make_manager(primary=16)
    mgr.add_sequence(make_request(1, A))
    mgr.store_context_blocks(1)
    assert mgr.probe_prefix_match_length(A, **kw) == 0
    mgr.add_sequence(make_request(2, A, **kw))
    assert mgr.admission(2).reused_blocks == 0 and not set(mgr.get_block_ids(2)) & set(mgr.get_block_ids(1))
    mgr.store_context_blocks(2)
    assert stored_hashes(mgr.take_events())[-3:] == block_hashes(A, 4, **kw)[:3]
    assert mgr.probe_prefix_match_length(A, **kw) == 12 and mgr.probe_prefix_match_length(A) == 12


def test_a_partial_match_after_a_full_chain_uses_the_next_blocks_key():
    mgr = make_manager(primary=16)
    mgr.add_sequence(make_request(1, A))
    mgr.store_context_blocks(1)
    summary = mgr.analyze_prefix_reuse(A[:10] + [0, 0])   # two full blocks, then two of A's third block's tokens
    assert (summary.reusable_blocks_all, summary.total_matched_tokens) == (2, 10)


@pytest.mark.parametrize("bad", [[1, True, 3], [1, 2.0], [1, -2], [1, None]])
def test_a_prompt_with_a_token_that_is_no_plain_non_negative_int_is_refused(bad):
    with pytest.raises(ValueError, match=r"tokens\[1\] must be a non-negative int"):
        validate_prompt(bad, None, None, (), None)
    mgr = make_manager()
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        mgr.add_sequence(make_request(1, bad))
    assert mgr.take_events() == [] and mgr.stats().free_num_blocks == 8
