"""Chunked prefill on one rank's ledger, with exact block ids and events (4 tokens per block).

A prompt is admitted chunk by chunk (``CacheConfig.context_chunk_size``),
its blocks allocated as each chunk is; the budgets follow TensorRT-LLM's
``getNeededBlocksOneStep``; ``fit_token_budget`` shrinks chunks after
allocation when the reuse obtained fell short of the estimate.
"""
from __future__ import annotations

import pytest
from ledger_helpers import make_manager, make_request, read_kv, serve, token_value, write_kv

from kvledger.worker.ledger import OutOfBlocksError, PrefixReuseSummary, block_hashes
from kvledger.worker.ledger.budget import ContextBudget, context_budget, sink_bubble, step_blocks
from kvledger.worker.wire.events import BlockRemoved, BlockStored

A = list(range(100, 112))    # three full blocks
P18 = list(range(200, 218))  # four full blocks and two tokens


def test_a_prompt_is_admitted_chunk_by_chunk_and_its_blocks_stored_as_they_are_written():
    mgr = make_manager(context_chunk_size=8)
    r = make_request(1, P18, max_new_tokens=2)
    assert mgr.add_sequence(r) == 0
    assert mgr.get_block_ids(1) == [0, 1] and mgr.context_chunk(1) == (0, 8)
    assert mgr.stats().used_num_blocks == 2 and mgr.take_events() == []
    assert mgr.get_needed_blocks_one_step(1) == 2       # the next chunk: positions 8..15
    with pytest.raises(ValueError, match="add_context_chunk"):
        mgr.add_token(1, 1, tokens=[5])                  # no decoding before the whole prompt is in
    h = block_hashes(P18, 4)

    write_kv(mgr, r, 0, 8, P18)
    assert mgr.add_context_chunk(1) == (8, 16)
    assert mgr.get_block_ids(1) == [0, 1, 2, 3]
    assert mgr.take_events() == [BlockStored(block_hashes=h[:2], parent_block_hash=None, token_ids=P18[:8],
                                             block_size=4, lora_id=None, medium="GPU", priority=35)]
    assert mgr.get_needed_blocks_one_step(1) == 1       # the last chunk: positions 16, 17
    write_kv(mgr, r, 8, 16, P18)
    assert mgr.add_context_chunk(1) == (16, 18) and mgr.get_block_ids(1) == [0, 1, 2, 3, 4]
    assert [e.block_hashes for e in mgr.take_events()] == [h[2:4]]
    with pytest.raises(ValueError, match="no context left"):
        mgr.add_context_chunk(1)

    write_kv(mgr, r, 16, 18, P18)
    mgr.store_context_blocks(1)                          # nothing new: the last block is not full
    assert mgr.take_events() == []
    assert mgr.get_needed_blocks_one_step(1) == 0       # decoding now: position 18 fits block 4
    mgr.add_token(1, 1, tokens=[5])
    with pytest.raises(ValueError, match="decoding"):
        mgr.context_chunk(1)
    assert mgr.commit_and_get_block_hashes(1) == h[:4]
    mgr.remove_sequence(1)


def test_a_chunked_prompt_reuses_full_and_partial_blocks_before_its_first_chunk():
    mgr = make_manager(context_chunk_size=8)
    assert serve(mgr, make_request(1, A)) == 0
    mgr.remove_sequence(1)
    mgr.take_events()

    # Three full blocks reused: the first chunk starts at 12.
    long = A + [7] * 9
    assert mgr.add_sequence(make_request(2, long)) == 12
    assert mgr.context_chunk(2) == (12, 20) and mgr.get_block_ids(2) == [0, 1, 2, 3, 4]
    mgr.remove_sequence(2, store=False)

    # Two full blocks and two tokens of the third, taken in place: the chunk starts mid-block, at 10.
    prompt = A[:10] + [7] * 5
    assert mgr.add_sequence(make_request(3, prompt)) == 10
    assert mgr.context_chunk(3) == (10, 15)
    assert mgr.get_block_ids(3) == [0, 1, 2, 5]          # 3 and 4 went back behind the never-used blocks
    assert mgr.take_events() == [BlockRemoved(block_hashes=[block_hashes(A, 4)[2]], medium="GPU")]
    for pos in range(10):
        assert read_kv(mgr, 3, pos) == token_value(tuple(prompt[:pos + 1]), None, None)


def test_a_chunk_that_does_not_fit_is_refused_and_changes_nothing():
    mgr = make_manager(primary=3, context_chunk_size=8)
    r = make_request(1, P18)
    mgr.add_sequence(r)
    mgr.add_sequence(make_request(2, [1, 2]))            # takes the third block
    write_kv(mgr, r, 0, 8, P18)
    before = (mgr.get_block_ids(1), mgr.context_chunk(1), mgr.stats())
    with pytest.raises(OutOfBlocksError):
        mgr.add_context_chunk(1)
    assert (mgr.get_block_ids(1), mgr.context_chunk(1), mgr.stats()) == before
    assert mgr.take_events() == []                      # the written chunk is not stored by a refused call
    with pytest.raises(ValueError, match="num_tokens"):
        mgr.add_context_chunk(1, 0)


def test_the_next_chunk_may_be_smaller_than_the_configured_size():
    mgr = make_manager(context_chunk_size=8)
    r = make_request(1, P18)
    mgr.add_sequence(r)
    write_kv(mgr, r, 0, 8, P18)
    assert mgr.add_context_chunk(1, 3) == (8, 11) and mgr.get_block_ids(1) == [0, 1, 2]
    write_kv(mgr, r, 8, 11, P18)
    assert mgr.add_context_chunk(1) == (11, 18) and mgr.get_block_ids(1) == [0, 1, 2, 3, 4]
    assert [e.block_hashes for e in mgr.take_events()] == [block_hashes(P18, 4)[:2]]   # block 2 is not full yet


def test_fit_token_budget_shrinks_the_last_context_chunk_when_reuse_fell_short():
    """The estimate counted three cached blocks; one was evicted before admission, so the chunk is four tokens
    longer than priced: the fit cuts them (they go to the next chunk) and the blocks stay allocated."""
    mgr = make_manager(primary=12)
    serve(mgr, make_request(1, A))
    mgr.remove_sequence(1)
    decode = make_request(2, [50, 51, 52])
    serve(mgr, decode)
    mgr.add_token(2, 1, tokens=[53])
    c = make_request(3, A + [9] * 6)
    budget = mgr.get_context_budget(c)
    assert budget == ContextBudget(blocks=5, estimated_reusable_tokens=12)
    mgr.add_sequence(make_request(4, list(range(200, 236))))   # evicts A's third block
    mgr.remove_sequence(4, store=False)
    mgr.take_events()

    assert mgr.add_sequence(c) == 8                         # two blocks reused, not three
    assert mgr.context_chunk(3) == (8, 18) and mgr.get_block_ids(3) == [0, 1, 2, 11, 10]
    priced = 1 + len(c.tokens) - budget.estimated_reusable_tokens
    assert mgr.fit_token_budget([2, 3], priced) == [1, 6]   # the decode is never cut
    assert mgr.context_chunk(3) == (8, 14) and mgr.get_block_ids(3) == [0, 1, 2, 11, 10]
    assert mgr.stats().free_num_blocks == 6 and mgr.take_events() == []
    assert mgr.get_needed_blocks_one_step(3) == 0           # the rest of the prompt has its blocks already

    write_kv(mgr, c, 8, 14, c.tokens)
    assert mgr.add_context_chunk(3) == (14, 18) and mgr.get_block_ids(3) == [0, 1, 2, 11, 10]
    assert mgr.take_events() == [BlockStored(block_hashes=[block_hashes(c.tokens, 4)[2]],
                                             parent_block_hash=block_hashes(A, 4)[1], token_ids=A[8:12],
                                             block_size=4, lora_id=None, medium="GPU", priority=35)]
    assert mgr.fit_token_budget([2, 3], 100) == [1, 4]      # within budget: nothing cut


def test_fit_token_budget_refuses_what_cannot_fit_and_changes_nothing():
    mgr = make_manager(context_chunk_size=8)
    mgr.add_sequence(make_request(1, P18))
    mgr.add_sequence(make_request(2, A))
    before = (mgr.context_chunk(1), mgr.context_chunk(2))
    with pytest.raises(ValueError, match="max_num_tokens=1"):
        mgr.fit_token_budget([1, 2], 1)                     # a chunk keeps one token at least
    with pytest.raises(ValueError, match="repeat"):
        mgr.fit_token_budget([1, 1], 10)
    with pytest.raises(ValueError, match="max_num_tokens"):
        mgr.fit_token_budget([1], -1)
    with pytest.raises(KeyError):
        mgr.fit_token_budget([1, 9], 10)
    assert (mgr.context_chunk(1), mgr.context_chunk(2)) == before
    assert mgr.fit_token_budget([1, 2], 9) == [8, 1]        # the last request is cut first
    assert mgr.fit_token_budget([1, 2], 2) == [1, 1]


def test_context_budget_counts_drafts_sink_bubble_and_beams():
    mgr = make_manager(context_chunk_size=8, sink_tokens=1)
    # 18 prompt tokens + min(2 drafts, 1 new token) + a bubble of 3 = 22 tokens: 5 full blocks and a tail.
    assert mgr.get_context_budget(make_request(1, P18, max_new_tokens=1, num_draft_tokens=2)).blocks == 6
    assert mgr.get_context_budget(make_request(1, P18, max_new_tokens=1, num_draft_tokens=2,
                                               beam_width=3)).blocks == 8
    plain = make_manager()
    assert plain.get_context_budget(make_request(1, P18)) == ContextBudget(5, 0)
    serve(plain, make_request(2, A))                       # running: its blocks cost no budget
    assert plain.get_context_budget(make_request(3, A + [1])) == ContextBudget(1, 12)
    off = make_manager(enable_block_reuse=False)
    serve(off, make_request(2, A))
    assert off.get_context_budget(make_request(3, A + [1])) == ContextBudget(4, 0)


def test_budget_formulas_with_a_window_and_two_step_lookahead():
    assert [sink_bubble(n, 4) for n in (0, 1, 4, 6)] == [0, 3, 0, 2]
    reuse = PrefixReuseSummary(reusable_blocks_allocated=10, reusable_blocks_all=12, total_matched_tokens=48,
                               first_new_block=12)
    # A window of 16 and a chunk of 8 keep 24 tokens of a 100-token prompt: 6 blocks, 5 of them recoverable.
    assert context_budget(100, 0, 0, 1, 4, 8, 16, 0, reuse) == ContextBudget(1, 20)
    assert context_budget(100, 0, 0, 1, 4, 8, None, 0, reuse) == ContextBudget(15, 48)
    assert context_budget(10, 0, 0, 2, 4, 8, None, 0, None) == ContextBudget(4, 0)
    # 6 tokens in 2 blocks, a draft: one step adds 2 tokens (no new block), two steps 4 (one).
    assert step_blocks(6, 2, 1, 1, 4, False) == 0 and step_blocks(6, 2, 1, 1, 4, True) == 1
    assert step_blocks(6, 2, 1, 3, 4, True) == 3
    mgr = make_manager()
    serve(mgr, make_request(1, [1, 2, 3, 4, 5, 6], num_draft_tokens=1))
    assert mgr.get_needed_blocks_one_step(1) == 0
    assert mgr.get_needed_blocks_one_step(1, two_steps_lookahead=True) == 1


@pytest.mark.parametrize("bad", [0, 6, -8, 4.0, True])
def test_bad_chunk_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="context_chunk_size"):
        make_manager(context_chunk_size=bad)
    with pytest.raises(ValueError, match="sink_tokens"):
        make_manager(sink_tokens=-1)
