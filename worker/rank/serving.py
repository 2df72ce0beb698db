"""Serving on one rank: batches through the reference engine on the rank's ledger, and the load it reports.

A served batch holds the ledger's lock from admission to release, so batches
on one rank run one after another; the ones waiting for the lock are the
rank's queue, and ``load`` reports them (requests and prompt tokens) next to
its blocks, in one answer. A router serves with ``publish=True``: the events
the batch caused are published as the next numbered batch before the lock is
let go, and travel back with the outcomes (``ServeReply.events``), so they are
indexed before the answer leaves; otherwise they wait for the next poll or push.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

from kvledger.worker.engine.reference import ReferenceEngine, ServeResult
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.wire.messages import RankLoad, ServeOutcome, ServeReply
from kvledger.worker.wire.request import Request


class RankServer:
    """See the module docstring."""

    def __init__(self, books: RankBooks, engine: ReferenceEngine) -> None:
        self.books = books
        self.engine = engine
        self._count_lock = threading.Lock()
        self._queued_tokens = self._queued_requests = self._running = 0
        self._served = 0

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        """Serve a batch to completion; the outcomes in order (with the last logits if asked), and with
        ``publish`` the events it caused."""
        reqs = list(requests)
        for r in reqs:
            if not isinstance(r, Request):
                raise TypeError(f"serve takes kvledger Request objects, got {type(r).__name__}")
        tokens = sum(len(r.tokens) for r in reqs)
        with self._count_lock:  # queued until the ledger is ours
            self._queued_tokens += tokens
            self._queued_requests += len(reqs)
        with self.books.lock:
            with self._count_lock:
                self._queued_tokens -= tokens
                self._queued_requests -= len(reqs)
                self._running = len(reqs)
            try:
                results = self.engine.serve(self.books.ledger(), reqs)
            finally:
                with self._count_lock:
                    self._running = 0
            self._served += len(results)
            events = self.books.events().poll() if publish else None
        return ServeReply([self._outcome(r, logits) for r in results], events)

    def _outcome(self, res: ServeResult, logits: bool) -> ServeOutcome:
        lp = res.logprobs
        return ServeOutcome(res.request_id, self.books.rank, list(res.output_tokens), res.cached_tokens,
                            res.computed_tokens, res.onboarded_blocks,
                            res.last_logits.tolist() if logits else None,
                            None if lp is None else lp.chosen, None if lp is None else lp.top)

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        """Exact probe: tokens of ``tokens[:-1]`` this rank holds as full blocks (either tier)."""
        with self.books.lock:
            return self.books.ledger().probe_prefix_match_length(tokens, lora_id=lora_id, cache_salt=cache_salt)

    def load(self, publishing: bool) -> RankLoad:
        """The queue and the blocks per tier, and the ledger's hit rate (``ready=False`` before the ledger).

        Read without the ledger's lock, which a batch holds from admission to
        release: the counters are plain ints, so a report taken mid-batch is as
        fresh as any, and a rank serving a long batch still answers at once.
        """
        mgr = self.books.manager
        s = mgr.stats() if mgr is not None else None
        pub = self.books.publisher
        with self._count_lock:
            queue = dict(publishing=publishing, queued_prefill_tokens=self._queued_tokens,
                         queued_requests=self._queued_requests, running_requests=self._running,
                         served_requests=self._served, published_batches=0 if pub is None else pub.next_seq)
        if s is None:
            return RankLoad(self.books.rank, False, **queue)
        return RankLoad(self.books.rank, True, **queue, device_blocks_used=s.used_num_blocks,
                        device_blocks_free=s.free_num_blocks,
                        host_blocks_used=s.max_num_secondary_blocks - s.num_free_secondary_blocks,
                        host_blocks_free=s.num_free_secondary_blocks, cache_hit_rate=s.cache_hit_rate)
