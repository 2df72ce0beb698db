"""The router's own numbers, as plain objects: the edges (``router.http``) export them as metrics.

``RateMeter`` turns counts into a per-second rate over a sliding window of an
injected clock; ``Histogram`` keeps cumulative bucket counts (probe latencies,
the gap between predicted and delivered cached tokens) the way a Prometheus
histogram reports them, without knowing Prometheus.
"""
from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: Probe latency buckets, seconds: a probe is a hash per block and a dict walk, so microseconds to milliseconds.
PROBE_BUCKETS_S: tuple[float, ...] = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                                      0.1)
#: Delivered minus predicted cached tokens: negative when the index promised more than the engine reused.
GAP_BUCKETS_TOKENS: tuple[float, ...] = (-1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024)


class RateMeter:
    """Events per second over the last ``window_s`` seconds (not thread-safe: its owner locks)."""

    __slots__ = ("_in_window", "_marks", "clock", "total", "window_s")

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.clock = clock
        self.total = 0
        self._marks: deque[tuple[float, int]] = deque()
        self._in_window = 0

    def add(self, n: int) -> None:
        now = self.clock()
        self.total += n
        self._marks.append((now, n))
        self._in_window += n
        self._expire(now)

    def rate(self) -> float:
        self._expire(self.clock())
        return self._in_window / self.window_s

    def _expire(self, now: float) -> None:
        marks = self._marks
        while marks and marks[0][0] <= now - self.window_s:
            self._in_window -= marks.popleft()[1]


@dataclass(slots=True)
class Histogram:
    """Counts per upper bound (``le``), cumulative when read; plus the sum and count of observations."""

    bounds: Sequence[float] = PROBE_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(self.bounds) or not self.bounds:
            raise ValueError(f"bounds must be non-empty and ascending, got {self.bounds!r}")
        self.counts = [0] * (len(self.bounds) + 1)   # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        """A copy that later observations leave as it is (for readers outside the owner's lock)."""
        out = Histogram(self.bounds)
        out.counts, out.sum, out.count = list(self.counts), self.sum, self.count
        return out

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, observations <= le)`` per bound, ending with ``(inf, count)``."""
        out, running = [], 0
        for le, c in zip((*self.bounds, float("inf")), self.counts):
            running += c
            out.append((le, running))
        return out
