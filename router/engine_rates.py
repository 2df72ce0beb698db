"""Each engine's speed, learned from its own answers: seconds per uncached prompt token and per decoded token.

A cost model with one figure for every engine sends work to the slow one as if
it were fast. Engines differ (another tenant's decodes, a hot node, a smaller
GPU), so the router fits each one from what it sees of every request it sent
there: the seconds its prefill took against the uncached prompt tokens it
computed, a line ``seconds = overhead + tokens * prefill`` fitted by least
squares with exponential forgetting (recent answers count most, an engine that
slows down is seen within tens of requests), and, from streams, the seconds
between the first token and the last over the tokens decoded. A whole
completion's first token is its end less its decode at the rank's current rate.

A prefill is timed from when the engine could start it: the request's sending,
or the rank's previous first token if that came later (until then the engine
was computing what was ahead of it), so a wait is not mistaken for slowness;
an answer taken in after a later one's (its start unknown) is left out.
The router's own count of the prompt tokens queued ahead would not do: it is an
estimate (a request sent before its prefix is computed counts its whole prompt,
then hits), and fitted against it, the simulator's bursts read two even ranks
at a thousandth of their true seconds per token and a slowed one as the faster.

Until ``MIN_SAMPLES`` answers have been seen a rank has no figure and the
policy uses its own. The waiting an engine makes a request do is in its
answers too: what the router did not queue there itself (another tenant's work)
makes an engine slow.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

#: Answers a rank needs before its fitted figures are used.
MIN_SAMPLES = 4
#: Weight of the past in the running sums, per answer.
FORGET = 0.95
#: Fewer computed tokens than this between answers leaves the slope to the running ratio.
MIN_SPREAD_TOKENS = 8.0


@dataclass(frozen=True, slots=True)
class EngineRate:
    """What the router has learned of one engine."""

    prefill_s_per_token: float
    decode_s_per_token: float | None
    """``None`` until a stream of two tokens or more has been seen."""
    samples: int


@dataclass(slots=True)
class _Fit:
    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    samples: int = 0
    decode: float | None = None
    busy_until: float = float("-inf")
    """The rank's latest first token seen (the caller's clock): a request sent before it waited until then."""

    def add(self, x: float, y: float) -> None:
        f = FORGET
        self.n, self.x, self.y = self.n * f + 1, self.x * f + x, self.y * f + y
        self.xx, self.xy = self.xx * f + x * x, self.xy * f + x * y
        self.samples += 1

    def slope(self) -> float:
        var = self.xx - self.x * self.x / self.n
        if var > MIN_SPREAD_TOKENS ** 2 * self.n:
            slope = (self.xy - self.x * self.y / self.n) / var
            if slope > 0:
                return slope
        return self.y / self.x if self.x > 0 else 0.0


class EngineRates:
    """Per rank, the fitted figures (see the module docstring); thread-safe."""

    def __init__(self) -> None:
        self._fits: dict[int, _Fit] = {}
        self._lock = threading.Lock()

    def observe(self, rank: int, computed_tokens: int, output_tokens: int, first_s: float | None,
                total_s: float, sent_at: float) -> None:
        """One answer from ``rank``, sent at ``sent_at`` (the caller's clock: ``time.perf_counter`` live): its first
        token ``first_s`` after (``None``: a whole completion), its end ``total_s`` after."""
        if computed_tokens < 0 or output_tokens < 0 or total_s < 0:
            return
        with self._lock:
            fit = self._fits.setdefault(rank, _Fit())
            if first_s is not None and output_tokens > 1 and total_s > first_s:
                sample = (total_s - first_s) / (output_tokens - 1)
                fit.decode = sample if fit.decode is None else FORGET * fit.decode + (1 - FORGET) * sample
            if first_s is None:
                first_s = max(0.0, total_s - (fit.decode or 0.0) * max(output_tokens - 1, 0))
            first_at = sent_at + first_s
            start = max(sent_at, fit.busy_until)
            fit.busy_until = max(fit.busy_until, first_at)
            if first_at >= start:   # else its answer came in after a later one's: its start is not known
                fit.add(float(computed_tokens), first_at - start)

    def rate(self, rank: int) -> EngineRate | None:
        """``rank``'s figures, or ``None`` before ``MIN_SAMPLES`` answers."""
        with self._lock:
            fit = self._fits.get(rank)
            if fit is None or fit.samples < MIN_SAMPLES:
                return None
            return EngineRate(fit.slope(), fit.decode, fit.samples)

    def prefill(self) -> dict[int, float]:
        """Every learned rank's seconds per uncached prompt token."""
        return {r: rate.prefill_s_per_token for r in list(self._fits) if (rate := self.rate(r)) is not None}

    def forget(self, rank: int) -> None:
        """``rank`` left: a rank that comes back is learned anew."""
        with self._lock:
            self._fits.pop(rank, None)
