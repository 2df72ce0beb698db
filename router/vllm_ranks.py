"""Real vLLM servers as ranks of the router, side by side with kvledger's own ranks.

``VllmEngine`` is one server as a ``RankClient``: it serves requests through
the server's completions API and reports its load from the server's metrics;
what a kvledger rank answers from its ledger (snapshots, replays, an exact
probe, migrations) a vLLM server cannot, and says so. Its events reach the
index over ZMQ (``router.vllm_events``), not through these calls.

``JoinedRanks`` is the ``RankSet`` the router routes over: the cluster's own
ranks (any ``RankSet``, or none: a router in front of vLLM servers only) and
the engines, each engine under a rank of its own from ``FOREIGN_RANK_BASE`` on.
An engine that stops answering is reported down (``RankDiedError``, so the
feed drops it from the index at once and its requests go elsewhere) and comes
back when ``check_health`` sees ``/health`` answer again.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.router.chat import ChatTemplate
from kvledger.router.liveness import Liveness
from kvledger.router.prompt_tokenizer import PromptTokenizer, engine_tokenizer
from kvledger.router.rank_client import RankClient, RankDiedError, RankSet
from kvledger.router.vllm_server import COMPLETIONS, EngineUnreachableError, VllmServer, VllmServerInfo
from kvledger.worker.wire.batches import PublishedBatch, Snapshot
from kvledger.worker.wire.messages import ExportTicket, ImportTicket, RankLoad, ServeOutcome, ServeReply
from kvledger.worker.wire.request import Request


class EngineCannotError(RuntimeError):
    """A vLLM server was asked for something only kvledger's own ranks do."""


@dataclass(frozen=True, slots=True)
class EngineCompletion:
    """A completion the server answered: its status and JSON, and the cached tokens it reported."""

    status: int
    body: dict

    @property
    def cached_tokens(self) -> int:
        return cached_tokens_of(self.body)


def cached_tokens_of(answer: dict) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of a server's answer or usage chunk (0 when absent)."""
    usage = answer.get("usage") or {}
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class VllmEngine:
    """One vLLM server under router rank ``rank`` (see the module docstring)."""

    def __init__(self, rank: int, server: VllmServer, info: VllmServerInfo, tokenizer: PromptTokenizer) -> None:
        self._rank = rank
        self.server = server
        self.info = info
        self.tokenizer = tokenizer
        self.chat_template = ChatTemplate.of_model(info.model_root)
        """The model's chat template when its files are readable here (``None``: it takes no chat)."""

    @classmethod
    def connect(cls, rank: int, url: str, tokenizer_path: str | None = None, timeout_s: float = 10.0) -> VllmEngine:
        """Discover the server at ``url`` (``VllmServer.discover``) and pick its tokenizer."""
        server = VllmServer(url, timeout_s)
        try:
            info = server.discover()
        except EngineUnreachableError:
            server.close()
            raise
        return cls(rank, server, info, engine_tokenizer(server, info.model, info.model_root, tokenizer_path))

    @property
    def rank(self) -> int:
        return self._rank

    def _died(self, e: EngineUnreachableError) -> RankDiedError:
        return RankDiedError(self._rank, str(e))

    def complete(self, body: dict, path: str = COMPLETIONS) -> EngineCompletion:
        """The server's answer to ``POST path`` with ``body`` (its model filled in)."""
        try:
            status, answer = self.server.complete({**body, "model": self.info.model}, path)
        except EngineUnreachableError as e:
            raise self._died(e) from e
        return EngineCompletion(status, answer)

    def stream(self, body: dict, path: str = COMPLETIONS):
        """The server's streamed events for ``body`` (``VllmServer.stream``), its model filled in."""
        return self.server.stream({**body, "model": self.info.model}, path)

    def serve(self, requests: Sequence[Request], logits: bool = False, publish: bool = False) -> ServeReply:
        """Each request greedily through the completions API, token ids in and out; events come over ZMQ."""
        if logits:
            raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) returns no logits")
        outcomes = []
        for req in requests:
            got = self.complete({"prompt": list(req.tokens), "max_tokens": req.max_new_tokens, "temperature": 0,
                                 "return_token_ids": True,
                                 **({"cache_salt": req.cache_salt} if req.cache_salt is not None else {})})
            if got.status != 200:
                raise ValueError(f"vLLM {self.server.url} refused request {req.request_id}: {got.body}")
            choice = got.body["choices"][0]
            cached = got.cached_tokens
            outcomes.append(ServeOutcome(req.request_id, self._rank, list(choice.get("token_ids") or []), cached,
                                         len(req.tokens) - cached, 0))
        return ServeReply(outcomes)

    def load(self) -> RankLoad:
        """Queue and KV usage from the server's ``/metrics``; its blocks from its cache config."""
        try:
            got = self.server.load()
        except EngineUnreachableError as e:
            raise self._died(e) from e
        total = self.info.num_blocks or 0
        used = min(total, round(got.kv_usage * total))
        return RankLoad(self._rank, True, True, 0, got.waiting, got.running, 0, used, total - used)

    def probe(self, tokens: Sequence[int], lora_id: int | None = None, cache_salt: str | None = None) -> int:
        raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) cannot be probed; the index answers "
                                "for it")

    def poll_events(self) -> PublishedBatch | None:
        return None   # its events arrive over ZMQ

    def replay_events(self, from_seq: int) -> list[PublishedBatch] | None:
        return None

    def event_snapshot(self) -> tuple[PublishedBatch | None, Snapshot]:
        raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) keeps no snapshot")

    def export_begin(self, tokens: Sequence[int], max_blocks: int | None = None, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ExportTicket:
        raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) does not migrate KV")

    def export_end(self, pin_id: int) -> None:
        raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) does not migrate KV")

    def import_begin(self, tokens: Sequence[int], num_blocks: int, lora_id: int | None = None,
                     cache_salt: str | None = None) -> ImportTicket:
        raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) does not migrate KV")

    def import_abort(self, import_id: int) -> None:
        raise EngineCannotError(f"rank {self._rank} (vLLM {self.server.url}) does not migrate KV")

    def close(self) -> None:
        self.server.close()


class JoinedRanks:
    """Own ranks (or none) and vLLM engines as one ``RankSet`` (see the module docstring)."""

    def __init__(self, own: RankSet | None) -> None:
        self.own = own
        self._engines: dict[int, VllmEngine] = {}
        self._liveness = Liveness()
        self._lock = threading.Lock()

    def add(self, engine: VllmEngine) -> None:
        with self._lock:
            if engine.rank in self._engines:
                raise ValueError(f"rank {engine.rank} is already an engine")
            self._engines[engine.rank] = engine

    def engines(self) -> dict[int, VllmEngine]:
        """Every engine, live or down, by rank."""
        with self._lock:
            return dict(self._engines)

    def engine(self, rank: int) -> VllmEngine | None:
        """The engine under ``rank``, or ``None`` for an own rank."""
        return self._engines.get(rank)

    def live(self) -> list[int]:
        own = self.own.live() if self.own is not None else []
        return [*own, *self._liveness.live(self.engines())]

    def client(self, rank: int) -> RankClient:
        engine = self._engines.get(rank)
        if engine is None:
            if self.own is None:
                raise RankDiedError(rank, "no such rank")
            return self.own.client(rank)
        self._liveness.check(rank)
        return engine

    def mark_down(self, rank: int) -> None:
        if rank in self._engines:
            self._liveness.mark_down(rank)
        elif self.own is not None:
            self.own.mark_down(rank)

    def check_health(self) -> list[int]:
        """One round: own ranks' check, and ``GET /health`` of every engine; the ranks back since the last."""
        back = self.own.check_health() if self.own is not None else []
        return back + self._liveness.update({r: e.server.healthy() for r, e in self.engines().items()})

    def migrate(self, tokens: Sequence[int], src: int, dst: int, max_blocks: int | None = None,
                lora_id: int | None = None, cache_salt: str | None = None) -> int:
        for r in (src, dst):
            if r in self._engines:
                raise EngineCannotError(f"rank {r} (vLLM {self._engines[r].server.url}) does not migrate KV")
        if self.own is None:
            raise RankDiedError(src, "no such rank")
        return self.own.migrate(tokens, src, dst, max_blocks, lora_id, cache_salt)

    def close(self) -> None:
        for engine in self.engines().values():
            engine.close()
