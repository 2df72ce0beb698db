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

A dispatch names the full blocks of its prompt by hash where the rank's block size is the request's, so the
account knows the distinct blocks in flight on each rank (``RankState.dispatched_blocks``): requests on one
document share its blocks, and they take room once; a dispatch without hashes (a peer's, or one to a rank of
another block size) counts all its blocks as its own.

Router replicas tell each other their dispatches (``router.replica_sync``): a
peer's are held per peer and id, apart from this router's own, so the peer's
finish removes exactly its entry and a peer that is gone takes all of its
entries with it (``drop_peer``). Every dispatch that ends is counted per rank
(``ended``), so a rank's load report can be read less the requests this
account saw end after the report was asked (``ReportedQueue.less``): a report
is then of age zero for every request some replica sent.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvledger.router.policies import RankState
from kvledger.router.replica_sync import DispatchEvent


@dataclass(slots=True, eq=False)
class Dispatch:
    """One request the router sent to ``rank``."""

    rank: int
    prefill_tokens: int
    """Prompt tokens the rank has to compute (the router's estimate at dispatch)."""
    blocks: int
    """Blocks it holds while it runs (prompt and output)."""
    hashes: tuple[int, ...] = ()
    """Its prompt's full blocks by hash (among ``blocks``), those it may share with the rank's other requests; ``()``:
    unknown, every block its own."""
    id: int = 0
    """Unique among the dispatches of the router that made it (what its peers know it by)."""
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

    def less(self, ended: Ended) -> ReportedQueue:
        """This report without ``ended`` (requests it may still count that have ended since it was asked)."""
        running = max(0, self.running - ended.requests)
        waiting = max(0, self.waiting - (ended.requests - (self.running - running)))
        return ReportedQueue(waiting, running, max(0, self.prefill_tokens - ended.prefill_tokens))


@dataclass(frozen=True, slots=True)
class Ended:
    """Dispatches to a rank that have ended, and their prompt tokens: a running total, or the part of it since a
    mark (``since``)."""

    requests: int = 0
    prefill_tokens: int = 0

    def since(self, mark: Ended) -> Ended:
        return Ended(self.requests - mark.requests, self.prefill_tokens - mark.prefill_tokens)


@dataclass(slots=True)
class _RankAccount:
    queued: int = 0
    queued_tokens: int = 0
    """Prompt tokens of the queued requests that have not started their prefill."""
    started: list[Dispatch] = field(default_factory=list)
    """Queued requests whose prefill has begun."""
    running: int = 0
    running_blocks: int = 0
    holders: dict[int, int] = field(default_factory=dict)
    """Block hash -> in-flight dispatches holding it (queued and running)."""
    own_blocks: int = 0
    """Blocks of in-flight dispatches not among ``holders``: their output, their partial last blocks, and every
    block of a dispatch without hashes."""

    def distinct_blocks(self) -> int:
        """Blocks the in-flight dispatches hold together, each shared block once."""
        return len(self.holders) + self.own_blocks


class LoadAccount:
    """The router's own account of every rank's load (see the module docstring); not thread-safe."""

    def __init__(self) -> None:
        self._ranks: dict[int, _RankAccount] = {}
        self._ids = itertools.count(1)
        self._peers: dict[str, dict[int, Dispatch]] = {}
        """Each peer's dispatches not yet finished, by the id the peer gave them."""
        self._ended: dict[int, Ended] = {}
        """Per rank, every dispatch that finished, own or a peer's (kept when the rank leaves: marks stay valid)."""

    def dispatch(self, rank: int, prefill_tokens: int, blocks: int, hashes: tuple[int, ...] = ()) -> Dispatch:
        """A request sent to ``rank`` with ``prefill_tokens`` to compute, holding ``blocks`` to completion, the first
        of them ``hashes`` (its prompt's full blocks, at the rank's block size; ``()``: unknown)."""
        if len(hashes) > blocks:
            raise ValueError(f"{len(hashes)} block hashes for a dispatch of {blocks} blocks")
        return self._queue(Dispatch(rank, prefill_tokens, blocks, hashes, next(self._ids)))

    def peer_events(self, peer: str, events: Iterable[DispatchEvent], reset: bool = False) -> None:
        """Router ``peer``'s dispatches and finishes, in its order; ``reset``: ``events`` are all it has open, in
        place of what this account held of it. A repeated dispatch, or the finish of one this account does not
        hold (or forgot with its rank), changes nothing."""
        if reset:
            self.drop_peer(peer)
        held = self._peers.setdefault(peer, {})
        for e in events:
            if e.kind == "dispatched":
                if e.id not in held:
                    held[e.id] = self._queue(Dispatch(e.rank, e.prefill_tokens, e.blocks, id=e.id))
            else:
                d = held.pop(e.id, None)
                if d is not None:
                    self.finished(d)

    def drop_peer(self, peer: str) -> None:
        """Router ``peer`` is gone (or starts over): none of its dispatches counts any more."""
        for d in self._peers.pop(peer, {}).values():
            self._remove(d)

    def peers(self) -> dict[str, int]:
        """Each peer's dispatches this account holds."""
        return {peer: len(held) for peer, held in self._peers.items()}

    def ended(self, rank: int) -> Ended:
        """The dispatches to ``rank`` that have ended so far (a mark to take before asking it for its load)."""
        return self._ended.get(rank, Ended())

    def _queue(self, d: Dispatch) -> Dispatch:
        a = self._ranks.setdefault(d.rank, _RankAccount())
        a.queued += 1
        a.queued_tokens += d.prefill_tokens
        holders = a.holders
        for h in d.hashes:
            holders[h] = holders.get(h, 0) + 1
        a.own_blocks += d.blocks - len(d.hashes)
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
        if self._remove(d):
            e = self.ended(d.rank)
            self._ended[d.rank] = Ended(e.requests + 1, e.prefill_tokens + d.prefill_tokens)

    def _remove(self, d: Dispatch) -> bool:
        """``d`` no longer counts on its rank; ``False`` when the rank left while it ran (it counted nowhere)."""
        a = self._ranks.get(d.rank)
        if a is None:
            return False
        if d.prefilled:
            a.running -= 1
            a.running_blocks -= d.blocks
        else:
            _leave_queue(a, d)
        holders = a.holders
        for h in d.hashes:
            left = holders[h] - 1
            if left:
                holders[h] = left
            else:
                del holders[h]
        a.own_blocks -= d.blocks - len(d.hashes)
        return True

    def forget(self, rank: int) -> None:
        """``rank`` left: nothing dispatched to it counts any more, the peers' dispatches neither."""
        self._ranks.pop(rank, None)
        for held in self._peers.values():
            for id in [id for id, d in held.items() if d.rank == rank]:
                del held[id]

    def inflight(self, rank: int) -> tuple[int, int]:
        """Requests dispatched to ``rank`` (by this router or a peer) and not finished, and their queued prefill
        tokens (at start)."""
        a = self._ranks.get(rank)
        if a is None:
            return 0, 0
        started = sum(d.prefill_tokens for d in a.started)
        return a.queued + a.running, a.queued_tokens + started

    def shared_blocks(self, rank: int, hashes: tuple[int, ...]) -> int:
        """How many of ``hashes`` (a prompt's full blocks, from the first) requests in flight on ``rank`` hold: room
        the prompt would not take again there. Blocks are chained, so the shared ones are a prefix."""
        a = self._ranks.get(rank)
        if a is None or not a.holders:
            return 0
        holders, k = a.holders, 0
        for h in hashes:   # bounded by the prompt's blocks
            if h not in holders:
                break
            k += 1
        return k

    def state(self, rank: int, now: float, kv_used_blocks: int = 0, kv_total_blocks: int = 0,
              reported: ReportedQueue | None = None, migratable: bool = True, session_blocks: int = 0,
              prefill_s_per_token: float = 0.0, onboard_s_per_block: float | None = None,
              prompt: tuple[int, ...] = ()) -> RankState:
        """``rank`` as the policies see it at ``now``, for placing a prompt of full blocks ``prompt`` (hashes: how
        many of them the requests in flight there hold); the blocks in use (and its measured onboard time per host
        block) come from the rank's own report, those live sessions left there (``session_blocks``) from the
        router's session table, its speed (``prefill_s_per_token``) from its answers.

        An engine's own count of its queue (``reported``) wins where it is larger: clients may send it work no
        router replica saw. The rank's count holds this router's requests too, so
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
                         migratable, a.distinct_blocks(), session_blocks, prefill_s_per_token,
                         onboard_s_per_block, self.shared_blocks(rank, prompt))


def _leave_queue(a: _RankAccount, d: Dispatch) -> None:
    """``d`` is no longer queued on its rank: its prompt tokens (or its started prefill) stop counting."""
    a.queued -= 1
    if d.started_at is None:
        a.queued_tokens -= d.prefill_tokens
    else:
        a.started.remove(d)
