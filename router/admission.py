"""The router's bounded, weighted-fair admission: at most so many completions on the ranks at once, a bounded queue
before them, and each tenant its share of the slots under contention.

A completion holds a slot from its routing decision to its answer (a streamed
one until its stream ends); one that finds no slot it may take waits, each
waiter on its own event; one that finds the queue full, or waits longer than
``queue_timeout_s``, is refused with ``AdmissionRefused`` (the HTTP API
answers 429 with ``Retry-After``) without anything having been sent. The
slots keep the ranks' own queues short, so routing decides with fresh loads;
the queue absorbs a burst without holding a thread per request on a rank.

Which waiter a freed slot goes to is the ``discipline``:

- ``fair``: start-time fair queueing (SFQ; Goyal, Vin and Cheng, 1996) with
  tenants as the flows and a request's cost (prompt tokens + ``n *
  max_tokens``, ``router.tenant_limits``) as its length. Each tenant keeps a
  finish tag ``F``: the virtual time it has been served up to. A slot goes to
  the tenant whose next request's start tag ``S = max(V, F)`` is least (ties:
  the earlier arrival); then ``V = S`` and ``F = S + cost / weight``. ``V``,
  the start tag of the last request let in, is where a tenant that asked
  nothing (or was held back by its own limits) starts again, so nobody banks
  credit by waiting: under contention each tenant gets slots in proportion to
  its weight, whatever it sends. A tenant at its ``max_inflight`` waits for
  one of its own slots, and one whose token bucket (``router.token_bucket``)
  does not yet hold its next request's cost waits for the bucket; others pass
  both. A request whose bucket would take longer than ``queue_timeout_s`` is
  refused at once, ``Retry-After`` saying when it would fit. Within a tenant:
  higher ``priority`` first, then an admin key's request, then arrival.
  Without keys everyone is one tenant, so this is arrival order by priority.
- ``fifo``: one queue in arrival order, as the router had before fair shares
  (kept for comparison): tenants are counted, their weights and limits are
  not applied.

Router replicas (``up --routers N``) each keep their own gate: shares and
limits hold per replica. Thread-safe; the clock is injected (token buckets,
queueing times), the waits are real.
"""
from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from kvledger.router.openai_types import ParamError
from kvledger.router.stats import Histogram
from kvledger.router.tenant_limits import TenantLimits
from kvledger.router.tenants import OPEN, Caller
from kvledger.router.token_bucket import TokenBucket
from kvledger.worker.wire.request import DEFAULT_PRIORITY

Discipline = Literal["fair", "fifo"]
DISCIPLINES: tuple[Discipline, ...] = ("fair", "fifo")
#: The tenant of a router without keys, as metrics and reports name it.
OPEN_TENANT = "open"
#: Queueing time buckets, seconds: from a slot handed over at once to a whole ``queue_timeout_s``.
QUEUE_BUCKETS_S: tuple[float, ...] = (0.001, 0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdmissionRefused(RuntimeError):
    """No slot and no room in the queue, no slot within the queue's timeout, or a tenant over its token rate: the
    request was not taken; ``retry_after_s`` says when it may be sent again."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Held:
    """One taken slot, given back exactly once: by ``release``, or when dropped unreleased. A streamed answer
    releases its slot when its stream ends, but a stream whose client left before it started never runs, so
    nothing but its being dropped gives the slot back."""

    __slots__ = ("_leave", "_once")

    def __init__(self, leave: Callable[[], None]) -> None:
        self._leave = leave
        self._once = threading.Lock()

    def release(self) -> None:
        if self._once.acquire(blocking=False):
            self._leave()

    __del__ = release


@dataclass(frozen=True, slots=True)
class TenantAdmission:
    """One tenant at the gate, as reports and metrics read it (a copy)."""

    tenant: str
    limits: TenantLimits
    running: int
    queued: int
    shed: int
    """Its completions refused with a 429."""
    served: int
    """Its completions let onto the ranks."""
    served_tokens: int
    """Their cost: prompt tokens + ``n * max_tokens`` each."""
    queue_seconds: Histogram
    """Time from arrival to a slot, of the completions let in."""


@dataclass(eq=False, slots=True)
class _Waiter:
    order: tuple[int, int, int]
    """Within its tenant: higher priority, an admin's, earlier arrival first (``fifo``: arrival only); the last
    member is the arrival number."""
    tenant: _Tenant
    cost: int
    since: float
    woken: threading.Condition
    """On the gate's lock: notified when the waiter is let in, or when its bucket will let it go sooner."""
    granted: bool = False
    ready_at: float | None = None
    """When its tenant's bucket holds its cost, while it heads its tenant's queue and the bucket holds it back."""


@dataclass(eq=False, slots=True)
class _Tenant:
    name: str
    limits: TenantLimits
    bucket: TokenBucket | None
    finish: float = 0.0
    """SFQ's finish tag: the virtual time this tenant has been served up to."""
    running: int = 0
    queue: list[_Waiter] = field(default_factory=list)
    """Sorted by ``_Waiter.order``."""
    shed: int = 0
    served: int = 0
    served_tokens: int = 0
    waited: Histogram = field(default_factory=lambda: Histogram(QUEUE_BUCKETS_S))

    def capped(self) -> bool:
        return self.limits.max_inflight is not None and self.running >= self.limits.max_inflight


class AdmissionGate:
    """See the module docstring."""

    def __init__(self, max_inflight: int, max_queued: int, queue_timeout_s: float, discipline: Discipline = "fair",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if discipline not in DISCIPLINES:
            raise ValueError(f"admission must be one of {', '.join(DISCIPLINES)}, got {discipline!r}")
        self.max_inflight, self.max_queued, self.queue_timeout_s = max_inflight, max_queued, queue_timeout_s
        self.discipline, self.clock = discipline, clock
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._inflight = 0
        self._queued = 0
        self._tenants: dict[str, _Tenant] = {}
        self._arrivals = itertools.count()
        self._vtime = 0.0
        """SFQ's ``V``: the start tag of the last request let in."""
        self.refused = 0

    def hold(self, caller: Caller = OPEN, priority: int | None = None, cost: int = 1) -> Held:
        """Take a slot for ``caller``'s request of ``cost`` (waiting in the queue for one first if need be); it is
        the caller's until released. ``ParamError`` (a ``ValueError``; nothing changed) for a cost its tenant's
        bucket can never hold; ``AdmissionRefused`` when there is no room for it."""
        name = OPEN_TENANT if caller.tenant is None else caller.tenant
        capacity = caller.limits.capacity
        if self.discipline == "fair" and capacity is not None and cost > capacity:
            raise ParamError("max_tokens", f"max_tokens: the request costs {cost} tokens (prompt + n * max_tokens), "
                                           f"more than tenant {name!r}'s token bucket holds (burst={capacity:g})")
        prio = DEFAULT_PRIORITY if priority is None else priority
        with self._lock:
            tenant = self._tenant(name, caller.limits)
            now = self.clock()
            arrival = next(self._arrivals)
            order = (-prio, caller.role != "admin", arrival) if self.discipline == "fair" else (0, 0, arrival)
            me = _Waiter(order, tenant, cost, now, threading.Condition(self._lock))
            if self.discipline == "fair" and tenant.bucket is not None:
                wait = tenant.bucket.wait_s(sum(w.cost for w in tenant.queue) + cost, now)
                if wait > self.queue_timeout_s:
                    raise self._refuse(tenant, f"tenant {name!r} is over its token rate (tokens_per_s="
                                       f"{tenant.limits.tokens_per_s:g}): this request fits in {wait:.1f} s",
                                       math.ceil(wait))
            self._enqueue(me)
            self._grant(now)
            if not me.granted and self._queued > self.max_queued:
                self._dequeue(me)
                raise self._refuse(tenant, f"the router is full: {self._inflight} completions running and "
                                   f"{self._queued} queued (max_queued_completions={self.max_queued})")
            deadline = now + self.queue_timeout_s
            while not me.granted:
                if now >= deadline:
                    self._dequeue(me)
                    self._grant(now)   # a new head of its tenant's queue may fit the bucket
                    raise self._refuse(tenant, f"no slot within {self.queue_timeout_s:g} s: {self._inflight} "
                                       "completions running", self._retry_after(tenant, now))
                until = deadline if me.ready_at is None else min(deadline, me.ready_at)
                if not me.woken.wait(until - now) and not me.granted:   # a bucket may let someone go now
                    me.ready_at = None
                    self._grant(self.clock())
                now = self.clock()
        return Held(lambda: self._leave(tenant))

    @contextmanager
    def slot(self, caller: Caller = OPEN, priority: int | None = None, cost: int = 1) -> Iterator[None]:
        """Hold a slot for the duration of the block."""
        held = self.hold(caller, priority, cost)
        try:
            yield
        finally:
            held.release()

    def shed(self, caller: Caller) -> None:
        """Count a 429 the caller got past the gate (a rank with no room now)."""
        with self._lock:
            self._tenant(OPEN_TENANT if caller.tenant is None else caller.tenant, caller.limits).shed += 1

    def counts(self) -> tuple[int, int]:
        """Completions holding a slot, completions queued."""
        with self._lock:
            return self._inflight, self._queued

    def tenants(self) -> list[TenantAdmission]:
        """Every tenant seen so far, by name."""
        with self._lock:
            return [TenantAdmission(t.name, t.limits, t.running, len(t.queue), t.shed, t.served, t.served_tokens,
                                    t.waited.copy()) for _, t in sorted(self._tenants.items())]

    def wait_idle(self, timeout_s: float) -> bool:
        """Until no completion holds or waits for a slot (a router draining; a caller that must know a stream
        ended on the server's thread); ``False`` if that takes longer than ``timeout_s``."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0 and self._queued == 0, timeout_s)

    # ------------------------------------------------------------------ under the lock

    def _tenant(self, name: str, limits: TenantLimits) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            bucket = None if limits.tokens_per_s is None else TokenBucket(limits.tokens_per_s, limits.capacity,
                                                                          self.clock())
            t = self._tenants[name] = _Tenant(name, limits, bucket)
        assert t.limits == limits, f"tenant {name!r} came with two sets of limits (ApiKeys.load makes one)"
        return t

    def _enqueue(self, w: _Waiter) -> None:
        bisect.insort(w.tenant.queue, w, key=lambda x: x.order)
        self._queued += 1

    def _dequeue(self, w: _Waiter) -> None:
        w.tenant.queue.remove(w)
        self._queued -= 1
        self._idle.notify_all()

    def _grant(self, now: float) -> None:
        """Hand every free slot to the waiter the discipline picks (a head its bucket holds back is told when to
        look again)."""
        while self._inflight < self.max_inflight and self._queued:
            w = self._pick_fifo() if self.discipline == "fifo" else self._pick_fair(now)
            if w is None:
                return
            t = w.tenant
            self._dequeue(w)
            if self.discipline == "fair":
                start = max(self._vtime, t.finish)
                self._vtime, t.finish = start, start + w.cost / t.limits.weight
                if t.bucket is not None:
                    assert t.bucket.take(w.cost, now), "picked only when the bucket holds the cost"
            self._inflight += 1
            t.running += 1
            t.served += 1
            t.served_tokens += w.cost
            t.waited.observe(max(0.0, now - w.since))
            w.granted = True
            w.woken.notify()

    def _pick_fifo(self) -> _Waiter:
        return min((t.queue[0] for t in self._tenants.values() if t.queue), key=lambda w: w.order[2])

    def _pick_fair(self, now: float) -> _Waiter | None:
        """The head of the eligible tenant with the least start tag (ties: the earlier arrival)."""
        best: tuple[float, int] | None = None
        pick = None
        for t in self._tenants.values():
            if not t.queue or t.capped():
                continue
            head = t.queue[0]
            if t.bucket is not None and (wait := t.bucket.wait_s(head.cost, now)) > 0:
                if head.ready_at is None or now + wait < head.ready_at:
                    head.ready_at = now + wait
                    head.woken.notify()
                continue
            key = (max(self._vtime, t.finish), head.order[2])
            if best is None or key < best:
                best, pick = key, head
        return pick

    def _refuse(self, tenant: _Tenant, message: str, retry_after_s: int = 1) -> AdmissionRefused:
        self.refused += 1
        tenant.shed += 1
        return AdmissionRefused(message, max(1, retry_after_s))

    def _retry_after(self, tenant: _Tenant, now: float) -> int:
        """When a refused request of ``tenant`` may fit: its bucket's wait for what it still has queued, or 1."""
        if self.discipline != "fair" or tenant.bucket is None:
            return 1
        return math.ceil(tenant.bucket.wait_s(sum(w.cost for w in tenant.queue), now))

    def _leave(self, tenant: _Tenant) -> None:
        with self._lock:
            self._inflight -= 1
            tenant.running -= 1
            self._grant(self.clock())
            self._idle.notify_all()
