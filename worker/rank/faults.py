"""Faults injected into the event transport on purpose, off by default: what the chaos run and the tests use.

A rank's batches travel to the router by push; ``FaultySink`` sits in front of
the real sink and, for a seeded share of batches, drops one (as a lost
message), sends it twice, holds it back until the next one has gone
(reordering), or delays it. The router must end up with the same index anyway:
it asks for a replay when the numbering shows a gap, ignores what it applied
already, and compares every rank's count of published batches with its own at
every health round, so a batch lost last (no later one shows the gap) is
fetched too.
"""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvledger.worker.wire.batches import PublishedBatch


@dataclass(frozen=True, slots=True)
class TransportFaults:
    """Shares of batches to drop, duplicate, reorder and delay (each 0..1, together at most 1), all seeded."""

    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.05
    """How long a delayed batch waits."""
    seed: int = 0

    def __post_init__(self) -> None:
        shares = (self.drop, self.duplicate, self.reorder, self.delay)
        if not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in shares) or sum(shares) > 1:
            raise ValueError(f"transport fault shares must be in 0..1 and sum to at most 1, got drop={self.drop}, "
                             f"duplicate={self.duplicate}, reorder={self.reorder}, delay={self.delay}")
        if not isinstance(self.delay_s, (int, float)) or not 0 <= self.delay_s <= 60:
            raise ValueError(f"delay_s must be in 0..60 seconds, got {self.delay_s!r}")

    @property
    def active(self) -> bool:
        return self.drop + self.duplicate + self.reorder + self.delay > 0


class FaultySink:
    """``sink`` behind the faults of ``faults`` (seeded per rank, so two ranks do not fail alike)."""

    def __init__(self, sink: Callable[[PublishedBatch], object], faults: TransportFaults, rank: int) -> None:
        self._sink = sink
        self._faults = faults
        self._rng = random.Random(faults.seed * 1_000_003 + rank)
        self._held: PublishedBatch | None = None
        self._lock = threading.Lock()
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0, "delayed": 0}

    def __call__(self, batch: PublishedBatch) -> None:
        f, r = self._faults, self._rng.random()
        with self._lock:
            held, self._held = self._held, None
        if r < f.drop:
            self.counts["dropped"] += 1
        elif r < f.drop + f.duplicate:
            self.counts["duplicated"] += 1
            self._sink(batch)
            self._sink(batch)
        elif r < f.drop + f.duplicate + f.reorder and held is None:
            self.counts["reordered"] += 1
            with self._lock:
                self._held = batch   # goes out after the next one
        else:
            if r < f.drop + f.duplicate + f.reorder + f.delay:
                self.counts["delayed"] += 1
                time.sleep(f.delay_s)   # the fault itself: this batch arrives late
            self._sink(batch)
        if held is not None:
            self._sink(held)
