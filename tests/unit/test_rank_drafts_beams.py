"""The ledger's drafts and beams do their work in serving: prompt-lookup drafts checked by the model change no
token (greedy or seeded) and the rejected ones leave nothing behind; beam searches run in the rank's batch
beside other requests and end as they end alone."""
from __future__ import annotations

import random
import threading

import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.ledger import CacheConfig, KVCacheManager
from kvledger.worker.rank.batch import BatchDriver
from kvledger.worker.rank.drafts import propose_drafts
from kvledger.worker.rank.scheduler import BatchingConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.request import Request, Sampling

T = 4
WAIT_S = 60


def cache(blocks: int = 64, check_integrity: bool = True, **kw) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=blocks, check_integrity=check_integrity, **kw)


def prompts(n: int) -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds something to draft."""
    rng = random.Random(1)
    return [[rng.randrange(256) for _ in range(6)] * 3 for _ in range(n)]


def test_prompt_lookup_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    assert propose_drafts([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]   # the latest match of [1, 2, 3]
    assert propose_drafts([5, 6, 4, 6], 3) == [4, 6]                         # [4, 6] is unmatched, [6] is
    assert propose_drafts([1, 2, 3], 3) == [] and propose_drafts([1, 1], 0) == []


def test_drafts_change_no_token_and_rejected_ones_leave_nothing_behind():
    """Greedy and seeded requests drafting up to 3 tokens a step give the tokens of drafting nothing, in one
    window and beside a sliding one, chunked; some drafts are accepted and some rejected (both paths run), and
    what the ledger stores afterwards is what it stores without drafts."""
    drafted = accepted = 0
    for kw in ({}, dict(context_chunk_size=8), dict(attention_windows=(8, None), window_shares=(2, 1))):
        cfg = cache(check_integrity=False, **kw)   # the books are checked after each request instead
        driver = BatchDriver(ReferenceEngine(cfg))
        for i, p in enumerate(prompts(3)):
            for sampling in (Sampling(), Sampling(temperature=0.5, top_k=4, seed=i)):
                plain_mgr, draft_mgr = KVCacheManager(cfg), KVCacheManager(cfg)
                (plain,) = driver.serve(plain_mgr, [Request(1, p, 24, sampling=sampling)])
                (drafting,) = driver.serve(draft_mgr, [Request(1, p, 24, sampling=sampling, num_draft_tokens=3)])
                draft_mgr.check_integrity()
                assert drafting.output_tokens == plain.output_tokens
                whole = p + plain.output_tokens
                assert draft_mgr.probe_prefix_match_length(whole) == plain_mgr.probe_prefix_match_length(whole)
                drafted, accepted = drafted + drafting.drafted_tokens, accepted + drafting.accepted_tokens
    assert 0 < accepted < drafted, (accepted, drafted)


def test_beam_searches_run_in_the_batch_beside_other_requests_and_end_as_alone():
    """A rank serving beam searches and greedy, drafting and sampled requests at once, on a pool tight enough
    that they wait for each other: every beam search ends with the beams (and scores) it ends with alone, every
    other request with scratch's tokens."""
    w = RankWorker(0, 1, cache(blocks=24), batching=BatchingConfig(max_num_seqs=4, max_num_batched_tokens=16))
    w.build_ledger(*w.local_block_counts())
    reqs = [Request(i + 1, p, 8, beam_width=3 if i % 3 == 0 else 1, num_draft_tokens=2 if i % 3 == 1 else 0,
                    sampling=Sampling(temperature=0.7, seed=i) if i % 3 == 2 else Sampling())
            for i, p in enumerate(prompts(6))]
    got: dict[int, object] = {}

    def send(r: Request) -> None:
        try:
            (got[r.request_id],) = w.serve([r]).outcomes
        except BaseException as e:
            got[r.request_id] = e

    threads = [threading.Thread(target=send, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert w.load().peak_running_requests > 1, "the requests never shared the batch"
    driver = BatchDriver(ReferenceEngine(cache()))
    for r in reqs:
        alone = Request(0, r.tokens, r.max_new_tokens, sampling=r.sampling, beam_width=r.beam_width)
        (want,) = driver.serve(KVCacheManager(cache()), [alone])
        out = got[r.request_id]
        assert not isinstance(out, BaseException), out
        assert out.output_tokens == want.output_tokens
        if r.beam_width > 1:
            assert out.beams == want.beams.tokens and len(out.beams) == 3
            assert torch.allclose(torch.tensor(out.beam_scores), torch.tensor(want.beams.scores), atol=1e-4)
    w.check_integrity()
    assert w.manager.stats().used_num_blocks == 0


def test_a_rank_set_to_speculate_drafts_for_requests_that_ask_for_none():
    """``num_speculative_tokens`` on the rank: its requests' outcomes count drafts checked and accepted, and
    their tokens are those of a rank that drafts nothing; a request too long to draft is served undrafted."""
    w = RankWorker(0, 1, cache(blocks=16), batching=BatchingConfig(num_speculative_tokens=3))
    w.build_ledger(*w.local_block_counts())
    p = prompts(2)[1]
    (out,) = w.serve([Request(1, p, 24)]).outcomes
    (plain,) = BatchDriver(ReferenceEngine(cache())).serve(KVCacheManager(cache()), [Request(1, p, 24)])
    assert out.output_tokens == plain.output_tokens and out.drafted_tokens > 0
    (full,) = w.serve([Request(2, p, 16 * T - len(p))]).outcomes   # fills the pool: no room for drafts
    assert full.drafted_tokens == 0 and len(full.output_tokens) == 16 * T - len(p)


def test_a_request_that_fills_the_pool_gets_no_drafts_even_sharing_a_running_prefix():
    """Drafts take blocks at the last step: a request whose every block fills the pool is served undrafted,
    also while a running request holds (and so would seem to lend it) the prefix it shares."""
    w = RankWorker(0, 1, cache(blocks=16), batching=BatchingConfig(num_speculative_tokens=3))
    w.build_ledger(*w.local_block_counts())
    prefix = (prompts(3)[2] * 2)[:8 * T]
    first = threading.Thread(target=w.serve, args=([Request(1, prefix + [1], 4 * T - 2)],))
    first.start()
    for _ in range(10_000):   # bounded: until the first request runs, holding the prefix's 8 blocks
        if w.load().running_requests:
            break
        threading.Event().wait(0.001)
    (full,) = w.serve([Request(2, prefix + [2], 16 * T - 8 * T - 1)]).outcomes
    first.join(WAIT_S)
    assert full.drafted_tokens == 0 and len(full.output_tokens) == 8 * T - 1
