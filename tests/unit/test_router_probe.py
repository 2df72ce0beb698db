"""Probing: hashes of tokens[:-1], matches split by tier, the chain breaking at an evicted block, and
agreement with a real ledger's own answer."""
from __future__ import annotations

import random

import pytest

from kvledger.router.groups import WindowedIndex
from kvledger.router.index import PrefixIndex
from kvledger.router.numbering import SequencedIndex
from kvledger.router.probe import PrefixMatch, match_prefix, probe, prompt_hashes
from kvledger.worker.wire.block_key import block_hashes
from kvledger.worker.wire.events import BlockRemoved, BlockStored, BlockUpdated, EventBatch

TPB = 4


def feed(index: PrefixIndex, rank: int, *events) -> None:
    assert index.apply(rank, list(events)) is None


def store(tokens, n_blocks, medium="GPU", start=0, **kw):
    """BlockStored for blocks [start, start + n_blocks) of ``tokens``, chained like a ledger's."""
    hs = block_hashes(tokens[:(start + n_blocks) * TPB], TPB, **kw)
    return BlockStored(hs[start:], hs[start - 1] if start else None,
                       list(tokens[start * TPB:(start + n_blocks) * TPB]), TPB, medium=medium, **kw)


PROMPT = list(range(500, 541))   # 41 tokens: tokens[:-1] has exactly 10 full blocks


def test_prompt_hashes_cover_the_full_blocks_of_all_but_the_last_token():
    assert prompt_hashes(PROMPT, TPB) == block_hashes(PROMPT[:40], TPB)
    assert len(prompt_hashes(PROMPT, TPB)) == 10
    assert len(prompt_hashes(PROMPT[:40], TPB)) == 9     # 39 tokens: the 10th block is not full
    assert prompt_hashes([5], TPB) == []
    with pytest.raises(TypeError):
        prompt_hashes("hello", TPB)
    with pytest.raises(ValueError):
        prompt_hashes([1, 2, -3, 4, 5], TPB)


def test_a_fully_held_prompt_reuses_all_but_its_last_token():
    index = PrefixIndex(TPB)
    feed(index, 0, store(PROMPT, 10))
    assert probe(index, PROMPT) == {0: PrefixMatch(10, 40, 0)}
    assert probe(index, PROMPT[:40]) == {0: PrefixMatch(9, 36, 0)}   # the 40th token is the one computed


def test_matches_split_by_tier():
    index = PrefixIndex(TPB)
    feed(index, 0, store(PROMPT, 4), store(PROMPT, 2, "CPU", start=4))          # GPU 0-3, CPU 4-5
    feed(index, 1, store(PROMPT, 4))                                            # GPU 0-1, CPU 2, GPU 3
    hs = prompt_hashes(PROMPT, TPB)
    feed(index, 1, BlockUpdated(hs[2], "GPU", "CPU"))
    feed(index, 2, store(PROMPT, 1))
    got = probe(index, PROMPT)
    assert got == {0: PrefixMatch(6, 24, 2), 1: PrefixMatch(4, 16, 1), 2: PrefixMatch(1, 4, 0)}
    assert got[0].device_blocks == 4


def test_chain_breaks_at_a_middle_eviction_even_though_later_blocks_stay_held():
    index = PrefixIndex(TPB)
    hs = prompt_hashes(PROMPT, TPB)
    feed(index, 0, store(PROMPT, 10))
    feed(index, 1, store(PROMPT, 10))
    feed(index, 0, BlockRemoved([hs[3]]))
    assert probe(index, PROMPT) == {0: PrefixMatch(3, 12, 0), 1: PrefixMatch(10, 40, 0)}
    assert index.refs(0, hs[4]) == (1, 0)                # its descendants are still held ...
    assert match_prefix(index, hs[4:]) == {0: PrefixMatch(6, 24, 0), 1: PrefixMatch(6, 24, 0)}


def test_host_blocks_past_the_break_are_not_counted():
    index = PrefixIndex(TPB)
    hs = prompt_hashes(PROMPT, TPB)
    feed(index, 0, store(PROMPT, 6))
    feed(index, 0, BlockUpdated(hs[4], "GPU", "CPU"), BlockUpdated(hs[1], "GPU", "CPU"), BlockRemoved([hs[3]]))
    feed(index, 1, store(PROMPT, 6))
    assert probe(index, PROMPT) == {0: PrefixMatch(3, 12, 1), 1: PrefixMatch(6, 24, 0)}


def test_lora_and_salt_are_part_of_the_prefix():
    index = PrefixIndex(TPB)
    feed(index, 0, store(PROMPT, 10, lora_id=3))
    feed(index, 1, store(PROMPT, 10, cache_salt="tenant-a"))
    assert probe(index, PROMPT) == {}
    assert probe(index, PROMPT, lora_id=3) == {0: PrefixMatch(10, 40, 0)}
    assert probe(index, PROMPT, cache_salt="tenant-a") == {1: PrefixMatch(10, 40, 0)}
    assert probe(index, PROMPT, cache_salt="tenant-b") == {}


def test_unknown_prompt_and_empty_prompt_match_nothing():
    index = PrefixIndex(TPB)
    feed(index, 0, store(PROMPT, 10))
    assert probe(index, list(range(41))) == {}
    assert probe(index, []) == {}
    assert match_prefix(index, []) == {}


def test_probe_agrees_with_real_ledgers_fed_by_their_own_events():
    """Two real ledgers under load (offload to a host tier, eviction); the index only sees their events."""
    from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request

    rng = random.Random(5)
    index = PrefixIndex(TPB)
    cfg = CacheConfig(tokens_per_block=TPB, num_primary_blocks=24, num_secondary_blocks=12,
                      materialize=False, device="cpu")
    managers = [KVCacheManager(cfg, clock=lambda: 0.0) for _ in range(2)]
    systems = [[rng.randrange(50) for _ in range(4 * TPB)] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))] for _ in range(30)]
    for i, prompt in enumerate(prompts):
        rank = i % 2
        mgr = managers[rank]
        mgr.add_sequence(Request(request_id=i, tokens=prompt, max_new_tokens=2))
        mgr.store_context_blocks(i)
        mgr.remove_sequence(i)
        feed(index, rank, *mgr.take_events())
        for p in prompts[: i + 1]:
            got = probe(index, p)
            for r, m in enumerate(managers):
                assert got.get(r, PrefixMatch(0, 0, 0)).matched_tokens == m.probe_prefix_match_length(p), (i, r)


def test_probe_of_ledgers_with_attention_windows_follows_the_safe_prefix_rule():
    """A windowed ledger (layer 0 slides over 8 tokens, layer 1 sees all: two KV cache groups) and a plain one
    under load, decoding (window 0 slides, its old blocks are released and evicted first); the index sees only
    their wire batches, and answers what each ledger would reuse."""
    from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request
    from kvledger.worker.wire.events import encode_batch

    rng = random.Random(7)
    index = SequencedIndex(WindowedIndex(TPB))
    windowed = CacheConfig(tokens_per_block=TPB, num_layers=2, attention_windows=(8, None), materialize=False,
                           device="cpu", window_blocks=((14, 0), (24, 6)), check_integrity=True)
    managers = [KVCacheManager(windowed, clock=lambda: 0.0),
                KVCacheManager(CacheConfig(tokens_per_block=TPB, num_primary_blocks=24, materialize=False,
                                           device="cpu"), clock=lambda: 0.0)]
    systems = [[rng.randrange(50) for _ in range(4 * TPB)] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))] for _ in range(30)]
    partial = 0
    for i, prompt in enumerate(prompts):
        for rank, mgr in enumerate(managers):
            rid = 100 * i + rank
            mgr.add_sequence(Request(request_id=rid, tokens=prompt, max_new_tokens=8))
            mgr.store_context_blocks(rid)
            for _ in range(rng.randrange(9)):
                mgr.add_token(rid, 1, tokens=[rng.randrange(50)])
            mgr.remove_sequence(rid)
            data = encode_batch(EventBatch(0.0, mgr.take_events(), rank))
            assert index.ingest(rank, index.next_seq(rank), data)[0].applied
        for p in prompts[: i + 1]:
            got = probe(index.store, p)
            for r, m in enumerate(managers):
                assert got.get(r, PrefixMatch(0, 0, 0)).matched_tokens == m.probe_prefix_match_length(p), (i, r)
            matched = prompt_hashes(p, TPB)[:got.get(0, PrefixMatch(0, 0, 0)).matched_blocks]
            partial += any(index.store.refs(0, h) == (0, 0) for h in matched)   # a block window 0 (group 0) let go
    assert partial > 5, "the sliding window's early blocks were never gone while the prefix still counted"
    fresh = WindowedIndex(TPB)   # a router that lost track rebuilds the windowed rank from its snapshot alone
    fresh.load_snapshot(0, managers[0].snapshot())
    for p in prompts:
        assert probe(fresh, p).get(0, PrefixMatch(0, 0, 0)).matched_tokens == managers[0].probe_prefix_match_length(p)
