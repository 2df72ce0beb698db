"""The per-rank KV cache manager: the admission policy over the block pool.

Follows TensorRT-LLM's KVCacheManager for one attention window, layered as
vLLM v1 is (``KVCacheManager`` over ``BlockPool``): the manager matches prompts
against the prefix tree, decides what to reuse, checks capacity, stores
finished blocks and tracks the running sequences; the pool (block_pool.py)
moves blocks between free lists and tiers. Every public operation validates
its input and checks capacity before it changes anything, so a refused call
leaves the books, the stats and the event buffer as they were.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvledger.worker.ledger.block import PRIMARY, SECONDARY, Block
from kvledger.worker.ledger.block_pool import BlockPool
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.integrity import check_integrity
from kvledger.worker.ledger.prefix_tree import TreeNode
from kvledger.worker.ledger.retention import Retention
from kvledger.worker.ledger.sequence import Sequence
from kvledger.worker.ledger.stats import Admission, KvCacheStats, PrefixReuseSummary
from kvledger.worker.wire.batches import StoredBlock
from kvledger.worker.wire.block_key import BlockKey, MmKey, block_keys, validate_prompt
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.events import BlockStored, KVEvent
from kvledger.worker.wire.request import Request

logger = logging.getLogger(__name__)
R = TypeVar("R")


@dataclass(slots=True)
class _Match:
    """What the tree offers one prompt: full blocks, then possibly one partly matching block."""

    full: list[Block]
    partial: Block | None = None
    partial_len: int = 0
    in_place: bool = False
    keys: list[BlockKey] | None = None
    """The prompt's block keys (the trailing partial block included), reused by the store."""


@dataclass(slots=True)
class _Plan:
    request: Request
    match: _Match
    new_blocks: int
    """Blocks to allocate, the copy destination of a partial match included."""


def _checked(method: Callable[..., R]) -> Callable[..., R]:
    """After ``method`` (refused or not), prove the books balance when ``CacheConfig.check_integrity`` asks."""
    @functools.wraps(method)
    def call(self: KVCacheManager, *args: object, **kwargs: object) -> R:
        try:
            return method(self, *args, **kwargs)
        finally:
            if self.config.check_integrity:
                self.check_integrity()
    return call


class KVCacheManager:
    """The books of one rank's KV blocks: who holds which block, where its data lives, what is reusable."""

    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self._pool = pool = BlockPool(config, clock)
        self.num_primary, self.num_secondary = pool.num_primary, pool.num_secondary
        self.pools = pool.pools
        self.blocks = pool.blocks
        self._retention = Retention(pool, self.tokens_per_block)
        self._seqs: dict[int, Sequence] = {}
        self._pinned: dict[int, list[Block]] = {}
        self._sched_free = pool.num_primary
        self._sched_taken: set[int] = set()
        """Blocks a tentative admission of this scheduling round already counted."""
        self._reused = self._missed = 0

    @property
    def clock(self) -> Callable[[], float]:
        """The injected clock that retention durations run on."""
        return self._pool.clock

    # ------------------------------------------------------------------ admission

    def add_sequence(self, request: Request) -> int:
        """Admit one request; returns its prepopulated prompt length (tokens whose KV is reused)."""
        return self.add_sequences([request])[0]

    @_checked
    def add_sequences(self, requests: Seq[Request]) -> list[int]:
        """Admit a batch: every request claims its matches before any block is allocated.

        So one request's allocation cannot evict what another in the batch was
        counted to reuse. Raises ``OutOfBlocksError`` (changing nothing) when the
        batch does not fit.
        """
        ids = set()
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"add_sequences takes Request objects, got {type(r).__name__}")
            r.validate()
            if r.request_id in self._seqs or r.request_id in self._pinned or r.request_id in ids:
                raise ValueError(f"request {r.request_id} is already in the ledger")
            ids.add(r.request_id)
        self.refresh_blocks()
        plans = self._plan(requests)
        self._check_capacity(plans)
        return [s.admission.prepopulated_tokens for s in self._apply(plans)]

    def _plan(self, requests: Seq[Request]) -> list[_Plan]:
        """Decide every request's reuse without changing anything (a dry run of the claims)."""
        T = self.tokens_per_block
        claimed: set[int] = set()
        taken: set[int] = set()
        plans = []
        for r in requests:
            m = self._match(r.tokens, r.lora_id, r.cache_salt, r.mm_keys, r.extra_ids, taken)
            self._decide_partial(m, claimed)
            if m.in_place:
                taken.add(m.partial.block_id)
            claimed.update(b.block_id for b in m.full)
            if m.partial is not None:
                claimed.add(m.partial.block_id)
            total = -(-len(r.tokens) // T)
            plans.append(_Plan(r, m, total - len(m.full) - (1 if m.in_place else 0)))
        return plans

    def _match(self, tokens: Seq[int], lora_id: int | None, cache_salt: str | None, mm_keys: Seq[MmKey],
               extra_ids: Seq[int] | None, taken: set[int] = frozenset()) -> _Match:
        """Walk the tree with the prompt's keys; the last prompt token is never matched."""
        if not self.config.enable_block_reuse:
            return _Match([])
        T = self.tokens_per_block
        usable = len(tokens) - 1
        n_full = usable // T
        keys = block_keys(tokens, T, lora_id=lora_id, cache_salt=cache_salt, mm_keys=mm_keys,
                          extra_ids=extra_ids, include_partial=True)
        tree = self._pool.tree
        node = tree.root
        full: list[Block] = []
        for key in keys[:n_full]:
            child = node.children.get(key)
            if child is None or child.block is None or child.block.block_id in taken:
                break
            full.append(child.block)
            node = child
        m = _Match(full, keys=keys)
        limit = min(T, usable - len(full) * T)
        if self.config.enable_partial_reuse and limit > 0 and len(full) < len(keys):
            cand, n = tree.best_partial(node, keys[len(full)], limit)
            if cand is not None:  # a block taken in place by an earlier request can still be copied
                m.partial, m.partial_len = cand.block, n
        return m

    def _decide_partial(self, m: _Match, claimed: set[int]) -> None:
        """Reuse a partly matching block in place when nobody else holds it and it is a leaf, else copy it."""
        p = m.partial
        if p is None:
            return
        m.in_place = p.ref_count == 0 and p.block_id not in claimed and not p.node.children
        if not m.in_place and not self.config.copy_on_partial_reuse:
            m.partial, m.partial_len = None, 0

    def _check_capacity(self, plans: list[_Plan]) -> None:
        held = {b.block_id: b for p in plans for b in (*p.match.full, p.match.partial) if b is not None}
        free_claimed = sum(1 for b in held.values() if b.tier == PRIMARY and b.ref_count == 0)
        onboards = len({b.block_id for p in plans for b in self._to_onboard(p.match) if b.tier == SECONDARY})
        needed = sum(p.new_blocks for p in plans) + onboards
        available = self._pool.num_free(PRIMARY) - free_claimed
        if needed > available:
            what = f"admitting request(s) {[p.request.request_id for p in plans]}"
            raise OutOfBlocksError(needed, available, what)

    @staticmethod
    def _to_onboard(m: _Match) -> list[Block]:
        """Blocks a match uses in place (a copied partial block is read from wherever it lies)."""
        return [*m.full, m.partial] if m.in_place else m.full

    def _apply(self, plans: list[_Plan]) -> list[Sequence]:
        T = self.tokens_per_block
        pool = self._pool
        copy_sources: list[Block] = []
        for p in plans:
            for b in p.match.full:
                pool.ref(b)
            part = p.match.partial
            if part is not None:
                pool.ref(part)
                if p.match.in_place:
                    pool.forget(part)
                else:
                    copy_sources.append(part)
        onboarded = []
        for p in plans:
            moved = [b for b in self._to_onboard(p.match) if b.tier == SECONDARY]
            for b in moved:
                pool.onboard(b)
            onboarded.append(len(moved))
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
            fresh = p.new_blocks - copied
            for _ in range(fresh):
                b = pool.take_free(count_alloc=True)
                b.ref_count = 1
                blocks.append(b)
            n_reused = len(m.full) + (1 if m.partial is not None else 0)
            self._reused += n_reused
            self._missed += len(blocks) - n_reused
            prepop = len(m.full) * T + m.partial_len
            adm = Admission(prepopulated_tokens=prepop, reused_blocks=len(m.full), partial_tokens=m.partial_len,
                            copied_blocks=copied, onboarded_blocks=n_onboarded, allocated_blocks=p.new_blocks)
            seq = Sequence(request=r, blocks=blocks, num_tokens=len(r.tokens), admission=adm, tokens=list(r.tokens),
                           keys=m.keys[:len(r.tokens) // T] if m.keys else [],
                           hashes=[b.block_hash for b in m.full], stored=len(m.full))
            self._retention.apply(seq, 0)
            self._seqs[r.request_id] = seq
            seqs.append(seq)
        for b in copy_sources:
            pool.unref(b)
        self.pools.flush()
        return seqs

    # ------------------------------------------------------------------ growth and release

    @_checked
    def add_token(self, request_id: int, n: int = 1, tokens: Seq[int] | None = None) -> None:
        """Grow a running sequence by ``n`` decoded tokens, allocating blocks at block boundaries.

        Pass the token ids to make full decode blocks reusable; without them the
        sequence stops being storable from here on. With the ids, a decode block
        is stored (reusable by a parallel request, announced) as soon as it is
        written, as TensorRT-LLM's ``storeNewBlock`` does: once every token in it
        has its KV: every token before this step's ``n`` (this step computes
        those), the previous step's rejected drafts having been rewound.
        """
        seq = self._running(request_id)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"add_token: n must be an int >= 1, got {n!r}")
        if tokens is not None:
            validate_prompt(tokens, None, None, (), None)
            if len(tokens) != n:
                raise ValueError(f"add_token: {len(tokens)} token ids given for n={n}")
        need = -(-(seq.num_tokens + n) // self.tokens_per_block) - len(seq.blocks)
        pool = self._pool
        if need > pool.num_free(PRIMARY):
            raise OutOfBlocksError(need, pool.num_free(PRIMARY), f"growing request {request_id}")
        first_new = len(seq.blocks)
        for _ in range(need):
            b = pool.take_free(count_alloc=True)
            b.ref_count = 1
            seq.blocks.append(b)
        if tokens is None or seq.opaque or seq.request.extra_ids is not None:
            seq.opaque = True
        else:
            seq.tokens.extend(tokens)
        seq.num_tokens += n
        self._retention.apply(seq, first_new)
        self.pools.flush()
        if not seq.opaque:   # everything before this step's tokens is written (rejected drafts were rewound)
            self._store(seq, (seq.num_tokens - n) // self.tokens_per_block)

    @_checked
    def rewind(self, request_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a running request (its rejected draft tokens) and release the blocks
        past the new end, last first; the prompt itself cannot be rewound.

        The dropped tokens' KV was never stored (a block is stored only once its
        every token is written and kept), so nothing reusable is lost.
        """
        seq = self._running(request_id)
        generated = seq.num_tokens - max(len(seq.request.tokens), seq.stored * self.tokens_per_block)
        if type(n) is not int or not 1 <= n <= generated:
            raise ValueError(f"rewind: n must be an int in 1..{generated} (the tokens request {request_id} generated "
                             f"past its prompt and its stored blocks), got {n!r}")
        seq.num_tokens -= n
        del seq.tokens[seq.num_tokens:]
        keep = -(-seq.num_tokens // self.tokens_per_block)
        full = seq.num_tokens // self.tokens_per_block
        assert seq.stored <= full, f"request {request_id}: a stored block would be rewound"
        del seq.keys[full:], seq.hashes[full:]
        dropped, seq.blocks[keep:] = seq.blocks[keep:], []
        self._pool.release(dropped)

    @_checked
    def store_context_blocks(self, request_id: int) -> None:
        """Make the prompt's full blocks reusable (after prefill wrote them)."""
        seq = self._running(request_id)
        self._store(seq, len(seq.request.tokens) // self.tokens_per_block)

    @_checked
    def commit_and_get_block_hashes(self, request_id: int) -> list[int]:
        """Store what of the request is written (its prompt's full blocks, and the decoded ones whose every
        token's KV is) and return the hashes of all its full blocks, reused and newly stored, in order."""
        seq = self._running(request_id)
        T = self.tokens_per_block
        count = max(len(seq.request.tokens) // T, seq.storable_blocks(T))
        self._store(seq, count)
        seq.ensure_keys(count, T)
        return list(seq.hashes[:count])

    @_checked
    def remove_sequence(self, request_id: int, pin: bool = False, store: bool = True) -> list[int]:
        """Finish a request: store its full blocks for reuse, then release them.

        With ``pin=True`` the blocks stay held (for example while a transfer reads
        them) until ``unpin_sequence``; returns the ids of the pinned blocks.
        ``store=False`` aborts: blocks whose KV was never written must not become reusable.
        """
        seq = self._running(request_id)
        if store:
            self._store(seq, seq.storable_blocks(self.tokens_per_block))
        del self._seqs[request_id]
        if pin:
            self._pinned[request_id] = seq.blocks
            return [b.block_id for b in seq.blocks]
        self._pool.release(seq.blocks)
        return []

    @_checked
    def pin_prefix(self, pin_id: int, tokens: Seq[int], lora_id: int | None = None, cache_salt: str | None = None,
                   mm_keys: Seq[MmKey] = (), extra_ids: Seq[int] | None = None,
                   max_blocks: int | None = None) -> list[int]:
        """Hold the stored full blocks that match ``tokens`` (at most ``max_blocks``) until ``unpin_sequence(pin_id)``.

        For reading them out (a migration to another rank): host-tier blocks are
        onboarded first, so the returned primary pool slots, in prompt order,
        stay valid and unchanged while pinned. Matches as ``probe_prefix_match_length``
        does. Raises ``OutOfBlocksError`` (changing nothing) when onboarding does not fit.
        """
        if not isinstance(pin_id, int) or isinstance(pin_id, bool):
            raise TypeError(f"pin_prefix: pin_id must be an int, got {pin_id!r}")
        if pin_id in self._seqs or pin_id in self._pinned:
            raise ValueError(f"pin_prefix: id {pin_id} is already in the ledger")
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 0):
            raise ValueError(f"pin_prefix: max_blocks must be None or an int >= 0, got {max_blocks!r}")
        validate_prompt(tokens, lora_id, cache_salt, mm_keys, extra_ids)
        self.refresh_blocks()
        full = self._match(tokens, lora_id, cache_salt, mm_keys, extra_ids).full if tokens else []
        if max_blocks is not None:
            full = full[:max_blocks]
        onboards = [b for b in full if b.tier == SECONDARY]
        free_claimed = sum(1 for b in full if b.tier == PRIMARY and b.ref_count == 0)
        pool = self._pool
        if len(onboards) > pool.num_free(PRIMARY) - free_claimed:
            raise OutOfBlocksError(len(onboards), pool.num_free(PRIMARY) - free_claimed,
                                   f"pinning {len(full)} blocks as {pin_id}")
        for b in full:
            pool.ref(b)
        for b in onboards:
            pool.onboard(b)
        self.pools.flush()
        self._pinned[pin_id] = full
        return [b.slot for b in full]

    @_checked
    def unpin_sequence(self, request_id: int) -> None:
        blocks = self._pinned.pop(request_id, None)
        if blocks is None:
            raise KeyError(f"request {request_id} has no pinned blocks")
        self._pool.release(blocks)

    def _running(self, request_id: int) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} is not running in this ledger")
        return seq

    # ------------------------------------------------------------------ storing

    def _store(self, seq: Sequence, count: int) -> None:
        """Put the first ``count`` blocks of ``seq`` in the tree; announce the newly stored runs."""
        if count <= 0 or not self.config.enable_block_reuse:
            return
        T = self.tokens_per_block
        c = seq.stored
        if c >= count:
            return
        seq.ensure_keys(count, T)
        tree = self._pool.tree
        node = seq.blocks[c - 1].node if c else tree.root
        run: list[int] = []
        for i in range(c, count):
            key, b = seq.keys[i], seq.blocks[i]
            node = tree.child_or_new(node, key)
            if node.block is None and b.node is None:
                tree.attach(node, b)
                b.key, b.block_hash, b.is_full = key, seq.hashes[i], True
                b.prev = seq.blocks[i - 1] if i else None
                if run and seq.blocks[run[-1]].priority != b.priority:
                    self._announce_stored(seq, run)
                    run = []
                run.append(i)
            else:
                if run:
                    self._announce_stored(seq, run)
                    run = []
                assert node.block is b or b.node is None, f"block {b.block_id} stored at two nodes"
            if c == i and b.node is node:
                c += 1
        seq.stored = c
        if run:
            self._announce_stored(seq, run)

    def _announce_stored(self, seq: Sequence, run: list[int]) -> None:
        T, r = self.tokens_per_block, seq.request
        first = run[0]
        self._pool.events.put(BlockStored(
            block_hashes=[seq.hashes[i] for i in run],
            parent_block_hash=seq.hashes[first - 1] if first else None,
            token_ids=seq.tokens[first * T:(run[-1] + 1) * T], block_size=T, lora_id=r.lora_id,
            medium="GPU", cache_salt=r.cache_salt, priority=seq.blocks[first].priority))

    # ------------------------------------------------------------------ retention and clearing

    @_checked
    def refresh_blocks(self) -> None:
        """Blocks whose retention duration has passed fall back to the default priority."""
        self._retention.refresh()

    @_checked
    def clear(self) -> None:
        """Forget every reusable block (nothing may be running); announces ``AllBlocksCleared``."""
        if self._seqs or self._pinned:
            raise RuntimeError(f"clear() with {len(self._seqs) + len(self._pinned)} sequences still holding blocks")
        self._pool.clear()

    # ------------------------------------------------------------------ queries

    def get_block_ids(self, request_id: int) -> list[int]:
        return [b.block_id for b in self._running(request_id).blocks]

    def admission(self, request_id: int) -> Admission:
        return self._running(request_id).admission

    def num_tokens(self, request_id: int) -> int:
        return self._running(request_id).num_tokens

    def block_table(self, request_ids: Iterable[int]) -> torch.Tensor:
        """Primary pool slots per request, ``int32 [batch, max_blocks]``, -1 where a row is shorter."""
        rows = [[b.slot for b in self._running(rid).blocks] for rid in request_ids]
        width = max((len(r) for r in rows), default=0)
        table = torch.full((len(rows), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.pools.device)

    def analyze_prefix_reuse(self, tokens: Seq[int], lora_id: int | None = None, cache_salt: str | None = None,
                             mm_keys: Seq[MmKey] = (), extra_ids: Seq[int] | None = None) -> PrefixReuseSummary:
        """What admitting ``tokens`` now would reuse (no state changes)."""
        validate_prompt(tokens, lora_id, cache_salt, mm_keys, extra_ids)
        m = self._match(tokens, lora_id, cache_salt, mm_keys, extra_ids) if tokens else _Match([])
        self._decide_partial(m, set())
        return PrefixReuseSummary(
            reusable_blocks_allocated=sum(1 for b in m.full if b.ref_count > 0),
            reusable_blocks_all=len(m.full),
            total_matched_tokens=len(m.full) * self.tokens_per_block + m.partial_len,
            first_new_block=len(m.full))

    def probe_prefix_match_length(self, tokens: Seq[int], lora_id: int | None = None, cache_salt: str | None = None,
                                  mm_keys: Seq[MmKey] = (), extra_ids: Seq[int] | None = None) -> int:
        """Tokens of ``tokens[:-1]`` held as full blocks on any tier: what the router's index would say."""
        return self.analyze_prefix_reuse(tokens, lora_id, cache_salt, mm_keys, extra_ids).reusable_blocks_all \
            * self.tokens_per_block

    def get_needed_blocks_one_step(self, request_id: int) -> int:
        """Blocks the next decode step of a running request must allocate: for the token it samples and its
        ``num_draft_tokens`` drafts."""
        seq = self._running(request_id)
        step = 1 + seq.request.num_draft_tokens
        return max(0, -(-(seq.num_tokens + step) // self.tokens_per_block) - len(seq.blocks))

    def get_remaining_blocks_to_completion(self, request: Request) -> int:
        """Blocks a request still needs until ``max_new_tokens`` (shared, already held blocks excluded), its last
        step's draft tokens counted."""
        request.validate()
        total = -(-(len(request.tokens) + request.max_new_tokens + request.num_draft_tokens) // self.tokens_per_block)
        seq = self._seqs.get(request.request_id)
        if seq is not None:
            return max(0, total - len(seq.blocks))
        summary = self.analyze_prefix_reuse(request.tokens, request.lora_id, request.cache_salt,
                                            request.mm_keys, request.extra_ids)
        return total - summary.reusable_blocks_allocated

    # ------------------------------------------------------------------ scheduling

    @_checked
    def start_scheduling(self) -> None:
        """Open a scheduling round: tentative admissions and releases are counted apart from the real books."""
        for holder in (*(seq.blocks for seq in self._seqs.values()), *self._pinned.values()):
            for b in holder:
                b.sched_ref_count = b.ref_count
        self._sched_free = self._pool.num_free(PRIMARY)
        self._sched_taken = set()

    @_checked
    def scheduling_add_sequence(self, request: Request) -> int:
        """Reserve, in this round, what admitting ``request`` would take out of the free queue; returns it.

        That is its new blocks, a primary block for each host-tier block it would
        onboard, and the blocks it would reuse that are free in this round (free
        now, or tentatively released by ``scheduling_remove_sequence``), each
        counted once per round. The books do not change: ``add_sequences`` commits.
        Raises ``OutOfBlocksError`` (reserving nothing) when the round lacks them.
        """
        request.validate()
        (plan,) = self._plan([request])
        m = plan.match
        take = plan.new_blocks
        reused = [b for b in self._to_onboard(m) if b.block_id not in self._sched_taken]
        free_now = [b for b in reused if (b.sched_ref_count if b.ref_count else 0) == 0]
        take += len(free_now) + sum(1 for b in reused if b.tier == SECONDARY)
        if take > self._sched_free:
            raise OutOfBlocksError(take, self._sched_free, f"reserving request {request.request_id} in this round")
        self._sched_free -= take
        self._sched_taken.update(b.block_id for b in reused)
        return take

    @_checked
    def scheduling_remove_sequence(self, request_id: int) -> None:
        """Count the blocks that pausing ``request_id`` would free in this round."""
        for b in self._running(request_id).blocks:
            b.sched_ref_count -= 1
            if b.sched_ref_count == 0:
                self._sched_free += 1

    @property
    def scheduling_num_free_blocks(self) -> int:
        return self._sched_free

    # ------------------------------------------------------------------ reports

    def stats(self) -> KvCacheStats:
        pool = self._pool
        free = pool.num_free(PRIMARY)
        looked = self._reused + self._missed
        total_blocks = self.num_primary + self.num_secondary
        return KvCacheStats(
            max_num_blocks=self.num_primary, free_num_blocks=free, used_num_blocks=self.num_primary - free,
            tokens_per_block=self.tokens_per_block, alloc_total_blocks=pool.alloc_total,
            alloc_new_blocks=pool.alloc_new, reused_blocks=self._reused, missed_blocks=self._missed,
            cache_hit_rate=self._reused / looked if looked else 0.0,
            num_free_secondary_blocks=pool.num_free(SECONDARY),
            allocated_bytes=total_blocks * self.config.bytes_per_block if self.config.materialize else 0,
            max_num_secondary_blocks=self.num_secondary, offloaded_blocks=pool.offloaded,
            onboarded_blocks=pool.onboarded, events_dropped=pool.events.dropped)

    def take_events(self) -> list[KVEvent]:
        """Drain the event buffer, oldest first."""
        return self._pool.events.take()

    def snapshot(self) -> list[StoredBlock]:
        """Every reusable block, parents before children: enough for a router to rebuild this rank's index."""
        out = []
        stack: list[TreeNode] = [self._pool.tree.root]
        while stack:
            node = stack.pop()
            b = node.block
            if b is not None:
                parent = node.parent.block if node.parent is not None else None
                out.append(StoredBlock(block_hash=b.block_hash,
                                       parent_hash=parent.block_hash if parent is not None else None,
                                       token_ids=list(b.key.tokens), medium=b.medium, lora_id=b.key.lora_id,
                                       cache_salt=b.key.cache_salt, priority=b.priority))
            stack.extend(node.children.values())
        return out

    def check_integrity(self) -> None:
        """Prove the books balance; raises ``AssertionError`` naming the first broken invariant."""
        check_integrity(self._pool, (*(s.blocks for s in self._seqs.values()), *self._pinned.values()))
