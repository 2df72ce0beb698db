"""What the router dispatched to each rank and has not seen finish, as the ``RankState`` every policy reads.

One account serves the live router and the replay simulator, so a policy
weighs the same numbers in ``kvledger up`` as in ``kvledger bench``. A request
is dispatched with the prompt tokens it still has to compute and the blocks it
will hold; it is *queued* until its prefill ends (``prefilled``), then
*running* (decoding, its blocks counted as decode load) until it ends
(``finished``). A prefill that has started (``started``, with its expected
duration) counts only the share of its tokens still to compute.

The live router serves through a blocking call that returns only at the end,
so it sees neither the start nor the end of a prefill: its requests stay
queued, with all their prompt tokens, until they finish. The simulator sees
every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.router.policies import RankState


@dataclass(slots=True, eq=False)
class Dispatch:
    """One request the router sent to ``rank``."""

    rank: int
    prefill_tokens: int
    """Prompt tokens the rank has to compute (the router's estimate at dispatch)."""
    blocks: int
    """Blocks it holds while it runs (prompt and output)."""
    started_at: float | None = None
    duration: float = 0.0
    prefilled: bool = False


@dataclass(frozen=True, slots=True)
class ReportedQueue:
    """What an engine says of its own queue (a vLLM server's ``/metrics``, an own rank's load report)."""

    waiting: int
    running: int
    prefill_tokens: int = 0
    """Prompt tokens of the waiting requests (0: not reported)."""


@dataclass(slots=True)
class _RankAccount:
    queued: int = 0
    queued_tokens: int = 0
    """Prompt tokens of the queued requests that have not started their prefill."""
    started: list[Dispatch] = field(default_factory=list)
    """Queued requests whose prefill has begun."""
    running: int = 0
    running_blocks: int = 0


class LoadAccount:
    """The router's own account of every rank's load (see the module docstring); not thread-safe."""

    def __init__(self) -> None:
        self._ranks: dict[int, _RankAccount] = {}

    def dispatch(self, rank: int, prefill_tokens: int, blocks: int) -> Dispatch:
        d = Dispatch(rank, prefill_tokens, blocks)
        a = self._ranks.setdefault(rank, _RankAccount())
        a.queued += 1
        a.queued_tokens += prefill_tokens
        return d

    def started(self, d: Dispatch, now: float, duration: float) -> None:
        """Its prefill began at ``now`` and is expected to take ``duration`` seconds."""
        a = self._ranks.get(d.rank)
        if a is None:
            return
        d.started_at, d.duration = now, duration
        a.queued_tokens -= d.prefill_tokens
        a.started.append(d)

    def prefilled(self, d: Dispatch) -> None:
        """Its first token is out: it leaves the queue and decodes."""
        a = self._ranks.get(d.rank)
        if a is None:
            return
        _leave_queue(a, d)
        d.prefilled = True
        a.running += 1
        a.running_blocks += d.blocks

    def finished(self, d: Dispatch) -> None:
        """It ended (or failed): whatever it still counted for goes."""
        a = self._ranks.get(d.rank)
        if a is None:   # the rank left while the request ran
            return
        if d.prefilled:
            a.running -= 1
            a.running_blocks -= d.blocks
        else:
            _leave_queue(a, d)

    def forget(self, rank: int) -> None:
        """``rank`` left: nothing dispatched to it counts any more."""
        self._ranks.pop(rank, None)

    def inflight(self, rank: int) -> tuple[int, int]:
        """Requests dispatched to ``rank`` and not finished, and their queued prefill tokens (at start)."""
        a = self._ranks.get(rank)
        if a is None:
            return 0, 0
        started = sum(d.prefill_tokens for d in a.started)
        return a.queued + a.running, a.queued_tokens + started

    def state(self, rank: int, now: float, kv_used_blocks: int = 0, kv_total_blocks: int = 0,
              reported: ReportedQueue | None = None, migratable: bool = True) -> RankState:
        """``rank`` as the policies see it at ``now``; the blocks in use come from the rank's own report.

        An engine's own count of its queue (``reported``) wins where it is larger: other routers (replicas) or
        clients may send it work this account never saw. The rank's count holds this router's requests too, so
        the two are never added: the requests in flight are the larger of the two totals (a request this
        account still calls queued may be running there), of which the larger running count runs.
        """
        a = self._ranks.get(rank) or _RankAccount()
        pending = a.queued_tokens
        for d in a.started:
            if d.duration > 0:
                pending += int(d.prefill_tokens * max(0.0, d.started_at + d.duration - now) / d.duration)
        queued, running = a.queued, a.running
        if reported is not None:
            running = max(a.running, reported.running)
            queued = max(a.queued + a.running, reported.waiting + reported.running) - running
            pending = max(pending, reported.prefill_tokens)
        return RankState(rank, True, queued, pending, running, a.running_blocks, kv_used_blocks, kv_total_blocks,
                         migratable)


def _leave_queue(a: _RankAccount, d: Dispatch) -> None:
    """``d`` is no longer queued on its rank: its prompt tokens (or its started prefill) stop counting."""
    a.queued -= 1
    if d.started_at is None:
        a.queued_tokens -= d.prefill_tokens
    else:
        a.started.remove(d)
