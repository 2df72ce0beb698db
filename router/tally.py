"""What the router served, per rank and in all: completions, cached tokens predicted and delivered, retries, shed.

The router keeps, for every completion, what its index predicted (cached
prompt tokens on the chosen rank) next to what the engine delivered: the
routing accuracy no peer reports. ``Tally`` is thread-safe; reports and the
metrics read copies.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvledger.router.stats import GAP_BUCKETS_TOKENS, Histogram


@dataclass(slots=True)
class RankCounters:
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


class Tally:
    """See the module docstring."""

    def __init__(self) -> None:
        self.stats = ServiceStats()
        self._ranks: dict[int, RankCounters] = {}
        self.lock = threading.Lock()

    def served(self, rank: int, prompt_len: int, predicted: int, cached: int, migrated: int) -> None:
        with self.lock:
            s, c = self.stats, self._ranks.setdefault(rank, RankCounters())
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

    def probed(self, seconds: float) -> None:
        with self.lock:
            self.stats.probe_latency.observe(seconds)

    def retried(self) -> None:
        with self.lock:
            self.stats.retries += 1

    def shed(self) -> None:
        with self.lock:
            self.stats.shed += 1

    def rank(self, rank: int) -> RankCounters:
        """A copy of ``rank``'s counters."""
        with self.lock:
            c = self._ranks.get(rank) or RankCounters()
            return RankCounters(c.decisions, c.completions, c.prompt_tokens, c.cached_tokens, c.predicted_tokens)

    def probe_latency(self) -> Histogram:
        with self.lock:
            return self.stats.probe_latency.copy()

    def cached_gap(self) -> Histogram:
        with self.lock:
            return self.stats.cached_gap.copy()

