"""A token bucket over request costs: the rate a tenant's completions may take of the ranks (``tokens_per_s``).

The bucket fills at ``rate`` up to ``capacity``; a request of cost ``c`` may
go when ``c`` tokens are in it and takes them. ``wait_s`` says how long until
a cost (the tenant's queued requests' and a new one's together) would be
covered, which is what a refusal's ``Retry-After`` tells the client. Time is
the caller's clock; not thread-safe (the admission gate locks).
"""
from __future__ import annotations


class TokenBucket:
    """See the module docstring."""

    __slots__ = ("_at", "_level", "capacity", "rate")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        assert rate > 0 and capacity > 0, "TenantLimits validates the rate and the capacity"
        self.rate, self.capacity = rate, capacity
        self._level, self._at = capacity, now

    def level(self, now: float) -> float:
        """Tokens in the bucket at ``now`` (a clock that steps back leaves it as it was)."""
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
            self._at = now
        return self._level

    def wait_s(self, cost: float, now: float) -> float:
        """Seconds until ``cost`` tokens would be in the bucket (0: now), had it no capacity: a cost of queued
        requests together may exceed it, each of them alone may not (the gate refuses those with a 400)."""
        return max(0.0, (cost - self.level(now)) / self.rate)

    def take(self, cost: float, now: float) -> bool:
        """Take ``cost`` tokens if they are in the bucket."""
        if self.level(now) < cost:
            return False
        self._level -= cost
        return True
