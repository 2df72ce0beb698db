"""One attention window's manager: its block pool and retention, and which of a sequence's blocks it still needs.

A model with attention windows of several sizes (VSWA, TensorRT-LLM's
``WindowBlockManager`` per window) keeps one of these per distinct window,
each with its own pools and block counts, all sharing one prefix tree (a node
holds one block per window) and one event stream (events name the window's
group). A query at position ``p`` of a window of ``size`` tokens attends to
the keys at positions ``> p - size`` (``worker/wire/windows.py``: the router
probes by the same rule); the blocks before the first such key are needed by
no later query, so decode releases them and leaves placeholders.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvledger.worker.ledger.block import PLACEHOLDER, Block
from kvledger.worker.ledger.block_pool import BlockPool
from kvledger.worker.ledger.config import CacheConfig, WindowKind
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.ledger.retention import Retention
from kvledger.worker.wire.windows import first_needed_block


class WindowManager:
    """The blocks of one attention window (see the module docstring)."""

    __slots__ = ("index", "size", "kind", "tokens_per_block", "pool", "retention")

    def __init__(self, config: CacheConfig, clock: Callable[[], float], index: int, tree: PrefixTree,
                 events: EventBuffer) -> None:
        layout = config.window_layouts[index]
        self.index = index
        self.size = layout.window
        """Tokens a query attends to, itself included; ``None``: full attention."""
        self.kind: WindowKind = layout.kind
        self.tokens_per_block = config.tokens_per_block
        self.pool = BlockPool(config, clock, index, tree, events)
        self.retention = Retention(self.pool, config.tokens_per_block)

    def first_needed(self, pos: int) -> int:
        """The first block position that a query at ``pos``, or any later one, attends to."""
        return first_needed_block(self.size, pos, self.tokens_per_block)

    def alloc(self, n: int) -> list[Block]:
        """``n`` clean primary blocks held once (capacity was checked)."""
        out = self.pool.take_free_n(n, count_alloc=True)
        for b in out:
            b.ref_count = 1
        return out

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference of each of ``blocks`` (a sequence's, in order); placeholders hold none."""
        self.pool.release(blocks)

    def sliding_out(self, blocks: list[Block], start: int, pos: int) -> list[Block]:
        """The blocks of positions ``start..`` that no query from ``pos`` on needs (held ones only)."""
        return [b for b in blocks[start:self.first_needed(pos)] if b is not PLACEHOLDER]


class WindowPools:
    """The tensor pools of every window of a VSWA ledger, as the engine reads them: ``primary_pools`` lists every
    window's pools, window by window (``CacheConfig.pool_layouts`` order)."""

    __slots__ = ("windows", "device")

    def __init__(self, windows: list[TieredPools]) -> None:
        self.windows = windows
        self.device = windows[0].device

    @property
    def primary_pools(self) -> list[torch.Tensor]:
        return [p for w in self.windows for p in w.primary_pools]

    @property
    def secondary_pools(self) -> list[torch.Tensor]:
        return [p for w in self.windows for p in w.secondary_pools]

    @property
    def primary(self) -> torch.Tensor | None:
        raise ValueError(f"this ledger keeps {len(self.windows)} attention windows, each with its own pools; use "
                         "primary_pools (window by window) or windows[i]")

    @property
    def copies_issued(self) -> int:
        return sum(w.copies_issued for w in self.windows)

    def flush(self) -> None:
        for w in self.windows:
            w.flush()
