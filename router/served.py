"""What the router's service answers: a served generation, a probe per rank, a stream, or no room now."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvledger.router.engine import Generation
from kvledger.router.load import Dispatch
from kvledger.router.policies import RouteDecision


class OverloadedError(RuntimeError):
    """No room for the request now (HTTP 429 with ``Retry-After``); it was not served and may be sent again
    after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Phases:
    """Where a generation's time went, phase by phase: the router's clock for the prefill and the transfer, the
    decoding engine's for its tokens."""

    prefill_rank: int | None
    """The rank that prefilled it apart (``None``: served whole)."""
    prefill_s: float
    """Seconds of the prefill apart (0 when served whole: the decode rank's first token holds it)."""
    transfer_s: float
    """Seconds moving its blocks to the decode rank (a split's, or a migration's)."""
    transferred_blocks: int
    first_token_s: float | None
    """From the router's dispatch to the first token: prefill, transfer, the decode rank's queue and first step
    (``None``: the engine does not time its tokens)."""
    inter_token_s: tuple[float, ...]
    """Gaps between the first choice's tokens on the decode rank."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a generation goes, and what was done before it is sent there (``RouterService._place``)."""

    decision: RouteDecision
    migrated: int = 0
    """Blocks moved to the decision's rank first (a migration's, or a split's transfer)."""
    prefill_rank: int | None = None
    """The rank its prompt was computed on apart (a split)."""
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    job: Generation | None = None
    """The generation as the decision's rank is sent it, when not the client's as it came (a split across vLLM
    servers adds the prefill's ``kv_transfer_params``)."""
    dispatch: Dispatch | None = None
    """Its dispatch, when counted as it was decided (``RouterService._decide``)."""

    def phases(self, token_times_s: list[float] | None) -> Phases:
        """Its phases, given the decoding engine's token times (seconds from its taking the request)."""
        times = token_times_s or []
        first = self.prefill_s + self.transfer_s + times[0] if times else None
        return Phases(self.prefill_rank, self.prefill_s, self.transfer_s, self.migrated, first,
                      tuple(b - a for a, b in zip(times, times[1:])))


@dataclass(frozen=True, slots=True)
class CompletionResult:
    """One served generation: where it ran, what the cache supplied, what it produced."""

    request_id: int
    rank: int
    output_tokens: list[int]
    """The first choice's token ids."""
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens whose KV the engine reused (its own count, not the router's estimate)."""
    computed_tokens: int
    onboarded_blocks: int
    migrated_blocks: int
    """Blocks pulled from ``decision.migrate_from`` before serving."""
    decision: RouteDecision
    retries: int
    """Engines that were lost with this request before one served it."""
    predicted_cached_tokens: int
    """What the index promised the chosen rank held (plus what was migrated to it)."""
    model: str
    answer: dict
    """The engine's OpenAI answer, usage included."""
    phases: Phases | None = None
    """Its time phase by phase (``None`` for a stream, whose router-side timing its chunks carry)."""


@dataclass(frozen=True, slots=True)
class RankProbe:
    """How much of a prompt one rank holds; the tier split is known only to the index (``exact=False``)."""

    matched_tokens: int
    device_tokens: int | None = None
    host_tokens: int | None = None


Streamed = Iterator[tuple[int, int, dict | str]]
"""A streamed generation: ``(rank, predicted cached tokens, chunk)``, ``"[DONE]"`` last."""
