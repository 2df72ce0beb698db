"""The oracle: a request served from cached blocks equals the same request computed from scratch.

"From scratch" is the same engine on a fresh manager, where nothing can be
reused. Every other path (full-block reuse, partial reuse in place or copied,
blocks offloaded to the host tier and onboarded again, batches) must give the
same last-prompt logits (``torch.allclose`` with ``ATOL``/``RTOL``: the paths
differ only in the order of float32 sums, the K/V themselves go through the
same pool dtype either way) and the same greedy tokens.
"""
from __future__ import annotations

import random

import pytest
import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.engine.tokenizer import VOCAB_SIZE
from kvledger.worker.ledger import CacheConfig, KVCacheManager, OutOfBlocksError, Request
from kvledger.worker.rank.batch import BatchDriver, ServeResult
from kvledger.worker.wire.events import BlockRemoved
from kvledger.worker.wire.request import Sampling

ATOL = RTOL = 1e-4
T = 4
# The CUDA cases join where a GPU exists; CI has none, and runs them on the lent GPU machine.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_config(**overrides: object) -> CacheConfig:
    base: dict[str, object] = dict(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=16,
                                   dtype=torch.float32, device="cpu", num_primary_blocks=64, check_integrity=True)
    base.update(overrides)
    return CacheConfig(**base)  # type: ignore[arg-type]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


_ids = iter(range(1, 1_000_000))


def req(toks: list[int], max_new: int = 4, **kw: object) -> Request:
    return Request(request_id=next(_ids), tokens=list(toks), max_new_tokens=max_new, **kw)  # type: ignore[arg-type]


def serve_one(engine: ReferenceEngine, mgr: KVCacheManager, r: Request) -> ServeResult:
    (res,) = BatchDriver(engine).serve(mgr, [r])
    mgr.check_integrity()
    assert mgr.stats().used_num_blocks == 0, "serve must release every block it took"
    return res


def beam_search(engine: ReferenceEngine, mgr: KVCacheManager, r: Request) -> ServeResult:
    """A beam search served alone, through the batch like any request; its beams are ``.beams``."""
    (res,) = BatchDriver(engine).serve(mgr, [r])
    assert res.beams is not None and res.output_tokens == res.beams.tokens[0]
    return res


def from_scratch(engine: ReferenceEngine, cfg: CacheConfig, r: Request) -> ServeResult:
    fresh = Request(request_id=next(_ids), tokens=list(r.tokens), max_new_tokens=r.max_new_tokens,
                    lora_id=r.lora_id, cache_salt=r.cache_salt)
    res = serve_one(engine, KVCacheManager(cfg), fresh)
    assert res.cached_tokens == 0
    return res


def assert_matches_scratch(engine: ReferenceEngine, cfg: CacheConfig, r: Request, got: ServeResult) -> None:
    ref = from_scratch(engine, cfg, r)
    assert got.last_logits.dtype == torch.float32 and got.last_logits.device.type == "cpu"
    assert got.last_logits.shape == (VOCAB_SIZE,)
    assert torch.allclose(got.last_logits, ref.last_logits, atol=ATOL, rtol=RTOL), \
        f"max diff {(got.last_logits - ref.last_logits).abs().max():.3g}"
    assert got.output_tokens == ref.output_tokens
    assert got.cached_tokens + got.computed_tokens == len(r.tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_full_block_prefix_reuse(dtype: torch.dtype) -> None:
    cfg = make_config(dtype=dtype)
    engine, mgr = ReferenceEngine(cfg, seed=1), KVCacheManager(cfg)
    shared = tokens(32, seed=1)
    a = req(shared + tokens(8, seed=2))
    first = serve_one(engine, mgr, a)
    assert first.cached_tokens == 0 and first.computed_tokens == 40 and len(first.output_tokens) == 4

    b = req(shared + tokens(10, seed=3), max_new=6)
    got = serve_one(engine, mgr, b)
    assert got.cached_tokens == 32 and got.computed_tokens == 10
    assert_matches_scratch(engine, cfg, b, got)

    again = req(a.tokens)  # the whole prompt is cached: all but its last token are reused
    got = serve_one(engine, mgr, again)
    assert got.cached_tokens == 39 and got.computed_tokens == 1
    assert_matches_scratch(engine, cfg, again, got)
    assert got.output_tokens == first.output_tokens


def test_next_turn_reuses_the_decoded_blocks() -> None:
    """Blocks written while decoding are stored on release, so a follow-up prompt reuses them too."""
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg, seed=2), KVCacheManager(cfg)
    a = req(tokens(13, seed=4), max_new=12)
    first = serve_one(engine, mgr, a)
    turn2 = req(a.tokens + first.output_tokens + tokens(5, seed=5))
    got = serve_one(engine, mgr, turn2)
    assert got.cached_tokens == 24  # 13 prompt + 11 fed decode tokens = 6 full blocks
    assert_matches_scratch(engine, cfg, turn2, got)


def test_partial_reuse_in_place() -> None:
    cfg = make_config(enable_partial_reuse=True, copy_on_partial_reuse=True)
    engine, mgr = ReferenceEngine(cfg, seed=3), KVCacheManager(cfg)
    a = req(tokens(22, seed=6), max_new=1)  # 5 full blocks stored; the 5th has no child
    serve_one(engine, mgr, a)
    b = req(a.tokens[:18] + tokens(7, seed=7))
    got = serve_one(engine, mgr, b)
    assert got.cached_tokens == 18
    assert_matches_scratch(engine, cfg, b, got)
    # a's 5th block was taken over by b; serving a again must still be right.
    a2 = req(a.tokens)
    assert_matches_scratch(engine, cfg, a2, serve_one(engine, mgr, a2))


@pytest.mark.parametrize("copy", [True, False])
def test_partial_reuse_of_a_block_with_children(copy: bool) -> None:
    """The partly matching block has a child: it is copied (copy_on_partial_reuse) or not reused at all."""
    cfg = make_config(enable_partial_reuse=True, copy_on_partial_reuse=copy)
    engine, mgr = ReferenceEngine(cfg, seed=4), KVCacheManager(cfg)
    a = req(tokens(30, seed=8), max_new=1)  # 7 full blocks stored: block 4 (positions 16..19) has a child
    serve_one(engine, mgr, a)
    b = req(a.tokens[:18] + tokens(9, seed=9))
    got = serve_one(engine, mgr, b)
    assert got.cached_tokens == (18 if copy else 16)
    assert_matches_scratch(engine, cfg, b, got)
    # The copy's source was only read: a's 7 full blocks are all still cached and still right.
    a2 = req(a.tokens)
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 28
    assert_matches_scratch(engine, cfg, a2, got)


@pytest.mark.parametrize("prompt_len, copied", [(22, 0), (30, 1)])
def test_partial_reuse_is_reported_in_the_admission(prompt_len: int, copied: int) -> None:
    """22 tokens: the partly matching block is a leaf, taken in place; 30: it has a child, so it is copied."""
    cfg = make_config(enable_partial_reuse=True, copy_on_partial_reuse=True)
    engine, mgr = ReferenceEngine(cfg, seed=4), KVCacheManager(cfg)
    a = req(tokens(prompt_len, seed=8), max_new=1)
    serve_one(engine, mgr, a)
    b = req(a.tokens[:18] + tokens(9, seed=9), max_new=0)
    mgr.add_sequences([b])
    adm = mgr.admission(b.request_id)
    assert (adm.reused_blocks, adm.partial_tokens, adm.copied_blocks) == (4, 2, copied)
    mgr.remove_sequence(b.request_id)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_offloaded_blocks_are_onboarded_and_give_the_same_answer(dtype: torch.dtype, device: str) -> None:
    cfg = make_config(dtype=dtype, device=device, num_primary_blocks=12, num_secondary_blocks=32)
    engine, mgr = ReferenceEngine(cfg, seed=5), KVCacheManager(cfg)
    a = req(tokens(30, seed=10), max_new=2)
    serve_one(engine, mgr, a)
    pressure = req(tokens(44, seed=11), max_new=1)  # needs 11 of the 12 primary blocks: a's blocks go to the host
    serve_one(engine, mgr, pressure)
    assert mgr.stats().offloaded_blocks > 0
    assert mgr.probe_prefix_match_length(a.tokens) == 28  # still known, now on the host tier

    a2 = req(a.tokens[:28] + tokens(6, seed=12), max_new=5)
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 28
    assert got.onboarded_blocks > 0
    assert mgr.stats().onboarded_blocks >= got.onboarded_blocks
    assert_matches_scratch(engine, cfg, a2, got)


def test_blocks_below_offload_priority_are_dropped_not_offloaded() -> None:
    cfg = make_config(num_primary_blocks=12, num_secondary_blocks=32, offload_min_priority=101)
    engine, mgr = ReferenceEngine(cfg, seed=5), KVCacheManager(cfg)
    a = req(tokens(30, seed=10), max_new=2)
    serve_one(engine, mgr, a)
    serve_one(engine, mgr, req(tokens(44, seed=11), max_new=1))
    a2 = req(a.tokens)
    got = serve_one(engine, mgr, a2)
    assert got.onboarded_blocks == 0 and mgr.stats().offloaded_blocks == 0
    assert got.cached_tokens < 28
    assert_matches_scratch(engine, cfg, a2, got)


def test_reuse_is_refused_under_another_cache_salt() -> None:
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg, seed=6), KVCacheManager(cfg)
    toks = tokens(25, seed=13)
    serve_one(engine, mgr, req(toks, cache_salt="tenant-a"))
    other = req(toks, cache_salt="tenant-b")
    got = serve_one(engine, mgr, other)
    assert got.cached_tokens == 0
    assert_matches_scratch(engine, cfg, other, got)
    same = req(toks, cache_salt="tenant-a")
    assert serve_one(engine, mgr, same).cached_tokens == 24


def test_reuse_is_refused_under_another_lora() -> None:
    """The adapter changes the K/V, so reusing across LoRA ids would change the answer: the ledger must refuse."""
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg, seed=7), KVCacheManager(cfg)
    toks = tokens(25, seed=14)
    base = serve_one(engine, mgr, req(toks))
    other = req(toks, lora_id=7)
    got = serve_one(engine, mgr, other)
    assert got.cached_tokens == 0
    assert_matches_scratch(engine, cfg, other, got)
    assert not torch.allclose(got.last_logits, base.last_logits, atol=ATOL, rtol=RTOL)
    again = req(toks, lora_id=7)
    got = serve_one(engine, mgr, again)
    assert got.cached_tokens == 24
    assert_matches_scratch(engine, cfg, again, got)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_batch_of_different_lengths_served_together(dtype: torch.dtype, device: str) -> None:
    cfg = make_config(dtype=dtype, device=device)
    engine, mgr = ReferenceEngine(cfg, seed=8), KVCacheManager(cfg)
    shared = tokens(20, seed=15)
    serve_one(engine, mgr, req(shared + tokens(3, seed=16)))
    batch = [req(tokens(5, seed=17), max_new=0), req(shared + tokens(13, seed=18), max_new=3),
             req(tokens(41, seed=19), max_new=7), req(shared[:9], max_new=2, lora_id=3)]
    got = BatchDriver(engine).serve(mgr, batch)
    mgr.check_integrity()
    assert [g.request_id for g in got] == [r.request_id for r in batch]
    assert [g.cached_tokens for g in got] == [0, 20, 0, 0]
    assert [len(g.output_tokens) for g in got] == [0, 3, 7, 2]
    for r, g in zip(batch, got):
        assert_matches_scratch(engine, cfg, r, g)


def test_running_out_of_blocks_while_decoding_leaves_no_poisoned_cache() -> None:
    cfg = make_config(num_primary_blocks=6)
    engine, mgr = ReferenceEngine(cfg, seed=9), KVCacheManager(cfg)
    r = req(tokens(15, seed=20), max_new=20)  # 35 tokens need 9 blocks, the pool has 6
    with pytest.raises(OutOfBlocksError):
        BatchDriver(engine).serve(mgr, [r])
    mgr.check_integrity()
    assert mgr.stats().used_num_blocks == 0
    again = req(r.tokens, max_new=3)
    got = serve_one(engine, mgr, again)
    assert got.cached_tokens == 14
    assert_matches_scratch(engine, cfg, again, got)


def test_bad_input_is_refused_before_the_ledger_changes() -> None:
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(cfg)
    mgr.take_events()
    with pytest.raises(ValueError, match="vocabulary"):
        BatchDriver(engine).serve(mgr, [req([1, 2, VOCAB_SIZE])])
    with pytest.raises(TypeError, match="Request"):
        BatchDriver(engine).serve(mgr, [object()])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="tokens_per_block"):
        BatchDriver(engine).serve(KVCacheManager(make_config(tokens_per_block=8)), [req([1, 2])])
    with pytest.raises(ValueError, match="materialize"):
        BatchDriver(engine).serve(KVCacheManager(make_config(materialize=False)), [req([1, 2])])
    assert mgr.take_events() == [] and mgr.stats().alloc_total_blocks == 0
    assert BatchDriver(engine).serve(mgr, []) == []


def test_a_speculative_step_with_rejected_drafts_gives_the_logits_of_the_accepted_sequence() -> None:
    """Drafts are written, two are rejected and rewound, decoding goes on over their slots: the next token's
    logits equal those of the accepted sequence computed from scratch, and the reused prefix later serves it."""
    cfg = make_config()
    engine = ReferenceEngine(cfg)
    mgr = KVCacheManager(cfg)
    prompt = tokens(10, seed=40)
    sampled, drafts, accepted_next = 7, [11, 12, 13], 99
    mgr.add_sequence(Request(1, prompt, max_new_tokens=8, num_draft_tokens=3))
    engine.model.forward(mgr.pools.primary, mgr.block_table([1]), [prompt], [0])
    mgr.store_context_blocks(1)
    assert mgr.get_needed_blocks_one_step(1) == 1            # 10 + 1 + 3 tokens need a fourth block
    mgr.add_token(1, 4, tokens=[sampled, *drafts])
    engine.model.forward(mgr.pools.primary, mgr.block_table([1]), [[sampled, *drafts]], [10])
    mgr.rewind(1, 2)                                         # drafts 12 and 13 rejected
    mgr.add_token(1, 1, tokens=[accepted_next])              # written over the first rejected draft's slot
    spec = engine.model.forward(mgr.pools.primary, mgr.block_table([1]), [[accepted_next]], [12])[-1]
    mgr.remove_sequence(1)
    mgr.check_integrity()
    sequence = prompt + [sampled, drafts[0], accepted_next]
    scratch = from_scratch(engine, cfg, req(sequence, max_new=0))
    assert torch.allclose(spec.float().cpu(), scratch.last_logits, atol=ATOL, rtol=RTOL)
    again = serve_one(engine, mgr, req(sequence, max_new=0))
    assert again.cached_tokens == 12, "the prompt block and the accepted decode block are reused"
    assert_matches_scratch(engine, cfg, req(sequence, max_new=0), again)


@pytest.mark.parametrize("chunk", [4, 8, 12])
def test_a_prompt_prefilled_in_chunks_gives_the_logits_of_one_prefill(chunk: int) -> None:
    """Each chunk reads the positions before it back from the pool; the answer is the one-step prefill's."""
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(make_config(context_chunk_size=chunk))
    r = req(tokens(30, seed=50), max_new=5)
    got = serve_one(engine, mgr, r)
    assert got.cached_tokens == 0
    assert_matches_scratch(engine, cfg, r, got)


def test_a_chunked_prefill_over_partially_reused_blocks() -> None:
    """Two full blocks and some tokens of a third are reused (a free leaf in place, then a block a running request
    holds); the chunks start mid-block and go on from there."""
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(make_config(context_chunk_size=8))
    shared = tokens(12, seed=51)
    serve_one(engine, mgr, req(shared + tokens(1, seed=52), max_new=0))
    r = req(shared[:11] + tokens(20, seed=53))
    got = serve_one(engine, mgr, r)
    assert got.cached_tokens == 11
    assert_matches_scratch(engine, cfg, r, got)

    holder = req(shared + tokens(1, seed=52), max_new=0)
    mgr.add_sequence(holder)                                   # holds the stored blocks: the partial one is copied
    r2 = req(shared[:10] + tokens(25, seed=54))
    (got2,) = BatchDriver(ReferenceEngine(cfg)).serve(mgr, [r2])
    assert got2.cached_tokens == 10
    assert_matches_scratch(engine, cfg, r2, got2)
    mgr.remove_sequence(holder.request_id, store=False)
    mgr.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_prefilled_in_chunks_of_different_counts(device: str) -> None:
    cfg = make_config(device=device)
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(make_config(device=device, context_chunk_size=8))
    batch = [req(tokens(n, seed=60 + n), max_new=3) for n in (3, 17, 30)]
    got = BatchDriver(engine).serve(mgr, batch)
    mgr.check_integrity()
    for r, g in zip(batch, got):
        assert_matches_scratch(engine, cfg, r, g)


def test_a_chunk_cut_by_fit_token_budget_is_computed_later_with_the_same_logits() -> None:
    """Reuse falls short of the estimate, the fit cuts the chunk after allocation, the cut tokens come in the next
    chunk: every prompt position's logits equal one from-scratch prefill's."""
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(make_config(context_chunk_size=12))
    prompt = tokens(26, seed=70)
    serve_one(engine, mgr, req(prompt[:16] + tokens(2, seed=71), max_new=0))
    r = req(prompt)
    estimate = mgr.get_context_budget(r).estimated_reusable_tokens
    assert estimate == 16
    assert mgr.add_sequence(r) == 16
    # Price the step as if four more tokens had been reused: the 10-token chunk must shrink to 6.
    assert mgr.fit_token_budget([r.request_id], len(prompt) - estimate - 4) == [6]
    pool, rid, out = mgr.pools.primary, r.request_id, []
    for _ in range(len(prompt)):
        start, end = mgr.context_chunk(rid)
        out.append(engine.model.forward(pool, mgr.block_table([rid]), [prompt[start:end]], [start]))
        if end == len(prompt):
            break
        mgr.add_context_chunk(rid)
    mgr.store_context_blocks(rid)
    mgr.remove_sequence(rid)
    fresh = KVCacheManager(cfg)
    fresh.add_sequence(Request(0, prompt))
    scratch = engine.model.forward(fresh.pools.primary, fresh.block_table([0]), [prompt], [0])
    got = torch.cat(out)
    assert got.shape[0] == len(prompt) - 16
    assert torch.allclose(got, scratch[16:], atol=ATOL, rtol=RTOL)


def scratch_logits(engine: ReferenceEngine, cfg: CacheConfig, sequence: list[int]) -> torch.Tensor:
    """Logits after every position of ``sequence``, computed in one prefill on a fresh manager."""
    fresh = KVCacheManager(cfg)
    fresh.add_sequence(Request(0, sequence))
    return engine.model.forward(fresh.pools.primary_pools, fresh.block_table([0]), [sequence], [0]).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prompt_len", [10, 12])
def test_every_beam_attends_to_its_own_sequence(prompt_len: int, device: str) -> None:
    """Each beam's final logits, and the score of each of its tokens, equal a from-scratch prefill of that beam's
    sequence: the shared context, its own tail, and the blocks copied when it took up another beam's hypothesis."""
    cfg = make_config(device=device)
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(cfg)
    prompt = tokens(prompt_len, seed=80)
    got = beam_search(engine, mgr, req(prompt, max_new=6, beam_width=3))
    mgr.check_integrity()
    assert mgr.stats().used_num_blocks == 0
    beams = got.beams
    assert len(beams.tokens) == 3 and len({tuple(b) for b in beams.tokens}) == 3
    assert beams.copied_blocks > 0, "no beam took up another's hypothesis: the copies went untested"
    assert beams.scores == sorted(beams.scores, reverse=True)
    for beam, score, last in zip(beams.tokens, beams.scores, beams.last_logits):
        ref = scratch_logits(engine, cfg, prompt + beam)
        assert torch.allclose(last, ref[-1], atol=ATOL, rtol=RTOL)
        logp = torch.log_softmax(ref[prompt_len - 1:-1], dim=-1)
        assert abs(sum(logp[i, t].item() for i, t in enumerate(beam)) - score) < 1e-3


def test_beams_over_a_reused_chunked_context() -> None:
    """The context comes partly from the tree and partly in chunks; the beams still see their own sequences, and
    the shared context is stored for reuse as for one beam."""
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(make_config(context_chunk_size=4))
    prompt = tokens(19, seed=82)
    serve_one(engine, mgr, req(prompt[:9], max_new=0))
    got = beam_search(engine, mgr, req(prompt, max_new=4, beam_width=2))
    assert got.cached_tokens == 8
    for beam, last in zip(got.beams.tokens, got.beams.last_logits):
        assert torch.allclose(last, scratch_logits(engine, cfg, prompt + beam)[-1], atol=ATOL, rtol=RTOL)
    assert mgr.probe_prefix_match_length(prompt + [1]) == 16   # the shared full blocks, nothing of the beams
    again = serve_one(engine, mgr, req(prompt, max_new=2))
    assert again.cached_tokens == 16
    assert_matches_scratch(engine, cfg, req(prompt, max_new=2), again)


def test_a_beam_search_refuses_no_tokens_drafts_and_sampling_changing_nothing() -> None:
    cfg = make_config()
    engine, mgr = ReferenceEngine(cfg), KVCacheManager(cfg)
    mgr.take_events()
    with pytest.raises(ValueError, match="no new tokens"):
        beam_search(engine, mgr, req([1, 2, 3], max_new=0, beam_width=2))
    with pytest.raises(ValueError, match="draft tokens"):
        beam_search(engine, mgr, req([1, 2, 3], beam_width=2, num_draft_tokens=2))
    with pytest.raises(ValueError, match="sample nothing"):
        beam_search(engine, mgr, req([1, 2, 3], beam_width=2, sampling=Sampling(temperature=1.0, seed=1)))
    assert mgr.take_events() == [] and mgr.stats().alloc_total_blocks == 0


@pytest.mark.parametrize("device", DEVICES)
def test_layers_with_different_kv_heads_reused_offloaded_and_onboarded(device: str) -> None:
    """VGQA: a pool per KV head count; prefix reuse, a copied partial block and host-tier round trips move every
    pool's K/V, and the answers are those computed from scratch."""
    cfg = make_config(device=device, num_layers=3, num_kv_heads_per_layer=(2, 1, 2), num_primary_blocks=12,
                      num_secondary_blocks=32)
    engine, mgr = ReferenceEngine(cfg, seed=6), KVCacheManager(cfg)
    assert len(mgr.pools.primary_pools) == 2
    a = req(tokens(30, seed=90), max_new=2)
    serve_one(engine, mgr, a)
    serve_one(engine, mgr, req(tokens(44, seed=91), max_new=1))   # a's blocks go to the host
    assert mgr.stats().offloaded_blocks > 0
    a2 = req(a.tokens[:26] + tokens(6, seed=92), max_new=4)       # six full blocks onboarded, two tokens copied
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 26 and got.onboarded_blocks > 0
    assert_matches_scratch(engine, cfg, a2, got)
    beams = beam_search(engine, mgr, req(a2.tokens, max_new=3, beam_width=2))
    assert beams.cached_tokens == 31
    for beam, last in zip(beams.beams.tokens, beams.beams.last_logits):
        assert torch.allclose(last, scratch_logits(engine, cfg, a2.tokens + beam)[-1], atol=ATOL, rtol=RTOL)


# --- attention windows (VSWA): a query at p attends to keys at p - window < q <= p ------------------------------

GEMMA = dict(attention_windows=(8, None))   # layer 0 slides over 8 tokens (window 0), layer 1 sees all (window 1)


def test_a_sliding_window_layer_never_reads_past_its_window() -> None:
    """The oracle's own window: with every layer sliding over 8 tokens, two layers see 15 tokens back, so a change
    at position 0 of a 20-token prompt leaves the last logits alone and a change inside the window does not."""
    cfg = make_config(attention_windows=(8,))
    engine = ReferenceEngine(cfg, seed=3)
    base = tokens(20, seed=40)
    far, near = [(base[0] + 1) % 256, *base[1:]], [*base[:-3], (base[-3] + 1) % 256, *base[-2:]]
    logits = [serve_one(engine, KVCacheManager(cfg), req(t, max_new=1)).last_logits for t in (base, far, near)]
    assert torch.allclose(logits[0], logits[1], atol=ATOL, rtol=RTOL)
    assert not torch.allclose(logits[0], logits[2], atol=ATOL, rtol=RTOL)
    wide = make_config(attention_windows=(64,))   # a window past the sequence is full attention
    assert torch.allclose(serve_one(ReferenceEngine(wide, seed=3), KVCacheManager(wide), req(base, 1)).last_logits,
                          serve_one(ReferenceEngine(make_config(), seed=3), KVCacheManager(make_config()),
                                    req(base, 1)).last_logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("device", DEVICES)
def test_a_sliding_window_model_served_from_reused_blocks(device: str) -> None:
    cfg = make_config(device=device, **GEMMA)
    engine, mgr = ReferenceEngine(cfg, seed=6), KVCacheManager(cfg)
    a = req(tokens(30, seed=41), max_new=12)   # decoding slides window 0 past the prompt's blocks
    serve_one(engine, mgr, a)
    assert_matches_scratch(engine, cfg, a, a_res := serve_one(engine, KVCacheManager(cfg), req(a.tokens, 12)))
    assert a_res.cached_tokens == 0
    a2 = req(a.tokens[:28] + tokens(9, seed=42), max_new=10)
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 28
    assert_matches_scratch(engine, cfg, a2, got)


@pytest.mark.parametrize("chunk", [4, 8, 12])
def test_a_sliding_window_prompt_prefilled_in_chunks_gives_the_unchunked_answer(chunk: int) -> None:
    """Window 0 lets its blocks slide out between context chunks; each chunk still reads every key its queries
    attend to, so the chunked prompt, fresh or over a reused prefix, answers as one unchunked from-scratch prefill."""
    cfg = make_config(**GEMMA)
    engine, mgr = ReferenceEngine(cfg, seed=9), KVCacheManager(make_config(context_chunk_size=chunk, **GEMMA))
    a = req(tokens(41, seed=50), max_new=6)
    assert_matches_scratch(engine, cfg, a, serve_one(engine, mgr, a))
    a2 = req(a.tokens[:29] + tokens(14, seed=51), max_new=5)
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 28
    assert_matches_scratch(engine, cfg, a2, got)


def test_a_sliding_window_model_served_from_partially_reused_blocks() -> None:
    """Window 0 (8 tokens) lost the early blocks of a finished turn (they slid out while it decoded, then were
    evicted), window 1 (full attention) kept them: the next turn still reuses the whole turn, since window 0 needs
    only the blocks of the last 8 tokens before the first position it computes."""
    cfg = make_config(window_blocks=((12, 0), (64, 0)), **GEMMA)
    engine, mgr = ReferenceEngine(cfg, seed=7), KVCacheManager(cfg)
    a = req(tokens(30, seed=43), max_new=8)
    turn = a.tokens + serve_one(engine, mgr, a).output_tokens[:6]   # 36 tokens: 9 stored blocks
    mgr.take_events()
    serve_one(engine, mgr, req(tokens(32, seed=44), max_new=1))   # evicts 6 of window 0's blocks of the turn
    gone = {h for e in mgr.take_events() if isinstance(e, BlockRemoved) and e.group_idx == 0 for h in e.block_hashes}
    assert len(gone) >= 6 and not any(isinstance(e, BlockRemoved) and e.group_idx == 1 for e in mgr.take_events())
    a2 = req(turn + tokens(5, seed=45), max_new=6)
    assert mgr.probe_prefix_match_length(a2.tokens) == 36
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 36
    assert_matches_scratch(engine, cfg, a2, got)


def test_a_sliding_window_model_served_from_onboarded_blocks() -> None:
    cfg = make_config(window_blocks=((12, 32), (12, 32)), **GEMMA)
    engine, mgr = ReferenceEngine(cfg, seed=8), KVCacheManager(cfg)
    a = req(tokens(30, seed=46), max_new=2)
    serve_one(engine, mgr, a)
    serve_one(engine, mgr, req(tokens(44, seed=47), max_new=1))   # a's blocks go to the host tier
    assert mgr.stats().offloaded_blocks > 0
    a2 = req(a.tokens[:28] + tokens(6, seed=48), max_new=5)
    got = serve_one(engine, mgr, a2)
    assert got.cached_tokens == 28 and got.onboarded_blocks > 0
    assert_matches_scratch(engine, cfg, a2, got)
