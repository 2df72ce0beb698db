"""One rank under pressure as a stateful property test: hypothesis drives its scheduler a step at a time.

``tests/rank_fuzz.py`` sends requests from threads, so the order they meet the
step loop is the threads' and a failure cannot be replayed; here the scheduler
runs without its thread (``BatchScheduler(background=False)``) and each rule
is one thing that happens to a rank: a request arrives (greedy or seeded,
drafting or searching beams, sharing a prefix), the batch steps, a migration's
import takes blocks and gives them back, a migration's export pins a prefix
and reads it, a client aborts. The ledger's walking integrity check runs
after every ledger call, and at the end every answer must be scratch's.
"""
from __future__ import annotations

import random

import pytest
from derandomized import run_derandomized, without_mined_constants
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from rank_fuzz import PREFIXES, T, cache, scratch

from kvledger.worker.ledger.budget import blocks_to_completion
from kvledger.worker.rank.scheduler import CAPACITY_POLICIES, BatchingConfig, BatchScheduler, Ticket
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.errors import OutOfBlocksError, RequestAbortedError
from kvledger.worker.wire.request import GREEDY, Request, Sampling

MAX_DRAIN_STEPS = 2000


@pytest.fixture(autouse=True)
def no_mined_constants(monkeypatch: pytest.MonkeyPatch) -> None:
    without_mined_constants(monkeypatch)


class RankMachine(RuleBasedStateMachine):
    """See the module docstring."""

    steps = 0
    answered = 0
    aborted = 0

    @initialize(seed=st.integers(0, 10**6), blocks=st.integers(5, 13), policy=st.sampled_from(CAPACITY_POLICIES),
                max_num_seqs=st.sampled_from([2, 4, 8]), step_tokens=st.sampled_from([8, 16, 64]))
    def build(self, seed: int, blocks: int, policy: str, max_num_seqs: int, step_tokens: int) -> None:
        self.cfg = cache(random.Random(seed), blocks)
        self.rank = RankWorker(0, 1, self.cfg)
        self.rank.build_ledger(*self.rank.local_block_counts())
        batching = BatchingConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=step_tokens,
                                  capacity_policy=policy)
        self.scheduler = BatchScheduler(self.rank.books, self.rank.engine, batching, background=False)
        self.full = min(s.max_num_blocks for s in self.rank.manager.stats().windows if s.window is None)
        self.tickets: dict[int, tuple[Request, Ticket]] = {}
        self.imports: list[int] = []
        self.next_id = 1

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1, 255), min_size=1, max_size=9),
          max_new=st.integers(1, 8), kind=st.sampled_from(["greedy", "seeded", "drafting", "beams"]),
          seed=st.integers(0, 999))
    def arrive(self, prefix: list[int], tail: list[int], max_new: int, kind: str, seed: int) -> None:
        beams = 3 if kind == "beams" and self.cfg.attention_windows is None else 1
        drafts = 2 if kind == "drafting" else 0
        tokens = prefix + tail
        if blocks_to_completion(len(tokens), max_new, drafts, beams, T) > self.full:
            return   # the router refuses what no pool of the rank could hold (a 400)
        sampling = Sampling(temperature=1.0, seed=seed) if kind == "seeded" else GREEDY
        r = Request(self.next_id, tokens, max_new, sampling=sampling, num_draft_tokens=drafts, beam_width=beams)
        self.next_id += 1
        self.tickets[r.request_id] = (r, self.scheduler.submit([r], publish=False))

    @precondition(lambda self: self.scheduler.has_work)
    @rule()
    def step(self) -> None:
        self.scheduler.step()
        RankMachine.steps += 1

    @rule(prefix=st.sampled_from(PREFIXES), blocks=st.integers(1, 3))
    def import_takes_blocks(self, prefix: list[int], blocks: int) -> None:
        try:
            self.imports.append(self.rank.import_begin(prefix + [255] * 12, blocks).import_id)
        except OutOfBlocksError:   # no room now: the batch holds the blocks
            pass

    @precondition(lambda self: self.imports)
    @rule()
    def import_gives_them_back(self) -> None:
        self.rank.import_abort(self.imports.pop())

    @rule(prefix=st.sampled_from(PREFIXES))
    def export_reads_a_prefix(self, prefix: list[int]) -> None:
        try:
            ticket = self.rank.export_begin(prefix + [1])
        except OutOfBlocksError:   # no room to onboard it now
            return
        self.rank.export_read(ticket.pin_id, 0)

    @precondition(lambda self: self.tickets)
    @rule(pick=st.integers(0, 10**6))
    def client_aborts(self, pick: int) -> None:
        ids = sorted(self.tickets)
        self.scheduler.abort([ids[pick % len(ids)]])

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        while self.imports:
            self.rank.import_abort(self.imports.pop())
        for _ in range(MAX_DRAIN_STEPS):
            if not self.scheduler.has_work:
                break
            self.scheduler.step()
            RankMachine.steps += 1
        assert not self.scheduler.has_work, "the rank did not drain its queue"
        for r, ticket in self.tickets.values():
            assert ticket.done.is_set(), f"request {r.request_id} was neither answered nor refused"
            if isinstance(ticket.error, RequestAbortedError):
                RankMachine.aborted += 1
                continue
            assert ticket.error is None, f"request {r.request_id}: {ticket.error!r}"
            (res,) = ticket.results
            got = res.beams.tokens if res.beams is not None else [res.output_tokens]
            assert got == scratch(self.cfg, r), f"request {r.request_id} diverged from scratch"
            RankMachine.answered += 1
        self.rank.check_integrity()
        assert self.rank.manager.stats().used_num_blocks == 0


def test_a_rank_driven_step_by_step_answers_as_scratch_and_keeps_its_books():
    RankMachine.steps = RankMachine.answered = RankMachine.aborted = 0
    run_derandomized(RankMachine, max_examples=80, step_count=40)
    assert RankMachine.steps >= 600 and RankMachine.answered >= 150, (RankMachine.steps, RankMachine.answered)
    assert RankMachine.aborted > 0
