"""Block metadata: who uses a block, what it holds, where its data lives. No KV data here.

Metadata and data are separate: offloading swaps pool slots between two blocks,
so a block's id, its tree node and the requests holding it never change.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvledger.worker.wire.block_key import BlockHash, BlockKey

if TYPE_CHECKING:
    from kvledger.worker.ledger.prefix_tree import TreeNode

PRIMARY, SECONDARY = 0, 1
TIER_MEDIUM = ("GPU", "CPU")


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    slot: int
    """Index into the pool of ``tier``."""
    tier: int
    """``PRIMARY`` (device) or ``SECONDARY`` (host)."""
    window: int = 0
    """Index of the attention window whose pool holds the block (``CacheConfig.window_layouts``)."""
    ref_count: int = 0
    """Running requests (and pins) holding the block."""
    sched_ref_count: int = 0
    """``ref_count`` as seen by the scheduling round in progress."""
    key: BlockKey | None = None
    """What the block holds once stored; ``None`` for a block with no reusable content."""
    block_hash: BlockHash | None = None
    node: TreeNode | None = None
    """Prefix-tree node while the block is reusable."""
    prev: Block | None = None
    """Previous block of the sequence that wrote it."""
    is_full: bool = False
    priority: int = 35
    duration_s: float | None = None
    """How long ``priority`` lasts once the block is free; ``None``: for good."""
    expires_at: float | None = None
    """When ``priority`` falls back to the default (injected clock): set when the block is released with a
    duration, cleared when a request takes it again. Only free blocks expire (TensorRT-LLM's rule)."""
    level: int = -1
    """Free-list level while free (-1 when not in a free list)."""
    freed_at: int = 0
    """Release order stamp: keeps LRU order among blocks moved between levels together."""
    fl_prev: Block | None = None
    fl_next: Block | None = None

    @property
    def medium(self) -> str:
        return TIER_MEDIUM[self.tier]


NO_BLOCK = 2**31 - 1
"""The id and slot of no block: int32's largest value, past every pool and every block list (``CacheConfig`` keeps
them smaller). Reading it raises ``IndexError``, where -1 would wrap to the last block and hand back its data
without a word; TensorRT-LLM's ``KVCacheIndex::nullIndex`` is likewise a value no real index takes."""

PLACEHOLDER = Block(block_id=NO_BLOCK, slot=NO_BLOCK, tier=PRIMARY)
"""A position of a sliding window's block list whose block slid out of the window (or was never needed): it keeps
the position in the sequence's block list and block table (id and slot ``NO_BLOCK``) and holds no memory."""
