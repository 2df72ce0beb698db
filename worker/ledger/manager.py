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
from kvledger.worker.ledger.budget import ContextBudget, blocks_to_completion, context_budget, sink_bubble, step_blocks
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.integrity import check_integrity, check_sequences
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
    """Blocks to allocate, the copy destination of a partial match and the other beams' tails included."""
    end: int
    """End of the first context chunk: the whole prompt unless chunked."""
    tails: int
    """Own last context blocks of beams 1.. (a beam search whose first chunk ends the prompt mid-block)."""


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
        chunk = self.config.context_chunk_size
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
            end = len(r.tokens) if chunk is None else min(len(r.tokens), len(m.full) * T + m.partial_len + chunk)
            tails = self._tails(r, end) if r.beam_width > 1 else 0
            plans.append(_Plan(r, m, -(-end // T) - len(m.full) - (1 if m.in_place else 0) + tails, end, tails))
        return plans

    def _tails(self, r: Request, end: int) -> int:
        """Blocks beams 1.. need of their own when a context chunk reaches ``end``: the prompt's last block, where
        the prompt ends mid-block (TensorRT-LLM shares it among the beams only when the prompt fills it)."""
        return r.beam_width - 1 if end == len(r.tokens) and end % self.tokens_per_block else 0

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
            blocks += self._alloc(p.new_blocks - copied - p.tails)
            n_reused = len(m.full) + (1 if m.partial is not None else 0)
            self._reused += n_reused
            self._missed += -(-len(r.tokens) // T) - n_reused   # the whole prompt's, chunked or not
            prepop = len(m.full) * T + m.partial_len
            adm = Admission(prepopulated_tokens=prepop, reused_blocks=len(m.full), partial_tokens=m.partial_len,
                            copied_blocks=copied, onboarded_blocks=n_onboarded, allocated_blocks=p.new_blocks)
            seq = Sequence(request=r, blocks=blocks, num_tokens=p.end, admission=adm, tokens=list(r.tokens),
                           keys=m.keys[:len(r.tokens) // T] if m.keys else [],
                           hashes=[b.block_hash for b in m.full], stored=len(m.full), chunk_start=prepop)
            if r.beam_width > 1:
                seq.beams = tuple(self._alloc(1 if p.tails else 0) for _ in range(r.beam_width - 1))
            self._retention.apply(seq, 0)
            self._seqs[r.request_id] = seq
            seqs.append(seq)
        for b in copy_sources:
            pool.unref(b)
        self.pools.flush()
        return seqs

    def _alloc(self, n: int) -> list[Block]:
        """``n`` clean primary blocks held once (capacity was checked)."""
        take = self._pool.take_free
        out = [take(count_alloc=True) for _ in range(n)]
        for b in out:
            b.ref_count = 1
        return out

    # ------------------------------------------------------------------ chunked prefill

    @_checked
    def add_context_chunk(self, request_id: int, num_tokens: int | None = None) -> tuple[int, int]:
        """The current context chunk is computed: make its full blocks reusable and admit the next chunk.

        The next chunk computes ``num_tokens`` prompt tokens (default
        ``CacheConfig.context_chunk_size``; the rest of the prompt when that is
        ``None``), fewer at the prompt's end; its blocks are allocated now.
        Returns its prompt positions ``(start, end)``. Raises ``ValueError`` when
        the whole prompt is admitted and ``OutOfBlocksError`` when the chunk's
        blocks do not fit, changing nothing either way.
        """
        seq = self._running(request_id)
        r = seq.request
        prompt = len(r.tokens)
        if seq.decoding or seq.num_tokens >= prompt:
            raise ValueError(f"add_context_chunk: request {request_id} has no context left to admit (its "
                             f"{prompt}-token prompt is admitted)")
        size = (self.config.context_chunk_size or prompt) if num_tokens is None else num_tokens
        if type(size) is not int or size < 1:
            raise ValueError(f"add_context_chunk: num_tokens must be None or an int >= 1, got {num_tokens!r}")
        start, end = seq.num_tokens, min(prompt, seq.num_tokens + size)
        need, tails = self._chunk_blocks(seq, end)
        pool = self._pool
        if need + tails > pool.num_free(PRIMARY):
            raise OutOfBlocksError(need + tails, pool.num_free(PRIMARY), f"admitting a context chunk of request "
                                                                          f"{request_id}")
        self._store(seq, start // self.tokens_per_block)
        first_new = len(seq.blocks)
        seq.blocks += self._alloc(need)
        for own in seq.beams[:tails]:
            own += self._alloc(1)
        seq.chunk_start, seq.num_tokens = start, end
        self._retention.apply(seq, first_new)
        self.pools.flush()
        return start, end

    def _chunk_blocks(self, seq: Sequence, end: int) -> tuple[int, int]:
        """Blocks beam 0 and the other beams' tails still need for a context chunk ending at ``end``; blocks a
        trimmed chunk left allocated count as had."""
        need = max(0, -(-end // self.tokens_per_block) - len(seq.blocks))
        return need, 0 if not seq.beams or seq.beams[0] else self._tails(seq.request, end)

    def context_chunk(self, request_id: int) -> tuple[int, int]:
        """Prompt positions ``(start, end)`` the current context chunk computes (``end == start`` never)."""
        seq = self._running(request_id)
        if seq.decoding:
            raise ValueError(f"context_chunk: request {request_id} is decoding; its context is computed")
        return seq.chunk_start, seq.num_tokens

    @_checked
    def fit_token_budget(self, request_ids: Seq[int], max_num_tokens: int) -> list[int]:
        """Shrink this step's context chunks, last request first, until the step computes ``max_num_tokens`` tokens
        at most; returns what each request computes, in order.

        A scheduler prices a batch with the estimated reuse
        (``get_context_budget(...).estimated_reusable_tokens``); the admission
        may reuse less (a block evicted or taken in between), and the step
        would then compute more tokens than the batch may hold (TensorRT-LLM
        issue 13318, the overrun its ``fit_token_budget`` prevents). After
        allocation no request leaves the batch, but a context chunk can end
        earlier: its cut tokens go to the next chunk (``add_context_chunk``)
        and its blocks stay allocated, so the gap is closed by computing later,
        not by rolling the allocation back. A decoding request computes
        ``1 + num_draft_tokens`` and is never cut; a chunk keeps one token at
        least. Raises ``ValueError`` (changing nothing) when even that does not fit.
        """
        if type(max_num_tokens) is not int or max_num_tokens < 0:
            raise ValueError(f"fit_token_budget: max_num_tokens must be an int >= 0, got {max_num_tokens!r}")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"fit_token_budget: request ids {list(request_ids)} repeat")
        seqs = [self._running(rid) for rid in request_ids]
        counts = [1 + s.request.num_draft_tokens if s.decoding else s.num_tokens - s.chunk_start for s in seqs]
        over = sum(counts) - max_num_tokens
        cuts: list[tuple[Sequence, int]] = []
        for i in reversed(range(len(seqs))):
            if over <= 0:
                break
            if not seqs[i].decoding and counts[i] > 1:
                cut = min(over, counts[i] - 1)
                cuts.append((seqs[i], cut))
                counts[i] -= cut
                over -= cut
        if over > 0:
            raise ValueError(f"fit_token_budget: requests {list(request_ids)} compute {sum(counts)} tokens at least "
                             f"(one per context chunk, 1 + drafts per decode), over max_num_tokens={max_num_tokens}")
        for seq, cut in cuts:
            seq.num_tokens -= cut
        return counts

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
        if not seq.decoding and seq.num_tokens < len(seq.request.tokens):
            raise ValueError(f"add_token: request {request_id} has admitted {seq.num_tokens} of its "
                             f"{len(seq.request.tokens)} prompt tokens; admit the rest with add_context_chunk")
        if tokens is not None:
            if seq.beams:
                raise ValueError(f"add_token: request {request_id} searches {seq.request.beam_width} beams, whose "
                                 "decode blocks are never stored; pass no token ids")
            validate_prompt(tokens, None, None, (), None)
            if len(tokens) != n:
                raise ValueError(f"add_token: {len(tokens)} token ids given for n={n}")
        need = -(-(seq.num_tokens + n) // self.tokens_per_block) - len(seq.blocks)
        pool = self._pool
        if need * seq.request.beam_width > pool.num_free(PRIMARY):   # every beam grows alike
            raise OutOfBlocksError(need * seq.request.beam_width, pool.num_free(PRIMARY),
                                   f"growing request {request_id}")
        first_new = len(seq.blocks)
        if need > 0:
            seq.blocks += self._alloc(need)
            for own in seq.beams:
                own += self._alloc(need)
        seq.decoding = True
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
        own_keep = keep - len(seq.request.tokens) // self.tokens_per_block
        for own in seq.beams:
            dropped += own[own_keep:]
            del own[own_keep:]
        self._pool.release(dropped)

    @_checked
    def store_context_blocks(self, request_id: int) -> None:
        """Make the full blocks of the prompt admitted so far reusable (after prefill, or its current chunk,
        wrote them); of a beam search, the blocks its beams share."""
        seq = self._running(request_id)
        self._store(seq, min(len(seq.request.tokens), seq.num_tokens) // self.tokens_per_block)

    @_checked
    def commit_and_get_block_hashes(self, request_id: int) -> list[int]:
        """Store what of the request is written (its prompt's full blocks, and the decoded ones whose every
        token's KV is) and return the hashes of all its full blocks, reused and newly stored, in order."""
        seq = self._running(request_id)
        T = self.tokens_per_block
        count = max(min(len(seq.request.tokens), seq.num_tokens) // T, seq.storable_blocks(T))
        self._store(seq, count)
        seq.ensure_keys(count, T)
        return list(seq.hashes[:count])

    @_checked
    def remove_sequence(self, request_id: int, pin: bool = False, store: bool = True) -> list[int]:
        """Finish a request: store its full blocks for reuse, then release them.

        With ``pin=True`` the blocks stay held (for example while a transfer reads
        them) until ``unpin_sequence``; returns the ids of the pinned blocks.
        ``store=False`` aborts: blocks whose KV was never written (a context chunk
        not computed) must not become reusable. Of a beam search nothing more is
        stored (TensorRT-LLM stores at release only for one beam).
        """
        seq = self._running(request_id)
        if store and not seq.beams:
            self._store(seq, seq.storable_blocks(self.tokens_per_block))
        del self._seqs[request_id]
        blocks = seq.blocks if not seq.beams else [b for own in seq.holders() for b in own]
        if pin:
            self._pinned[request_id] = blocks
            return [b.block_id for b in blocks]
        self._pool.release(blocks)
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

    def get_block_ids(self, request_id: int, beam: int = 0) -> list[int]:
        """Block ids of one beam of a running request, in sequence order."""
        seq = self._running(request_id)
        if beam == 0:
            return [b.block_id for b in seq.blocks]
        if type(beam) is not int or not 0 < beam < seq.request.beam_width:
            raise ValueError(f"get_block_ids: beam must be an int in 0..{seq.request.beam_width - 1}, got {beam!r}")
        return [b.block_id for b in seq.beam_rows(self.tokens_per_block)[beam]]

    def admission(self, request_id: int) -> Admission:
        return self._running(request_id).admission

    def num_tokens(self, request_id: int) -> int:
        return self._running(request_id).num_tokens

    def block_table(self, request_ids: Iterable[int]) -> torch.Tensor:
        """Primary pool slots, ``int32 [rows, max_blocks]``, -1 where a row is shorter: a row per request, or per
        beam of a beam search (``beam_width`` consecutive rows, beam 0 first)."""
        rows = []
        for rid in request_ids:
            seq = self._running(rid)
            if seq.beams:
                rows += [[b.slot for b in row] for row in seq.beam_rows(self.tokens_per_block)]
            else:
                rows.append([b.slot for b in seq.blocks])
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

    def get_needed_blocks_one_step(self, request_id: int, two_steps_lookahead: bool = False) -> int:
        """Blocks the next step of a running request must allocate, every beam's: in its context, for the next
        chunk (``add_context_chunk`` with the default size); decoding, for the token it samples and its
        ``num_draft_tokens`` drafts (two such steps with ``two_steps_lookahead``, TensorRT-LLM's
        ``twoStepsLookAhead``)."""
        seq = self._running(request_id)
        r = seq.request
        prompt = len(r.tokens)
        if not seq.decoding and seq.num_tokens < prompt:
            return sum(self._chunk_blocks(seq, min(prompt, seq.num_tokens + (self.config.context_chunk_size
                                                                             or prompt))))
        return step_blocks(seq.num_tokens, len(seq.blocks), r.num_draft_tokens, r.beam_width, self.tokens_per_block,
                           two_steps_lookahead)

    def get_context_budget(self, request: Request) -> ContextBudget:
        """What admitting ``request``'s context costs, as TensorRT-LLM's ``getNeededBlocksOneStep`` prices a
        context: ``prompt + min(drafts, max_new_tokens)`` tokens (one full-attention window) plus the sink bubble,
        the tail per beam, less the matched blocks running requests hold; and the prompt tokens the prefix tree is
        expected to supply. Chunked, the blocks come as chunks are admitted; the budget is the whole context's."""
        request.validate()
        T = self.tokens_per_block
        n = len(request.tokens)
        reuse = self.analyze_prefix_reuse(request.tokens, request.lora_id, request.cache_salt, request.mm_keys,
                                          request.extra_ids) if self.config.enable_block_reuse else None
        return context_budget(n, request.num_draft_tokens, request.max_new_tokens, request.beam_width, T,
                              self.config.context_chunk_size or n, None, sink_bubble(self.config.sink_tokens, T), reuse)

    def get_remaining_blocks_to_completion(self, request: Request) -> int:
        """Blocks a request still needs until ``max_new_tokens`` (shared, already held blocks excluded), its last
        step's draft tokens counted; a beam search's prompt blocks once, every later block per beam."""
        request.validate()
        total = blocks_to_completion(len(request.tokens), request.max_new_tokens, request.num_draft_tokens,
                                     request.beam_width, self.tokens_per_block)
        seq = self._seqs.get(request.request_id)
        if seq is not None:
            return max(0, total - sum(len(h) for h in seq.holders()))
        summary = self.analyze_prefix_reuse(request.tokens, request.lora_id, request.cache_salt,
                                            request.mm_keys, request.extra_ids)
        return total - summary.reusable_blocks_allocated

    # ------------------------------------------------------------------ scheduling

    @_checked
    def start_scheduling(self) -> None:
        """Open a scheduling round: tentative admissions and releases are counted apart from the real books."""
        for holder in self._holders():
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
        for holder in self._running(request_id).holders():
            for b in holder:
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
        check_integrity(self._pool, self._holders())
        check_sequences(self._seqs.values(), self.tokens_per_block)

    def _holders(self) -> list[list[Block]]:
        """Every block list that holds references: running sequences' (every beam's own) and pins."""
        return [*(h for s in self._seqs.values() for h in s.holders()), *self._pinned.values()]
