"""Continuous batching on one rank: one running batch that requests join at step boundaries, behind a bounded queue.

Bounded as vLLM bounds it: at most ``max_num_seqs`` requests run, and a step
computes at most ``max_num_batched_tokens`` tokens (a token per decoding
request, then context chunks first come first served; a long prompt is
prefilled in chunks over several steps, ``BatchDriver.step``). Requests
wait in a first-come-first-served queue of at most ``max_queued_requests``;
past it a rank answers ``RankBusyError`` at once, changing nothing.

Blocks are admitted by one of TensorRT-LLM's two capacity policies, each
window against its own pool (``BatchingConfig.capacity_policy``):

- ``guaranteed_no_evict`` (the default): the head of the queue joins only when
  the free blocks cover what it needs to completion on top of what the running
  requests still need to theirs, so a request that runs never runs out; one
  that does not fit waits in the queue, and nothing accepted fails for want of
  blocks.
- ``max_utilization``: a scheduling round reserves the running requests' next
  step, then admits heads while the round has their first step's blocks
  (``scheduling_add_sequence``, reserve then commit). More requests run at
  once; when a step cannot grow them all, the latest admitted is paused.

A step that cannot be planned (under ``max_utilization``, or when blocks were
taken behind the batch's back by a migration's import) pauses the request
admitted last as vLLM preempts, by recomputation: its blocks go, written ones
stored for reuse, and it goes back to the head of the queue to resume from
what the prefix tree still holds (greedy and seeded requests give the same
tokens again).

One thread runs the steps while there is work and ends when there is none.
It holds the ledger's lock per step, not per batch, so probes, loads,
migrations and event polls interleave with a running batch.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.engine.sampler import Sampler
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.rank.batch import BatchDriver, RunningRequest, ServeResult, StepRecord
from kvledger.worker.rank.books import RankBooks
from kvledger.worker.wire.batches import PublishedBatch
from kvledger.worker.wire.errors import OutOfBlocksError, RankNotReadyError, RequestAbortedError
from kvledger.worker.wire.messages import RankBusyError
from kvledger.worker.wire.request import Request

logger = logging.getLogger(__name__)

#: How long a caller waits for its requests between checks that the step loop still runs.
WAIT_SLICE_S = 1.0
#: How long a lone running request waits for blocks taken from under it before it fails, and how often it looks.
STALL_S = 30.0
STALL_POLL_S = 0.01
#: Threads of a rank actor beyond its batch and queue: probes, loads, event polls and migrations never wait
#: behind parked serve calls (as long as the routers keep fewer serve calls in flight than the batch and queue hold).
CONTROL_THREADS = 16
CapacityPolicy = Literal["guaranteed_no_evict", "max_utilization"]
CAPACITY_POLICIES = get_args(CapacityPolicy)
#: The most draft tokens a step proposes per request.
MAX_DRAFTS = 16

@dataclass(frozen=True, slots=True)
class BatchingConfig:
    """The bounds of one rank's running batch and queue (``ClusterConfig`` sets them for every rank)."""

    max_num_seqs: int = 64
    """Requests in the running batch at once (vLLM's ``max_num_seqs``)."""
    max_num_batched_tokens: int = 1024
    """Tokens one step computes at most: context-chunk tokens plus one per decoding request."""
    max_queued_requests: int = 256
    """Requests waiting to join the batch; past it the rank refuses new ones (the router answers 429)."""
    capacity_policy: CapacityPolicy = "guaranteed_no_evict"
    """TensorRT-LLM's capacity scheduler policies: ``guaranteed_no_evict`` admits a request only when its blocks
    to completion are free, so nothing admitted is ever paused; ``max_utilization`` admits while the next step's
    blocks are free (reserve, then commit) and pauses the latest admitted when a step cannot grow."""
    num_speculative_tokens: int = 0
    """Draft tokens a decode step proposes by prompt lookup and the model checks (vLLM's n-gram speculative
    decoding); a request that asks for none gets these. 0: none."""

    @property
    def actor_threads(self) -> int:
        """Calls a rank actor takes at once: every serve call its batch and queue hold, and the control calls."""
        return self.max_num_seqs + self.max_queued_requests + CONTROL_THREADS

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_queued_requests"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.capacity_policy not in CAPACITY_POLICIES:
            raise ValueError(f"capacity_policy must be one of {CAPACITY_POLICIES}, got {self.capacity_policy!r}")
        if type(self.num_speculative_tokens) is not int or not 0 <= self.num_speculative_tokens <= MAX_DRAFTS:
            raise ValueError(f"num_speculative_tokens must be an int in 0..{MAX_DRAFTS}, got "
                             f"{self.num_speculative_tokens!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                             f"({self.max_num_seqs}): every running request decodes a token per step")


@dataclass(slots=True)
class BatchCounts:
    """What the loop holds and has done, as the rank's load report shows it."""

    queued_requests: int = 0
    queued_prefill_tokens: int = 0
    """Prompt tokens of the queued requests."""
    running_requests: int = 0
    served_requests: int = 0
    steps: int = 0
    peak_running_requests: int = 0
    peak_step_tokens: int = 0
    preempted_requests: int = 0
    refused_requests: int = 0
    """Requests refused because the queue was full (``RankBusyError``)."""


class Ticket:
    """One caller's requests: done when every one is served, or at the first error."""

    __slots__ = ("requests", "results", "steps", "left", "publish", "events", "error", "done", "submitted")

    def __init__(self, requests: list[Request], publish: bool) -> None:
        self.requests = requests
        self.results: list[ServeResult | None] = [None] * len(requests)
        self.steps: list[tuple[int, int]] = [(0, 0)] * len(requests)
        """Per request the steps it was admitted at and finished at."""
        self.left = len(requests)
        self.publish = publish
        self.events: PublishedBatch | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.submitted = time.monotonic()
        """When the rank took the requests: their token times count from here."""

    def fail(self, error: BaseException) -> None:
        if self.error is None and not self.done.is_set():
            self.error = error
            self.done.set()


@dataclass(slots=True, eq=False)
class _Entry:
    ticket: Ticket
    index: int
    running: RunningRequest | None = None
    admitted_step: int = 0

    @property
    def request(self) -> Request:
        return self.ticket.requests[self.index]


@dataclass(frozen=True, slots=True)
class Served:
    """A caller's served requests, in order, with the steps each joined and left the batch at."""

    results: list[ServeResult]
    steps: list[tuple[int, int]]
    events: PublishedBatch | None
    submitted: float
    """``time.monotonic()`` when the rank took them (``ServeResult.token_times`` count from it)."""


class BatchScheduler:
    """See the module docstring."""

    def __init__(self, books: RankBooks, engine: ReferenceEngine, config: BatchingConfig = BatchingConfig(),
                 background: bool = True) -> None:
        """``background``: a thread of its own runs the steps while there is work (``serve`` waits on it);
        without, the caller runs each ``step`` (as vLLM's ``LLMEngine.step``), so a test drives it step by
        step."""
        self.books = books
        self.driver = BatchDriver(engine)
        self.config = config
        self.background = background
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Entry] = collections.deque()
        self._running: list[_Entry] = []
        self._ids: set[int] = set()
        self._sampler = Sampler(())
        self._counts = BatchCounts()
        self._looping = False
        self._stalled_since: float | None = None

    def serve(self, requests: Sequence[Request], publish: bool) -> Served:
        """Queue ``requests`` (``RankBusyError`` when the queue has no room for them, ``ValueError`` for an id
        already in) and wait until all are served; with ``publish`` the events published as they finished."""
        ticket = self.submit(list(requests), publish)
        while not ticket.done.wait(WAIT_SLICE_S):
            with self._cv:
                if not self._looping and not ticket.done.is_set():
                    raise RuntimeError(f"rank {self.books.rank}: the step loop ended with requests unserved")
        if ticket.error is not None:
            raise ticket.error
        return Served([r for r in ticket.results if r is not None], ticket.steps, ticket.events, ticket.submitted)

    def counts(self) -> BatchCounts:
        with self._cv:
            c = self._counts
            return BatchCounts(len(self._waiting), sum(len(e.request.tokens) for e in self._waiting),
                               len(self._running), c.served_requests, c.steps, c.peak_running_requests,
                               c.peak_step_tokens, c.preempted_requests, c.refused_requests)

    def submit(self, requests: list[Request], publish: bool) -> Ticket:
        """Queue ``requests``, refused as ``serve`` refuses them; their ticket is done when they are served."""
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"request ids {ids} repeat")
        if len(requests) > self.config.max_queued_requests:
            raise ValueError(f"a batch of {len(requests)} requests is more than a rank queues "
                             f"(max_queued_requests={self.config.max_queued_requests}); send fewer at a time")
        self.books.ledger()   # RankNotReadyError before anything is queued
        ticket = Ticket(requests, publish)
        with self._cv:
            taken = sorted(self._ids.intersection(ids))
            if taken:
                raise ValueError(f"request(s) {taken} are already queued or running on rank {self.books.rank}")
            if len(self._waiting) + len(requests) > self.config.max_queued_requests:
                self._counts.refused_requests += len(requests)
                raise RankBusyError(self.books.rank, len(self._waiting), self.config.max_queued_requests)
            if not requests:
                ticket.done.set()
                return ticket
            self._ids.update(ids)
            self._waiting.extend(_Entry(ticket, i) for i in range(len(requests)))
            if self.background and not self._looping:
                self._looping = True
                threading.Thread(target=self._loop, name=f"kvledger-rank{self.books.rank}-steps", daemon=True).start()
        return ticket

    @property
    def has_work(self) -> bool:
        with self._cv:
            return bool(self._waiting or self._running)

    def _loop(self) -> None:
        while True:
            with self._cv:
                if not self._waiting and not self._running:
                    self._looping = False
                    return
            if self.step():   # stalled: with the ledger's lock let go, blocks may come back
                time.sleep(STALL_POLL_S)
            else:   # the lock is not fair: let a caller waiting for it (a probe, a migration) in between steps
                time.sleep(0)

    def step(self) -> bool:
        """Admit what fits, run one step of the batch and release what finished, under the ledger's lock; whether
        the batch is stalled, waiting for blocks. A step that fails aborts its requests (their callers hear why)
        and the queue goes on."""
        try:
            with self.books.lock:
                return self._step(self.books.ledger())
        except RankNotReadyError as e:   # the ledger is gone: nothing queued here can be served
            self._abort(e, queued=True)
        except BaseException as e:  # noqa: BLE001 - every caller hears of it; the loop goes on with the queue
            logger.exception("rank %d: a step failed; its requests are aborted", self.books.rank)
            self._abort(e, queued=False)
        return False

    def _step(self, mgr: KVCacheManager) -> bool:
        """Admit what fits, run one step, release what finished (the caller holds the ledger's lock); whether
        the batch is stalled, waiting for blocks."""
        blocked = self._admit(mgr)
        if not self._running:
            return blocked
        batch = [e.running for e in self._running]
        try:
            record = self.driver.step(mgr, batch, self._sampler, self.config.max_num_batched_tokens)
        except OutOfBlocksError as e:
            return self._preempt_last(mgr, e)
        self._stalled_since = None
        if record.prefill_tokens:
            self.books.faults.reached("mid_prefill")   # part of the admitted prompts' KV is written
        self._finish(mgr, record)
        return False

    def _admit(self, mgr: KVCacheManager) -> bool:
        """The queue's head joins while the batch has room and its blocks are free, as the capacity policy counts
        them (see the module docstring). A head its windows' pools could never hold is refused with
        ``OutOfBlocksError``; one that fits them but finds the blocks held outside the batch (a migration's
        import, a pinned export) waits for them, ``STALL_S`` at most with nothing running. Whether it waits so."""
        fits = self._fits_to_completion(mgr) if self.config.capacity_policy == "guaranteed_no_evict" \
            else self._fits_next_step(mgr)
        if fits is None:
            return False
        while len(self._running) < self.config.max_num_seqs:
            with self._cv:
                if not self._waiting:
                    return False
                head = self._waiting[0]
            if head.ticket.done.is_set():   # its caller already failed: drop what is left of it
                self._pop(head)
                continue
            try:
                fits(head.request)
                (head.running,) = self.driver.admit(mgr, [head.request], self._sampler)
            except OutOfBlocksError as e:
                if self._running:
                    return False   # it waits for the running requests to finish
                if self._may_wait(mgr, head.request):
                    return True
                self._pop(head)
                head.ticket.fail(e)
                continue
            except (ValueError, TypeError) as e:
                self._pop(head)
                head.ticket.fail(e)
                continue
            self._stalled_since = None
            head.admitted_step = self._counts.steps + 1
            with self._cv:
                self._waiting.popleft()
                self._running.append(head)
                c = self._counts
                c.peak_running_requests = max(c.peak_running_requests, len(self._running))
        return False

    def _fits_to_completion(self, mgr: KVCacheManager) -> Callable[[Request], None]:
        """``guaranteed_no_evict``: a request fits when each window's free blocks, less what the running requests
        will still take there, cover what it needs to completion; each fit is counted against the next."""
        free = list(mgr.free_blocks_by_window())   # each window against its own pool, never their sum
        for e in self._running:
            free = [f - n for f, n in zip(free, mgr.remaining_blocks_by_window(e.request))]

        def fits(r: Request) -> None:
            need = mgr.remaining_blocks_by_window(r)
            for w, (n, f) in enumerate(zip(need, free)):
                if n > f:
                    raise OutOfBlocksError(n, f, f"request {r.request_id} to completion"
                                                 + (f" in attention window {w}" if len(free) > 1 else ""))
            free[:] = [f - n for f, n in zip(free, need)]
        return fits

    def _fits_next_step(self, mgr: KVCacheManager) -> Callable[[Request], None] | None:
        """``max_utilization``: the round reserves the running requests' next step, then each head's admission
        (``scheduling_add_sequence``), and a head fits while the round has its blocks; ``None`` when the running
        requests' next step alone does not fit (the step pauses the latest admitted)."""
        mgr.start_scheduling()
        try:
            for e in self._running:
                mgr.scheduling_add_step(e.request.request_id)
        except OutOfBlocksError:
            return None
        return mgr.scheduling_add_sequence

    def _may_wait(self, mgr: KVCacheManager, request: Request) -> bool:
        """Whether a head that finds no blocks free for it, with nothing running, waits for blocks held outside
        the batch to come back: only when its windows' pools could hold it at all, and for ``STALL_S``."""
        return mgr.could_hold(request) and self._stall()

    def _stall(self) -> bool:
        """Whether to wait on for blocks to come back: for ``STALL_S`` since the first wait of this stall."""
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        if now - self._stalled_since < STALL_S:
            return True
        self._stalled_since = None
        return False

    def _pop(self, head: _Entry) -> None:
        with self._cv:
            self._waiting.popleft()
            self._ids.discard(head.request.request_id)

    def _finish(self, mgr: KVCacheManager, record: StepRecord) -> None:
        done = [e for e in self._running if e.running.finished]
        results = self.driver.finish(mgr, [e.running for e in done])
        with self._cv:
            c = self._counts
            c.steps += 1
            c.peak_step_tokens = max(c.peak_step_tokens, record.tokens)
            c.served_requests += len(done)
            self._running = [e for e in self._running if not e.running.finished]
            self._ids.difference_update(e.request.request_id for e in done)
        complete = []
        for e, res in zip(done, results):
            self._sampler.drop(e.request.request_id)
            t = e.ticket
            t.results[e.index] = res
            t.steps[e.index] = (e.admitted_step, c.steps)
            t.left -= 1
            if t.left == 0:
                complete.append(t)
        if any(t.publish for t in complete):   # indexed before the answers leave (``RankServer``)
            events = self.books.events().poll()
            for t in complete:
                t.events = events if t.publish else None
        for t in complete:
            t.done.set()

    def _preempt_last(self, mgr: KVCacheManager, error: OutOfBlocksError) -> bool:
        """The step could not run: the request admitted last starts over from the queue's head. Alone, it waits
        for blocks to come back (``STALL_S`` at most, then it fails with ``error``); whether it waits."""
        if len(self._running) == 1 and self._stall():
            return True
        self._stalled_since = None
        victim = self._running[-1]
        self.driver.abort(mgr, [victim.running])
        self._sampler.drop(victim.request.request_id)
        victim.running = None
        with self._cv:
            self._running.pop()
            if not self._running:
                self._ids.discard(victim.request.request_id)
                victim.ticket.fail(error)
                return False
            self._waiting.appendleft(victim)
            self._counts.preempted_requests += 1
        logger.info("rank %d: request %d preempted (%s); it starts over", self.books.rank,
                    victim.request.request_id, error)
        return False

    def abort(self, request_ids: Sequence[int]) -> list[int]:
        """Abort ``request_ids`` between two steps: a queued one leaves the queue, a running one the batch and the
        ledger (its written KV stored for reuse, as a preempted request's); each caller gets
        ``RequestAbortedError``. Ids not queued or running (finished, or never sent) are passed over; returns
        those that were in."""
        wanted = set(request_ids)
        with self.books.lock, self._cv:
            queued = [e for e in self._waiting if e.request.request_id in wanted]
            running = [e for e in self._running if e.request.request_id in wanted]
            if running:
                self.driver.abort(self.books.ledger(), [e.running for e in running])
            self._waiting = collections.deque(e for e in self._waiting if e not in queued)
            self._running = [e for e in self._running if e not in running]
            for e in queued + running:
                self._sampler.drop(e.request.request_id)
                self._ids.discard(e.request.request_id)
        for e in queued + running:
            e.ticket.fail(RequestAbortedError(self.books.rank, e.request.request_id))
        return sorted(e.request.request_id for e in queued + running)

    def _abort(self, error: BaseException, queued: bool) -> None:
        """A step failed: the running requests (and with ``queued`` the queued ones) leave the ledger unfinished
        and their callers hear why."""
        with self.books.lock:
            if self.books.manager is not None:
                self.driver.abort(self.books.manager, [e.running for e in self._running])
        with self._cv:
            failed, self._running = self._running, []
            if queued:
                failed += self._waiting
                self._waiting.clear()
            for e in failed:
                self._sampler.drop(e.request.request_id)
                self._ids.discard(e.request.request_id)
        for e in failed:
            e.ticket.fail(error)
