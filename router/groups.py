"""The KV cache groups of ranks whose models have attention windows (VSWA), and the safe-prefix rule over them.

The index's flat maps hold each rank's group-0 blocks, as for any model. A
rank whose events name another group (``group_idx > 0``) or a sliding window
is *windowed*: its other groups' blocks are kept here, with every group's
window as its stored events say (``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``, as vLLM publishes them), and a probe answers
for it by the rule its ledger admits by: a prefix of ``m`` blocks counts only
if every group holds the blocks that the query at position ``m * block_size``
reads, all ``m`` under full attention, only those of the last ``window``
tokens under a sliding window (a query at ``p`` reads the keys ``> p - window``).
A group the rank never described counts as full attention.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvledger.worker.wire.windows import first_needed_block

_DEV_MASK = (1 << 32) - 1   # the index's packing: device refs in the low 32 bits, host refs above


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
        if not (v >> 32 if unit > _DEV_MASK else v & _DEV_MASK):
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
            host += any(j >= first_needed_block(w, best * block_size, block_size) and not refs[h] & _DEV_MASK
                        for refs, w in groups)
        return best, host
