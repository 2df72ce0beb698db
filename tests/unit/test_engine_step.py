"""One batched step of the reference engine is all or none: the decoding requests grow, in every window, before
a context chunk may take a block, so no request counts a token whose KV the step did not write, and a step that
cannot grow them changes nothing. The rank admits a request only when every window's own pool holds what it
still needs."""
from __future__ import annotations

import pytest
import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.engine.sampler import Sampler
from kvledger.worker.ledger import CacheConfig, KVCacheManager
from kvledger.worker.rank.batch import BatchDriver, RunningRequest
from kvledger.worker.rank.scheduler import BatchingConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.request import Request

T = 4


def cache(blocks: int, chunk: int | None = 8, **kw) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=blocks, context_chunk_size=chunk, check_integrity=True, **kw)


def scratch(r: Request, **kw) -> list[int]:
    big = cache(64, None, **kw)
    (res,) = BatchDriver(ReferenceEngine(big)).serve(KVCacheManager(big), [Request(0, r.tokens, r.max_new_tokens)])
    return res.output_tokens


def run(driver: BatchDriver, mgr: KVCacheManager, batch: list[RunningRequest], sampler: Sampler) -> dict:
    """Step the batch to its end (bounded), finishing requests as they are done."""
    out = {}
    for _ in range(100):
        if not batch:
            return out
        driver.step(mgr, batch, sampler)
        done = [r for r in batch if r.finished]
        out.update({res.request_id: res.output_tokens for res in driver.finish(mgr, done)})
        batch = [r for r in batch if not r.finished]
    raise AssertionError("the batch did not finish in 100 steps")


def test_decoders_grow_before_a_context_chunk_takes_their_block():
    """Two decoders at a block boundary need the pool's last 2 blocks in the step where a third request's next
    chunk wants 1: they grow, the chunk waits, and every output is scratch's."""
    cfg = cache(6)
    mgr, driver, sampler = KVCacheManager(cfg), BatchDriver(ReferenceEngine(cfg)), Sampler(())
    a, c = Request(1, [1, 2, 3, 4], 3), Request(2, [5, 6, 7, 8], 3)
    b = Request(3, list(range(10, 22)), 2)   # 12 tokens: chunks of 8 and 4
    batch = driver.admit(mgr, [a, c, b], sampler)
    assert mgr.stats().free_num_blocks == 2
    got = run(driver, mgr, batch, sampler)
    assert got == {r.request_id: scratch(r) for r in (a, c, b)}
    mgr.check_integrity()


def test_a_decode_step_is_held_against_each_windows_own_pool():
    """A sliding window of 6 blocks and a full one of 3: the sum of their free blocks (4 + 1) covers both
    decoders' growth (2 blocks in each window), the full window's pool alone does not; the step is refused
    before anything changes."""
    cfg = cache(5, None, attention_windows=(8, None), window_shares=(2, 1))
    mgr, driver, sampler = KVCacheManager(cfg), BatchDriver(ReferenceEngine(cfg)), Sampler(())
    batch = driver.admit(mgr, [Request(1, [1, 2, 3, 4], 6), Request(2, [5, 6, 7, 8], 6)], sampler)
    driver.step(mgr, batch, sampler)   # both prompts computed; each holds one block per window
    full = [w for w in mgr.stats().windows if w.window is None][0]
    assert full.free_num_blocks == 1 < 2 <= mgr.stats().free_num_blocks
    before = [mgr.num_tokens(r.request.request_id) for r in batch]
    with pytest.raises(OutOfBlocksError, match="attention window"):
        driver.step(mgr, batch, sampler)
    assert [mgr.num_tokens(r.request.request_id) for r in batch] == before, "the refused step changed nothing"
    mgr.check_integrity()


def test_admission_holds_each_window_against_its_own_pool():
    """Two requests that need 2 blocks each in the full window of 3 (and 2 each in the sliding one of 6): the
    sum over windows (8 of 9 free) would admit both at once; the full window holds one, so the second waits
    for the first to finish, and both give scratch's tokens."""
    windows = dict(attention_windows=(8, None), window_shares=(2, 1))
    w = RankWorker(0, 1, cache(5, None, **windows), batching=BatchingConfig(max_num_seqs=4))
    w.build_ledger(*w.local_block_counts())
    reqs = [Request(1, [1, 2, 3, 4], 4), Request(2, [5, 6, 7, 8], 4)]
    outs = w.serve(reqs).outcomes
    assert [o.output_tokens for o in outs] == [scratch(r, **windows) for r in reqs]
    load = w.load()
    assert load.peak_running_requests == 1, "the second request waited for the full window's blocks"
    assert load.preempted_requests == 0, "nothing admitted had to start over"
