"""The block store for models with attention windows (VSWA): ``WindowedIndex``, and the safe-prefix rule.

The flat store (``PrefixIndex``, or ``ArrayIndex``) holds each rank's group-0
blocks, as for any model. A rank whose events name another group (``group_idx > 0``) or a sliding
window is *windowed*: its other groups' blocks are kept in ``RankGroups``, with
every group's window as its stored events say (``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``, as vLLM publishes them), and a probe answers
for it by the rule its ledger admits by: a prefix of ``m`` blocks counts only
if every group holds the blocks that the query at position ``m * block_size``
reads, all ``m`` under full attention, only those of the last ``window``
tokens under a sliding window (a query at ``p`` reads the keys ``> p - window``).
A group the rank never described counts as full attention. Ranks without
windows pay one check per event and per probe for this.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvledger.router.array_index import ArrayIndex
from kvledger.router.index import PrefixIndex, T
from kvledger.router.refs import DEV_MASK, held_on, tier_unit
from kvledger.router.snapshot import SnapshotEntry, group0_refs, read_snapshot
from kvledger.worker.wire.events import EVENT_CLASS, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheCreated
from kvledger.worker.wire.windows import first_needed_block


def is_windowed(group_idx: int, kind: str | None) -> bool:
    """Whether an event shows its rank's model has attention windows."""
    return group_idx != 0 or kind == "sliding_window"


@dataclass(slots=True)
class RankGroups:
    """One windowed rank's groups: each one's window, and the blocks of groups 1.. (group 0's are the index's)."""

    windows: dict[int, int | None] = field(default_factory=lambda: {0: None})
    """Group -> its window in tokens (``None``: full attention), as its stored events described it."""
    refs: dict[int, dict[int, int]] = field(default_factory=dict)
    """Group (1..) -> hash -> refs packed as the index packs them."""

    def describe(self, group_idx: int, kind: str | None, window: int | None) -> None:
        """Record a group's window from one of its ``BlockStored`` events."""
        self.windows[group_idx] = window if kind == "sliding_window" else None

    def held(self, group_idx: int) -> dict[int, int]:
        self.windows.setdefault(group_idx, None)
        return self.refs.setdefault(group_idx, {})

    def add(self, group_idx: int, h: int, unit: int) -> None:
        refs = self.held(group_idx)
        refs[h] = refs.get(h, 0) + unit

    def sub(self, group_idx: int, h: int, unit: int) -> bool:
        """Drop one ref of ``h`` on ``unit``'s tier; ``False`` (changing nothing) when the group holds none there."""
        refs = self.held(group_idx)
        v = refs.get(h, 0)
        if not held_on(v, unit):
            return False
        if v == unit:
            del refs[h]
        else:
            refs[h] = v - unit
        return True

    def clear(self) -> None:
        """The rank's blocks are gone (its windows stay known)."""
        self.refs = {}

    def num_blocks(self) -> int:
        return sum(len(r) for r in self.refs.values())

    def match(self, group0: dict[int, int], hashes: Sequence[int], block_size: int) -> tuple[int, int]:
        """``(blocks, host-only blocks)`` of the longest prefix of the chain ``hashes`` that every group can serve;
        ``group0`` is the index's holdings of the rank (its group 0)."""
        groups = [(group0 if g == 0 else self.refs.get(g, {}), w) for g, w in sorted(self.windows.items())]
        runs = [0] * len(groups)
        best = 0
        for depth, h in enumerate(hashes, 1):
            for i, (refs, _) in enumerate(groups):
                runs[i] = runs[i] + 1 if h in refs else 0
            if any(run < depth for run, (_, w) in zip(runs, groups) if w is None):
                break
            if all(run >= depth - first_needed_block(w, depth * block_size, block_size)
                   for run, (_, w) in zip(runs, groups)):
                best = depth
        host = 0
        for j in range(best):   # a block some group must onboard before it can be read
            h = hashes[j]
            host += any(j >= first_needed_block(w, best * block_size, block_size) and not refs[h] & DEV_MASK
                        for refs, w in groups)
        return best, host


_CLEARS = (AllBlocksCleared, KVCacheCreated)


def _shows_windows(ev: object) -> bool:
    """Whether an event names a group past 0 or a sliding window (clears name neither)."""
    t = EVENT_CLASS[type(ev)]
    if t is BlockStored:
        return is_windowed(ev.group_idx, ev.kv_cache_spec_kind)
    return t not in _CLEARS and ev.group_idx != 0


class Windowed:
    """A flat store (``PrefixIndex``, ``ArrayIndex``) for ranks of any model: the groups past 0 of windowed ranks
    are kept beside it, and a probe answers for those ranks by the safe-prefix rule (see the module docstring).
    Mixed in before the store; the concrete class declares the ``_groups`` slot."""

    __slots__ = ()
    _groups: dict[int, RankGroups]

    def __init__(self, tokens_per_block: int) -> None:
        super().__init__(tokens_per_block)
        self._groups: dict[int, RankGroups] = {}   # windowed rank -> its groups

    def apply(self, rank: int, events: Sequence[object]) -> str | None:
        """``PrefixIndex.apply``; a windowed rank's events of groups past 0 are applied to its groups, with the
        rest, all or none."""
        groups = self._groups.get(rank)
        if groups is None and not any(map(_shows_windows, events)):
            return super().apply(rank, events)
        self._check_sizes(rank, events)
        if groups is None:
            groups = self._groups[rank] = RankGroups()
        undo: list[tuple[int, int, int] | dict[int, dict[int, int]]] = []   # (group, hash, ±unit), or a clear
        flat = []
        for i, ev in enumerate(events):
            t = EVENT_CLASS[type(ev)]
            if t is AllBlocksCleared or t is KVCacheCreated:
                undo.append(groups.refs)
                groups.clear()
                flat.append(ev)
                continue
            g = ev.group_idx
            if t is BlockStored:
                groups.describe(g, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
            if not g:
                flat.append(ev)
            elif not self._apply_grouped(groups, t, ev, undo):
                _undo(groups, undo)
                return f"events[{i}] removes or moves a block that group {g} does not hold: the index has diverged"
        diverged = super().apply(rank, flat)
        if diverged is not None:
            _undo(groups, undo)
        return diverged

    @staticmethod
    def _apply_grouped(groups: RankGroups, t: type, ev: object, undo: list) -> bool:
        """Apply an event of a group past 0, logging each change in ``undo``; ``False`` where the group does not
        hold what the event removes or moves (changing nothing more)."""
        g = ev.group_idx
        if t is BlockStored or t is BlockRemoved:
            unit = tier_unit(ev.medium)
            for h in ev.block_hashes:
                if t is BlockStored:
                    groups.add(g, h, unit)
                elif not groups.sub(g, h, unit):
                    return False
                undo.append((g, h, unit if t is BlockStored else -unit))
            return True
        if ev.old_medium is None or ev.new_medium is None or ev.old_medium == ev.new_medium:
            return True   # a priority update: nothing to index
        old, new = tier_unit(ev.old_medium), tier_unit(ev.new_medium)
        if not groups.sub(g, ev.block_hash, old):
            return False
        groups.add(g, ev.block_hash, new)
        undo.extend(((g, ev.block_hash, -old), (g, ev.block_hash, new)))
        return True

    def load_snapshot(self, rank: int, blocks: Iterable[SnapshotEntry]) -> None:
        rows = read_snapshot(blocks)
        self._load_refs(rank, group0_refs(rows))
        windowed = [row for row in rows if is_windowed(row.group, row.kind)]
        groups = self._groups.get(rank)
        if groups is not None:
            groups.clear()
        elif windowed:
            groups = self._groups[rank] = RankGroups()
        for row in windowed:
            groups.describe(row.group, row.kind, row.window)
            if row.group:
                groups.add(row.group, row.block_hash, row.unit)

    def set_block_size(self, rank: int, block_size: int) -> None:
        changed = block_size != self.block_size(rank)
        super().set_block_size(rank, block_size)
        groups = self._groups.get(rank)
        if changed and groups is not None:
            groups.clear()

    def remove_rank(self, rank: int) -> None:
        super().remove_rank(rank)
        self._groups.pop(rank, None)

    def match(self, hashes: Sequence[int], make: Callable[[int, int], T]) -> dict[int, T]:
        return self._windowed_answer(hashes, super().match(hashes, make), make)

    def longest_prefixes(self, hashes: Sequence[int]) -> dict[int, tuple[int, int]]:
        return self._windowed_answer(hashes, super().longest_prefixes(hashes), lambda b, h: (b, h))

    def _windowed_answer(self, hashes: Sequence[int], out: dict[int, T], make: Callable[[int, int], T],
                         ) -> dict[int, T]:
        """``out`` with each windowed rank's match by the safe-prefix rule over its groups instead."""
        if not hashes:
            return out
        for rank, groups in self._groups.items():
            found = groups.match(self.held_among(rank, hashes), hashes, self.block_size(rank))
            if found[0]:
                out[rank] = make(*found)
            else:
                out.pop(rank, None)
        return out


class WindowedIndex(Windowed, PrefixIndex):
    """``Windowed`` over the reference store."""

    __slots__ = ("_groups",)


class WindowedArrayIndex(Windowed, ArrayIndex):
    """``Windowed`` over the array store: the router's default."""

    __slots__ = ("_groups",)


def _undo(groups: RankGroups, undo: list) -> None:
    """Undo a batch's changes to ``groups``, newest first."""
    for change in reversed(undo):
        if isinstance(change, dict):
            groups.refs = change
        else:
            g, h, unit = change
            if unit > 0:
                groups.sub(g, h, unit)
            else:
                groups.add(g, h, -unit)
