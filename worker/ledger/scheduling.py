"""One scheduling round: tentative admissions and releases, counted apart from the books (reserve, then commit).

TensorRT-LLM's ``schedulingAddSequence`` / ``schedulingRemoveSequence``: a
scheduler tries requests against the round's free counts (one per attention
window) and the ledger's books stay as they were; ``add_sequences`` commits.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvledger.worker.ledger.block import PLACEHOLDER, PRIMARY, SECONDARY, Block
from kvledger.worker.ledger.matching import Match
from kvledger.worker.ledger.window import WindowManager
from kvledger.worker.wire.errors import OutOfBlocksError


class SchedulingRound:
    """The round's free blocks and the blocks a tentative admission already counted, per window."""

    __slots__ = ("free", "taken", "reserved")

    def __init__(self, windows: Sequence[WindowManager], holders: Iterable[Iterable[Iterable[Block]]] = ()) -> None:
        """Open a round: every held block's ``sched_ref_count`` starts at its ``ref_count`` (``holders``: per
        window, every block list holding references there)."""
        for window_holders in holders:
            for holder in window_holders:
                for b in holder:
                    b.sched_ref_count = b.ref_count
        self.free = [w.pool.num_free(PRIMARY) for w in windows]
        self.taken: list[set[int]] = [set() for _ in windows]
        self.reserved: dict[int, int] = {}
        """What each request reserved in this round: it is counted once, however often it is added."""

    def reserve(self, match: Match, new_blocks: int, request_id: int) -> int:
        """Count what admitting a request with ``match`` and ``new_blocks`` new blocks per window would take out of
        the free queues: its new blocks, a primary block for each host-tier block it would onboard, and the
        blocks it would reuse that are free in this round, each counted once per round. Returns the blocks of
        every window; raises ``OutOfBlocksError`` (reserving nothing) when some window lacks them. A request
        reserved already in this round reserves nothing more: what it took is returned again."""
        if request_id in self.reserved:
            return self.reserved[request_id]
        takes, reused_of = [], []
        for w, taken in enumerate(self.taken):
            reused = [b for b in match.to_onboard(w) if b.block_id not in taken]
            # a host-tier block takes a primary block to onboard into, not a free primary block of its own
            free_now = sum(1 for b in reused if b.tier == PRIMARY and (b.sched_ref_count if b.ref_count else 0) == 0)
            takes.append(new_blocks + free_now + sum(1 for b in reused if b.tier == SECONDARY))
            reused_of.append(reused)
        self._take(takes, request_id, "")
        for w, reused in enumerate(reused_of):
            self.taken[w].update(b.block_id for b in reused)
        return sum(takes)

    def reserve_blocks(self, needs: Sequence[int], request_id: int) -> int:
        """Count ``needs[w]`` blocks of window ``w`` as taken by running request ``request_id``'s next step; as
        ``reserve``, raises (reserving nothing) when a window lacks them, and counts a request once per round."""
        if request_id in self.reserved:
            return self.reserved[request_id]
        self._take(needs, request_id, "'s next step")
        return sum(needs)

    def _take(self, takes: Sequence[int], request_id: int, what: str) -> None:
        for w, (take, free) in enumerate(zip(takes, self.free)):
            if take > free:
                where = f" (window {w})" if len(self.free) > 1 else ""
                raise OutOfBlocksError(take, free, f"reserving request {request_id}{what} in this round{where}")
        for w, take in enumerate(takes):
            self.free[w] -= take
        self.reserved[request_id] = sum(takes)

    def release(self, holders: Sequence[Iterable[Iterable[Block]]]) -> None:
        """Count the blocks that pausing a running sequence (its block lists per window) would free."""
        for w, window_holders in enumerate(holders):
            for holder in window_holders:
                for b in holder:
                    if b is PLACEHOLDER:
                        continue
                    b.sched_ref_count -= 1
                    if b.sched_ref_count == 0:
                        self.free[w] += 1

    @property
    def num_free(self) -> int:
        return sum(self.free)
