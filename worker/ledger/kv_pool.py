"""The KV tensors of one rank's two tiers, and block copies planned as few large slice copies.

Each pool is ``[blocks, layers, K|V, tokens, kv_heads, head_dim]``, block-major,
so adjacent slots form one contiguous run and a run of adjacent (source,
destination) pairs moves as one slice copy. On CUDA the copies go on a side
stream that the compute stream then waits on.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from kvledger.worker.device import host_pin_memory, resolve_device
from kvledger.worker.ledger.block import PRIMARY, SECONDARY
from kvledger.worker.ledger.config import CacheConfig, PoolLayout

CopyOp = tuple[int, int, int, int]
"""(source tier, source slot, destination tier, destination slot)."""


def merge_runs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) slot pairs as ``(src_start, dst_start, length)`` runs where both sides are adjacent."""
    runs: list[list[int]] = []
    for s, d in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: Iterable[tuple[int, int]]) -> int:
    """Copy blocks ``src[s] -> dst[d]`` for every pair, one slice copy per run; returns the number of copies."""
    runs = merge_runs(pairs)
    cuda = src.is_cuda or dst.is_cuda
    if not cuda:
        for s, d, n in runs:
            dst[d:d + n].copy_(src[s:s + n])
        return len(runs)
    side = torch.cuda.Stream(device=src.device if src.is_cuda else dst.device)
    side.wait_stream(torch.cuda.current_stream(side.device))
    with torch.cuda.stream(side):
        for s, d, n in runs:
            dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
    torch.cuda.current_stream(side.device).wait_stream(side)
    return len(runs)


class TieredPools:
    """Primary pools on the rank's device, secondary pools in host memory (pinned where CUDA exists).

    One pool per distinct KV head count of one window's layers (``layouts``,
    by default ``CacheConfig.pool_layouts``; one for most models), all indexed
    by the same slots: a block's slot names its K/V in every pool, and a block
    copy moves it in each.
    """

    def __init__(self, config: CacheConfig, num_primary: int, num_secondary: int,
                 layouts: tuple[PoolLayout, ...] | None = None) -> None:
        self.device = resolve_device(config.device)
        self.layouts = config.pool_layouts if layouts is None else layouts
        self.primary_pools: list[torch.Tensor] = []
        self.secondary_pools: list[torch.Tensor] = []
        if config.materialize:
            pin = host_pin_memory() and num_secondary > 0
            T, d = config.tokens_per_block, config.head_dim
            for shape in ((len(p.layers), 2, T, p.num_kv_heads, d) for p in self.layouts):
                self.primary_pools.append(torch.zeros((num_primary, *shape), dtype=config.dtype, device=self.device))
                self.secondary_pools.append(torch.zeros((num_secondary, *shape), dtype=config.dtype, device="cpu",
                                                        pin_memory=pin))
        self._pending: list[CopyOp] = []
        self.copies_issued = 0

    @property
    def primary(self) -> torch.Tensor | None:
        """The primary pool where there is one (every layer with the same KV heads); ``None`` without tensors."""
        return self._single(self.primary_pools)

    @property
    def secondary(self) -> torch.Tensor | None:
        return self._single(self.secondary_pools)

    def _single(self, pools: list[torch.Tensor]) -> torch.Tensor | None:
        if len(pools) > 1:
            raise ValueError(f"this ledger keeps {len(pools)} pools, one per KV head count "
                             f"{[p.num_kv_heads for p in self.layouts]}; use primary_pools / secondary_pools")
        return pools[0] if pools else None

    def tier(self, tier: int) -> list[torch.Tensor]:
        return self.primary_pools if tier == PRIMARY else self.secondary_pools

    def plan(self, src_tier: int, src_slot: int, dst_tier: int, dst_slot: int) -> None:
        """Queue one block copy; queued copies run in order at ``flush``."""
        if self.primary_pools:
            self._pending.append((src_tier, src_slot, dst_tier, dst_slot))

    def flush(self) -> None:
        """Run queued copies in as few merged runs as their order allows.

        Copies are grouped while they go in one direction and touch disjoint
        slots: a later copy may read or overwrite a slot an earlier one wrote (an
        onboard into a slot an offload just vacated, a host slot offloaded into
        twice), and such a copy starts a new group so that order is kept.
        """
        ops, self._pending = self._pending, []
        group: list[CopyOp] = []
        touched: set[tuple[int, int]] = set()
        for op in ops:
            src, dst = (op[0], op[1]), (op[2], op[3])
            if group and (op[0] != group[0][0] or op[2] != group[0][2] or src in touched or dst in touched):
                self._run(group)
                group, touched = [], set()
            group.append(op)
            touched.update((src, dst))
        if group:
            self._run(group)

    def _run(self, group: list[CopyOp]) -> None:
        src_tier, _, dst_tier, _ = group[0]
        pairs = [(op[1], op[3]) for op in group]
        for src, dst in zip(self.tier(src_tier), self.tier(dst_tier)):
            self.copies_issued += copy_blocks(src, dst, pairs)

    @property
    def elements_per_block(self) -> int:
        """Elements of one block's K/V summed over the primary pools: a row of ``read_blocks``."""
        return sum(p[0].numel() for p in self.primary_pools)

    def _rows(self, data: torch.Tensor) -> list[torch.Tensor]:
        """``data`` (``[blocks, elements_per_block]``) as one view per primary pool, shaped like its blocks."""
        views, at = [], 0
        for pool in self.primary_pools:
            e = pool[0].numel()
            views.append(data[:, at:at + e].view(data.shape[0], *pool.shape[1:]))
            at += e
        return views

    def read_blocks(self, slots: Sequence[int]) -> torch.Tensor:
        """Primary blocks gathered into one contiguous ``[len(slots), elements_per_block]`` tensor (for sending):
        row ``i`` holds block ``slots[i]``'s K/V of every pool, pool after pool."""
        assert self.primary_pools, "read_blocks on a ledger without tensors"
        first = self.primary_pools[0]
        out = torch.empty((len(slots), self.elements_per_block), dtype=first.dtype, device=first.device)
        pairs = [(s, i) for i, s in enumerate(slots)]
        for pool, rows in zip(self.primary_pools, self._rows(out)):
            copy_blocks(pool, rows, pairs)
        return out

    def write_blocks(self, slots: Sequence[int], data: torch.Tensor) -> None:
        """Scatter the rows of ``data`` (``read_blocks``' layout) into primary slots ``slots`` of every pool."""
        assert self.primary_pools, "write_blocks on a ledger without tensors"
        pairs = [(i, s) for i, s in enumerate(slots)]
        for pool, rows in zip(self.primary_pools, self._rows(data)):
            copy_blocks(rows, pool, pairs)

__all__ = ["CopyOp", "TieredPools", "copy_blocks", "merge_runs", "PRIMARY", "SECONDARY"]
