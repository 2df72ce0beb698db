"""Beam search on one rank's ledger, with exact block ids and events (4 tokens per block).

The beams share the prompt's full blocks (its last block too when the prompt
fills it), each beam holds its own blocks past them, the block table has a
row per beam, budgets count every beam, and only the shared context blocks
are ever stored.
"""
from __future__ import annotations

import pytest
from ledger_helpers import make_manager, make_request, prefill, serve

from kvledger.worker.ledger import OutOfBlocksError, block_hashes
from kvledger.worker.ledger.budget import ContextBudget
from kvledger.worker.wire.events import BlockStored

P10 = list(range(200, 210))   # two full blocks and a tail of two
P12 = list(range(300, 312))   # three full blocks


def beam_ids(mgr, rid: int, width: int) -> list[list[int]]:
    return [mgr.get_block_ids(rid, b) for b in range(width)]


def test_beams_share_the_full_context_blocks_and_own_the_tail():
    mgr = make_manager(primary=16)
    r = make_request(1, P10, max_new_tokens=7, beam_width=3)
    assert mgr.get_context_budget(r) == ContextBudget(blocks=5, estimated_reusable_tokens=0)
    assert mgr.get_remaining_blocks_to_completion(r) == 11    # 2 shared + 3 beams x 3 blocks for 17 tokens
    assert mgr.add_sequence(r) == 0
    assert beam_ids(mgr, 1, 3) == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert mgr.block_table([1]).tolist() == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert mgr.stats().used_num_blocks == 5 and mgr.get_remaining_blocks_to_completion(r) == 6
    prefill(mgr, r)
    mgr.store_context_blocks(1)
    assert mgr.take_events() == [BlockStored(block_hashes=block_hashes(P10, 4)[:2], parent_block_hash=None,
                                             token_ids=P10[:8], block_size=4, lora_id=None, medium="GPU",
                                             priority=35)]

    mgr.add_token(1, 2)                                       # positions 10, 11: each beam's tail
    assert beam_ids(mgr, 1, 3) == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert mgr.get_needed_blocks_one_step(1) == 3             # a block per beam for position 12
    mgr.add_token(1, 1)
    assert beam_ids(mgr, 1, 3) == [[0, 1, 2, 5], [0, 1, 3, 6], [0, 1, 4, 7]]
    mgr.rewind(1, 1)                                          # every beam drops its block past the new end
    assert beam_ids(mgr, 1, 3) == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert mgr.stats().used_num_blocks == 5

    mgr.start_scheduling()
    assert mgr.scheduling_num_free_blocks == 11
    mgr.scheduling_remove_sequence(1)                         # every beam's blocks would go
    assert mgr.scheduling_num_free_blocks == 16

    mgr.remove_sequence(1)                                    # nothing more is stored of a beam search
    assert mgr.take_events() == [] and mgr.stats().used_num_blocks == 0
    assert mgr.probe_prefix_match_length(P10) == 8


def test_a_prompt_that_fills_its_last_block_shares_it_too():
    mgr = make_manager(primary=16)
    r = make_request(1, P12, max_new_tokens=4, beam_width=2)
    assert mgr.get_context_budget(r).blocks == 3
    mgr.add_sequence(r)
    assert beam_ids(mgr, 1, 2) == [[0, 1, 2], [0, 1, 2]]
    mgr.store_context_blocks(1)
    assert [e.block_hashes for e in mgr.take_events()] == [block_hashes(P12, 4)]
    assert mgr.get_needed_blocks_one_step(1) == 2
    mgr.add_token(1, 1)
    assert beam_ids(mgr, 1, 2) == [[0, 1, 2, 3], [0, 1, 2, 4]]
    pinned = mgr.remove_sequence(1, pin=True)                 # every beam's blocks stay held
    assert sorted(pinned) == [0, 1, 2, 3, 4] and mgr.stats().used_num_blocks == 5
    mgr.unpin_sequence(1)
    assert mgr.stats().used_num_blocks == 0


def test_beams_reuse_the_stored_context_and_chunks_give_the_tails_at_the_prompt_end():
    mgr = make_manager(primary=16, context_chunk_size=4)
    serve(mgr, make_request(1, P10[:8] + [1]))
    mgr.remove_sequence(1)
    mgr.take_events()
    r = make_request(2, P10, beam_width=2)
    assert mgr.get_context_budget(r) == ContextBudget(blocks=4, estimated_reusable_tokens=8)
    assert mgr.add_sequence(r) == 8                           # the shared blocks come from the tree
    assert mgr.context_chunk(2) == (8, 10)
    assert beam_ids(mgr, 2, 2) == [[0, 1, 3], [0, 1, 4]]

    mgr.remove_sequence(2, store=False)
    chunked = make_request(3, list(range(400, 410)), beam_width=2)
    mgr.add_sequence(chunked)
    assert beam_ids(mgr, 3, 2) == [[5], [5]]                  # no tail before the chunk that ends the prompt
    mgr.add_context_chunk(3)
    assert beam_ids(mgr, 3, 2) == [[5, 6], [5, 6]]
    assert mgr.get_needed_blocks_one_step(3) == 2             # the prompt's last block, once per beam
    mgr.add_context_chunk(3)
    assert beam_ids(mgr, 3, 2) == [[5, 6, 7], [5, 6, 8]]


def test_beam_input_is_refused_and_changes_nothing():
    mgr = make_manager(primary=4)
    with pytest.raises(ValueError, match="beam_width"):
        mgr.add_sequence(make_request(1, P10, beam_width=0))
    with pytest.raises(OutOfBlocksError):                     # 2 shared + 3 tails do not fit 4 blocks
        mgr.add_sequence(make_request(1, P10, beam_width=3))
    assert mgr.stats().used_num_blocks == 0 and mgr.take_events() == []
    mgr.add_sequence(make_request(1, P10, beam_width=2))
    with pytest.raises(ValueError, match="no token ids"):
        mgr.add_token(1, 1, tokens=[5])
    with pytest.raises(ValueError, match="beam must be"):
        mgr.get_block_ids(1, 2)
    mgr.add_token(1, 2)
    with pytest.raises(OutOfBlocksError):                     # a block per beam, one free
        mgr.add_token(1, 1)
    assert mgr.num_tokens(1) == 12 and beam_ids(mgr, 1, 2) == [[0, 1, 2], [0, 1, 3]]
