"""One real vLLM OpenAI server as the router reaches it over HTTP: what it is, how loaded, and its completions.

``VllmServer.discover`` asks the server itself for everything the router needs
to index and route to it, so ``kvledger up --vllm URL`` takes nothing else:

- the model (``GET /v1/models``: its id, the path it was loaded from, its
  maximum length);
- the block size and block count (the labels of ``vllm:cache_config_info`` in
  ``/metrics``);
- the KV-event publishers (``GET /kv_event_sources``: one config per
  data-parallel rank, each publishing on a port of its own), turned into
  where the router subscribes (``EventSource``);
- whether it runs a KV connector that takes a prefill done elsewhere (its
  metrics; ``kv_connector`` asks ``/server_info`` for the connector's role,
  as a prefill server must have: ``router.kv_connector``).

A server started with ``--data-parallel-size N`` runs N engine cores behind
one API server: each is an engine of its own to the router. A client made for
data-parallel rank ``dp_rank`` names it in every request's
``X-data-parallel-rank`` header (vLLM then schedules the request on that core)
and reads only that core's samples of ``/metrics`` (its ``engine`` label).

``load`` reads the queue and the KV usage from ``/metrics``
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``) with prometheus-client's own parser, and the
host tier's onboarding (``router.vllm_onboard``).
Completions go through as JSON or, streamed, as the server's own
server-sent-event lines, over the router's own keep-alive connections
(``router.http_pool``: the hot path; the rest goes through ``httpx``). Every
call has a timeout; a server that does not answer raises
``EngineUnreachableError``.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvledger.router.http_pool import HttpPool
from kvledger.router.kv_connector import KvConnector, connector_of
from kvledger.router.openai_types import Relayed
from kvledger.router.vllm_onboard import ONBOARD_SAMPLES, OnboardMeter

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
RESPONSES = "/v1/responses"
#: The request header vLLM's OpenAI server takes a data-parallel rank from.
DP_RANK_HEADER = "X-data-parallel-rank"


class EngineUnreachableError(RuntimeError):
    """The server did not answer (refused, reset, timed out)."""


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where the router subscribes to one engine's KV events."""

    endpoint: str
    """The address the router's SUB socket connects to or binds."""
    bind: bool | None
    """``False``: vLLM binds (its endpoint was a wildcard), the router connects. ``None``: the endpoint names a
    host, which vLLM either connects to (the router must bind it) or bound itself (``tcp://*:0`` is reported as
    the address it got); the subscriber binds if it can, else connects."""
    replay_endpoint: str | None
    topic: str


@dataclass(frozen=True, slots=True)
class VllmServerInfo:
    """What a server said about itself."""

    url: str
    model: str
    model_root: str | None
    """The path or hub name the model was loaded from (its tokenizer lives there)."""
    max_model_len: int | None
    block_size: int | None
    num_blocks: int | None
    events: dict[int, EventSource]
    """Per data-parallel rank, where its KV events are published (empty when the server publishes none: then it is
    routed to blind)."""
    dp_ranks: tuple[int, ...] = (0,)
    """Its engine cores' data-parallel ranks (the ``engine`` labels of its metrics); ``(0,)`` without DP."""
    connector: KvConnector | None = None
    """The KV connector its metrics show it consumes with (``None``: it takes no prefill done elsewhere)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: int
    running: int
    kv_usage: float
    """Share of the KV blocks in use, 0..1."""
    onboard: OnboardMeter = OnboardMeter()
    """What its host tier has onboarded so far (``router.vllm_onboard``)."""


def event_source(config: dict, server_host: str) -> EventSource | None:
    """The subscription for one publisher config as ``/kv_event_sources`` gives it (vLLM's ``KVEventsConfig``)."""
    if not config.get("enable_kv_cache_events") or config.get("publisher") != "zmq":
        return None
    endpoint = str(config["endpoint"])
    # vLLM binds wildcard and ipc/inproc endpoints, and connects to the rest
    vllm_binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    replay = config.get("replay_endpoint")
    return EventSource(_reachable(endpoint, server_host) if vllm_binds else endpoint, False if vllm_binds else None,
                       None if replay is None else _reachable(str(replay), server_host), str(config.get("topic", "")))


def _reachable(endpoint: str, host: str) -> str:
    """A bound endpoint as a client reaches it: a wildcard host is the server's own."""
    return endpoint.replace("*", host, 1) if "*" in endpoint else endpoint


class VllmServer:
    """An HTTP client of one vLLM server (see the module docstring)."""

    def __init__(self, url: str, timeout_s: float = 10.0, completion_timeout_s: float = 300.0,
                 dp_rank: int | None = None) -> None:
        """``dp_rank``: the data-parallel rank this client's requests go to and whose metrics it reads (``None``:
        the server's own choice, and every core's metrics summed)."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"a vLLM server is http://HOST:PORT, got {url!r}")
        if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
            raise ValueError(f"dp_rank must be a non-negative int or None, got {dp_rank!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.dp_rank = dp_rank
        self._timeout = httpx.Timeout(timeout_s)
        headers = {} if dp_rank is None else {DP_RANK_HEADER: str(dp_rank)}
        self._http = httpx.Client(base_url=self.url, timeout=self._timeout, headers=headers)
        self._pool = HttpPool(self.host, parts.port or 80, timeout_s, completion_timeout_s, headers)

    def close(self) -> None:
        self._http.close()
        self._pool.close()

    def _fetch(self, path: str, **kwargs: object) -> httpx.Response:
        """``GET path``; ``EngineUnreachableError`` if the server does not answer. A kept-alive connection the
        server closes as the request goes out (uvicorn drops idle ones after 5 s) is met by sending the GET once
        more, on a fresh connection: it changes nothing on the server."""
        try:
            try:
                return self._http.get(path, **kwargs)
            except httpx.RemoteProtocolError:
                return self._http.get(path, **kwargs)
        except httpx.TransportError as e:
            raise EngineUnreachableError(f"vLLM server {self.url}: GET {path}: {e!r}") from e

    def _get(self, path: str) -> httpx.Response:
        r = self._fetch(path)
        r.raise_for_status()
        return r

    def _post(self, path: str, body: dict, timeout: httpx.Timeout | None = None) -> httpx.Response:
        try:
            return self._http.post(path, json=body, timeout=timeout or self._timeout)
        except httpx.TransportError as e:
            raise EngineUnreachableError(f"vLLM server {self.url}: POST {path}: {e!r}") from e

    def healthy(self) -> bool:
        """Whether ``GET /health`` answers 200."""
        try:
            return self._fetch("/health").status_code == 200
        except EngineUnreachableError:
            return False

    def discover(self) -> VllmServerInfo:
        """Ask the server what it serves, at what block size, and where it publishes events."""
        models = self._get("/v1/models").json()["data"]
        if not models:
            raise ValueError(f"vLLM server {self.url} serves no model")
        model = models[0]
        metrics = self._get("/metrics").text
        info = _labels(metrics, "vllm:cache_config_info")
        sources = self._get("/kv_event_sources").json() if self._has_event_sources() else {}
        events = {int(k): src for k, config in sources.items() if (src := event_source(config, self.host))}
        dp_ranks = tuple(sorted({*_engine_labels(metrics), *events})) or (0,)
        return VllmServerInfo(self.url, str(model["id"]), model.get("root"), model.get("max_model_len"),
                              _int_label(info, "block_size"), _int_label(info, "num_gpu_blocks"), events, dp_ranks,
                              connector_of(None, _metric_names(metrics)))

    def kv_connector(self, seen: KvConnector | None) -> KvConnector | None:
        """The KV connector it runs, with its name and role when it serves ``/server_info``
        (``VLLM_SERVER_DEV_MODE=1``), else ``seen`` (what ``discover`` read from its metrics); ``None``: it runs
        none."""
        r = self._fetch("/server_info", params={"config_format": "json"}, timeout=httpx.Timeout(60.0))
        return connector_of(r.json(), set()) if r.status_code == 200 else seen

    def _has_event_sources(self) -> bool:
        return self._fetch("/kv_event_sources").status_code == 200

    def load(self) -> EngineLoad:
        """Its queue, KV usage and host-tier onboarding from ``/metrics`` (``engine_load``)."""
        return engine_load(self._get("/metrics").text, self.dp_rank)

    def tokenize(self, model: str, text: str, add_special_tokens: bool = True) -> list[int]:
        """The server's own tokenization of ``text`` (``POST /tokenize``), special tokens as a completion adds
        them unless told not to."""
        r = self._post("/tokenize", {"model": model, "prompt": text, "add_special_tokens": add_special_tokens})
        r.raise_for_status()
        return list(r.json()["tokens"])

    def complete(self, body: dict, path: str = COMPLETIONS) -> tuple[int, dict]:
        """``POST path`` (completions, chat completions or responses): the status and the server's JSON answer."""
        try:
            status, answer = self._pool.post_json(path, _encode(body))
        except OSError as e:
            raise EngineUnreachableError(f"vLLM server {self.url}: POST {path}: {e!r}") from e
        return status, _decode(answer)

    def stream(self, body: dict, path: str = COMPLETIONS) -> Iterator[dict | str]:
        """``POST path`` with ``stream``: each server-sent event's JSON, then ``"[DONE]"`` (a Responses stream has
        none: its events are named by the ``type`` each carries, so the ``event:`` lines are left out here).

        ``EngineUnreachableError`` if the server cannot be reached before its first event.
        """
        try:
            with self._pool.post(path, _encode(body)) as answer:
                if answer.status != 200:
                    yield {"error": _decode(answer.read()), "status": answer.status}
                    return
                rest = b""
                for chunk in answer.chunks():
                    *lines, rest = (rest + chunk).split(b"\n")
                    for line in lines:
                        if line.startswith(b"data:"):
                            data = line[5:].strip()
                            yield "[DONE]" if data == b"[DONE]" else Relayed.of(_decode(data), data)
        except OSError as e:
            raise EngineUnreachableError(f"vLLM server {self.url}: streamed completion: {e!r}") from e

    def reset_prefix_cache(self) -> None:
        """Empty its prefix cache (vLLM serves this only with ``VLLM_SERVER_DEV_MODE=1``)."""
        r = self._post("/reset_prefix_cache", {})
        if r.status_code == 404:
            raise RuntimeError(f"vLLM server {self.url} has no /reset_prefix_cache: start it with "
                               "VLLM_SERVER_DEV_MODE=1, or restart it to empty its cache")
        r.raise_for_status()


_encode = msgspec.json.Encoder().encode
_decoder = msgspec.json.Decoder()


def _decode(data: bytes) -> dict:
    """JSON as the server wrote it: msgspec's decoder (a quarter of ``json.loads``' time on an answer), else, for
    what only Python's writes (``NaN``, ``-Infinity``), ``json.loads``."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        return json.loads(data)


def engine_load(metrics_text: str, dp_rank: int | None) -> EngineLoad:
    """The load in a server's ``/metrics`` text: data-parallel rank ``dp_rank``'s samples (its ``engine`` label),
    or every engine core's summed (``None``)."""
    values = dict.fromkeys(("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                            *ONBOARD_SAMPLES), 0.0)
    engine = None if dp_rank is None else str(dp_rank)
    # only the samples read here are parsed: the parser took 8% of a busy router's CPU on a server's whole page
    wanted = tuple(values)
    lines = "\n".join(line for line in metrics_text.splitlines() if line.startswith(wanted))
    for family in text_string_to_metric_families(lines):
        for s in family.samples:
            if s.name in values and (engine is None or s.labels.get("engine") == engine):
                values[s.name] += s.value
    return EngineLoad(int(values["vllm:num_requests_waiting"]), int(values["vllm:num_requests_running"]),
                      values["vllm:kv_cache_usage_perc"], OnboardMeter.of(values))


def _labels(metrics_text: str, name: str) -> dict[str, str]:
    """The labels of the first sample of info-style gauge ``name`` (empty when absent)."""
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name:
                return dict(s.labels)
    return {}


def _metric_names(metrics_text: str) -> set[str]:
    """The metric families a ``/metrics`` page declares (its ``# TYPE`` lines)."""
    return {line.split()[2] for line in metrics_text.splitlines() if line.startswith("# TYPE ")}


def _engine_labels(metrics_text: str) -> set[int]:
    """The data-parallel ranks whose engine cores report ``vllm:num_requests_running`` (its ``engine`` label)."""
    return {int(s.labels["engine"]) for family in text_string_to_metric_families(metrics_text)
            for s in family.samples
            if s.name == "vllm:num_requests_running" and s.labels.get("engine", "").isdigit()}


def _int_label(labels: dict[str, str], key: str) -> int | None:
    value = labels.get(key)
    return int(value) if value not in (None, "", "None") else None
