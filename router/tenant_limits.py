"""A tenant's share and limits at the router's admission: its weight, its own cap on running completions, its
token rate.

They follow a key's role in the ``--api-keys`` file as ``key=value`` fields
(``router.tenants``)::

    sk-aaa  acme   user   weight=2 max_inflight=8 tokens_per_s=20000
    sk-bbb  flood  user   weight=1 max_inflight=4 tokens_per_s=5000 burst=20000

A request's cost, which the weight shares and the token rate bounds, is its
prompt tokens plus the tokens it may generate (``n * max_tokens``): what it
can take of a rank, known before anything is sent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's settings (every tenant's, without keys: the defaults); validated on construction."""

    weight: float = 1.0
    """Share of the router's slots under contention, relative to the other tenants' weights."""
    max_inflight: int | None = None
    """Completions of this tenant on the ranks at once; more wait for one of its own slots (others pass them)."""
    tokens_per_s: float | None = None
    """Rate of a token bucket over each request's cost; ``None``: no rate limit."""
    burst: float | None = None
    """The bucket's capacity (default: one second's worth of ``tokens_per_s``); a request costing more is a 400."""

    def __post_init__(self) -> None:
        if not (isinstance(self.weight, (int, float)) and 0 < self.weight < math.inf):
            raise ValueError(f"weight must be a number > 0, got {self.weight!r}")
        if self.max_inflight is not None and (type(self.max_inflight) is not int or self.max_inflight < 1):
            raise ValueError(f"max_inflight must be an int >= 1, got {self.max_inflight!r}")
        for name in ("tokens_per_s", "burst"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and 0 < v < math.inf):
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if self.burst is not None and self.tokens_per_s is None:
            raise ValueError("burst needs tokens_per_s (it is the capacity of that rate's bucket)")

    @property
    def capacity(self) -> float | None:
        """The token bucket's capacity, ``None`` without a rate."""
        if self.tokens_per_s is None:
            return None
        return self.tokens_per_s if self.burst is None else self.burst


NO_LIMITS = TenantLimits()
"""The defaults: weight 1, no cap, no rate (every tenant of a key that sets nothing; the open router's)."""

#: How each ``key=value`` field of the keys file reads its value (as ``TenantLimits`` types it).
FIELDS: dict[str, type] = {"weight": float, "max_inflight": int, "tokens_per_s": float, "burst": float}


def parse_limits(fields: list[str]) -> TenantLimits:
    """``["weight=2", "max_inflight=8"]`` -> ``TenantLimits(weight=2.0, max_inflight=8)``; a ``ValueError`` begins
    with the field that is wrong (unknown, given twice, not ``NAME=VALUE``, or a value out of range)."""
    given: dict[str, float | int] = {}
    for f in fields:
        name, eq, text = f.partition("=")
        if not eq or name not in FIELDS:
            raise ValueError(f"{f!r}: expected NAME=VALUE with NAME one of {', '.join(FIELDS)}")
        if name in given:
            raise ValueError(f"{name}: given twice")
        try:
            given[name] = FIELDS[name](text)
        except ValueError:
            kind = "an int" if FIELDS[name] is int else "a number"
            raise ValueError(f"{name}: expected {kind}, got {text!r}") from None
    return TenantLimits(**given)  # type: ignore[arg-type]
