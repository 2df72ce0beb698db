"""The step loop on the plain rank class (no Ray): blocks taken from under a running batch preempt the request
admitted last, which starts over and still gives the scratch computation's tokens, while the one left waits for
blocks instead of failing; the queue holds a request its blocks do not cover yet instead of failing it."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.ledger import CacheConfig, KVCacheManager
from kvledger.worker.rank.batch import BatchDriver
from kvledger.worker.rank.scheduler import BatchingConfig
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.errors import RequestAbortedError
from kvledger.worker.wire.request import Request, Sampling

T = 4
WAIT_S = 60.0


def cache(blocks: int) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=blocks, check_integrity=True)


def worker(blocks: int, **batching) -> RankWorker:
    w = RankWorker(0, 1, cache(blocks), batching=BatchingConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                                **batching))
    w.build_ledger(blocks, 0)
    return w


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def scratch(r: Request, blocks: int) -> list[int]:
    fresh = Request(0, r.tokens, r.max_new_tokens)
    (res,) = BatchDriver(ReferenceEngine(cache(blocks))).serve(KVCacheManager(cache(blocks)), [fresh])
    return res.output_tokens


def until(cond, what: str) -> None:
    """Poll ``cond`` (bounded): the step loop runs on its own thread."""
    for _ in range(60_000):
        if cond():
            return
        threading.Event().wait(0.001)
    raise AssertionError(f"timed out waiting for {what}")


def serve_in_thread(w: RankWorker, r: Request, out: dict) -> threading.Thread:
    t = threading.Thread(target=lambda: out.__setitem__(r.request_id, w.serve([r]).outcomes[0]))
    t.start()
    return t


class SquattingDriver(BatchDriver):
    """Once armed, takes every free block for a squatter right before its next step, as a migration's import
    would between two steps (inside the step loop's hold of the lock: a test thread racing the loop for the lock
    might get it only after the batch finished)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = threading.Event()
        self.squatter: Request | None = None

    def step(self, manager, batch, sampler, max_tokens=None):
        if self.armed.is_set() and self.squatter is None:
            self.squatter = Request(99, tokens(99, manager.stats().free_num_blocks * T))
            manager.add_sequence(self.squatter)
        return super().step(manager, batch, sampler, max_tokens)


def test_blocks_taken_from_a_running_batch_preempt_the_last_admitted_which_starts_over():
    blocks = 256
    w = worker(blocks)
    engine = w.server.scheduler.driver = SquattingDriver(w.engine)
    first, second = Request(1, tokens(1, 9), 120), Request(2, tokens(2, 9), 120)
    out: dict = {}
    threads = [serve_in_thread(w, first, out)]
    until(lambda: w.load().running_requests == 1, "the first request to run")
    threads.append(serve_in_thread(w, second, out))
    until(lambda: w.load().running_requests == 2 and w.load().steps >= 2, "both to run")
    engine.armed.set()
    until(lambda: w.load().preempted_requests >= 1, "a decode step to find its blocks gone")
    mgr = w.manager
    with w.books.lock:
        assert w.load().running_requests == 1 and w.load().queued_requests == 1, "the last admitted went back"
        mgr.remove_sequence(engine.squatter.request_id, store=False)
    for t in threads:
        t.join(WAIT_S)
    assert [out[r.request_id].output_tokens for r in (first, second)] == [scratch(first, blocks),
                                                                           scratch(second, blocks)]
    assert w.load().preempted_requests == 1, "the first request, alone, waited for the blocks to come back"
    w.check_integrity()
    assert w.load().device_blocks_used == 0


def test_a_request_its_blocks_do_not_cover_yet_waits_in_the_queue_instead_of_failing():
    blocks = 48   # one request of 9 + 120 tokens needs 33 blocks to completion: two never fit together
    w = worker(blocks)
    reqs = [Request(10 + i, tokens(10 + i, 9), 120) for i in range(2)]
    outcomes = w.serve(reqs).outcomes
    assert outcomes[1].admitted_step > outcomes[0].finished_step, "the second joined once the first left"
    assert [o.output_tokens for o in outcomes] == [scratch(r, blocks) for r in reqs]
    assert w.load().peak_running_requests == 1 and w.load().preempted_requests == 0
    w.check_integrity()


def test_a_sampled_request_draws_the_same_tokens_alone_and_joining_a_running_batch():
    blocks = 256
    w = worker(blocks)
    sampled = Sampling(temperature=1.2, top_k=40, seed=11, logprobs=2)
    alone = w.serve([Request(30, tokens(30, 11), 12, sampling=sampled)]).outcomes[0]
    others = [Request(31 + i, tokens(31 + i, 7 + 5 * i), 20) for i in range(3)]
    batch = w.serve([others[0], Request(40, tokens(30, 11), 12, sampling=sampled), *others[1:]]).outcomes
    assert batch[1].output_tokens == alone.output_tokens
    assert batch[1].logprobs == pytest.approx(alone.logprobs, abs=1e-4), "batched sums differ in the last digits"
    assert len(alone.logprobs) == 12 and all(len(top) == 2 for top in alone.top_logprobs)
    assert [o.output_tokens for o in (batch[0], *batch[2:])] == [scratch(r, blocks) for r in others], \
        "the greedy requests beside it stay greedy"
    assert w.load().peak_running_requests == 4


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_each_capacity_policy_serves_a_tight_pool_as_scratch(policy):
    """Four requests of 9 blocks each to completion on a pool of 16: guaranteed-no-evict runs one at a time and
    pauses none; max-utilization runs them together while the next step fits, pauses the latest admitted when a
    step cannot grow them all, and resumes it later. Every answer is scratch's either way."""
    blocks = 16
    w = worker(blocks, capacity_policy=policy)
    reqs = [Request(i + 1, tokens(i + 20, 9), 24) for i in range(4)]
    out: dict = {}
    for t in [serve_in_thread(w, r, out) for r in reqs]:
        t.join(WAIT_S)
    assert {r.request_id: out[r.request_id].output_tokens for r in reqs} == \
        {r.request_id: scratch(r, 64) for r in reqs}
    load = w.load()
    if policy == "guaranteed_no_evict":
        assert load.peak_running_requests == 1 and load.preempted_requests == 0
    else:
        assert load.peak_running_requests > 1 and load.preempted_requests > 0
    w.check_integrity()


def test_a_capacity_policy_or_a_draft_count_out_of_range_is_refused_by_name():
    with pytest.raises(ValueError, match="capacity_policy"):
        BatchingConfig(capacity_policy="first_come")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        BatchingConfig(num_speculative_tokens=-1)


def test_aborting_a_running_and_a_queued_request_frees_their_blocks_and_tells_their_callers():
    """One request decoding, one queued behind it (a batch of one): both aborted, each caller gets
    ``RequestAbortedError``; the running one's written prompt blocks stay stored for reuse, nothing stays held,
    and an id that is not in is passed over."""
    w = RankWorker(0, 1, cache(64), batching=BatchingConfig(max_num_seqs=1))
    w.build_ledger(64, 0)
    running, queued = Request(1, tokens(30, 9), 200), Request(2, tokens(31, 9), 4)
    errors: dict = {}

    def send(r: Request) -> None:
        try:
            w.serve([r])
        except RequestAbortedError as e:
            errors[r.request_id] = e

    threads = [threading.Thread(target=send, args=(r,)) for r in (running, queued)]
    threads[0].start()
    until(lambda: w.load().steps >= 2, "the first request to decode")
    threads[1].start()
    until(lambda: w.load().queued_requests == 1, "the second to queue")
    assert w.abort([2, 1, 77]) == [1, 2]
    for t in threads:
        t.join(WAIT_S)
    assert sorted(errors) == [1, 2] and errors[1].request_id == 1 and "aborted" in str(errors[1])
    load = w.load()
    assert load.running_requests == load.queued_requests == 0 and w.manager.stats().used_num_blocks == 0
    assert w.probe(running.tokens + [1]) == 8, "the aborted request's written prompt blocks stay reusable"
    w.check_integrity()
    (again,) = w.serve([Request(3, queued.tokens, 4)]).outcomes
    assert again.output_tokens == scratch(queued, 64)
