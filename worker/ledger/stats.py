"""Plain results the ledger reports: stats, prefix-reuse summaries, what an admission reused, what a pin holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WindowStats:
    """One attention window's device-tier blocks."""

    window: int | None
    """Its size in tokens; ``None``: full attention."""
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    num_free_secondary_blocks: int


@dataclass(frozen=True, slots=True)
class KvCacheStats:
    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    """Blocks handed to sequences, fresh or recycled."""
    alloc_new_blocks: int
    """Of those, blocks that held nothing reusable before."""
    reused_blocks: int
    """Prompt blocks served from the cache (fully or partly)."""
    missed_blocks: int
    """Prompt blocks that had to be computed."""
    cache_hit_rate: float
    """reused / (reused + missed); 0 before any prompt."""
    num_free_secondary_blocks: int
    allocated_bytes: int
    max_num_secondary_blocks: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0
    events_dropped: int = 0
    windows: tuple[WindowStats, ...] = ()
    """Per attention window (``CacheConfig.window_layouts`` order); the block counts above are their sums."""


@dataclass(frozen=True, slots=True)
class PrefixReuseSummary:
    reusable_blocks_allocated: int
    """Matched full blocks already held by running requests: they cost no block budget."""
    reusable_blocks_all: int
    """All matched full blocks: they cost no token budget."""
    total_matched_tokens: int
    """Tokens an admission would reuse now, partial block included."""
    first_new_block: int
    """Index of the first prompt block that must be computed (or copied into)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What adding one sequence reused, moved and allocated."""

    prepopulated_tokens: int
    reused_blocks: int
    """Full blocks shared from the tree."""
    partial_tokens: int
    """Tokens reused from a partly matching block (in place or copied)."""
    copied_blocks: int
    onboarded_blocks: int
    allocated_blocks: int


@dataclass(frozen=True, slots=True)
class PinnedPrefix:
    """What ``pin_prefix`` holds: a prefix of ``blocks`` full blocks, of which each window keeps the blocks a query
    past the prefix reads (all of them under full attention, the last ones in a sliding window)."""

    blocks: int
    slots: tuple[list[int], ...]
    """Each window's primary pool slots of its pinned blocks, in prompt order: the prefix's last ones."""
