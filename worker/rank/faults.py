"""Faults injected on purpose, off by default: what the chaos run and the tests use.

Two kinds: faults of the event transport (``TransportFaults``, ``FaultySink``)
and crashes of a rank at a named point of its work (``CrashPoints``).

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

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from kvledger.worker.wire.batches import PublishedBatch

logger = logging.getLogger(__name__)

CrashPoint = Literal["mid_prefill", "mid_publish", "migration_source", "migration_target"]
"""Where a rank can be made to crash: after a prefill wrote part of its prompts' KV and before the
requests finish; after a batch was numbered and before it left; on a migration's source with its
blocks pinned, mid-send; on its target with blocks allocated, mid-receive."""
CRASH_POINTS: tuple[str, ...] = get_args(CrashPoint)


@dataclass(frozen=True, slots=True)
class CrashSpec:
    """A crash a cluster arms when it starts (``Cluster.start(crashes=...)``): rank ``rank`` crashes the
    ``after``-th time it reaches ``point``. Armed once, in the rank's first incarnation: the actor Ray restarts
    after the crash starts with nothing armed."""

    rank: int
    point: CrashPoint
    after: int = 1

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 0:
            raise ValueError(f"CrashSpec.rank must be an int >= 0, got {self.rank!r}")
        if self.point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {self.point!r}; the points are {', '.join(CRASH_POINTS)}")
        if type(self.after) is not int or self.after < 1:
            raise ValueError(f"CrashSpec.after must be an int >= 1, got {self.after!r}")


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


class CrashPoints:
    """Crashes armed at named points of one rank's work (``CrashPoint``); none armed by default.

    A crash is the process exiting at once (``os._exit``), as a killed rank
    would: nothing is cleaned up, no reply is sent. The code at each point calls
    ``reached(point)``; the ``after``-th call past the arming crashes.
    ``exit`` is what crashing does (tests of the bookkeeping pass a function
    that raises instead).
    """

    def __init__(self, rank: int, exit: Callable[[int], object] = os._exit) -> None:
        self.rank = rank
        self._exit = exit
        self._armed: dict[str, int] = {}
        self._lock = threading.Lock()

    def arm(self, point: str, after: int = 1) -> None:
        """Crash the ``after``-th time ``point`` is reached from now on (1: the next time)."""
        if point not in CRASH_POINTS:
            raise ValueError(f"unknown crash point {point!r}; the points are {', '.join(CRASH_POINTS)}")
        if not isinstance(after, int) or isinstance(after, bool) or after < 1:
            raise ValueError(f"after must be an int >= 1, got {after!r}")
        with self._lock:
            self._armed[point] = after

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def armed(self) -> dict[str, int]:
        """Each armed point and how many more times it is passed before it crashes (1: the next)."""
        with self._lock:
            return dict(self._armed)

    def reached(self, point: CrashPoint) -> None:
        """The work is at ``point``: crash here if it is armed and its count is up."""
        if not self._armed:   # the common case: nothing armed, no lock taken
            return
        with self._lock:
            left = self._armed.get(point)
            if left is None:
                return
            if left > 1:
                self._armed[point] = left - 1
                return
            del self._armed[point]
        logger.warning("rank %d: crashing at %s, as armed", self.rank, point)
        self._exit(1)
