"""What a rank publishes about its blocks: numbered event batches, and snapshots of every block it holds.

A batch travels as ``encode_batch`` bytes under the rank's number for it
(from 0, per rank), so a router can tell a gap, a duplicate or a restart from
the numbering alone; a snapshot lists every reusable block together with the
first batch number it does not reflect.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PublishedBatch:
    seq: int
    data: bytes
    """``encode_batch`` of the batch: what travels to routers and monitors."""


@dataclass(slots=True)
class StoredBlock:
    """One block a rank holds, as a snapshot reports it."""

    block_hash: int
    parent_hash: int | None
    token_ids: list[int]
    medium: str
    lora_id: int | None
    cache_salt: str | None
    priority: int
    group_idx: int = 0
    """The attention window group holding it (as ``BlockStored.group_idx``)."""
    kv_cache_spec_kind: str | None = None
    """Its group's attention, ``"full_attention"`` or ``"sliding_window"`` (``None``: a model without windows)."""
    kv_cache_spec_sliding_window: int | None = None
    """Its group's window in tokens, for a sliding window."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    next_seq: int
    """The first batch number not reflected in ``blocks``."""
    blocks: list[StoredBlock]
