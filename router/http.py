"""The router's HTTP API (FastAPI): OpenAI's completions, chat completions and responses, routing and probing, the
event stream, metrics.

``make_app(service, keys)`` builds the app over a ``RouterService``; ``HttpServer``
runs it with uvicorn in a background thread (the router actor, the tests), on
127.0.0.1 unless told otherwise. Request bodies are pydantic models
(``router.openai_types``): a field of the wrong type or out of range is a 400
naming it, unknown fields are ignored as vLLM ignores them. Every error has
OpenAI's shape and status: 400 bad input (a prompt no rank could ever hold
included, with the numbers), 401 no or a wrong key, 403 a user key on an admin
endpoint, 404 an unknown model, 429 no room now (with ``Retry-After``), 503 no
live rank; a vLLM server's own refusal goes back with its status and body. No
input gets a 5xx.

With keys (``router.tenants``) every request is its tenant's: its cache salt
is derived from the tenant, so probes, routes and cached tokens never show
another tenant's prompts, and the event stream, the cluster report and the
metrics, which show every tenant's, want an admin key.

A completion comes back as the engine's own answer (its text, usage and ids;
``router.engine``), streamed chunk by chunk when asked, plus the ``kvledger``
block: the rank, the cached tokens the router predicted and the ones the
engine delivered. A completion names the agent session it is a turn of with
the ``x-session-id`` header, else ``metadata.session_id``, else ``user``
(``router.sessions.session_of``; within the caller's tenant). Metrics live in
a registry of the app's own, filled at scrape time from the service's counters
(the service itself does not know Prometheus).

A Responses request (``POST /v1/responses``) is rendered as the chat vLLM
renders for it (``router.responses``), routed by that prefix, and goes to the
engine as sent; its answer, or its named events streamed, comes back as the
engine sent it, the ``kvledger`` block added to the answer (or to the
``response.completed`` event's response). The router remembers which rank made
each response (``router.response_store``): a follow-up naming it in
``previous_response_id`` goes to that rank and no other, hashed with the whole
conversation; an id it does not know, or whose rank is gone, is a 404 naming
the field, as vLLM answers an id it does not hold.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, TypeVar

import msgspec
import uvicorn
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvledger.router.admission import TenantAdmission
from kvledger.router.engine import EngineRefusedError, cached_tokens_of
from kvledger.router.models import UnknownModelError
from kvledger.router.openai_types import ChatBody, CompletionBody, ProbeBody, ResponsesBody, RouteBody, sse
from kvledger.router.policies import NoLiveRankError, RankState
from kvledger.router.response_store import StoredResponse, UnknownResponseError
from kvledger.router.responses import input_messages, sse_event, template_fields
from kvledger.router.served import CompletionResult, OverloadedError, Streamed
from kvledger.router.service import RouterService
from kvledger.router.sessions import session_of
from kvledger.router.stats import Histogram
from kvledger.router.tenants import OPEN, ApiKeys, AuthError, Caller, ForbiddenError
from kvledger.router.thread_stream import ThreadedStream

logger = logging.getLogger(__name__)
_encode_json = msgspec.json.Encoder().encode
#: A request body model.
B = TypeVar("B", bound=BaseModel)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
#: Threads for completions beyond the admission bounds: a refusal (429) needs a thread to be decided on.
SPARE_THREADS = 32
#: Seconds a client's idle connection is kept open (uvicorn's default is 5). uvicorn closes it when its timer
#: fires, and after the event loop was held up (a starved machine) expired timers run before the sockets are read:
#: a request the client had sent meanwhile on that connection was lost unanswered, a ``ReadError`` at the client
#: (4 of 9,000 completions at 64 in flight on this 2-core machine; with the timer at 0.2 s, 13 to 44 of 1,000).
#: Clients that pool connections (the OpenAI client, httpx) close idle ones themselves, after 5 s by default.
KEEP_ALIVE_S = 75.0

#: OpenAI's error ``type`` per status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """What every error answers (OpenAI's shape)."""

    error: ErrorDetail


#: Every endpoint may answer these (the OpenAPI document lists them; FastAPI's own 422 is never sent).
ERROR_RESPONSES: dict[int | str, dict] = {status: {"model": ErrorBody, "description": kind}
                                          for status, kind in ERROR_TYPES.items()}


#: A completion answers JSON, or server-sent events with ``"stream": true``.
GENERATED: dict[int | str, dict] = {200: {"content": {"application/json": {}, "text/event-stream": {}},
                                          "description": "the answer, or its chunks as server-sent events"}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


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
        speed = GaugeMetricFamily("kvledger_engine_seconds_per_token",
                                  "Each engine's speed as the router learned it from its answers, per phase",
                                  labels=["rank", "phase"])
        predicted = CounterMetricFamily("kvledger_predicted_cached_tokens",
                                        "Cached prompt tokens the index predicted on the rank a request was routed to",
                                        labels=["rank"])
        delivered = CounterMetricFamily("kvledger_delivered_cached_tokens",
                                        "Cached prompt tokens the rank reported reusing (vLLM: usage.cached_tokens)",
                                        labels=["rank"])
        rejected = CounterMetricFamily("kvledger_events_rejected", "Events the index could not take, per reason",
                                       labels=["rank", "reason"])
        onboard = GaugeMetricFamily("kvledger_onboard_seconds_per_block",
                                    "Seconds the rank measured to onboard one block from its host tier",
                                    labels=["rank"])
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
            for phase, seconds in (("prefill", r.prefill_s_per_token), ("decode", r.decode_s_per_token)):
                if seconds is not None:
                    speed.add_metric([rank, phase], seconds)
            if r.onboard_s_per_block is not None:
                onboard.add_metric([rank], r.onboard_s_per_block)
        for rank, reasons in svc.feed.rejections.by_rank().items():
            for reason, n in reasons.items():
                rejected.add_metric([str(rank), reason], n)
        yield from (blocks, hit, eps, events, decisions, index_blocks, inflight, speed, predicted, delivered, rejected,
                    onboard)
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
        s = report.sessions
        yield GaugeMetricFamily("kvledger_sessions_live", "Agent sessions the router holds (seen within the TTL)",
                                value=s.live)
        yield GaugeMetricFamily("kvledger_sessions_waiting_on_tool",
                                "Live sessions whose last answer called a tool (finish_reason tool_calls)",
                                value=s.waiting_on_tool)
        yield CounterMetricFamily("kvledger_session_prompt_tokens", "Prompt tokens of session turns served",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("kvledger_session_cached_tokens", "Prompt tokens of session turns served from cache",
                                  value=s.cached_tokens)
        yield CounterMetricFamily("kvledger_shed_completions", "Completions refused with 429 (no room now)",
                                  value=svc.tally.stats.shed)
        running, queued = svc.admission.counts()
        yield GaugeMetricFamily("kvledger_router_queued_completions", "Completions waiting for a slot on the ranks",
                                value=queued)
        yield GaugeMetricFamily("kvledger_router_running_completions", "Completions holding a slot on the ranks",
                                value=running)
        yield from _tenant_families(svc.admission.tenants())
        h = svc.tally.probe_latency()
        yield HistogramMetricFamily("kvledger_probe_latency_seconds", "Index probe latency", buckets=_buckets(h),
                                    sum_value=h.sum)
        g = svc.tally.cached_gap()
        yield HistogramMetricFamily("kvledger_cached_tokens_gap", "Delivered minus predicted cached tokens per "
                                    "completion (negative: the index promised more than the rank reused)",
                                    buckets=_buckets(g), sum_value=g.sum)


def _tenant_families(tenants: list[TenantAdmission]) -> Iterator[Metric]:
    """Per tenant: its 429s, its queueing times, what runs and waits, what it was let onto the ranks (its share:
    the rate of ``kvledger_tenant_served_tokens`` over the sum). Metrics want an admin key, so only admins see
    the tenants' names."""
    shed = CounterMetricFamily("kvledger_tenant_shed_completions", "Completions refused with 429, per tenant",
                               labels=["tenant"])
    served = CounterMetricFamily("kvledger_tenant_served_completions", "Completions let onto the ranks, per tenant",
                                 labels=["tenant"])
    tokens = CounterMetricFamily("kvledger_tenant_served_tokens", "Cost (prompt tokens + n * max_tokens) of the "
                                 "completions let onto the ranks, per tenant", labels=["tenant"])
    running = GaugeMetricFamily("kvledger_tenant_running_completions", "Completions holding a slot, per tenant",
                                labels=["tenant"])
    queued = GaugeMetricFamily("kvledger_tenant_queued_completions", "Completions waiting for a slot, per tenant",
                               labels=["tenant"])
    waited = HistogramMetricFamily("kvledger_tenant_queue_seconds", "Time from arrival to a slot, per tenant",
                                   labels=["tenant"])
    for t in tenants:
        shed.add_metric([t.tenant], t.shed)
        served.add_metric([t.tenant], t.served)
        tokens.add_metric([t.tenant], t.served_tokens)
        running.add_metric([t.tenant], t.running)
        queued.add_metric([t.tenant], t.queued)
        waited.add_metric([t.tenant], _buckets(t.queue_seconds), t.queue_seconds.sum)
    yield from (shed, served, tokens, running, queued, waited)


def _buckets(h: Histogram) -> list[tuple[str, int]]:
    """A histogram's cumulative buckets as Prometheus names their bounds."""
    return [("+Inf" if math.isinf(le) else repr(float(le)), n) for le, n in h.cumulative()]


class _StartingGate:
    """503 with ``Retry-After`` to every request until ``ready`` is set (a router rebuilding its index after a
    restart). Plain ASGI: Starlette's ``BaseHTTPMiddleware`` would cost every request a task group and a stream
    pair, which a burst of completions pays for in time to first answer."""

    def __init__(self, app: ASGIApp, ready: threading.Event) -> None:
        self.app, self.ready = app, ready

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.ready.is_set():
            answer = error_response(503, "the router is starting: it is rebuilding its index from the ranks' "
                                         "snapshots", code="starting", headers={"Retry-After": "1"})
            await answer(scope, receive, send)
            return
        await self.app(scope, receive, send)


Endpoint = Callable[[Request], Awaitable[Response]]


class _HotRoutes:
    """``POST`` to the generating endpoints straight to their functions, past FastAPI's router: its route matching,
    request wrappers and dependency solving cost the event loop about 0.1 ms of each short completion, which the
    engine sharing the machine pays. An error is answered by the app's own exception handlers (by the exception's
    class, as Starlette's ``ExceptionMiddleware`` finds them); one with none propagates to the server-error
    middleware outside, as from any route. The same functions are FastAPI's routes, which document them."""

    def __init__(self, app: ASGIApp, routes: dict[str, Endpoint], handlers: dict) -> None:
        self.app, self.routes, self.handlers = app, routes, handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await endpoint(request)
        except Exception as exc:
            handler = next((self.handlers[c] for c in type(exc).__mro__ if c in self.handlers), None)
            if handler is None:
                raise
            response = await handler(request, exc)
        await response(scope, receive, send)


async def _caller(request: Request, authorization: Annotated[str | None, Header()] = None) -> Caller:
    """Who sends the request: the key's tenant and role, or everyone (``OPEN``) on a router without keys. A
    coroutine: FastAPI sends a plain function to a thread of its pool, a hop per request for a few comparisons."""
    keys: ApiKeys | None = request.app.state.keys
    if keys is None:
        return OPEN
    scheme, _, key = (authorization or "").partition(" ")
    return keys.caller(key.strip() if scheme.lower() == "bearer" else None)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's document without the 422 it adds to every operation (validation errors answer 400 here), with the
    schemas of the bodies the hot endpoints parse themselves (``PARSED_BODIES``)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for body in PARSED_BODIES:
            schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update({**schema.pop("$defs", {}), body.__name__: schema})
        for path in doc["paths"].values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        app.openapi_schema = doc
    return app.openapi_schema


def _param(loc: tuple) -> str | None:
    """The field a validation error is about, as OpenAI names it (``messages[0].role``): pydantic's location
    without its section (``body``, ``query``) and the names it gives the members of a union."""
    out = ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier():
            out += f".{part}" if out else part
    return out or None


async def _admin(who: Annotated[Caller, Depends(_caller)]) -> Caller:
    who.require("admin")
    return who


User = Annotated[Caller, Depends(_caller)]
Admin = Annotated[Caller, Depends(_admin)]
SESSION_DOC = "The agent session this request is a turn of (router.sessions); else metadata.session_id, else user"
SessionHeader = Annotated[str | None, Header(description=SESSION_DOC)]
#: The bodies the hot endpoints parse themselves (``_parsed``), documented as FastAPI documents its own.
PARSED_BODIES: tuple[type[BaseModel], ...] = (CompletionBody, ChatBody)
_OPTIONAL_TEXT = {"anyOf": [{"type": "string"}, {"type": "null"}]}


def _documented(body: type[BaseModel]) -> dict:
    """The OpenAPI of an endpoint that parses ``_parsed``'s way: its JSON body (``_openapi`` adds its schema) and
    the headers it reads."""
    return {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}},
            "parameters": [
                {"name": "x-session-id", "in": "header", "required": False, "description": SESSION_DOC,
                 "schema": {**_OPTIONAL_TEXT, "title": "X-Session-Id", "description": SESSION_DOC}},
                {"name": "authorization", "in": "header", "required": False,
                 "schema": {**_OPTIONAL_TEXT, "title": "Authorization"}}]}


async def _parsed(request: Request, model: type[B]) -> tuple[B, Caller, str | None]:
    """A generating request's body, validated from its bytes by pydantic in one call, its caller and its session
    header. FastAPI's own solving of the same parameters cost a short completion ~0.15 ms of the router's CPU
    more. Bad input is FastAPI's ``RequestValidationError`` all the same (a 400 naming the field)."""
    try:
        body = model.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e
    return body, await _caller(request, request.headers.get("authorization")), request.headers.get("x-session-id")


def make_app(service: RouterService, keys: ApiKeys | None = None, ready: threading.Event | None = None) -> FastAPI:
    """The router's HTTP API over ``service`` (see DESIGN.md, "HTTP"); with ``keys``, every endpoint but
    ``/health`` wants a key, and the admin endpoints an admin's (``router.tenants``). Until ``ready`` is set
    (a router rebuilding its index after a restart) every request gets a 503 with ``Retry-After``."""
    # no OpenTelemetry: the router exports its own metrics, and FastAPI's check for a provider cost every request
    # about a tenth of the router's sampled CPU
    app = FastAPI(title="kvledger router", version="0.1.0", responses=ERROR_RESPONSES,
                  telemetry={"tracing": False, "metrics": False, "logs": False})
    app.openapi = lambda: _openapi(app)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ServiceCollector(service))
    app.state.service = service
    app.state.registry = registry
    app.state.keys = keys

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        # the most specific error: for a union (text or token ids) the member the input was meant to be
        first = max(exc.errors(), key=lambda e: len(e.get("loc", ())))
        param = _param(first.get("loc", ()))
        return error_response(400, f"{param or 'body'}: {first.get('msg')}", param, first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, exc: ValueError) -> JSONResponse:
        return error_response(400, str(exc), getattr(exc, "param", None))

    @app.exception_handler(AuthError)
    async def _no_key(_: Request, exc: AuthError) -> JSONResponse:
        return error_response(401, str(exc), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(ForbiddenError)
    async def _forbidden(_: Request, exc: ForbiddenError) -> JSONResponse:
        return error_response(403, str(exc), code="insufficient_role")

    @app.exception_handler(UnknownModelError)
    async def _no_model(_: Request, exc: UnknownModelError) -> JSONResponse:
        return error_response(404, str(exc.args[0]), "model", "model_not_found")

    @app.exception_handler(UnknownResponseError)
    async def _no_response(_: Request, exc: UnknownResponseError) -> JSONResponse:
        return error_response(404, str(exc.args[0]), "previous_response_id", "response_not_found")

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return error_response(429, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(NoLiveRankError)
    async def _no_rank(_: Request, exc: NoLiveRankError) -> JSONResponse:
        return error_response(503, str(exc), code="no_live_rank", headers={"Retry-After": "5"})

    @app.exception_handler(EngineRefusedError)
    async def _refused(_: Request, exc: EngineRefusedError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.get("/v1/models")
    def models(_: User) -> dict:
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": created, "owned_by": m.info.owned_by,
             "kvledger": {"ranks": m.ranks}} for m in service.models.catalogue().values()]}

    def generate(body: CompletionBody | ChatBody, who: Caller, model: str, tokens: list[int], chat: bool,
                 session_header: str | None) -> Response:
        fields = body.passthrough()
        session = session_of(session_header, fields, who.tenant)
        if chat:
            fields["messages"] = body.message_dicts()
        args = dict(max_tokens=body.max_new, cache_salt=who.salt(body.cache_salt), lora_id=body.lora_id,
                    priority=body.priority, model=model, fields=fields, chat=chat, n=body.n, caller=who,
                    session=session)
        if body.stream:
            return streamed(_relay(service.stream(tokens, **args), body.include_usage))
        result = service.complete(tokens, **args)
        return _answer(result)

    c = service.config
    threads = ThreadPoolExecutor(c.max_inflight_completions + c.max_queued_completions + SPARE_THREADS,
                                 thread_name_prefix="kvledger-completion")

    def in_worker_thread(fn: Callable[[], Response]) -> Awaitable[Response]:
        """Run a completion on a thread of the app's own pool, as large as the router's admission bounds: the
        service's queue orders and bounds completions (``router.admission``), not a pool of 40 threads
        (anyio's default, which held every completion past the 40th back, unanswered and unrefused). A plain
        executor: anyio's limiter and worker queue cost twice its time per hop."""
        return asyncio.get_running_loop().run_in_executor(threads, fn)

    def streamed(events: Iterator[bytes]) -> StreamingResponse:
        """A generation's server-sent events, drained on a thread of the same pool (``router.thread_stream``)."""
        return StreamingResponse(ThreadedStream(events, threads), media_type="text/event-stream")

    @app.post("/v1/completions", responses=GENERATED, openapi_extra=_documented(CompletionBody))
    async def completions(request: Request) -> Response:
        body, who, session = await _parsed(request, CompletionBody)

        def run() -> Response:
            model, tokens = service.models.encode(body.prompt, body.model)
            return generate(body, who, model, tokens, False, session)
        return await in_worker_thread(run)

    @app.post("/v1/chat/completions", responses=GENERATED, openapi_extra=_documented(ChatBody))
    async def chat_completions(request: Request) -> Response:
        body, who, session = await _parsed(request, ChatBody)

        def run() -> Response:
            model, tokens = service.models.encode_chat(body.message_dicts(), body.model, body.passthrough())
            return generate(body, who, model, tokens, True, session)
        return await in_worker_thread(run)

    # the gate added last, outermost: a router still starting answers 503 on the hot routes too
    app.add_middleware(_HotRoutes, routes={"/v1/completions": completions, "/v1/chat/completions": chat_completions},
                       handlers=app.exception_handlers)
    if ready is not None:
        app.add_middleware(_StartingGate, ready=ready)

    @app.post("/v1/responses", responses=GENERATED)
    async def responses(body: ResponsesBody, who: User, x_session_id: SessionHeader = None) -> Response:
        def run() -> Response:
            fields = body.passthrough()
            session = session_of(x_session_id, fields, who.tenant)
            before = None if body.previous_response_id is None else service.responses.get(body.previous_response_id)
            messages = input_messages(body.instructions, fields["input"], *(() if before is None else
                                                                           (before.messages, before.output)))
            # vLLM tokenizes a Responses prompt with the special tokens (TokenizeParams' default), a chat without
            model, tokens = service.models.encode_chat(messages, body.model, template_fields(fields), True)
            kept = body.store is not False

            def remember(answer: dict, rank: int) -> None:
                if kept and isinstance(answer.get("id"), str):
                    service.responses.remember(answer["id"], StoredResponse(rank, messages,
                                                                            list(answer.get("output") or [])))

            args = {"max_tokens": body.max_new, "cache_salt": who.salt(body.cache_salt), "lora_id": body.lora_id,
                    "priority": body.priority, "model": model, "fields": fields, "chat": True, "responses": True,
                    "rank": None if before is None else before.rank, "caller": who, "session": session}
            if body.stream:
                return streamed(_relay_responses(service.stream(tokens, **args), remember))
            result = service.complete(tokens, **args)
            remember(result.answer, result.rank)
            return _answer(result)
        return await in_worker_thread(run)

    @app.post("/v1/route")
    def route(body: RouteBody, who: User) -> dict:
        model, tokens = service.models.encode(body.prompt, body.model)
        d = service.route(tokens, max_tokens=body.max_tokens, cache_salt=who.salt(body.cache_salt),
                          lora_id=body.lora_id, model=model)
        ranks = sorted(set(d.scores) | set(d.matched_tokens))
        return {"rank": d.rank, "policy": d.policy, "lower_is_better": d.lower_is_better,
                "migrate_from": d.migrate_from, "migrate_blocks": d.migrate_blocks,
                "split": None if d.split is None else dataclasses.asdict(d.split),
                "ranks": [{"rank": r, "matched_tokens": d.matched_tokens.get(r, 0), "score": d.scores.get(r),
                           "load": _load_seen(d.loads.get(r))} for r in ranks]}

    @app.post("/v1/probe")
    def probe(body: ProbeBody, who: User) -> dict:
        _, tokens = service.models.encode(body.prompt, body.model)
        got = service.probe(tokens, lora_id=body.lora_id, cache_salt=who.salt(body.cache_salt), exact=body.exact)
        foreign, dp_ranks = service.feed.foreign_engines(), service.feed.foreign_dp_ranks()
        ranks = []
        for r, m in sorted(got.items()):
            entry = {"rank": r, "matched_tokens": m.matched_tokens,
                     "tiers": None if m.device_tokens is None else {"GPU": m.device_tokens, "CPU": m.host_tokens}}
            if r in foreign:
                entry["vllm"] = foreign[r]   # a foreign engine's rank, named after its endpoint
            if r in dp_ranks:
                entry["data_parallel_rank"] = dp_ranks[r]
            ranks.append(entry)
        return {"exact": body.exact, "prompt_tokens": len(tokens), "ranks": ranks}

    @app.get("/v1/events", response_class=StreamingResponse,
             responses={200: {"content": {"application/x-ndjson": {}}, "description": "one JSON event a line"}})
    async def events(request: Request, _: Admin, since: Annotated[int, Query(ge=0)] = 0,
                     rank: Annotated[int | None, Query(ge=0)] = None,
                     limit: Annotated[int | None, Query(ge=1)] = None,
                     timeout: Annotated[float | None, Query(gt=0, le=86_400)] = None) -> StreamingResponse:
        """Newline-delimited JSON events from ``since``, following live; ends after ``limit`` events or
        ``timeout`` seconds when given, else when the client goes away. Admins only: events carry every
        tenant's token ids."""
        return StreamingResponse(_follow(service, request, since, rank, limit, timeout),
                                 media_type="application/x-ndjson")

    @app.get("/v1/cluster")
    def cluster(_: Admin) -> dict:
        return service.report(refresh=True).to_dict()

    @app.get("/health")
    def health() -> JSONResponse:
        live = service.engines.live()
        return JSONResponse({"status": "ok" if live else "no_live_rank", "live_ranks": live},
                            status_code=200 if live else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text"}})
    def metrics(_: Admin) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _load_seen(state: RankState | None) -> dict | None:
    """A rank's load as the policy weighed it (the ranks' last reports and this router's own dispatches)."""
    if state is None:
        return None
    return {"queued_requests": state.queued_requests, "queued_prefill_tokens": state.queued_prefill_tokens,
            "running_requests": state.running_requests}


def _answer(res: CompletionResult) -> Response:
    """The engine's answer with the ``kvledger`` block, encoded by msgspec, ``Phases`` as it is: a one-token
    completion's answer took 21 µs through ``asdict`` and Starlette's ``JSONResponse``, 3.4 µs so."""
    block = {"rank": res.rank, "predicted_cached_tokens": res.predicted_cached_tokens,
             "cached_tokens": res.cached_tokens, "computed_tokens": res.computed_tokens,
             "onboarded_blocks": res.onboarded_blocks, "migrated_blocks": res.migrated_blocks,
             "retries": res.retries, "output_token_ids": res.output_tokens, "policy": res.decision.policy}
    if res.phases is not None:
        block["phases"] = res.phases
    return Response(_encode_json({**res.answer, "kvledger": block}), media_type="application/json")


def _relay(events: Streamed, usage: bool) -> Iterator[bytes]:
    """An engine's chunks as they come; its usage chunk (the router always asks for one) only when the client
    did, carrying the ``kvledger`` block."""
    for rank, predicted, ev in events:
        if isinstance(ev, dict) and ev.get("usage") and not ev.get("choices"):
            if usage:
                yield sse({**ev, "kvledger": {"rank": rank, "predicted_cached_tokens": predicted,
                                               "cached_tokens": cached_tokens_of(ev)}})
            continue
        yield sse(ev)


def _relay_responses(events: Streamed, remember: Callable[[dict, int], None]) -> Iterator[bytes]:
    """A Responses stream's events as the engine sent them, named; the last (``response.completed``) carries the
    ``kvledger`` block in its response, which is remembered for follow-ups."""
    for rank, predicted, ev in events:
        if isinstance(ev, dict) and ev.get("type") == "response.completed" and isinstance(ev.get("response"), dict):
            remember(ev["response"], rank)
            ev = {**ev, "response": {**ev["response"], "kvledger": {
                "rank": rank, "predicted_cached_tokens": predicted, "cached_tokens": cached_tokens_of(ev)}}}
        yield sse_event(ev)


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
                                                     access_log=False, lifespan="off",
                                                     timeout_keep_alive=KEEP_ALIVE_S))
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
