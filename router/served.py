"""What the router's service answers: a served generation, a probe per rank, a stream, or no room now."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvledger.router.policies import RouteDecision


class OverloadedError(RuntimeError):
    """No room for the request now (HTTP 429 with ``Retry-After``); it was not served and may be sent again
    after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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


@dataclass(frozen=True, slots=True)
class RankProbe:
    """How much of a prompt one rank holds; the tier split is known only to the index (``exact=False``)."""

    matched_tokens: int
    device_tokens: int | None = None
    host_tokens: int | None = None


Streamed = Iterator[tuple[int, int, dict | str]]
"""A streamed generation: ``(rank, predicted cached tokens, chunk)``, ``"[DONE]"`` last."""
