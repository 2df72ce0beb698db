"""What the router sends work to: one ``Engine`` interface for kvledger's own ranks and real vLLM servers alike.

An engine answers four questions: what it is (``info``: model, block size,
vocabulary, tokenizer, maximum context, capabilities), how loaded it is
(``load``), and a ``Generation`` served whole (``generate``) or as it is made
(``stream``). Both answer in OpenAI's shapes, so the router relays what comes
back without asking who made it. A generation carries all ``n`` samplings of
one client request: it is routed once.

What only a rank with a ledger can do (an exact probe, event replay and
snapshots, export and import for migration) is the ``RankClient`` interface
(``router.rank_client``); the router reaches it through ``Engines.ledger``
(``router.engines``), for engines whose ``info`` lists the capability.
"""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from kvledger.router.chat import ChatTemplate
from kvledger.router.kv_connector import KvConnector
from kvledger.router.prompt_tokenizer import PromptTokenizer
from kvledger.router.vllm_server import EventSource
from kvledger.worker.wire.messages import RankLoad


class Capability(enum.Enum):
    """What an engine can do beyond generating (``RankClient`` has the calls)."""

    EXACT_PROBE = "exact_probe"
    """It answers how much of a prompt it holds from its own books."""
    EVENT_REPLAY = "event_replay"
    """It replays its numbered event batches and gives snapshots of its blocks."""
    MIGRATION = "migration"
    """Prefix blocks move between it and another such engine (``torch.distributed``)."""


#: Everything a rank with a ledger does.
LEDGER = frozenset(Capability)


class EngineRefusedError(ValueError):
    """An engine answered a generation with an error: its status and body go back as they are."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(status, body)
        self.status, self.body = status, body

    def __str__(self) -> str:
        return f"the engine answered {self.status}: {self.body}"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine said about itself."""

    model: str
    block_size: int
    tokenizer: PromptTokenizer
    """How text prompts for it are tokenized (the way it will)."""
    max_context: int | None
    """The most tokens one request may hold, prompt and output (``None``: unknown)."""
    vocab_size: int | None = None
    """Token ids it takes are below this (``None``: it checks them itself)."""
    chat_template: ChatTemplate | None = None
    """How it renders a chat (``None``: it takes none)."""
    capabilities: frozenset[Capability] = frozenset()
    owned_by: str = "kvledger"
    url: str | None = None
    """Where it serves, for engines reached over HTTP."""
    events: EventSource | None = None
    """Where it publishes its KV events over ZMQ (``None``: they come with its ledger's batches, or not at all)."""
    data_parallel_rank: int | None = None
    """The engine core it is among a data-parallel server's (``None``: the server runs one)."""
    connector: KvConnector | None = None
    """The KV connector a vLLM server takes prefills done elsewhere with (``router.kv_connector``)."""

    def can(self, capability: Capability) -> bool:
        return capability in self.capabilities


@dataclass(frozen=True, slots=True)
class Generation:
    """One client request as an engine is sent it: the prompt as the token ids the router hashed."""

    request_id: int
    tokens: list[int]
    max_tokens: int
    n: int = 1
    fields: dict = field(default_factory=dict)
    """The client's other OpenAI fields, as sent (sampling parameters, stop strings, log-probabilities; a chat's
    ``messages``)."""
    chat: bool = False
    responses: bool = False
    """A Responses API request (a chat, answered in the Responses shape: ``router.responses``); ``fields`` is its
    body as sent, ``n`` is 1."""
    cache_salt: str | None = None
    lora_id: int | None = None
    priority: int | None = None
    """Retention priority of its blocks, on engines with a ledger."""
    priority_s: float | None = None
    """How long ``priority`` lasts once its blocks are free, then the ledger's default (``None``: for good)."""


@dataclass(frozen=True, slots=True)
class Generated:
    """A generation served whole."""

    answer: dict
    """OpenAI's completion or chat completion, usage included."""
    output_tokens: list[int]
    """The first choice's token ids."""
    cached_tokens: int
    """Prompt tokens whose KV the engine reused (its own count)."""
    onboarded_blocks: int = 0
    token_times_s: list[float] | None = None
    """Seconds from the engine taking the request to each of the first choice's tokens (``None``: the engine
    does not say; kvledger's own ranks do)."""


class Engine(Protocol):
    """One engine under router rank ``rank``. Every call raises ``RankDiedError`` when it is lost."""

    @property
    def rank(self) -> int: ...

    def info(self) -> EngineInfo:
        """What it is (asked once, again when it comes back from being down)."""
        ...

    def check(self, job: Generation) -> None:
        """Raise ``ValueError`` naming what in ``job`` it could never serve, before anything is sent."""
        ...

    def generate(self, job: Generation) -> Generated:
        """``job`` served whole. ``EngineRefusedError``: it refused it; ``RankBusyError``/``OutOfBlocksError``:
        no room now."""
        ...

    def stream(self, job: Generation) -> Iterator[dict | str]:
        """``job``'s OpenAI chunks as they are made, a usage chunk (``choices`` empty) after the last, then
        ``"[DONE]"`` (a Responses request: its events, ``response.completed`` last). Nothing is sent until the
        first is asked for; an engine lost before it raises ``RankDiedError`` there, one lost later raises it
        where the stream stops."""
        ...

    def load(self) -> RankLoad:
        """Its queue and blocks (``ready=False``: it cannot serve yet)."""
        ...

    def close(self) -> None: ...


def cached_tokens_of(answer: dict) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer or a usage chunk, or a Responses answer's (or its
    ``response.completed`` event's) ``usage.input_tokens_details.cached_tokens``; 0 when absent."""
    if isinstance(answer.get("response"), dict):
        answer = answer["response"]
    usage = answer.get("usage") or {}
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
