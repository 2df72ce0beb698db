"""The router as one plain, thread-safe object: events in, routing decisions and generations out.

``RouterService`` routes over ``Engines`` (``router.engines``: kvledger's own
ranks and vLLM servers, each an ``Engine``), whose models the catalogue holds
(``router.models``). It puts three parts together: the event feed
(``router.feed.EventFeed``, the global index fed by each engine's events),
the routing step (``router.routing.RouteStep`` over the router's
``LoadAccount`` of what it dispatched, and the engines' own load reports), and
dispatch with one retry loop, streaming a mode of it: an engine lost before it
answers is left out and the request decided again. It knows nothing of Ray or
HTTP, so the same object runs in tests over in-process ranks and in the router
actor over the cluster. Router replicas share their dispatches through two
hooks (``router.replica_sync``): each dispatch and finish goes to the
``listen``-er, and the peers' come in through ``peer_events``. A request that
names an agent session (``session``) is a turn of it: ``router.sessions`` knows
where the session lives, the policy weighs that (``RouteRequest.session``, and
every rank's session blocks), and own ranks keep its blocks at
``RouterConfig.session_priority`` for the session's TTL.

Locks: ``_lock`` guards the loads and the policy, and is never held across a
call to an engine; the feed has its own (``EventFeed.lock``), the tally too.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kvledger.router.admission import AdmissionGate, AdmissionRefused, Held
from kvledger.router.config import RouterConfig
from kvledger.router.disaggregation import Link, SplitPlanner, TransferRate
from kvledger.router.engine import (Capability, Engine, EngineRefusedError, Generated, Generation,
                                    cached_tokens_of)
from kvledger.router.engine_rates import EngineRates
from kvledger.router.engines import EngineCannotError, Engines
from kvledger.router.feed import EventFeed
from kvledger.router.kv_connector import EXAMPLE_FLAG, decode_fields, prefill_fields
from kvledger.router.load import Dispatch, Ended, LoadAccount, ReportedQueue
from kvledger.router.models import Model, Models
from kvledger.router.numbering import SequencedIndex
from kvledger.router.openai_types import MAX_N
from kvledger.router.policies import NoLiveRankError, RouteDecision, RouteRequest, RoutingPolicy
from kvledger.router.probe import PrefixMatch
from kvledger.router.rank_client import RankDiedError, RankSet
from kvledger.router.replica_sync import DispatchEvent, DispatchKind, DispatchListener
from kvledger.router.report import ClusterReport
from kvledger.router.reporting import cluster_report
from kvledger.router.response_store import ResponseStore, UnknownResponseError
from kvledger.router.routing import RouteStep
from kvledger.router.served import CompletionResult, OverloadedError, Phases, Placement, RankProbe, Streamed
from kvledger.router.sessions import Sessions, waits_on_tool
from kvledger.router.tally import Tally
from kvledger.router.tenants import OPEN, Caller
from kvledger.router.vllm_engine import VllmEngine
from kvledger.worker.wire.batches import PublishedBatch
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.messages import RankBusyError, RankLoad

logger = logging.getLogger(__name__)


class RouterService:
    """See the module docstring."""

    def __init__(self, ranks: RankSet | None, config: RouterConfig = RouterConfig(),
                 policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.policy = policy if policy is not None else config.make_policy()
        self.engines = Engines(ranks, self._publish)
        self.models = Models(self.engines)
        self.feed = EventFeed(self.engines, config.tokens_per_block, config.event_log_size, config.rate_window_s,
                              clock, on_removed=self._forget)
        self.account = LoadAccount()
        self.admission = AdmissionGate(config.max_inflight_completions, config.max_queued_completions,
                                       config.queue_timeout_s, config.admission, clock)
        split = config.split_config()
        self.transfers = TransferRate(split.transfer_setup_s, split.transfer_s_per_block)
        """Seconds per migration, fitted from those the router timed (``router.disaggregation``)."""
        self.step = RouteStep(self.policy, self.account, SplitPlanner(split, self.transfers))
        self.tally = Tally()
        self.responses = ResponseStore(config.stored_responses)
        """The responses relayed, for follow-ups (``router.response_store``: the HTTP API keeps it)."""
        self.sessions = Sessions(config.session_ttl_s, config.max_sessions, clock)
        self.rates = EngineRates()
        """Each engine's speed, learned from its answers (``router.engine_rates``), weighed by the policy."""
        self._lock = threading.Lock()
        self._loads: dict[int, RankLoad] = {}
        self._loads_at = float("-inf")
        self._asked: dict[int, Ended] = {}
        """Per rank, what had ended there when its load report was asked (``ReportedQueue.less``)."""
        self._listener: DispatchListener | None = None
        self._request_ids = itertools.count(1, MAX_N + 1)   # a generation's n choices (and prefill) take the next ids
        self._vllm_prefill: set[int] = set()
        """Ranks of vLLM servers that only prefill (``RouterConfig.vllm_prefill``)."""
        try:
            for url in config.vllm:
                self.add_vllm(url)
            for url in config.vllm_prefill:
                self.add_vllm(url, prefill=True)
            if config.vllm_prefill and not any(self._link(r) is Link.CONNECTOR for r in self.engines.added()
                                               if r not in self._vllm_prefill):
                raise ValueError(f"vllm_prefill servers {list(config.vllm_prefill)} need a vllm server whose KV "
                                 "connector takes their KV, to decode (none of "
                                 f"{list(config.vllm)} runs one): start it with {EXAMPLE_FLAG} or another connector")
        except BaseException:
            self.close()
            raise

    @property
    def index(self) -> SequencedIndex:
        """The feed's ``SequencedIndex`` (read it under ``feed.lock``)."""
        return self.feed.index

    # ------------------------------------------------------------------ membership

    def add_vllm(self, url: str, prefill: bool = False) -> list[int]:
        """Route to the vLLM server at ``url`` too: ask it what it serves, subscribe to its events; its ranks, one
        per data-parallel rank it runs (each indexed, routed to and loaded as an engine of its own). ``prefill``:
        it only prefills, for decode servers whose KV connector takes what its own produces."""
        if url in self.feed.foreign_engines().values():
            raise ValueError(f"vLLM server {url} is already a rank")
        engines = VllmEngine.connect_all(self.feed.next_foreign_rank(), url, self.config.tokenizer,
                                         self.config.engine_timeout_s)
        missing = [e.info().data_parallel_rank for e in engines if e.info().events is None]
        if missing:
            for engine in engines:
                engine.close()
            dp = "" if missing == [None] else f" for data-parallel ranks {missing}"
            raise ValueError(f"vLLM server {url} publishes no KV events{dp}; start it with --enable-prefix-caching "
                             "and --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", ...}'")
        if prefill:
            self._check_producer(url, engines)
        for engine in engines:
            info = engine.info()
            src = info.events
            rank = self.feed.attach_vllm(src.endpoint, src.replay_endpoint, src.topic, bind=src.bind,
                                         block_size=info.block_size, name=url, routed=True,
                                         dp_rank=info.data_parallel_rank)
            assert rank == engine.rank, "engines are attached one at a time"
            self.engines.add(engine)
            if prefill:
                self._vllm_prefill.add(rank)
            logger.info("vLLM server %s%s (model %s, %s tokens per block, tokenizer %s) is rank %d", url,
                        "" if info.data_parallel_rank is None else f" data-parallel rank {info.data_parallel_rank}",
                        info.model, info.block_size, info.tokenizer.name, rank)
        return [e.rank for e in engines]

    @staticmethod
    def _check_producer(url: str, engines: list[VllmEngine]) -> None:
        """A prefill server must run a KV connector that keeps what it computes for another server; else the
        engines are closed and the error says how to start one."""
        try:
            connector = engines[0].server.kv_connector(engines[0].info().connector)
            if connector is None or not connector.produces:
                runs = "no KV connector" if connector is None else f"{connector.name} as {connector.role}"
                raise ValueError(f"vLLM server {url} cannot prefill for another server: it runs {runs}; start it "
                                 f"with {EXAMPLE_FLAG} (or NixlConnector, role kv_producer or kv_both)")
        except BaseException:
            for engine in engines:
                engine.close()
            raise

    def _link(self, rank: int) -> Link | None:
        """The path a split's KV takes to or from ``rank`` (``router.disaggregation``); ``None``: it is never
        part of a split."""
        info = self.engines.engine(rank).info()
        if info.can(Capability.MIGRATION):
            return Link.MIGRATION
        if rank in self._vllm_prefill or (info.connector is not None and info.connector.consumes):
            return Link.CONNECTOR
        return None

    def check_health(self) -> list[int]:
        """One health round over every engine, then the index follows (``EventFeed.sync``); the ranks back.

        An engine that publishes over ZMQ and comes back is subscribed anew where it now says it publishes.
        """
        back = self.engines.check_health()
        for rank in back:
            try:
                src = self.engines.engine(rank).info().events
            except RankDiedError:
                continue
            if src is not None:
                self.feed.move_foreign(rank, src.endpoint, src.replay_endpoint, src.bind)
        self.feed.sync()
        return back

    def _publish(self, rank: int, batch: PublishedBatch) -> None:
        """What serving did on ``rank`` is indexed before its answer leaves."""
        self.feed.ingest(rank, batch.seq, batch.data)

    def _forget(self, rank: int) -> None:
        """The feed dropped ``rank``: its load, what was dispatched to it and the policy's memory of it go."""
        self.rates.forget(rank)
        self._vllm_prefill.discard(rank)
        with self._lock:
            self.account.forget(rank)
            self._loads.pop(rank, None)
            self._asked.pop(rank, None)
            self.policy.on_rank_removed(rank)
        self.sessions.forget_rank(rank)

    # ------------------------------------------------------------------ probing and routing

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None,
              exact: bool = False) -> dict[int, RankProbe]:
        """Matched prompt tokens per rank: from the index, or (``exact``) from each live ledger's own books.

        Matched tokens count at each rank's own block size.
        """
        req = RouteRequest.of(tokens, self.config.tokens_per_block, cache_salt=cache_salt, lora_id=lora_id)
        live = self.engines.live()
        out = {}
        if exact:
            for r in live:
                try:
                    out[r] = RankProbe(self.engines.ledger(r, Capability.EXACT_PROBE).probe(req.tokens, lora_id,
                                                                                            cache_salt))
                except EngineCannotError:
                    continue
                except RankDiedError as e:
                    self._lost(e)
            return out
        matches = self._match(req)
        index = self.feed.index
        for r in dict.fromkeys([*live, *self.feed.foreign_engines()]):
            m = matches.get(r)
            size = index.block_size(r)
            out[r] = RankProbe(0, 0, 0) if m is None else RankProbe(m.matched_tokens, m.device_blocks * size,
                                                                     m.host_blocks * size)
        return out

    def route(self, tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
              lora_id: int | None = None, model: str | None = None) -> RouteDecision:
        """Where the policy would send this prompt now (nothing is sent or recorded)."""
        req = RouteRequest.of(tokens, self.config.tokens_per_block, max_tokens=max_tokens, cache_salt=cache_salt,
                              lora_id=lora_id)
        return self._decide(req, self.models.get(model), frozenset(), record=False)[0]

    def _match(self, req: RouteRequest) -> dict[int, PrefixMatch]:
        t0 = time.perf_counter()
        matches = self.feed.match(req.tokens, req.block_hashes, req.lora_id, req.cache_salt)
        self.tally.probed(time.perf_counter() - t0)
        return matches

    def _decide(self, req: RouteRequest, model: Model, exclude: frozenset[int], record: bool,
                only: int | None = None) -> tuple[RouteDecision, Dispatch | None]:
        """The policy's decision; with ``record`` (the request is then sent), a decision served where it is made,
        nothing computed or moved apart first, is dispatched there in the same hold of the lock, so that the next
        decision, though made at once on another thread, counts it (else concurrent requests herd onto the rank
        each saw idle). A split's or a migration's dispatch waits for its transfer (``None`` here)."""
        serving = set(model.ranks)
        engines = self.engines.live_engines()
        prefill_only = {*self.config.prefill_rank_ids, *self._vllm_prefill}
        up = [r for r in engines if r not in exclude and r in serving]
        live = [r for r in up if r not in prefill_only and only in (None, r)]
        prefill = [r for r in up if r in prefill_only] if only is None else []
        if not live and only is not None:
            raise UnknownResponseError(f"the previous response was kept by rank {only}, which is gone (it died or "
                                       "left), and its responses with it; start the conversation again")
        if not live:
            raise NoLiveRankError(f"no live rank serves {model.name}"
                                  + (f" (ranks {sorted(exclude)} died)" if exclude else ""))
        matches = self._match(req)
        fixed = [r for r in (*live, *prefill) if not engines[r].info().can(Capability.MIGRATION)]
        links = {r: link for r in (*live, *prefill) if (link := self._link(r)) is not None} if prefill else {}
        with self._lock:
            blocks = {r: (load.device_blocks_used, load.device_blocks) for r, load in self._loads.items()}
            # every engine's own count (clients no replica saw), less what ended since it was asked
            reported = {r: ReportedQueue(load.queued_requests, load.running_requests, load.queued_prefill_tokens)
                        .less(self.account.ended(r).since(self._asked[r])) for r, load in self._loads.items()}
            onboard = {r: load.onboard_s_per_block for r, load in self._loads.items()}
            decision = self.step.decide(req, matches, live, blocks, self.clock(), record, reported, fixed,
                                        self.sessions.blocks_by_rank(), self.rates.prefill(), onboard, prefill, links)
            if not record or decision.split is not None or decision.migrate_from is not None:
                return decision, None
            return decision, self._count(req, decision.rank, self._predicted(req, decision, 0))

    # ------------------------------------------------------------------ serving

    def complete(self, prompt_tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
                 lora_id: int | None = None, priority: int | None = None, model: str | None = None,
                 fields: dict | None = None, chat: bool = False, n: int = 1, responses: bool = False,
                 rank: int | None = None, caller: Caller = OPEN, session: str | None = None) -> CompletionResult:
        """Route, migrate a prefix if the decision says so, serve; decide again if the engine is lost.

        ``fields``: the client's other OpenAI fields (sampling, stop strings, log-probabilities; with ``chat``,
        its ``messages``; with ``responses``, a Responses request's body), which the engine honours or refuses by
        name. ``n`` choices are one generation, routed once. Bad input raises ``ValueError``/``TypeError`` before
        anything is sent;
        ``UnknownModelError`` for a model nobody serves; ``NoLiveRankError`` when no engine is left to serve it;
        ``EngineRefusedError`` when the engine refuses it; ``OverloadedError`` (nothing sent, or nothing kept)
        when there is no room for it now: the router's queue is full (``RouterConfig.max_queued_completions``),
        or the engine's. ``caller``: whose request it is, for its tenant's share and limits at admission
        (``router.admission``). ``session``: the agent session it is a turn of (``router.sessions``): weighed by
        the policy, its blocks kept at ``RouterConfig.session_priority`` unless ``priority`` says otherwise.
        ``rank``: the one rank that may serve it (the engine keeping the response a Responses follow-up continues;
        ``UnknownResponseError`` once that rank is gone).
        """
        m, req, job = self._job(prompt_tokens, max_tokens, cache_salt, lora_id, priority, model, fields, chat, n,
                                responses, session)
        held = self._hold(caller, job)
        try:
            return self._serve(req, job, m, None, rank, session)
        except OverloadedError:
            self.admission.shed(caller)
            raise
        finally:
            held.release()

    def stream(self, prompt_tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
               lora_id: int | None = None, priority: int | None = None, model: str | None = None,
               fields: dict | None = None, chat: bool = False, n: int = 1, responses: bool = False,
               rank: int | None = None, caller: Caller = OPEN, session: str | None = None) -> Streamed:
        """``complete``, streamed: it returns once the engine's first chunk is in (an engine lost before that is
        decided around); one lost later ends the stream with an error chunk. The admission slot is held until
        the stream ends."""
        m, req, job = self._job(prompt_tokens, max_tokens, cache_salt, lora_id, priority, model, fields, chat, n,
                                responses, session)
        held = self._hold(caller, job)
        try:
            return self._serve(req, job, m, held, rank, session)
        except BaseException as e:
            if isinstance(e, OverloadedError):
                self.admission.shed(caller)
            held.release()
            raise

    def _job(self, prompt_tokens: Sequence[int], max_tokens: int, cache_salt: str | None, lora_id: int | None,
             priority: int | None, model: str | None, fields: dict | None, chat: bool, n: int,
             responses: bool, session: str | None) -> tuple[Model, RouteRequest, Generation]:
        """The request's model (looked up once for all its routing) and the request checked against that model's
        engines before anything is sent; a session's turn knows where its session lives, and keeps its blocks at
        the session priority for the session's TTL."""
        if type(max_tokens) is not int or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        if type(n) is not int or not 1 <= n <= MAX_N:
            raise ValueError(f"n must be an int in 1..{MAX_N}, got {n!r}")
        m = self.models.get(model)
        req = RouteRequest.of(prompt_tokens, self.config.tokens_per_block, max_tokens=max_tokens,
                              cache_salt=cache_salt, lora_id=lora_id)
        priority_s = None
        if session is not None:
            req = dataclasses.replace(req, session=self.sessions.at(session, req))
            if priority is None:
                priority, priority_s = self.config.session_priority, self.config.session_ttl_s
        job = Generation(next(self._request_ids), list(req.tokens), max_tokens, n, dict(fields or {}), chat,
                         responses, cache_salt, lora_id, priority, priority_s)
        m.check(job)
        return m, req, job

    def _hold(self, caller: Caller, job: Generation) -> Held:
        """A generation's admission slot, at its cost (prompt tokens + ``n * max_tokens``); ``OverloadedError``
        (the request shed) when the router is full or the caller's tenant is over its limits."""
        try:
            return self.admission.hold(caller, job.priority, len(job.tokens) + job.n * job.max_tokens)
        except AdmissionRefused as e:
            self.tally.shed()
            raise OverloadedError(f"{e}; retry shortly", e.retry_after_s) from e

    def _serve(self, req: RouteRequest, job: Generation, model: Model, stream: Held | None,
               only: int | None, session: str | None) -> CompletionResult | Streamed:
        """The one retry loop: decide (on rank ``only`` alone when given), migrate, dispatch; whole, or (holding
        ``stream``'s slot) streamed."""
        died: set[int] = set()
        try:
            while True:
                placed = self._place(req, job, model, died, only)
                if placed is None:
                    continue
                decision, migrated, job = placed.decision, placed.migrated, placed.job or job
                rank = decision.rank
                predicted = self._predicted(req, decision, migrated)
                dispatch = placed.dispatch if placed.dispatch is not None else self._dispatch(req, rank, predicted)
                try:
                    engine = self.engines.engine(rank)
                    t0 = time.perf_counter()
                    if stream is not None:
                        chunks = engine.stream(job)
                        first = next(chunks)
                        first_s = time.perf_counter() - t0
                        self._prefilled(dispatch)
                    else:
                        got = engine.generate(job)
                except RankDiedError as e:
                    self._finished(dispatch)
                    self._died(e, died)
                    continue
                except (OutOfBlocksError, RankBusyError) as e:   # it fits the engine (Models.check) but not now
                    self._finished(dispatch)
                    raise OverloadedError(f"rank {rank} has no room for the request now ({e}); retry shortly") from e
                except BaseException:
                    self._finished(dispatch)
                    raise
                if stream is not None:
                    return self._relay(rank, predicted, migrated, req, job.n, dispatch, first, chunks, stream,
                                       session, t0, first_s)
                self._finished(dispatch)
                self._observe(rank, len(req.tokens), got.answer, got.cached_tokens, None, t0)
                if session is not None:
                    self._session_served(session, rank, req, job.n, got.answer, got.cached_tokens,
                                         waits_on_tool(got.answer))
                return self._result(job, got, rank, model.name, decision, predicted, migrated, len(died),
                                    placed.phases(got.token_times_s))
        except OverloadedError:
            self.tally.shed()
            raise

    def _predicted(self, req: RouteRequest, decision: RouteDecision, migrated: int) -> int:
        """The prompt tokens the decision's rank holds once ``migrated`` blocks are moved there (all but the
        last, at most)."""
        rank = decision.rank
        return min(self._held(req, rank, decision) + migrated * self.feed.index.block_size(rank), len(req.tokens) - 1)

    @staticmethod
    def _held(req: RouteRequest, rank: int, decision: RouteDecision) -> int:
        """What ``rank`` holds of the prompt: the index's match, or, on the rank of the request's session, the
        last turn's prompt it starts with, when the index has not caught up with that turn's events yet (an
        engine publishes them after it answers, and an agent's next turn may come first)."""
        matched = decision.matched_tokens.get(rank, 0)
        session = req.session
        return max(matched, session.held_tokens) if session is not None and session.rank == rank else matched

    def _result(self, job: Generation, got: Generated, rank: int, name: str, decision: RouteDecision,
                predicted: int, migrated: int, retries: int, phases: Phases) -> CompletionResult:
        prompt = len(job.tokens)
        self.tally.served(rank, prompt, predicted, got.cached_tokens, migrated)
        return CompletionResult(job.request_id, rank, got.output_tokens, prompt, got.cached_tokens,
                                prompt - got.cached_tokens, got.onboarded_blocks, migrated, decision, retries,
                                predicted, name, got.answer, phases)

    def _relay(self, rank: int, predicted: int, migrated: int, req: RouteRequest, n: int, dispatch: Dispatch,
               first: dict | str, chunks: Iterator[dict | str], held: Held, session: str | None,
               t0: float, first_s: float) -> Streamed:
        """The stream's chunks; its admission slot is given back when it ends (or when it is dropped unstarted).
        ``t0``: when it was sent, ``first_s`` after it the first chunk came (the engine's speed is learned from
        them and the stream's end)."""
        cached, usage, tool = 0, {}, False
        try:
            for ev in itertools.chain((first,), chunks):
                if isinstance(ev, dict):
                    tool = tool or (session is not None and waits_on_tool(ev))
                    if ev.get("usage"):
                        usage, cached = ev, cached_tokens_of(ev)
                    elif ev.get("type") == "response.completed":   # a Responses stream's end: it sends no [DONE]
                        usage, cached = ev.get("response") or {}, cached_tokens_of(ev)
                        if session is not None:
                            self._session_served(session, rank, req, n, usage, cached, tool)
                elif ev == "[DONE]" and session is not None:   # before the client sees the end: its next turn
                    self._session_served(session, rank, req, n, usage, cached, tool)   # finds the session
                yield rank, predicted, ev
        except RankDiedError as e:
            self._lost(e)
            yield rank, predicted, {"error": {"message": f"rank {rank} died while streaming: {e}",
                                              "type": "engine_died"}}
        finally:
            self._finished(dispatch)
            held.release()
        self.tally.served(rank, len(req.tokens), predicted, cached, migrated)
        self._observe(rank, len(req.tokens), usage, cached, first_s, t0)

    def _observe(self, rank: int, prompt: int, answer: dict, cached: int, first_s: float | None,
                 sent_at: float) -> None:
        """An answer from ``rank``, sent at ``sent_at`` (``time.perf_counter``), ending now: what it computed and
        decoded, and how long it took (its first token ``first_s`` after its sending, where known)."""
        usage = answer.get("usage") or answer
        output = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        self.rates.observe(rank, prompt - cached, output, first_s, time.perf_counter() - sent_at, sent_at)

    def _session_served(self, session: str, rank: int, req: RouteRequest, n: int, answer: dict, cached: int,
                        tool: bool) -> None:
        """A session's turn was served on ``rank``: the full blocks of its prompt and (one choice's) answer there
        are what it left for its next turn."""
        usage = answer.get("usage") or {}
        output = int(usage.get("completion_tokens") or usage.get("output_tokens") or 0) // n
        blocks = (len(req.tokens) + output) // self.feed.index.block_size(rank)
        self.sessions.served(session, rank, req, blocks, cached, tool)

    def _place(self, req: RouteRequest, job: Generation, model: Model, died: set[int],
               only: int | None) -> Placement | None:
        """Decide, and prefill apart or migrate the prefix if the decision says so; ``None``: a rank died, decide
        again."""
        if len(died) > self.config.max_retries:
            raise NoLiveRankError(f"ranks {sorted(died)} died serving the request")
        decision, dispatch = self._decide(req, model, frozenset(died), record=True, only=only)
        if decision.split is not None and decision.split.prefill_rank in self._vllm_prefill:
            return self._prefill_on_server(req, job, decision)
        if decision.split is not None:
            return self._prefill_apart(req, job, decision, died)
        if decision.migrate_from is None:
            return Placement(decision, dispatch=dispatch)
        try:
            moved, seconds = self._move(req, decision.migrate_from, decision.rank)
        except RankDiedError as e:
            self._lost(e)
            died.add(e.rank)
            return None
        except Exception:  # a failed transfer costs a recompute, never the request
            logger.exception("migration %d -> %d failed; rank %d computes the prefix instead",
                             decision.migrate_from, decision.rank, decision.rank)
            return Placement(decision)
        return Placement(decision, moved, transfer_s=seconds)

    def _move(self, req: RouteRequest, src: int, dst: int) -> tuple[int, float]:
        """Migrate the whole prefix of the prompt ``src`` holds to ``dst`` (which shares what it has, receives the
        rest); the blocks sent and the seconds it took, which the router's transfer fit learns."""
        t0 = time.perf_counter()
        moved = self.engines.migrate(req.tokens, src, dst, None, req.lora_id, req.cache_salt)
        seconds = time.perf_counter() - t0
        self.transfers.observe(moved, seconds)
        return moved, seconds

    def _prefill(self, req: RouteRequest, decision: RouteDecision, prefill: Generation) -> tuple[dict, float] | None:
        """``prefill`` (a split's first request) run on the decision's prefill rank: its answer and seconds, learned
        as the rank's speed; ``None`` when the rank is lost, full or failing (the request is then served whole).
        A refusal of the request itself is raised: the decode rank would refuse it as well."""
        p = decision.split.prefill_rank
        dispatch = self._dispatch(dataclasses.replace(req, max_tokens=prefill.max_tokens), p,
                                  decision.matched_tokens.get(p, 0))
        t0 = time.perf_counter()
        try:
            got = self.engines.engine(p).generate(prefill)
        except RankDiedError as e:
            self._lost(e)
            return None
        except (OutOfBlocksError, RankBusyError, EngineRefusedError) as e:
            if isinstance(e, EngineRefusedError) and e.status < 500:
                raise
            logger.info("prefill rank %d cannot take the request now (%s); rank %d serves it whole", p, e,
                        decision.split.whole_rank)
            return None
        finally:
            self._finished(dispatch)
        seconds = time.perf_counter() - t0
        self._observe(p, len(req.tokens), got.answer, got.cached_tokens, None, t0)
        return got.answer, seconds

    def _prefill_apart(self, req: RouteRequest, job: Generation, decision: RouteDecision,
                       died: set[int]) -> Placement | None:
        """A split: the prompt computed on the prefill rank (its blocks stored there), its full blocks moved to
        the decode rank, which allocates them before any byte moves and stores them once written: its most
        recently used blocks, the last its LRU evicts, which the decode request sent next reuses. They are not
        pinned beyond: a pinned prefix whose request waits behind a queue head that needs those blocks stalls
        the rank's FCFS queue (measured: requests timed out on the docs trace). Whatever fails costs a
        recompute, never the request: a prefill rank that is full or dies leaves the request whole (on the
        policy's rank, or the decode rank once the prompt is computed); a decode rank that dies has it decided
        again."""
        p, d = decision.split.prefill_rank, decision.rank
        prefilled = self._prefill(req, decision, dataclasses.replace(
            job, request_id=job.request_id + job.n, max_tokens=0, n=1, fields={}, chat=False, responses=False))
        if prefilled is None:
            return Placement(dataclasses.replace(decision, rank=decision.split.whole_rank, split=None))
        try:
            moved, transfer_s = self._move(req, p, d)
        except RankDiedError as e:
            self._lost(e)
            if e.rank == d:
                died.add(d)
                return None
            return Placement(dataclasses.replace(decision, split=None))
        except Exception:
            logger.exception("transfer %d -> %d failed; rank %d computes the prompt instead", p, d, d)
            return Placement(dataclasses.replace(decision, split=None))
        return Placement(decision, moved, p, prefilled[1], transfer_s)

    def _prefill_on_server(self, req: RouteRequest, job: Generation, decision: RouteDecision) -> Placement:
        """A split across vLLM servers (``router.kv_connector``): the request with one output token and
        ``kv_transfer_params`` to the prefill server, then the decode server is sent it with the parameters the
        prefill answered. The prefill is sent as the client's request is (a chat as its messages), so both servers
        render the same prompt. A Responses request is served whole (its prefill would be stored as a response
        of its own); so is one whose prefill server is lost or full. The decode server's connector takes the
        prompt's full blocks, as far as the index knows it lacks them."""
        p, d = decision.split.prefill_rank, decision.rank
        prefilled = None if job.responses else self._prefill(req, decision, dataclasses.replace(
            job, request_id=job.request_id + job.n, max_tokens=1, n=1, fields=prefill_fields(job.fields)))
        if prefilled is None:
            return Placement(dataclasses.replace(decision, rank=decision.split.whole_rank, split=None))
        answer, prefill_s = prefilled
        size = self.feed.index.block_size(d)
        handed = max(0, (len(req.tokens) - 1) // size - decision.matched_tokens.get(d, 0) // size)
        return Placement(decision, handed, p, prefill_s,
                         job=dataclasses.replace(job, fields=decode_fields(job.fields, answer)))

    def _dispatch(self, req: RouteRequest, rank: int, predicted: int) -> Dispatch:
        with self._lock:
            return self._count(req, rank, predicted)

    def _count(self, req: RouteRequest, rank: int, predicted: int) -> Dispatch:
        """``req`` dispatched to ``rank``, which holds ``predicted`` of its tokens, in the load account (under the
        lock)."""
        tpb = self.feed.index.block_size(rank)
        d = self.account.dispatch(rank, len(req.tokens) - predicted, -(-(len(req.tokens) + req.max_tokens) // tpb),
                                  req.block_hashes if tpb == req.tokens_per_block else ())
        self._tell("dispatched", d)
        return d

    def _prefilled(self, dispatch: Dispatch) -> None:
        """A stream's first chunk is in: its prompt is computed, so it stops counting as prefill queued on its rank
        (the policies' load) and runs there, decoding."""
        with self._lock:
            self.account.prefilled(dispatch)

    def _finished(self, dispatch: Dispatch) -> None:
        with self._lock:
            self.account.finished(dispatch)
            self._tell("finished", dispatch)

    def _tell(self, kind: DispatchKind, d: Dispatch) -> None:
        if self._listener is not None:
            self._listener(DispatchEvent(kind, d.id, d.rank, d.prefill_tokens, d.blocks))

    # ------------------------------------------------------------------ router replicas

    def listen(self, listener: DispatchListener) -> None:
        """Tell ``listener`` of every dispatch from now on and of its finish (the replicas' ``ReplicaSync``)."""
        with self._lock:
            self._listener = listener

    def peer_events(self, peer: str, events: Sequence[DispatchEvent], reset: bool) -> None:
        """Router replica ``peer``'s dispatches and finishes, in its order; ``reset``: ``events`` are all it has
        open, in place of what this router held of it."""
        with self._lock:
            self.account.peer_events(peer, events, reset)

    def drop_peer(self, peer: str) -> None:
        """Router replica ``peer`` is gone: its dispatches no longer count."""
        with self._lock:
            self.account.drop_peer(peer)

    def _lost(self, e: RankDiedError) -> None:
        """``e.rank`` is gone: out of the live engines until a health round sees it back, out of the index now."""
        self.engines.mark_down(e.rank)
        self.feed.lost(e)

    def _died(self, e: RankDiedError, died: set[int]) -> None:
        self._lost(e)
        died.add(e.rank)
        self.tally.retried()

    # ------------------------------------------------------------------ loads and reports

    def refresh_loads(self, force: bool = False) -> None:
        """Ask every live engine for its load (at most every ``load_refresh_s``): one call each. A ledger that
        published batches the index has not seen is asked for them (``EventFeed.close_gap``)."""
        now = self.clock()
        if not force and now - self._loads_at < self.config.load_refresh_s:
            return
        self._loads_at = now
        loads: dict[int, tuple[Engine, RankLoad]] = {}
        engines = self.engines.live_engines()
        with self._lock:
            asked = {r: self.account.ended(r) for r in engines}
        for r, engine in engines.items():
            try:
                load = engine.load()
            except RankDiedError as e:
                self._lost(e)
                continue
            if not load.ready:
                self._lost(RankDiedError(r, "it has no ledger"))
                continue
            loads[r] = engine, load
        with self._lock:
            self._loads.update({r: load for r, (_, load) in loads.items()})
            self._asked.update({r: asked[r] for r in loads})
        for r, (engine, load) in loads.items():
            if engine.info().can(Capability.EVENT_REPLAY):
                self.feed.close_gap(r, load.published_batches)

    def report(self, refresh: bool = True) -> ClusterReport:
        """The cluster as the router sees it: per live rank its blocks, hit rate, events and load; totals."""
        if refresh:
            self.refresh_loads()
        live = self.engines.live()
        with self._lock:
            loads = dict(self._loads)
            inflight = {r: self.account.inflight(r) for r in live}
        return cluster_report(self.policy.name, self.config.tokens_per_block, live, self.engines, self.feed,
                              loads, inflight, self.tally, self.admission.tenants(), self.sessions.stats(),
                              self.rates, self._vllm_prefill)

    def close(self) -> None:
        self.feed.close()
        self.engines.close()


__all__ = ["RouterService"]
