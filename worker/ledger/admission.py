"""Admission: what a batch of requests reuses, whether it fits, and the sequences it becomes.

Every request of a batch claims its matches (matching.py) before any block is
allocated, so one request's allocation cannot evict what another was counted
to reuse; capacity is checked in every attention window before anything
changes, so a refused batch leaves the books as they were. A partly matching
block is taken in place when nobody else holds it, else copied; a beam search
gives beams 1.. their own last context block where the prompt ends mid-block.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvledger.worker.ledger.block import PLACEHOLDER, PRIMARY, SECONDARY, Block
from kvledger.worker.ledger.budget import beam_tails
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.matching import Match, decide_partial, match_prompt
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.ledger.sequence import Sequence
from kvledger.worker.ledger.stats import Admission
from kvledger.worker.ledger.window import WindowManager
from kvledger.worker.ledger.window_pools import WindowPools
from kvledger.worker.wire.block_key import MmKey
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.request import Request


@dataclass(slots=True)
class Plan:
    """One request's admission, decided before anything changes."""

    request: Request
    match: Match
    new_blocks: int
    """Blocks to allocate, the copy destination of a partial match and the other beams' tails included."""
    end: int
    """End of the first context chunk: the whole prompt unless chunked."""
    tails: int
    """Own last context blocks of beams 1.. (a beam search whose first chunk ends the prompt mid-block)."""
    skipped: tuple[int, ...]
    """Per window, the new positions left as placeholders, not allocated (a received context's, see ``plan``)."""
    received: bool
    """The context's KV is received: only its last token's query is computed here."""

    def allocated(self, window: int) -> int:
        """Blocks window ``window`` allocates."""
        return self.new_blocks - self.skipped[window]


class Admitter:
    """Plans, checks and applies admissions over a ledger's windows; counts the prompt blocks reused and missed."""

    __slots__ = ("config", "tokens_per_block", "pools", "reused", "missed", "_tree", "_windows", "_pool",
                 "_windowed")

    def __init__(self, config: CacheConfig, tree: PrefixTree, windows: Seq[WindowManager],
                 pools: TieredPools | WindowPools) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.pools = pools
        self.reused = self.missed = 0
        """Prompt blocks served from the cache (fully or partly), and computed."""
        self._tree, self._windows, self._pool = tree, windows, windows[0].pool
        self._windowed = len(windows) > 1 or windows[0].slides

    def plan_fitting(self, requests: Seq[Request], received: bool = False) -> list[Plan]:
        """``plan`` the batch and check it fits (``check_capacity``). A copied partial block holds its source
        beside the copy, one block more than computing those tokens: when that is what does not fit, the batch is
        planned again copying no partial block, and that plan must fit (``OutOfBlocksError`` otherwise)."""
        plans = self.plan(requests, received)
        try:
            self.check_capacity(plans)
        except OutOfBlocksError:
            if not any(p.match.partial is not None and not p.match.in_place for p in plans):
                raise
            plans = self.plan(requests, received, copy_partial=False)
            self.check_capacity(plans)
        return plans

    def plan(self, requests: Seq[Request], received: bool = False, copy_partial: bool | None = None) -> list[Plan]:
        """Decide every request's reuse without changing anything (a dry run of the claims). ``received``: the KV
        of every prompt token but the last is received, not computed (a migration's import): each whole context is
        planned, whatever ``context_chunk_size`` says, and a sliding window holds only the blocks the last token's
        query reads (``Plan.skipped``). ``copy_partial``: copy a partly matching block others hold (default
        ``CacheConfig.copy_on_partial_reuse``)."""
        T = self.tokens_per_block
        copy = self.config.copy_on_partial_reuse if copy_partial is None else copy_partial
        chunk = None if received else self.config.context_chunk_size
        claimed: set[int] = set()
        taken: set[int] = set()
        plans = []
        for r in requests:
            m = self.match(r.tokens, r.lora_id, r.cache_salt, r.mm_keys, r.extra_ids, taken)
            decide_partial(m, claimed, copy)
            if m.in_place:
                taken.add(m.partial.block_id)
            claimed.update([b.block_id for b in m.full])
            if m.partial is not None:
                claimed.add(m.partial.block_id)
            end = len(r.tokens) if chunk is None else min(len(r.tokens), len(m.full) * T + m.partial_len + chunk)
            tails = beam_tails(len(r.tokens), end, r.beam_width, T) if r.beam_width > 1 else 0
            skipped = self._skip_received(m, len(r.tokens) - 1) if received else (0,) * len(self._windows)
            plans.append(Plan(r, m, -(-end // T) - len(m.full) - (1 if m.in_place else 0) + tails, end, tails,
                              skipped, received))
        return plans

    def _skip_received(self, m: Match, pos: int) -> tuple[int, ...]:
        """Per window, the positions past the match that a received context leaves as placeholders: those before
        the first block a query at ``pos`` reads. The match's blocks there are dropped from it too: no query of the
        sequence reads them (a full-attention window skips nothing)."""
        if m.windows is None:
            return (0,)
        skipped = []
        for w in self._windows:
            first = w.first_needed(pos)
            own = m.windows[w.index]
            if first > 0:
                kept = own[first:]
                own[:] = [PLACEHOLDER] * min(first, len(own)) + kept
                m.window_held[w.index] = [b for b in kept if b is not PLACEHOLDER]
            skipped.append(max(0, first - len(own)))
        m.full = m.windows[0]
        return tuple(skipped)

    def match(self, tokens: Seq[int], lora_id: int | None, cache_salt: str | None, mm_keys: Seq[MmKey],
              extra_ids: Seq[int] | None, taken: set[int] = frozenset(), max_blocks: int | None = None) -> Match:
        if not self.config.enable_block_reuse:
            return Match([], windows=[[] for _ in self._windows] if self._windowed else None)
        return match_prompt(self._tree, self._windows, tokens, lora_id, cache_salt, mm_keys, extra_ids,
                            self.config.enable_partial_reuse, taken, max_blocks)

    def check_capacity(self, plans: list[Plan]) -> None:
        """Every window must have the free blocks the batch takes: new ones, onboard targets, and the free blocks it
        reuses."""
        for w in self._windows:
            held = {b.block_id: b for p in plans for b in p.match.to_onboard(w.index)}
            onboards = len([b for b in held.values() if b.tier == SECONDARY])
            if w.index == 0:
                held.update((p.match.partial.block_id, p.match.partial) for p in plans if p.match.partial is not None)
            free_claimed = len([b for b in held.values() if b.tier == PRIMARY and b.ref_count == 0])
            needed = sum(p.allocated(w.index) for p in plans) + onboards
            available = w.pool.num_free(PRIMARY) - free_claimed
            if needed > available:
                what = f"admitting request(s) {[p.request.request_id for p in plans]}{w.where}"
                raise OutOfBlocksError(needed, available, what)

    def apply(self, plans: list[Plan]) -> list[Sequence]:
        T = self.tokens_per_block
        pool = self._pool
        copy_sources: list[Block] = []
        for p in plans:
            for w in self._windows:
                w.pool.ref_n(p.match.held(w.index))
            part = p.match.partial
            if part is not None:
                pool.ref_n([part])
                if p.match.in_place:
                    pool.forget(part)
                else:
                    copy_sources.append(part)
        onboarded = []
        for p in plans:
            n_moved = 0
            for w in self._windows:
                moved = [b for b in p.match.to_onboard(w.index) if b.tier == SECONDARY]
                w.pool.onboard_n(moved)
                n_moved += len(moved)
            onboarded.append(n_moved)
        seqs = []
        for p, n_onboarded in zip(plans, onboarded):
            r, m = p.request, p.match
            blocks = list(m.full)
            copied = 0
            if m.partial is not None:
                if m.in_place:
                    blocks.append(m.partial)
                else:
                    dst = pool.take_free(count_alloc=True)
                    self.pools.plan(m.partial.tier, m.partial.slot, PRIMARY, dst.slot)
                    dst.ref_count = 1
                    blocks.append(dst)
                    copied = 1
            w0 = self._windows[0]
            blocks += [PLACEHOLDER] * p.skipped[0] + w0.alloc(p.allocated(0) - copied - p.tails)
            windows = (blocks, *(m.windows[w.index] + [PLACEHOLDER] * p.skipped[w.index] + w.alloc(p.allocated(w.index))
                                 for w in self._windows[1:]))
            n_reused = len(m.full) + (1 if m.partial is not None else 0)
            self.reused += n_reused
            self.missed += -(-len(r.tokens) // T) - n_reused   # the whole prompt's, chunked or not
            prepop = len(m.full) * T + m.partial_len
            adm = Admission(prepopulated_tokens=prepop, reused_blocks=len(m.full), partial_tokens=m.partial_len,
                            copied_blocks=copied, onboarded_blocks=n_onboarded, allocated_blocks=p.new_blocks)
            seq = Sequence(request=r, blocks=blocks, num_tokens=p.end, admission=adm, tokens=r.tokens,
                           keys=m.keys[:len(r.tokens) // T] if m.keys else [],
                           hashes=[] if self._windowed else [b.block_hash for b in m.full], stored=len(m.full),
                           chunk_start=prepop, windows=windows, sliding=tuple(w.size for w in self._windows),
                           slid=[w.first_needed(len(r.tokens) - 1 if p.received else prepop) for w in self._windows])
            if r.beam_width > 1:
                seq.beams = tuple(w0.alloc(1 if p.tails else 0) for _ in range(r.beam_width - 1))
            for w, wb in zip(self._windows, windows):
                w.retention.apply(r, wb, 0)
            seqs.append(seq)
        for b in copy_sources:
            pool.unref(b)
        self.pools.flush()
        return seqs
