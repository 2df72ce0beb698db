"""Serving on one rank: requests join the rank's running batch (``scheduler``), and the load it reports.

Every caller's requests are queued for the rank's one running batch and
served by its step loop, which holds the ledger's lock a step at a time; the
queue, the batch and what the loop did are in ``load``, next to the blocks, in
one answer. A router serves with ``publish=True``: the events published in the
step its requests finished travel back with the outcomes
(``ServeReply.events``), so they are indexed before the answer leaves;
otherwise they wait for the next poll or push.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.rank.batch import ServeResult
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.rank.scheduler import BatchingConfig, BatchScheduler
from kvledger.worker.wire.messages import RankLoad, ServeOutcome, ServeReply
from kvledger.worker.wire.request import Request


class RankServer:
    """See the module docstring."""

    def __init__(self, books: RankBooks, engine: ReferenceEngine, batching: BatchingConfig = BatchingConfig()) -> None:
        self.books = books
        self.engine = engine
        self.batching = batching
        self.scheduler = BatchScheduler(books, engine, batching)

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        """Serve the requests in the running batch; the outcomes in order (with the last logits if asked), and
        with ``publish`` the events published when the last of them finished. ``RankBusyError`` when the queue
        is full, ``ValueError``/``TypeError`` for bad input, both before anything changes."""
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"serve takes kvledger Request objects, got {type(r).__name__}")
        reqs = [self._drafting(r) for r in requests]
        self.engine.check(self.books.ledger(), reqs)
        served = self.scheduler.serve(reqs, publish)
        return ServeReply([self._outcome(r, logits, steps, served.submitted)
                           for r, steps in zip(served.results, served.steps)], served.events)

    def _drafting(self, r: Request) -> Request:
        """``r`` with the rank's draft tokens per step when it asks for none, and its windows' pools hold it
        with them (a step's drafts take blocks: a request that fits only without them is served so); a beam
        search takes none."""
        k = self.batching.num_speculative_tokens
        if not k or r.num_draft_tokens or r.beam_width > 1:
            return r
        drafting = dataclasses.replace(r, num_draft_tokens=k)
        return drafting if self.books.ledger().could_hold(drafting) else r

    def _outcome(self, res: ServeResult, logits: bool, steps: tuple[int, int], submitted: float) -> ServeOutcome:
        lp, beams = res.logprobs, res.beams
        return ServeOutcome(res.request_id, self.books.rank, list(res.output_tokens), res.cached_tokens,
                            res.computed_tokens, res.onboarded_blocks,
                            res.last_logits.tolist() if logits else None,
                            None if lp is None else lp.chosen, None if lp is None else lp.top, *steps,
                            None if beams is None else beams.tokens, None if beams is None else beams.scores,
                            res.drafted_tokens, res.accepted_tokens,
                            None if beams is not None else [t - submitted for t in res.token_times])

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        """Exact probe: tokens of ``tokens[:-1]`` this rank holds as full blocks (either tier)."""
        with self.books.lock:
            return self.books.ledger().probe_prefix_match_length(tokens, lora_id=lora_id, cache_salt=cache_salt)

    def load(self, publishing: bool) -> RankLoad:
        """The queue, the running batch and the blocks per tier, and the ledger's hit rate (``ready=False``
        before the ledger).

        Read without the ledger's lock (the step loop holds it a step at a time):
        the counters have their own, so a rank serving a long batch still answers at once.
        """
        mgr = self.books.manager
        s = mgr.stats() if mgr is not None else None
        pub = self.books.publisher
        c = self.scheduler.counts()
        queue = dict(publishing=publishing, queued_prefill_tokens=c.queued_prefill_tokens,
                     queued_requests=c.queued_requests, running_requests=c.running_requests,
                     served_requests=c.served_requests, published_batches=0 if pub is None else pub.next_seq,
                     steps=c.steps, peak_running_requests=c.peak_running_requests,
                     peak_step_tokens=c.peak_step_tokens, preempted_requests=c.preempted_requests,
                     refused_requests=c.refused_requests)
        if s is None:
            return RankLoad(self.books.rank, False, **queue)
        return RankLoad(self.books.rank, True, **queue, device_blocks_used=s.used_num_blocks,
                        device_blocks_free=s.free_num_blocks,
                        host_blocks_used=s.max_num_secondary_blocks - s.num_free_secondary_blocks,
                        host_blocks_free=s.num_free_secondary_blocks, cache_hit_rate=s.cache_hit_rate)
