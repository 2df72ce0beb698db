"""The tensor pools of every window of a VSWA ledger, as the engine reads them."""
from __future__ import annotations

import torch

from kvledger.worker.ledger.kv_pool import TieredPools


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
