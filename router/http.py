"""The router's HTTP API (FastAPI): OpenAI-style completions, routing and probing, the event stream, metrics.

``make_app(service)`` builds the app over a ``RouterService``; ``HttpServer``
runs it with uvicorn in a background thread (the router actor, the tests), on
127.0.0.1 unless told otherwise. Request bodies are pydantic models, so a bad
request gets a 4xx naming the field and reaches nothing; errors the service
raises for bad input (``ValueError``) become 400, an unknown model 404, no live
rank 503, and a vLLM server's own refusal goes back with its status and body.

A completion a vLLM server serves comes back as the server's own answer (its
text, usage and ids), streamed event by event when asked, plus the
``kvledger`` block: the rank, the cached tokens the router predicted and the
ones the engine delivered. Metrics live in a registry of the app's own, filled at scrape time from
the service's counters (the service itself does not know Prometheus).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Annotated

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from kvledger.router.policies import NoLiveRankError
from kvledger.router.service import OWN_MODEL, CompletionResult, EngineRefusedError, RouterService, UnknownModelError
from kvledger.worker.engine.tokenizer import decode
from kvledger.worker.wire.errors import OutOfBlocksError

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000

TokenId = Annotated[StrictInt, Field(ge=0)]
Prompt = Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class CompletionBody(_Body):
    """``POST /v1/completions``: the OpenAI completions fields kvledger serves, plus its own three."""

    prompt: Prompt
    """Text (tokenized the way the model's engines tokenize, ``router.prompt_tokenizer``) or token ids."""
    max_tokens: Annotated[StrictInt, Field(ge=0, le=4096)] = 16
    model: str | None = None
    """A model of ``GET /v1/models`` (none: the first listed)."""
    stream: StrictBool = False
    """Server-sent events, as OpenAI streams them."""
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    lora_id: Annotated[StrictInt, Field(ge=0)] | None = None
    priority: Annotated[StrictInt, Field(ge=0, le=100)] | None = None
    """Retention priority of the prompt's and the output's blocks (``RetentionConfig``)."""
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    ignore_eos: StrictBool | None = None
    """vLLM's extension: generate ``max_tokens`` even past the end-of-sequence token (the reference engine
    always does)."""

    def sampling(self) -> dict:
        """The sampling parameters given, as a vLLM server is sent them."""
        return {k: v for k in SAMPLING if (v := getattr(self, k)) is not None}

    def check_greedy(self) -> None:
        """The reference engine decodes greedily: a sampling parameter it cannot honour is refused, by name."""
        for name, value in self.sampling().items():
            if not (name == "temperature" and value == 0 or name == "ignore_eos"):
                raise ValueError(f"{name}={value!r}: the {OWN_MODEL} ranks decode greedily; they honour only "
                                 "temperature 0 (vLLM servers take every sampling parameter)")


#: The sampling parameters a vLLM server gets as the client sent them.
SAMPLING = ("temperature", "top_p", "seed", "stop", "ignore_eos")


class RouteBody(_Body):
    """``POST /v1/route``: where the prompt would go, without sending it."""

    prompt: Prompt
    model: str | None = None
    max_tokens: Annotated[StrictInt, Field(ge=0, le=4096)] = 16
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    lora_id: Annotated[StrictInt, Field(ge=0)] | None = None


class ProbeBody(_Body):
    """``POST /v1/probe``: how much of the prompt each rank holds; ``exact`` asks the ranks' ledgers."""

    prompt: Prompt
    model: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    lora_id: Annotated[StrictInt, Field(ge=0)] | None = None
    exact: bool = False


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status)


class _ServiceCollector:
    """Prometheus families read from the service at scrape time."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        return []   # unchecked collector: families are known only when collected

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        report = svc.report(refresh=True)
        blocks = GaugeMetricFamily("kvledger_blocks", "KV blocks per rank, tier and state (used/free)",
                                   labels=["rank", "tier", "state"])
        hit = GaugeMetricFamily("kvledger_cache_hit_rate", "The ledger's reused / (reused + missed) blocks",
                                labels=["rank"])
        eps = GaugeMetricFamily("kvledger_events_per_second", "Block events indexed per second (sliding window)",
                                labels=["rank"])
        events = CounterMetricFamily("kvledger_events", "Block events indexed", labels=["rank"])
        decisions = CounterMetricFamily("kvledger_routing_decisions", "Requests routed and served, per rank",
                                        labels=["rank", "policy"])
        index_blocks = GaugeMetricFamily("kvledger_index_blocks", "Distinct block hashes the index holds per rank",
                                         labels=["rank"])
        inflight = GaugeMetricFamily("kvledger_inflight_requests", "Requests dispatched and not finished",
                                     labels=["rank"])
        predicted = CounterMetricFamily("kvledger_predicted_cached_tokens",
                                        "Cached prompt tokens the index predicted on the rank a request was routed to",
                                        labels=["rank"])
        delivered = CounterMetricFamily("kvledger_delivered_cached_tokens",
                                        "Cached prompt tokens the rank reported reusing (vLLM: usage.cached_tokens)",
                                        labels=["rank"])
        rejected = CounterMetricFamily("kvledger_events_rejected", "Events the index could not take, per reason",
                                       labels=["rank", "reason"])
        for r in report.ranks:
            rank = str(r.rank)
            if r.blocks is not None:
                for tier, counts in r.blocks.items():
                    blocks.add_metric([rank, tier, "used"], counts.used)
                    blocks.add_metric([rank, tier, "free"], counts.free)
            if r.cache_hit_rate is not None:
                hit.add_metric([rank], r.cache_hit_rate)
            eps.add_metric([rank], r.events_per_s)
            events.add_metric([rank], r.events_total)
            decisions.add_metric([rank, report.policy], r.decisions)
            index_blocks.add_metric([rank], r.index_blocks)
            inflight.add_metric([rank], r.inflight_requests)
            predicted.add_metric([rank], r.predicted_tokens)
            delivered.add_metric([rank], r.cached_tokens)
        for rank, reasons in svc.feed.rejections.by_rank().items():
            for reason, n in reasons.items():
                rejected.add_metric([str(rank), reason], n)
        yield from (blocks, hit, eps, events, decisions, index_blocks, inflight, predicted, delivered, rejected)
        t = report.router
        yield GaugeMetricFamily("kvledger_router_hit_rate", "Cached / prompt tokens over the router's completions",
                                value=t.hit_rate)
        for name, value, doc in (("kvledger_completions", t.completions, "Completions served"),
                                 ("kvledger_prompt_tokens", t.prompt_tokens, "Prompt tokens of served completions"),
                                 ("kvledger_cached_tokens", t.cached_tokens, "Prompt tokens served from cache"),
                                 ("kvledger_migrated_blocks", t.migrated_blocks, "Blocks pulled between ranks"),
                                 ("kvledger_request_retries", t.retries, "Requests re-sent after their rank died"),
                                 ("kvledger_rank_removals", t.ranks_removed, "Ranks dropped from the index"),
                                 ("kvledger_index_replays", t.replays, "Replays asked of ranks"),
                                 ("kvledger_index_snapshots", t.snapshots, "Snapshots loaded")):
            yield CounterMetricFamily(name, doc, value=value)
        h = svc.probe_latency()
        yield HistogramMetricFamily("kvledger_probe_latency_seconds", "Index probe latency",
                                    buckets=[("+Inf" if math.isinf(le) else repr(le), n) for le, n in h.cumulative()],
                                    sum_value=h.sum)
        g = svc.cached_gap()
        yield HistogramMetricFamily("kvledger_cached_tokens_gap", "Delivered minus predicted cached tokens per "
                                    "completion (negative: the index promised more than the rank reused)",
                                    buckets=[("+Inf" if math.isinf(le) else repr(float(le)), n)
                                             for le, n in g.cumulative()], sum_value=g.sum)


def make_app(service: RouterService) -> FastAPI:
    """The router's HTTP API over ``service`` (see DESIGN.md, "HTTP")."""
    app = FastAPI(title="kvledger router", version="0.1.0")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServiceCollector(service))
    app.state.service = service
    app.state.registry = registry

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, str(exc), "invalid_request_error")

    @app.exception_handler(NoLiveRankError)
    async def _no_rank(_: Request, exc: NoLiveRankError) -> JSONResponse:
        return _error(503, str(exc), "no_live_rank")

    @app.exception_handler(OutOfBlocksError)
    async def _no_blocks(_: Request, exc: OutOfBlocksError) -> JSONResponse:
        return _error(503, str(exc), "out_of_blocks")

    @app.exception_handler(UnknownModelError)
    async def _no_model(_: Request, exc: UnknownModelError) -> JSONResponse:
        return _error(404, str(exc.args[0]), "model_not_found")

    @app.exception_handler(EngineRefusedError)
    async def _refused(_: Request, exc: EngineRefusedError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.get("/v1/models")
    def models() -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": created, "owned_by": "kvledger" if m == OWN_MODEL else "vllm",
             "kvledger": {"ranks": ranks}} for m, ranks in service.models().items()]}

    @app.post("/v1/completions")
    def completions(body: CompletionBody) -> Response:
        model, tokens = service.encode(body.prompt, body.model)
        if model == OWN_MODEL:
            body.check_greedy()
        args = dict(max_tokens=body.max_tokens, cache_salt=body.cache_salt, lora_id=body.lora_id, model=model,
                    engine_fields=body.sampling())
        usage = body.stream_options is not None and body.stream_options.include_usage
        if body.stream and model != OWN_MODEL:
            events = service.stream(tokens, **args)
            return StreamingResponse(_relay(events, usage), media_type="text/event-stream")
        res = service.complete(tokens, priority=body.priority, **args)
        answer = res.engine_answer if res.engine_answer is not None else _own_answer(res)
        answer = {**answer, "kvledger": _kvledger_block(res)}
        if body.stream:   # own ranks answer whole: one chunk, then usage when asked
            return StreamingResponse(_own_stream(answer, usage), media_type="text/event-stream")
        return JSONResponse(answer)

    @app.post("/v1/route")
    def route(body: RouteBody) -> dict:
        model, tokens = service.encode(body.prompt, body.model)
        d = service.route(tokens, max_tokens=body.max_tokens, cache_salt=body.cache_salt, lora_id=body.lora_id,
                          model=model)
        ranks = sorted(set(d.scores) | set(d.matched_tokens))
        return {"rank": d.rank, "policy": d.policy, "lower_is_better": d.lower_is_better,
                "migrate_from": d.migrate_from, "migrate_blocks": d.migrate_blocks,
                "ranks": [{"rank": r, "matched_tokens": d.matched_tokens.get(r, 0), "score": d.scores.get(r)}
                          for r in ranks]}

    @app.post("/v1/probe")
    def probe(body: ProbeBody) -> dict:
        _, tokens = service.encode(body.prompt, body.model)
        got = service.probe(tokens, lora_id=body.lora_id, cache_salt=body.cache_salt, exact=body.exact)
        foreign = service.feed.foreign_engines()
        ranks = []
        for r, m in sorted(got.items()):
            entry = {"rank": r, "matched_tokens": m.matched_tokens,
                     "tiers": None if m.device_tokens is None else {"GPU": m.device_tokens, "CPU": m.host_tokens}}
            if r in foreign:
                entry["vllm"] = foreign[r]   # a foreign engine's rank, named after its endpoint
            ranks.append(entry)
        return {"exact": body.exact, "prompt_tokens": len(tokens), "ranks": ranks}

    @app.get("/v1/events")
    async def events(request: Request, since: Annotated[int, Query(ge=0)] = 0,
                     rank: Annotated[int | None, Query(ge=0)] = None,
                     limit: Annotated[int | None, Query(ge=1)] = None,
                     timeout: Annotated[float | None, Query(gt=0, le=86_400)] = None) -> StreamingResponse:
        """Newline-delimited JSON events from ``since``, following live; ends after ``limit`` events or
        ``timeout`` seconds when given, else when the client goes away."""
        return StreamingResponse(_follow(service, request, since, rank, limit, timeout),
                                 media_type="application/x-ndjson")

    @app.get("/v1/cluster")
    def cluster() -> dict:
        return service.report(refresh=True).to_dict()

    @app.get("/health")
    def health() -> JSONResponse:
        live = service.ranks.live()
        return JSONResponse({"status": "ok" if live else "no_live_rank", "live_ranks": live},
                            status_code=200 if live else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _own_answer(res: CompletionResult) -> dict:
    return {
        "id": f"cmpl-{res.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": res.model,
        "choices": [{"index": 0, "text": decode(res.output_tokens), "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": res.prompt_tokens, "completion_tokens": len(res.output_tokens),
                  "total_tokens": res.prompt_tokens + len(res.output_tokens),
                  "prompt_tokens_details": {"cached_tokens": res.cached_tokens}},
    }


def _kvledger_block(res: CompletionResult) -> dict:
    return {"rank": res.rank, "predicted_cached_tokens": res.predicted_cached_tokens,
            "cached_tokens": res.cached_tokens, "computed_tokens": res.computed_tokens,
            "onboarded_blocks": res.onboarded_blocks, "migrated_blocks": res.migrated_blocks,
            "retries": res.retries, "output_token_ids": res.output_tokens, "policy": res.decision.policy}


def _sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _own_stream(answer: dict, usage: bool) -> Iterator[bytes]:
    yield _sse({k: v for k, v in answer.items() if k != "usage"})
    if usage:
        yield _sse({"id": answer["id"], "object": "text_completion", "created": answer["created"],
                    "model": answer["model"], "choices": [], "usage": answer["usage"], "kvledger": answer["kvledger"]})
    yield _sse("[DONE]")


def _relay(events: Iterator[tuple[int, int, dict | str]], usage: bool) -> Iterator[bytes]:
    """A vLLM server's events as they come; its usage event (the router always asks for it) only when the client
    did, carrying the ``kvledger`` block."""
    for rank, predicted, ev in events:
        if isinstance(ev, dict) and ev.get("usage") and not ev.get("choices"):
            if usage:
                cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                yield _sse({**ev, "kvledger": {"rank": rank, "predicted_cached_tokens": predicted,
                                               "cached_tokens": cached}})
            continue
        yield _sse(ev)


async def _follow(service: RouterService, request: Request, since: int, rank: int | None, limit: int | None,
                  timeout: float | None) -> AsyncIterator[bytes]:
    deadline = None if timeout is None else time.monotonic() + timeout
    left = limit
    while True:
        wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
        if wait <= 0 or await request.is_disconnected():
            return
        recs, since = await asyncio.to_thread(service.feed.wait_events, since, rank, min(left or 1000, 1000), wait)
        if recs:
            yield "".join(json.dumps(r.to_dict(), separators=(",", ":")) + "\n" for r in recs).encode()
            if left is not None:
                left -= len(recs)
                if left <= 0:
                    return


class HttpServer:
    """The app under uvicorn in a background thread; ``port`` is the bound one (ask for 0 to get a free one)."""

    def __init__(self, app: FastAPI, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 log_level: str = "warning") -> None:
        self.host = host
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                     access_log=False, lifespan="off"))
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "start the server first"
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 15.0) -> HttpServer:
        """Start serving; returns once the socket listens (raises ``RuntimeError`` if it does not in time)."""
        self._thread = threading.Thread(target=self._server.run, name="kvledger-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server on {self.host} exited during start-up (port taken?)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server on {self.host} did not start within {timeout_s:g} s")
            time.sleep(0.01)   # uvicorn offers no start-up event to wait on
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        logger.info("router HTTP API on %s", self.url)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
