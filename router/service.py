"""The router as one plain, thread-safe object: events in, decisions and completions out.

``RouterService`` puts three parts together over one ``RankSet`` of
kvledger's own ranks and real vLLM servers (``router.vllm_ranks``): the event feed
(``router.feed.EventFeed``: the global index fed by each rank's numbered
batches, with replays, snapshots and foreign engines), the routing step
(``router.routing.RouteStep`` over the router's ``LoadAccount`` of what it
dispatched, and the ranks' own block reports), and serving with retry and its
counters; ``report`` sums it all up as a typed ``ClusterReport``. It reaches
ranks only through a ``RankSet`` of typed ``RankClient``s; it knows nothing of
Ray or HTTP, so the same object runs in tests over in-process ranks and in the
router actor over the cluster.

Each rank serves one model: kvledger's own ranks the reference model
(``OWN_MODEL``), each vLLM server the model it reports. A request names its
model (none: the first listed), is tokenized the way that model's engines
tokenize, and is routed among the live ranks serving it. For every completion
the router keeps what its index predicted (cached prompt tokens on the chosen
rank) next to what the rank delivered, the routing accuracy no peer reports.

Locks: ``_lock`` guards the accounting and the policy, and is never held
across a call to a rank; the feed has its own (``EventFeed.lock``).
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvledger.router.admission import AdmissionGate, AdmissionRefused, Held
from kvledger.router.chat import render_plain
from kvledger.router.config import RouterConfig
from kvledger.router.feed import EventFeed
from kvledger.router.numbering import SequencedIndex
from kvledger.router.load import LoadAccount, ReportedQueue
from kvledger.router.openai_types import ParamError
from kvledger.router.policies import NoLiveRankError, RouteDecision, RouteRequest, RoutingPolicy
from kvledger.router.probe import PrefixMatch
from kvledger.router.prompt_tokenizer import ByteTokenizer, PromptTokenizer
from kvledger.router.rank_client import RankDiedError, RankSet
from kvledger.router.report import ClusterReport, ForeignReport, RankReport, RouterTotals, TierBlocks
from kvledger.router.routing import RouteStep
from kvledger.router.stats import GAP_BUCKETS_TOKENS, Histogram
from kvledger.router.vllm_ranks import JoinedRanks, VllmEngine, cached_tokens_of
from kvledger.router.vllm_server import CHAT_COMPLETIONS, COMPLETIONS, EngineUnreachableError
from kvledger.worker.engine.tokenizer import VOCAB_SIZE
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.messages import RankBusyError, RankLoad
from kvledger.worker.wire.request import GREEDY, Request, RetentionConfig, Sampling, TokenRange

logger = logging.getLogger(__name__)

#: The model kvledger's own ranks serve (the reference engine).
OWN_MODEL = "kvledger-reference"


class UnknownModelError(LookupError):
    """A request named a model no rank serves."""


class OverloadedError(RuntimeError):
    """No room for the request now (HTTP 429 with ``Retry-After``); it was not served and may be sent again."""

    retry_after_s = 1


class EngineRefusedError(ValueError):
    """A vLLM server answered a completion with an error: its status and body go back as they are."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body

    def __str__(self) -> str:
        return f"the engine answered {self.status}: {self.body}"


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """One served request: where it ran, what the cache supplied, what it produced."""

    request_id: int
    rank: int
    output_tokens: list[int]
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV the rank reused (the ledger's own count, not the router's estimate)."""
    computed_tokens: int
    onboarded_blocks: int
    migrated_blocks: int
    """Blocks pulled from ``decision.migrate_from`` before serving."""
    decision: RouteDecision
    retries: int
    """Ranks that died with this request before one served it."""
    predicted_cached_tokens: int
    """What the index promised the chosen rank held (plus what was migrated to it)."""
    model: str
    engine_answer: dict | None = None
    """A vLLM server's own JSON answer, when one served it."""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(frozen=True, slots=True)
class RankProbe:
    """How much of a prompt one rank holds; the tier split is known only to the index (``exact=False``)."""

    matched_tokens: int
    device_tokens: int | None = None
    host_tokens: int | None = None


@dataclass(slots=True)
class _RankCounters:
    """What the router routed to one rank and what came back."""

    decisions: int = 0
    completions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    predicted_tokens: int = 0


@dataclass(slots=True)
class ServiceStats:
    completions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    migrations: int = 0
    migrated_blocks: int = 0
    retries: int = 0
    predicted_tokens: int = 0
    """Cached tokens the index predicted, summed over completions (``cached_tokens`` is what was delivered)."""
    probe_latency: Histogram = field(default_factory=Histogram)
    cached_gap: Histogram = field(default_factory=lambda: Histogram(GAP_BUCKETS_TOKENS))
    """Delivered minus predicted cached tokens, per completion."""
    shed: int = 0
    """Completions refused for want of room (HTTP 429): the router's queue or a rank's was full."""


def retention_for(priority: int | None) -> RetentionConfig | None:
    """The whole prompt and its decoded blocks at ``priority`` (``None``: the ledger's default)."""
    if priority is None:
        return None
    return RetentionConfig(ranges=(TokenRange(0, None, priority),), decode_priority=priority)


class RouterService:
    """See the module docstring."""

    def __init__(self, ranks: RankSet | None, config: RouterConfig = RouterConfig(),
                 policy: RoutingPolicy | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = JoinedRanks(ranks)
        self.config = config
        self.clock = clock
        self.policy = policy if policy is not None else config.make_policy()
        self.feed = EventFeed(self.ranks, config.tokens_per_block, config.event_log_size, config.rate_window_s,
                              clock, on_removed=self._forget)
        self.account = LoadAccount()
        self.admission = AdmissionGate(config.max_inflight_completions, config.max_queued_completions,
                                       config.queue_timeout_s)
        self.step = RouteStep(self.policy, self.account)
        self.stats = ServiceStats()
        self._lock = threading.Lock()
        self._loads: dict[int, RankLoad] = {}
        self._loads_at = float("-inf")
        self._counters: dict[int, _RankCounters] = {}
        self._request_ids = itertools.count(1)
        self._own_tokenizer = ByteTokenizer()
        try:
            for url in config.vllm:
                self.add_vllm(url)
        except BaseException:
            self.close()
            raise

    def add_vllm(self, url: str) -> int:
        """Route to the vLLM server at ``url`` too: ask it what it serves, subscribe to its events; its rank."""
        if url in self.feed.foreign_engines().values():
            raise ValueError(f"vLLM server {url} is already a rank")
        engine = VllmEngine.connect(self.feed.next_foreign_rank(), url, self.config.tokenizer,
                                    self.config.engine_timeout_s)
        src = engine.info.events
        if src is None:
            engine.close()
            raise ValueError(f"vLLM server {url} publishes no KV events; start it with --enable-prefix-caching and "
                             "--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", ...}'")
        rank = self.feed.attach_vllm(src.endpoint, src.replay_endpoint, src.topic, bind=src.bind,
                                     block_size=engine.info.block_size, name=url, routed=True)
        assert rank == engine.rank, "engines are attached one at a time"
        self.ranks.add(engine)
        logger.info("vLLM server %s (model %s, %s tokens per block, tokenizer %s) is rank %d", url,
                    engine.info.model, engine.info.block_size, engine.tokenizer.name, rank)
        return rank

    def check_health(self) -> list[int]:
        """One health round over own ranks and vLLM servers, then the index follows (``EventFeed.sync``).

        A server that answers again is asked anew where it publishes (a restarted one may have moved), and
        its events are resynced. Returns the ranks that came back.
        """
        back = self.ranks.check_health()
        for rank in back:
            engine = self.ranks.engine(rank)
            if engine is None:
                continue
            try:
                engine.info = engine.server.discover()
            except (EngineUnreachableError, ValueError) as e:
                self.ranks.mark_down(rank)
                logger.warning("vLLM server %s answers /health but not discovery: %s", engine.server.url, e)
                continue
            src = engine.info.events
            if src is not None:
                self.feed.move_foreign(rank, src.endpoint, src.replay_endpoint, src.bind)
        self.feed.sync()
        return back

    # ------------------------------------------------------------------ models

    def models(self) -> dict[str, list[int]]:
        """Model -> the ranks serving it (live or not), own ranks' model first."""
        own = self.ranks.own
        out: dict[str, list[int]] = {OWN_MODEL: own.live()} if own is not None else {}
        for r, e in sorted(self.ranks.engines().items()):
            out.setdefault(e.info.model, []).append(r)
        return out

    def resolve_model(self, model: str | None) -> str:
        """The model a request names, or the first listed; ``UnknownModelError`` for one nobody serves."""
        models = self.models()
        if model is None:
            if not models:
                raise NoLiveRankError("no rank serves any model")
            return next(iter(models))
        if model not in models:
            raise UnknownModelError(f"model {model!r} is not served here; models: {sorted(models)}")
        return model

    def tokenizer(self, model: str) -> PromptTokenizer:
        """How text prompts for ``model`` are tokenized (the way its engines will)."""
        if model == OWN_MODEL and self.ranks.own is not None:
            return self._own_tokenizer
        for e in self.ranks.engines().values():
            if e.info.model == model:
                return e.tokenizer
        raise UnknownModelError(f"model {model!r} is not served here")

    def encode(self, prompt: str | Sequence[int], model: str | None = None) -> tuple[str, list[int]]:
        """The model a request goes to and its prompt as token ids (text tokenized once, for that model)."""
        name = self.resolve_model(model)
        return name, self.tokenizer(name).encode(prompt) if isinstance(prompt, str) else list(prompt)

    def encode_chat(self, messages: Sequence[dict], model: str | None = None) -> tuple[str, list[int]]:
        """The model a chat goes to and the tokens its engines will compute for it (``router.chat``)."""
        name = self.resolve_model(model)
        if name == OWN_MODEL and self.ranks.own is not None:
            return name, self._own_tokenizer.encode(render_plain(messages))
        engine = next(e for e in self.ranks.engines().values() if e.info.model == name)
        if engine.chat_template is None:
            raise ParamError("messages", f"model {name!r} has no chat template (none in its tokenizer_config.json "
                                         f"at {engine.info.model_root}); use /v1/completions")
        return name, engine.tokenizer.encode(engine.chat_template.render(messages), add_special_tokens=False)

    def check_fits(self, model: str, prompt_len: int, max_tokens: int) -> None:
        """A prompt no rank of ``model`` could ever hold is bad input (``ParamError`` with the numbers), not a
        request to queue: longer than a vLLM server's maximum length, or than the largest own rank's pool."""
        need = prompt_len + max_tokens
        if model != OWN_MODEL:
            limits = [e.info.max_model_len for e in self.ranks.engines().values()
                      if e.info.model == model and e.info.max_model_len]
            if limits and need > max(limits):
                raise ParamError("prompt", f"this model's maximum context length is {max(limits)} tokens; the "
                                           f"request needs {need} ({prompt_len} in the prompt, {max_tokens} to "
                                           "generate)")
            return
        tpb = self.config.tokens_per_block
        pools = self._own_pools()
        blocks = -(-need // tpb)
        if pools and blocks > max(pools):
            raise ParamError("prompt", f"{prompt_len} prompt tokens and max_tokens {max_tokens} need {blocks} blocks "
                                       f"of {tpb} tokens; the largest rank's pool holds {max(pools)}")

    def _serving(self, model: str) -> set[int]:
        own = self.ranks.own
        if model == OWN_MODEL and own is not None:
            return set(own.live())
        return {r for r, e in self.ranks.engines().items() if e.info.model == model}
    @property
    def index(self) -> SequencedIndex:
        """The feed's ``SequencedIndex`` (read it under ``feed.lock``)."""
        return self.feed.index

    def _forget(self, rank: int) -> None:
        """The feed dropped ``rank``: its load, what was dispatched to it and the policy's memory of it go."""
        with self._lock:
            self.account.forget(rank)
            self._loads.pop(rank, None)
            self.policy.on_rank_removed(rank)

    # ------------------------------------------------------------------ probing and routing

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None,
              exact: bool = False) -> dict[int, RankProbe]:
        """Matched prompt tokens per live rank: from the index, or (``exact``) from each rank's ledger.

        Foreign engines (vLLM servers, ``EventFeed.attach_vllm``) are in the index's answer only: they cannot be
        asked. Matched tokens count at each rank's own block size.
        """
        req = RouteRequest.of(tokens, self.config.tokens_per_block, cache_salt=cache_salt, lora_id=lora_id)
        live = self.ranks.live()
        if exact:
            out = {}
            for r in live:
                if self.ranks.engine(r) is not None:
                    continue
                try:
                    out[r] = RankProbe(self.ranks.client(r).probe(req.tokens, lora_id, cache_salt))
                except RankDiedError as e:
                    self._lost(e)
            return out
        matches = self._match(req)
        index = self.feed.index
        out = {}
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
        return self._decide(req, self.resolve_model(model), frozenset(), record=False)

    def _match(self, req: RouteRequest) -> dict[int, PrefixMatch]:
        t0 = time.perf_counter()
        matches = self.feed.match(req.tokens, req.block_hashes, req.lora_id, req.cache_salt)
        with self._lock:
            self.stats.probe_latency.observe(time.perf_counter() - t0)
        return matches

    def _decide(self, req: RouteRequest, model: str, exclude: frozenset[int], record: bool) -> RouteDecision:
        serving = self._serving(model)
        live = [r for r in self.ranks.live() if r not in exclude and r in serving]
        if not live:
            raise NoLiveRankError(f"no live rank serves {model}"
                                  + (f" (ranks {sorted(exclude)} died)" if exclude else ""))
        matches = self._match(req)
        engines = self.ranks.engines()
        with self._lock:
            blocks = {r: (load.device_blocks_used, load.device_blocks) for r, load in self._loads.items()}
            # every rank's own count (own ranks too: other router replicas dispatch to them)
            reported = {r: ReportedQueue(load.queued_requests, load.running_requests, load.queued_prefill_tokens)
                        for r, load in self._loads.items()}
            return self.step.decide(req, matches, live, blocks, self.clock(), record, reported, engines.keys())

    # ------------------------------------------------------------------ serving

    def complete(self, prompt_tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
                 lora_id: int | None = None, priority: int | None = None, model: str | None = None,
                 engine_fields: dict | None = None, chat: bool = False,
                 sampling: Sampling = GREEDY) -> CompletionResult:
        """Route, migrate a prefix if the decision says so, serve; retry elsewhere if the rank dies.

        ``sampling``: how an own rank chooses tokens (a vLLM server takes ``engine_fields`` instead).
        ``engine_fields``: more of the client's body for a vLLM server that serves it (sampling parameters;
        with ``chat``, its ``messages``, which go to the server's chat completions).
        Bad input raises ``ValueError``/``TypeError`` before anything is sent; ``UnknownModelError`` for a
        model nobody serves; ``NoLiveRankError`` when no rank is left to serve it; ``EngineRefusedError``
        when a vLLM server refuses it; ``OverloadedError`` (nothing sent, or nothing kept) when there is no
        room for it now: the router's queue is full (``RouterConfig.max_queued_completions``), or the rank's.
        """
        name, req = self._request(prompt_tokens, max_tokens, cache_salt, lora_id, model)
        request = Request(next(self._request_ids), list(req.tokens), max_tokens, lora_id, cache_salt,
                          retention=retention_for(priority), sampling=sampling)
        if name == OWN_MODEL:
            request.validate()
        held = self._hold()
        try:
            return self._complete(req, request, name, engine_fields, chat)
        except OverloadedError:
            self._shed()
            raise
        finally:
            held.release()

    def _hold(self) -> Held:
        """A completion's admission slot; ``OverloadedError`` (the request shed) when the router is full."""
        try:
            return self.admission.hold()
        except AdmissionRefused as e:
            self._shed()
            raise OverloadedError(f"{e}; retry shortly") from e

    def _shed(self) -> None:
        with self._lock:
            self.stats.shed += 1

    def _complete(self, req: RouteRequest, request: Request, name: str, engine_fields: dict | None,
                  chat: bool) -> CompletionResult:
        """``complete`` once it holds an admission slot."""
        died: set[int] = set()
        while True:
            decision, migrated = self._place(req, name, died)
            if decision is None:
                continue
            rank = decision.rank
            predicted = min(decision.matched_tokens.get(rank, 0) + migrated * self.config.tokens_per_block,
                            len(req.tokens) - 1)
            dispatch = self._dispatch(req, rank, predicted)
            engine = self.ranks.engine(rank)
            try:
                if engine is not None:
                    got = engine.complete(self._engine_body(req, engine_fields, chat),
                                          CHAT_COMPLETIONS if chat else COMPLETIONS)
                else:
                    reply = self.ranks.client(rank).serve([request], publish=True)
            except RankDiedError as e:
                self._died(e, died)
                continue
            except (OutOfBlocksError, RankBusyError) as e:   # it fits the pool (check_fits) but not now
                raise OverloadedError(f"rank {rank} has no room for the request now ({e}); retry shortly") from e
            finally:
                with self._lock:
                    self.account.finished(dispatch)
            if engine is not None:
                if got.status != 200:
                    raise EngineRefusedError(got.status, got.body)
                out_tokens = list(got.body["choices"][0].get("token_ids") or [])
                cached, onboarded, answer = got.cached_tokens, 0, got.body
            else:
                if reply.events is not None:   # what serving did is indexed before the answer leaves
                    self.feed.ingest(rank, reply.events.seq, reply.events.data)
                (out,) = reply.outcomes
                out_tokens, cached, onboarded, answer = out.output_tokens, out.cached_tokens, out.onboarded_blocks, None
            self._served(rank, len(req.tokens), predicted, cached, migrated)
            own = None if engine is not None else out
            return CompletionResult(request.request_id, rank, out_tokens, len(req.tokens), cached,
                                    len(req.tokens) - cached, onboarded, migrated, decision, len(died), predicted,
                                    name, answer, own and own.logprobs, own and own.top_logprobs)

    def stream(self, prompt_tokens: Sequence[int], max_tokens: int = 16, cache_salt: str | None = None,
               lora_id: int | None = None, model: str | None = None, engine_fields: dict | None = None,
               chat: bool = False) -> Iterator[tuple[int, int, dict | str]]:
        """A vLLM server's streamed completion, event by event: ``(rank, predicted, event)``, ``"[DONE]"`` last.

        The router asks the server for a usage event (to count what it delivered); a server that dies before
        its first event is retried elsewhere, one that dies later ends the stream with an error event.
        Own ranks answer whole (``complete``); the caller streams their answer as one event.
        """
        name, req = self._request(prompt_tokens, max_tokens, cache_salt, lora_id, model)
        path = CHAT_COMPLETIONS if chat else COMPLETIONS
        died: set[int] = set()
        held = self._hold()
        try:
            while True:
                decision, _ = self._place(req, name, died, migrate=False)
                if decision is None:
                    continue
                rank = decision.rank
                engine = self.ranks.engine(rank)
                if engine is None:
                    raise ValueError(f"rank {rank} is not a vLLM server; stream its answer with complete()")
                predicted = min(decision.matched_tokens.get(rank, 0), len(req.tokens) - 1)
                dispatch = self._dispatch(req, rank, predicted)
                body = {**self._engine_body(req, engine_fields, chat), "stream": True,
                        "stream_options": {"include_usage": True}}
                events = engine.stream(body, path)
                try:
                    first = next(events)
                except EngineUnreachableError as e:
                    with self._lock:
                        self.account.finished(dispatch)
                    self._died(RankDiedError(rank, str(e)), died)
                    continue
                return self._relay(rank, predicted, len(req.tokens), dispatch, first, events, held)
        except BaseException:
            held.release()
            raise

    def _relay(self, rank: int, predicted: int, prompt_len: int, dispatch, first: dict | str,
               events: Iterator[dict | str], held: Held) -> Iterator[tuple[int, int, dict | str]]:
        """The stream's events; its admission slot is given back when it ends (or when it is dropped unstarted)."""
        cached = 0
        try:
            for ev in itertools.chain((first,), events):
                if isinstance(ev, dict) and ev.get("usage"):
                    cached = cached_tokens_of(ev)
                yield rank, predicted, ev
        except EngineUnreachableError as e:
            self._lost(RankDiedError(rank, str(e)))
            yield rank, predicted, {"error": {"message": f"rank {rank} died while streaming: {e}",
                                              "type": "engine_died"}}
        finally:
            with self._lock:
                self.account.finished(dispatch)
            held.release()
        self._served(rank, prompt_len, predicted, cached, 0)

    def _request(self, prompt_tokens: Sequence[int], max_tokens: int, cache_salt: str | None,
                 lora_id: int | None, model: str | None) -> tuple[str, RouteRequest]:
        if type(max_tokens) is not int or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        name = self.resolve_model(model)
        req = RouteRequest.of(prompt_tokens, self.config.tokens_per_block, max_tokens=max_tokens,
                              cache_salt=cache_salt, lora_id=lora_id)
        if name == OWN_MODEL and max(req.tokens) >= VOCAB_SIZE:
            raise ParamError("prompt", f"token {max(req.tokens)} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
        self.check_fits(name, len(req.tokens), max_tokens)
        return name, req

    def _place(self, req: RouteRequest, model: str, died: set[int],
               migrate: bool = True) -> tuple[RouteDecision | None, int]:
        """Decide, and migrate the prefix if the decision says so; ``(None, 0)``: a rank died, decide again."""
        if len(died) > self.config.max_retries:
            raise NoLiveRankError(f"ranks {sorted(died)} died serving the request")
        decision = self._decide(req, model, frozenset(died), record=True)
        if decision.migrate_from is None or not migrate:
            return decision, 0
        try:
            # the whole prefix the source holds: the target shares what it has, receives the rest
            return decision, self.ranks.migrate(req.tokens, decision.migrate_from, decision.rank, None,
                                                req.lora_id, req.cache_salt)
        except RankDiedError as e:
            self._lost(e)
            died.add(e.rank)
            return None, 0
        except Exception:  # a failed transfer costs a recompute, never the request
            logger.exception("migration %d -> %d failed; rank %d computes the prefix instead",
                             decision.migrate_from, decision.rank, decision.rank)
            return decision, 0

    def _dispatch(self, req: RouteRequest, rank: int, predicted: int):
        tpb = self.feed.index.block_size(rank)
        with self._lock:
            return self.account.dispatch(rank, len(req.tokens) - predicted,
                                         -(-(len(req.tokens) + req.max_tokens) // tpb))

    def _lost(self, e: RankDiedError) -> None:
        """``e.rank`` is gone: out of the index now; a vLLM server stays out of the live ranks until its health
        check sees it back (own ranks' clients report themselves)."""
        if self.ranks.engine(e.rank) is not None:
            self.ranks.mark_down(e.rank)
        self.feed.lost(e)

    def _died(self, e: RankDiedError, died: set[int]) -> None:
        self._lost(e)
        died.add(e.rank)
        with self._lock:
            self.stats.retries += 1

    @staticmethod
    def _engine_body(req: RouteRequest, engine_fields: dict | None, chat: bool) -> dict:
        """What a vLLM server is sent: the client's fields, and the prompt as the token ids the router hashed
        (a chat keeps its messages: the server renders them as the router did)."""
        body = {**(engine_fields or {}), "max_tokens": req.max_tokens}
        if not chat:
            body["prompt"] = list(req.tokens)
        if req.cache_salt is not None:
            body["cache_salt"] = req.cache_salt
        return body

    def _served(self, rank: int, prompt_len: int, predicted: int, cached: int, migrated: int) -> None:
        with self._lock:
            s, c = self.stats, self._counter(rank)
            s.completions += 1
            s.prompt_tokens += prompt_len
            s.cached_tokens += cached
            s.predicted_tokens += predicted
            s.cached_gap.observe(cached - predicted)
            if migrated:
                s.migrations += 1
                s.migrated_blocks += migrated
            c.decisions += 1
            c.completions += 1
            c.prompt_tokens += prompt_len
            c.cached_tokens += cached
            c.predicted_tokens += predicted

    def _counter(self, rank: int) -> _RankCounters:
        c = self._counters.get(rank)
        if c is None:
            c = self._counters[rank] = _RankCounters()
        return c

    # ------------------------------------------------------------------ reports

    def _own_pools(self) -> list[int]:
        """Device blocks of each live own rank: from its last load report, asked for once when there is none."""
        own = self.ranks.own
        live = own.live() if own is not None else []
        with self._lock:
            missing = [r for r in live if r not in self._loads]
        for r in missing:
            try:
                load = own.client(r).load()
            except RankDiedError as e:
                self._lost(e)
                continue
            if load.ready:
                with self._lock:
                    self._loads.setdefault(r, load)
        with self._lock:
            return [self._loads[r].device_blocks for r in live if r in self._loads]

    def refresh_loads(self, force: bool = False) -> None:
        """Ask every live rank for its load report (at most every ``load_refresh_s``): one call per rank."""
        now = self.clock()
        if not force and now - self._loads_at < self.config.load_refresh_s:
            return
        self._loads_at = now
        loads = {}
        for r in self.ranks.live():
            try:
                load = self.ranks.client(r).load()
            except RankDiedError as e:
                self._lost(e)
                continue
            if not load.ready:
                self.ranks.mark_down(r)
                self._lost(RankDiedError(r, "it has no ledger"))
                continue
            loads[r] = load
        with self._lock:
            self._loads.update(loads)
        for r, load in loads.items():
            if self.ranks.engine(r) is None:
                self.feed.close_gap(r, load.published_batches)

    def report(self, refresh: bool = True) -> ClusterReport:
        """The cluster as the router sees it: per live rank its blocks, hit rate, events and load; totals."""
        if refresh:
            self.refresh_loads()
        live = self.ranks.live()
        feed, index = self.feed, self.feed.index
        events = {r: feed.counters(r) for r in live}
        foreign_engines = feed.foreign_engines()
        rejected = feed.rejections.by_rank()
        engines = self.ranks.engines()
        with feed.lock:
            held = {r: (index.num_blocks(r), index.next_seq(r), index.block_size(r))
                    for r in [*live, *foreign_engines]}
            ix, total_blocks = index.stats, index.num_blocks()
            applied, duplicate = ix.batches_applied, ix.batches_duplicate
            replays, snapshots = ix.replays_requested, ix.snapshots_loaded
        with self._lock:
            ranks = []
            for r in live:
                load = self._loads.get(r)
                c = self._counter(r)
                inflight, queued_tokens = self.account.inflight(r)
                events_total, events_per_s, batches = events[r]
                ranks.append(RankReport(
                    r, True, None if load is None else {
                        "GPU": TierBlocks(load.device_blocks_used, load.device_blocks_free),
                        "CPU": TierBlocks(load.host_blocks_used, load.host_blocks_free)},
                    None if load is None else load.cache_hit_rate, held[r][0], held[r][1], events_total,
                    events_per_s, batches, c.decisions, c.completions, c.prompt_tokens, c.cached_tokens, inflight,
                    queued_tokens, c.predicted_tokens, engines[r].info.model if r in engines else OWN_MODEL,
                    held[r][2], engines[r].server.url if r in engines else None, rejected.get(r, {})))
            s = self.stats
            totals = RouterTotals(s.completions, s.prompt_tokens, s.cached_tokens,
                                  s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0, s.migrations,
                                  s.migrated_blocks, s.retries, feed.ranks_removed, total_blocks, applied, duplicate,
                                  replays, snapshots, feed.log.next_id, s.predicted_tokens,
                                  s.cached_tokens / s.predicted_tokens if s.predicted_tokens else None,
                                  feed.rejections.total())
        live_set = set(live)
        foreign = [ForeignReport(r, name, *held[r][:2], r in live_set or r not in engines, held[r][2],
                                 rejected.get(r, {})) for r, name in foreign_engines.items()]
        return ClusterReport(self.policy.name, self.config.tokens_per_block, ranks, foreign, totals)

    def probe_latency(self) -> Histogram:
        """A copy of the probe latency histogram."""
        with self._lock:
            return _copy_hist(self.stats.probe_latency)

    def cached_gap(self) -> Histogram:
        """A copy of the histogram of delivered minus predicted cached tokens."""
        with self._lock:
            return _copy_hist(self.stats.cached_gap)

    def close(self) -> None:
        self.feed.close()
        self.ranks.close()


def _copy_hist(h: Histogram) -> Histogram:
    out = Histogram(h.bounds)
    out.counts = list(h.counts)
    out.sum, out.count = h.sum, h.count
    return out


__all__ = ["CompletionResult", "EngineRefusedError", "OWN_MODEL", "OverloadedError", "RankProbe", "RouterService",
           "ServiceStats", "UnknownModelError", "retention_for"]
