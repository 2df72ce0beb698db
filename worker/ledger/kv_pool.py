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
CopyRun = tuple[int, int, list[int], list[int]]
"""Copies planned together: (source tier, destination tier, source slots, the destination slot of each)."""


def merge_slot_runs(srcs: Sequence[int], dsts: Sequence[int]) -> list[tuple[int, int, int]]:
    """Copies ``srcs[i] -> dsts[i]`` as ``(src_start, dst_start, length)`` runs where both sides are adjacent, in
    source order (equal sources in the given order)."""
    one = _one_run(srcs, dsts)
    if one is not None:
        return [one]
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = n = 0
    for i in sorted(range(len(srcs)), key=srcs.__getitem__):
        s, d = srcs[i], dsts[i]
        if n and s == s0 + n and d == d0 + n:
            n += 1
            continue
        if n:
            runs.append((s0, d0, n))
        s0, d0, n = s, d, 1
    if n:
        runs.append((s0, d0, n))
    return runs


def _one_run(srcs: Sequence[int], dsts: Sequence[int]) -> tuple[int, int, int] | None:
    """The one run of ``merge_slot_runs`` where both sides step by one the same way (the slots of an offload or
    an onboard, told in C with no sort), else ``None``."""
    n = len(srcs)
    if not n:
        return None
    s, d = srcs[0], dsts[0]
    step = 1 if srcs[-1] >= s else -1
    if list(srcs) != list(range(s, s + step * n, step)) or list(dsts) != list(range(d, d + step * n, step)):
        return None
    return (s, d, n) if step == 1 else (srcs[-1], dsts[-1], n)


def merge_runs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst) slot pairs as ``(src_start, dst_start, length)`` runs where both sides are adjacent."""
    ordered = sorted(pairs)
    return merge_slot_runs([s for s, _ in ordered], [d for _, d in ordered])


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: Iterable[tuple[int, int]]) -> int:
    """Copy blocks ``src[s] -> dst[d]`` for every pair, one slice copy per run; returns the number of copies."""
    return copy_runs(src, dst, merge_runs(pairs))


def copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]) -> int:
    """Copy ``src[s:s + n] -> dst[d:d + n]`` for every ``(s, d, n)`` run; returns the number of copies."""
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


def _one_group(runs: list[CopyRun]) -> bool:
    """Whether ``runs`` go one way and touch every slot once, so that ``TieredPools.flush`` runs them as one group
    (told in a few passes in C instead of its walk: the common case of one admission's offloads or onboards)."""
    src_tier, dst_tier = runs[0][0], runs[0][1]
    if any(r[0] != src_tier or r[1] != dst_tier for r in runs):
        return False
    n = sum(len(r[2]) for r in runs)
    srcs, dsts = set().union(*(r[2] for r in runs)), set().union(*(r[3] for r in runs))
    return len(srcs) == len(dsts) == n and (src_tier != dst_tier or srcs.isdisjoint(dsts))


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
        self._pending: list[CopyRun] = []
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
            self._pending.append((src_tier, dst_tier, [src_slot], [dst_slot]))

    def plan_n(self, src_tier: int, src_slots: list[int], dst_tier: int, dst_slots: list[int]) -> None:
        """``plan`` a copy of each source slot to the destination slot at its position, in order."""
        if self.primary_pools and src_slots:
            self._pending.append((src_tier, dst_tier, src_slots, dst_slots))

    def flush(self) -> None:
        """Run queued copies in as few merged runs as their order allows.

        Copies are grouped while they go in one direction and touch disjoint
        slots: a later copy may read or overwrite a slot an earlier one wrote (an
        onboard into a slot an offload just vacated, a host slot offloaded into
        twice), and such a copy starts a new group so that order is kept.
        """
        runs, self._pending = self._pending, []
        if not runs:
            return
        if _one_group(runs):
            src_tier, dst_tier, srcs, dsts = runs[0]
            if len(runs) > 1:
                srcs, dsts = [s for r in runs for s in r[2]], [d for r in runs for d in r[3]]
            self._run(src_tier, dst_tier, srcs, dsts)
            return
        ops = [(st, s, dt, d) for st, dt, ss, ds in runs for s, d in zip(ss, ds)]
        group: list[CopyOp] = []
        touched: set[tuple[int, int]] = set()
        for op in ops:
            src, dst = (op[0], op[1]), (op[2], op[3])
            if group and (op[0] != group[0][0] or op[2] != group[0][2] or src in touched or dst in touched):
                self._run_ops(group)
                group, touched = [], set()
            group.append(op)
            touched.update((src, dst))
        if group:
            self._run_ops(group)

    def _run_ops(self, group: list[CopyOp]) -> None:
        self._run(group[0][0], group[0][2], [op[1] for op in group], [op[3] for op in group])

    def _run(self, src_tier: int, dst_tier: int, srcs: list[int], dsts: list[int]) -> None:
        runs = merge_slot_runs(srcs, dsts)
        for src, dst in zip(self.tier(src_tier), self.tier(dst_tier)):
            self.copies_issued += copy_runs(src, dst, runs)

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

__all__ = ["CopyOp", "CopyRun", "TieredPools", "copy_blocks", "copy_runs", "merge_runs", "merge_slot_runs", "PRIMARY",
           "SECONDARY"]
