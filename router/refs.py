"""A rank's refs on one block hash, packed in one int: device refs in the low 32 bits, host refs above.

Two stores of one hash then one removal leave it held, as vLLM's block pool may
hold two blocks with one hash; one int per (rank, hash) keeps both tiers' counts
without a container object per block.
"""
from __future__ import annotations

from kvledger.worker.wire.events import Medium

DEV = 1                   # one device-tier ref
HOST = 1 << 32            # one host-tier ref
DEV_MASK = HOST - 1


def tier_unit(medium: Medium | None) -> int:
    """The packed increment for one ref on ``medium`` (``None`` = unspecified = device, as vLLM means it)."""
    return HOST if medium == "CPU" else DEV


def held_on(v: int, unit: int) -> bool:
    """Whether packed refs ``v`` include one on the tier of ``unit``."""
    return bool(v >> 32) if unit == HOST else bool(v & DEV_MASK)
