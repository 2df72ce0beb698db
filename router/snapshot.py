"""A rank's snapshot as the block store reads it: every block it holds, checked before anything changes.

An entry is anything with ``block_hash`` and ``medium`` (the ledger's
``StoredBlock``, or ``SnapshotBlock``); a windowed model's entries also name
their KV cache group and its window, as its stored events do.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from kvledger.router.refs import tier_unit
from kvledger.worker.wire.events import Medium, check_hash, check_medium


class SnapshotEntry(Protocol):
    """One block a rank holds, as its snapshot lists it (``kvledger.worker.wire.batches.StoredBlock`` is one)."""

    @property
    def block_hash(self) -> int: ...

    @property
    def medium(self) -> str: ...


@dataclass(frozen=True, slots=True)
class SnapshotBlock:
    """The least a snapshot entry carries; a hash listed twice holds two refs."""

    block_hash: int
    medium: Medium = "GPU"


@dataclass(frozen=True, slots=True)
class SnapshotRow:
    """A snapshot entry, checked: its group, hash, packed ref unit, and the group's window as the entry says."""

    group: int
    block_hash: int
    unit: int
    kind: str | None
    window: int | None


def read_snapshot(blocks: Iterable[SnapshotEntry]) -> list[SnapshotRow]:
    """Check every entry of a snapshot (``TypeError``/``ValueError`` naming the first bad one)."""
    rows = []
    for i, b in enumerate(blocks):
        try:
            h, medium = b.block_hash, b.medium
        except AttributeError:
            raise TypeError(f"blocks[{i}] must have block_hash and medium (e.g. SnapshotBlock), "
                            f"got {type(b).__name__}") from None
        h = check_hash(h, f"blocks[{i}].block_hash")
        if check_medium(medium, f"blocks[{i}].medium") is None:
            raise ValueError(f"blocks[{i}].medium must be 'GPU' or 'CPU', got None")
        g = getattr(b, "group_idx", 0)
        if type(g) is not int or g < 0:
            raise ValueError(f"blocks[{i}].group_idx must be an int >= 0, got {g!r}")
        rows.append(SnapshotRow(g, h, tier_unit(medium), getattr(b, "kv_cache_spec_kind", None),
                                getattr(b, "kv_cache_spec_sliding_window", None)))
    return rows


def group0_refs(rows: list[SnapshotRow]) -> dict[int, int]:
    """The packed refs per hash of a snapshot's group 0 (every block, for a model without windows)."""
    refs: dict[int, int] = {}
    for row in rows:
        if not row.group:
            refs[row.block_hash] = refs.get(row.block_hash, 0) + row.unit
    return refs
