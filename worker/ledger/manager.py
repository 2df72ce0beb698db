"""The per-rank KV cache manager: the admission policy over the block pool.

Follows TensorRT-LLM's KVCacheManager, layered as vLLM v1 is
(``KVCacheManager`` over a ``KVCacheCoordinator`` over ``BlockPool``): the
manager is the facade that validates every call and tracks the running
sequences; admission.py matches prompts (matching.py) and decides what to
reuse, storing.py stores finished blocks, and the coordinator
(coordinator.py) loops over one window manager per attention window, of its
kind's class (window.py), each holding that window's pool (block_pool.py),
which moves blocks between free lists and tiers. Every window's blocks sit in
one prefix tree; a sequence (sequence.py) keeps a block list per window, all
as long as each other, a sliding window's with placeholders where its blocks
slid out. Every public operation validates its input and checks capacity
before it changes anything, so a refused call leaves the books, the stats and
the event buffer as they were.
"""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TypeVar

import torch

from kvledger.worker.ledger.admission import Admitter
from kvledger.worker.ledger.block import Block
from kvledger.worker.ledger.budget import ContextBudget, fit_token_counts
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.coordinator import LedgerCoordinator
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.integrity import check_pool, check_sequences, check_tree
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.matching import Match, decide_partial
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.ledger.scheduling import SchedulingRound
from kvledger.worker.ledger.sequence import Sequence
from kvledger.worker.ledger.stats import Admission, KvCacheStats, PinnedPrefix, PrefixReuseSummary
from kvledger.worker.wire.batches import StoredBlock
from kvledger.worker.wire.block_key import MmKey, validate_prompt
from kvledger.worker.wire.events import AllBlocksCleared, KVCacheCreated, KVEvent
from kvledger.worker.wire.request import Request

logger = logging.getLogger(__name__)
R = TypeVar("R")


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


def _require_request(what: str, r: object) -> None:
    """A ``Request`` is valid once made (``Request.__post_init__``): only its type is left to check."""
    if not isinstance(r, Request):
        raise TypeError(f"{what} takes Request objects, got {type(r).__name__}")


class KVCacheManager:
    """The books of one rank's KV blocks: who holds which block, where its data lives, what is reusable."""

    def __init__(self, config: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self._tree = tree = PrefixTree(len(config.window_layouts))
        self._events = events = EventBuffer(config.event_buffer_size)
        self._coord = coord = LedgerCoordinator(config, clock, tree, events)
        self._windows = coord.windows
        """One window manager per distinct attention window (``CacheConfig.window_layouts``), of its kind's class."""
        self._pool = self._windows[0].pool
        self.num_primary = sum(w.pool.num_primary for w in self._windows)
        self.num_secondary = sum(w.pool.num_secondary for w in self._windows)
        self.pools = coord.pools
        """The tensors: window 0's ``TieredPools`` for one window, else every window's (``WindowPools``)."""
        self.blocks = self._pool.blocks
        """Window 0's blocks by id (``window_blocks`` has every window's)."""
        self._admit = Admitter(config, tree, self._windows, self.pools)
        self._storer = coord.storer
        self._seqs: dict[int, Sequence] = {}
        self._pinned: dict[int, tuple[list[Block], ...]] = {}
        """Pinned blocks by pin id: every window's list, window 0's first (as ``Sequence.windows``)."""
        self._round = SchedulingRound(self._windows)
        events.put_n(self.created_events())

    def created_events(self) -> list[KVCacheCreated]:
        """What this ledger was created with: one ``KVCacheCreated`` per attention window, each window's own pool
        (TensorRT-LLM's one created event per window size), its group named as ``BlockStored`` names it."""
        return self._coord.created_events()

    @property
    def clock(self) -> Callable[[], float]:
        """The injected clock that retention durations run on."""
        return self._pool.clock

    @property
    def window_block_counts(self) -> tuple[tuple[int, int], ...]:
        """``(device, host)`` blocks of each attention window, in ``CacheConfig.window_layouts`` order."""
        return tuple((w.pool.num_primary, w.pool.num_secondary) for w in self._windows)

    def window_blocks(self, window: int) -> list[Block]:
        """The blocks of attention window ``window`` by id (``blocks`` is window 0's)."""
        return self._windows[window].pool.blocks

    # ------------------------------------------------------------------ admission

    def add_sequence(self, request: Request) -> int:
        """Admit one request; returns its prepopulated prompt length (tokens whose KV is reused)."""
        return self.add_sequences([request])[0]

    @_checked
    def add_sequences(self, requests: Seq[Request], received: bool = False) -> list[int]:
        """Admit a batch: every request claims its matches before any block is allocated.

        So one request's allocation cannot evict what another in the batch was
        counted to reuse. Raises ``OutOfBlocksError`` (changing nothing) when the
        batch does not fit. ``received=True`` is for contexts whose KV is
        received, not computed (a migration's import): each whole context is
        allocated at once even under ``context_chunk_size``, and a sliding window
        takes only the blocks its last token's query reads (the rest are
        placeholders, never stored), as a request would reuse them.
        """
        ids = set()
        for r in requests:
            _require_request("add_sequences", r)
            if r.request_id in self._seqs or r.request_id in self._pinned or r.request_id in ids:
                raise ValueError(f"request {r.request_id} is already in the ledger")
            if r.beam_width > 1 and self._coord.windowed:
                raise ValueError(f"request {r.request_id} asks for {r.beam_width} beams; beam search is not supported "
                                 f"with attention windows {self.config.attention_windows}")
            ids.add(r.request_id)
        self.refresh_blocks()
        plans = self._admit.plan_fitting(requests, received)
        seqs = self._admit.apply(plans)
        for seq in seqs:
            self._seqs[seq.request.request_id] = seq
        return [s.admission.prepopulated_tokens for s in seqs]

    # ------------------------------------------------------------------ chunked prefill

    @_checked
    def add_context_chunk(self, request_id: int, num_tokens: int | None = None) -> tuple[int, int]:
        """The current context chunk is computed: make its full blocks reusable and admit the next chunk.

        The next chunk computes ``num_tokens`` prompt tokens (default
        ``CacheConfig.context_chunk_size``; the rest of the prompt when that is
        ``None``), fewer at the prompt's end; its blocks are allocated now. A
        sliding window first releases the blocks no query from the chunk's
        start attends to, stored first, as ``add_token`` does while decoding,
        so a window holds at most ``window + chunk`` tokens' blocks (what
        ``get_context_budget`` prices). Returns its prompt positions
        ``(start, end)``. Raises ``ValueError`` when
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
        self._coord.admit_chunk(seq, start, end, f"admitting a context chunk of request {request_id}")
        return start, end

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
        counts = [s.step_tokens() for s in seqs]
        fitted = fit_token_counts(counts, [not s.decoding for s in seqs], max_num_tokens)
        if sum(fitted) > max_num_tokens:
            raise ValueError(f"fit_token_budget: requests {list(request_ids)} compute {sum(fitted)} tokens at least "
                             f"(one per context chunk, 1 + drafts per decode), over max_num_tokens={max_num_tokens}")
        for seq, count, kept in zip(seqs, counts, fitted):
            seq.trim_chunk(count - kept)
        return fitted

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
        self._coord.decode(seq, n, tokens, f"growing request {request_id}")

    @_checked
    def rewind(self, request_id: int, n: int) -> None:
        """Drop the last ``n`` tokens of a running request (its rejected draft tokens) and release the blocks
        past the new end, last first; the prompt itself cannot be rewound.

        The dropped tokens' KV was never stored (a block is stored only once its
        every token is written and kept), so nothing reusable is lost.
        """
        seq = self._running(request_id)
        generated = seq.rewindable(self.tokens_per_block)
        if type(n) is not int or not 1 <= n <= generated:
            raise ValueError(f"rewind: n must be an int in 1..{generated} (the tokens request {request_id} generated "
                             f"past its prompt, its stored blocks and, with a sliding window, its last step's start), "
                             f"got {n!r}")
        self._coord.release(seq.rewind(n, self.tokens_per_block))

    @_checked
    def store_context_blocks(self, request_id: int) -> None:
        """Make the full blocks of the prompt admitted so far reusable (after prefill, or its current chunk,
        wrote them); of a beam search, the blocks its beams share."""
        seq = self._running(request_id)
        self._storer.store(seq, min(len(seq.request.tokens), seq.num_tokens) // self.tokens_per_block)

    def commit_and_get_block_hashes(self, request_id: int) -> list[int]:
        """The hashes of the request's full blocks, in order: its prompt's admitted so far, reused or not, and the
        decoded ones whose every token's KV is written.

        Hashing only, as TensorRT-LLM's does: nothing is stored or announced. Called before prefill, storing would
        publish blocks whose KV was never written; ``store_context_blocks`` (after prefill) and ``add_token``
        store what is written."""
        seq = self._running(request_id)
        T = self.tokens_per_block
        count = max(min(len(seq.request.tokens), seq.num_tokens) // T, seq.storable_blocks(T))
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
            self._storer.store(seq, seq.storable_blocks(self.tokens_per_block))
        del self._seqs[request_id]
        held = seq.held_lists()
        if pin:
            self._pinned[request_id] = held
            return [b.block_id for b in held[0]]
        self._coord.release(held)
        return []

    @_checked
    def pin_prefix(self, pin_id: int, tokens: Seq[int], lora_id: int | None = None, cache_salt: str | None = None,
                   mm_keys: Seq[MmKey] = (), extra_ids: Seq[int] | None = None,
                   max_blocks: int | None = None) -> PinnedPrefix:
        """Hold the stored full blocks that match ``tokens`` (a prefix of ``max_blocks`` at most) until
        ``unpin_sequence(pin_id)``; returns the prefix's length and each window's primary pool slots of them.

        For reading them out (a migration to another rank): host-tier blocks are
        onboarded first, so the slots stay valid and unchanged while pinned.
        Matches as ``probe_prefix_match_length`` does: with attention windows by
        the safe-prefix rule, so a full-attention window pins every block of the
        prefix and a sliding window only the last ones a query past the prefix
        reads (what a request reuses). Raises ``OutOfBlocksError`` (changing
        nothing) when onboarding does not fit.
        """
        if not isinstance(pin_id, int) or isinstance(pin_id, bool):
            raise TypeError(f"pin_prefix: pin_id must be an int, got {pin_id!r}")
        if pin_id in self._seqs or pin_id in self._pinned:
            raise ValueError(f"pin_prefix: id {pin_id} is already in the ledger")
        if max_blocks is not None and (not isinstance(max_blocks, int) or max_blocks < 0):
            raise ValueError(f"pin_prefix: max_blocks must be None or an int >= 0, got {max_blocks!r}")
        validate_prompt(tokens, lora_id, cache_salt, mm_keys, extra_ids)
        self.refresh_blocks()
        m = self._admit.match(tokens, lora_id, cache_salt, mm_keys, extra_ids, max_blocks=max_blocks) if tokens \
            else Match([])
        held = tuple(m.held(w.index) for w in self._windows)
        self._coord.hold(held, f"pinning {len(m.full)} blocks as {pin_id}")
        self._pinned[pin_id] = held
        return PinnedPrefix(len(m.full), tuple([b.slot for b in blocks] for blocks in held))

    @_checked
    def unpin_sequence(self, request_id: int) -> None:
        """Release the blocks ``pin_prefix`` or ``remove_sequence(pin=True)`` held under ``request_id``."""
        held = self._pinned.pop(request_id, None)
        if held is None:
            raise KeyError(f"request {request_id} has no pinned blocks")
        self._coord.release(held)

    def _running(self, request_id: int) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"request {request_id} is not running in this ledger")
        return seq

    # ------------------------------------------------------------------ retention and clearing

    @_checked
    def refresh_blocks(self) -> None:
        """Blocks whose retention duration has passed fall back to the default priority."""
        for w in self._windows:
            w.retention.refresh()

    @_checked
    def clear(self) -> None:
        """Forget every reusable block (nothing may be running); announces ``AllBlocksCleared``."""
        if self._seqs or self._pinned:
            raise RuntimeError(f"clear() with {len(self._seqs) + len(self._pinned)} sequences still holding blocks")
        for w in self._windows:
            w.pool.clear(announce=False)
        self._events.put(AllBlocksCleared())

    # ------------------------------------------------------------------ queries

    def get_block_ids(self, request_id: int, beam: int = 0, window: int = 0) -> list[int]:
        """Block ids of one beam of a running request, in sequence order; with attention windows, of one window
        (ids of ``window_blocks(window)``, ``NO_BLOCK`` for a placeholder)."""
        return self._running(request_id).block_ids(beam, window, self.tokens_per_block)

    def window_slots(self, request_id: int, start: int, end: int) -> tuple[list[int], ...]:
        """Each window's primary pool slots of running request ``request_id``'s blocks at positions ``start..end-1``
        that the window holds (placeholders left out): where a migration's import receives each window's KV."""
        seq = self._running(request_id)
        if type(start) is not int or type(end) is not int or not 0 <= start <= end <= len(seq.blocks):
            raise ValueError(f"window_slots: need 0 <= start <= end <= {len(seq.blocks)} (request {request_id}'s "
                             f"blocks), got start={start!r}, end={end!r}")
        return seq.window_slots(start, end)

    @property
    def window_pools(self) -> list[TieredPools]:
        """Every window's tensor pools, in ``window_block_counts`` order (``pools`` is window 0's for one window)."""
        return [w.pool.pools for w in self._windows]

    @_checked
    def arrange_slots(self, request_id: int, start: int, slots: Seq[int], window: int = 0) -> None:
        """Give the blocks of running request ``request_id`` from position ``start`` on, in attention window
        ``window``, the device slots ``slots``, an order of their own slots: a transfer receives straight into the
        pool where the slots run as the sender's do. Only blocks that the request alone holds and that hold nothing
        reusable yet may trade slots (no one else has seen their data); raises ``ValueError``, changing nothing,
        otherwise."""
        self._running(request_id).arrange_slots(start, slots, window)

    def admission(self, request_id: int) -> Admission:
        return self._running(request_id).admission

    def num_tokens(self, request_id: int) -> int:
        return self._running(request_id).num_tokens

    def block_table(self, request_ids: Iterable[int]) -> torch.Tensor:
        """Primary pool slots, ``int32 [rows, max_blocks]``: a row per request, or per beam of a beam search
        (``beam_width`` consecutive rows, beam 0 first). With several attention windows
        ``int32 [rows, windows, max_blocks]``: each window's slots in its own pools.

        ``NO_BLOCK`` stands where a row holds no block: past the end of a row shorter than the longest, and at a
        sliding window's placeholder (a block that slid out). It is past every pool, so a read of it raises
        instead of wrapping to the last slot; a reader masks the positions it does not attend to."""
        return self._coord.block_table([self._running(rid) for rid in request_ids])

    def analyze_prefix_reuse(self, tokens: Seq[int], lora_id: int | None = None, cache_salt: str | None = None,
                             mm_keys: Seq[MmKey] = (), extra_ids: Seq[int] | None = None) -> PrefixReuseSummary:
        """What admitting ``tokens`` now would reuse (no state changes). With attention windows, a matched position
        counts as allocated when every window that keeps a block there has it held by a running request (a
        placeholder costs no block), so the figure does not depend on the order the windows are listed in."""
        validate_prompt(tokens, lora_id, cache_salt, mm_keys, extra_ids)
        return self._match(tokens, lora_id, cache_salt, mm_keys, extra_ids).summary(self.tokens_per_block)

    def _match(self, tokens: Seq[int], lora_id: int | None, cache_salt: str | None, mm_keys: Seq[MmKey],
               extra_ids: Seq[int] | None) -> Match:
        m = self._admit.match(tokens, lora_id, cache_salt, mm_keys, extra_ids) if tokens else Match([])
        decide_partial(m, set(), self.config.copy_on_partial_reuse)
        return m

    def _held_matched(self, request: Request) -> tuple[int, ...]:
        """Per window, the blocks matching ``request``'s prompt that running requests hold: they cost that window's
        pool nothing."""
        m = self._match(request.tokens, request.lora_id, request.cache_salt, request.mm_keys, request.extra_ids)
        return m.held_by_running(len(self._windows))

    def probe_prefix_match_length(self, tokens: Seq[int], lora_id: int | None = None, cache_salt: str | None = None,
                                  mm_keys: Seq[MmKey] = (), extra_ids: Seq[int] | None = None) -> int:
        """Tokens of ``tokens[:-1]`` held as full blocks on any tier: what the router's index would say."""
        return self.analyze_prefix_reuse(tokens, lora_id, cache_salt, mm_keys, extra_ids).reusable_blocks_all \
            * self.tokens_per_block

    def get_needed_blocks_one_step(self, request_id: int, two_steps_lookahead: bool = False) -> int:
        """Blocks the next step of a running request must allocate, every beam's and every window's: in its context,
        for the next chunk (``add_context_chunk`` with the default size); decoding, for the token it samples and its
        ``num_draft_tokens`` drafts (two such steps with ``two_steps_lookahead``, TensorRT-LLM's
        ``twoStepsLookAhead``). The sum of ``step_blocks_by_window``."""
        return sum(self.step_blocks_by_window(request_id, two_steps_lookahead))

    def step_blocks_by_window(self, request_id: int, two_steps_lookahead: bool = False) -> tuple[int, ...]:
        """``get_needed_blocks_one_step`` per window, in ``window_block_counts`` order: what each window's own
        pool must supply (the other beams' tails of a context chunk come from window 0, the only one with beams)."""
        return self._coord.step_blocks(self._running(request_id), two_steps_lookahead)

    def check_decode_step(self, request_ids: Seq[int]) -> None:
        """``OutOfBlocksError`` unless the decoding ``request_ids`` can all grow by one step at once, changing
        nothing: each window grows alike and draws on its own pool, so each window's need is held against that
        window's free blocks, never against the sum over windows."""
        need = sum(self._running(rid).step_blocks(self.tokens_per_block, False) for rid in request_ids)
        self._coord.check_growth(f"decode step of request(s) {list(request_ids)}", self._coord.per_window(need, need))

    def get_context_budget(self, request: Request) -> ContextBudget:
        """What admitting ``request``'s context costs: ``context_budget_by_window``, its blocks summed over the
        windows (each window draws on its own pool: a scheduler compares ``context_budget_by_window`` with
        ``free_blocks_by_window``, never this sum with one pool) and the least of their reusable tokens."""
        per = self.context_budget_by_window(request)
        if len(per) == 1:
            return per[0]
        return ContextBudget(sum(b.blocks for b in per), min(b.estimated_reusable_tokens for b in per))

    def context_budget_by_window(self, request: Request) -> tuple[ContextBudget, ...]:
        """Each window's price of admitting ``request``'s context, in ``window_block_counts`` order, as
        TensorRT-LLM's ``getNeededBlocksOneStep`` prices a context: ``prompt + min(drafts, max_new_tokens)`` tokens
        (at most ``window + chunk`` for a sliding window) plus the sink bubble, the tail per beam, less the matched
        blocks that running requests hold in that window; and the prompt tokens the prefix tree is expected to
        supply. Chunked, the blocks come as chunks are admitted; the budget is the whole context's."""
        _require_request("context_budget_by_window", request)
        reuse = held = None
        if self.config.enable_block_reuse:
            reuse = self.analyze_prefix_reuse(request.tokens, request.lora_id, request.cache_salt, request.mm_keys,
                                              request.extra_ids)
            held = self._held_matched(request)
        return self._coord.context_budgets(request, reuse, held)

    def get_remaining_blocks_to_completion(self, request: Request) -> int:
        """Blocks a request still needs until ``max_new_tokens`` (shared, already held blocks excluded), its last
        step's draft tokens counted; a beam search's prompt blocks once, every later block per beam. With attention
        windows, the sum over the windows, a sliding window's capped at the most it ever holds at once."""
        return sum(self.remaining_blocks_by_window(request))

    def remaining_blocks_by_window(self, request: Request) -> tuple[int, ...]:
        """``get_remaining_blocks_to_completion`` per window, in ``window_block_counts`` order: what each window's
        own pool must still supply. Before admission the matched blocks that running requests hold are taken off
        the full attention windows only (a sliding window may hold none of them when it needs its blocks)."""
        totals = self.blocks_to_completion_by_window(request)
        seq = self._seqs.get(request.request_id)
        return self._coord.remaining_blocks(totals, seq, () if seq is not None else self._held_matched(request))

    def blocks_to_completion_by_window(self, request: Request) -> tuple[int, ...]:
        """The most blocks each window holds for ``request`` at once, shared or its own, its last step's drafts
        counted: what that window's pool must be able to hold at all (a sliding window: the prompt's blocks, then
        those of one window and one filling)."""
        _require_request("blocks_to_completion_by_window", request)
        return self._coord.blocks_to_completion(request)

    def could_hold(self, request: Request) -> bool:
        """Whether every window's device pool could hold ``request`` at all, however much is free now (it may
        then wait for blocks; otherwise it never fits)."""
        return all(n <= device for n, (device, _) in zip(self.blocks_to_completion_by_window(request),
                                                          self.window_block_counts))

    def context_limit(self) -> int | None:
        """The most tokens, prompt and output, one request can ever hold here: a full-attention window keeps
        every block, so its pool is the bound (never the sum over windows); ``None`` with sliding windows only."""
        return self._coord.context_limit()

    def free_blocks_by_window(self) -> tuple[int, ...]:
        """Free device blocks of each window's pool, in ``window_block_counts`` order."""
        return self._coord.free_blocks()

    # ------------------------------------------------------------------ scheduling

    @_checked
    def start_scheduling(self) -> None:
        """Open a scheduling round: tentative admissions and releases are counted apart from the real books."""
        self._round = SchedulingRound(self._windows, (self._holders(w) for w in range(len(self._windows))))

    @_checked
    def scheduling_add_sequence(self, request: Request) -> int:
        """Reserve, in this round, what admitting ``request`` would take out of the free queue; returns it.

        That is its new blocks, a primary block for each host-tier block it would
        onboard, and the blocks it would reuse that are free in this round (free
        now, or tentatively released by ``scheduling_remove_sequence``), each
        counted once per round, in every attention window; a request added twice
        in a round is counted once. The books do not change: ``add_sequences``
        commits. Raises ``OutOfBlocksError`` (reserving nothing) when the round
        lacks them.
        """
        _require_request("scheduling_add_sequence", request)
        (plan,) = self._admit.plan([request])
        return self._round.reserve(plan.match, plan.new_blocks, request.request_id)

    @_checked
    def scheduling_add_step(self, request_id: int) -> int:
        """Reserve, in this round, what the next step of running ``request_id`` allocates in each window
        (``step_blocks_by_window``); returns it, counting a request once per round. Raises ``OutOfBlocksError``
        (reserving nothing) when some window of the round lacks them."""
        return self._round.reserve_blocks(self.step_blocks_by_window(request_id), request_id)

    @_checked
    def scheduling_remove_sequence(self, request_id: int) -> None:
        """Count the blocks that pausing ``request_id`` would free in this round."""
        seq = self._running(request_id)
        self._round.release([seq.held_in(w.index) for w in self._windows])

    @property
    def scheduling_num_free_blocks(self) -> int:
        return self._round.num_free

    # ------------------------------------------------------------------ reports

    def stats(self) -> KvCacheStats:
        return self._coord.stats(self._admit.reused, self._admit.missed, self._events.dropped)

    def take_events(self) -> list[KVEvent]:
        """Drain the event buffer, oldest first."""
        return self._events.take()

    def snapshot(self) -> list[StoredBlock]:
        """Every reusable block (of every window), parents before children: enough for a router to rebuild this
        rank's index."""
        return self._storer.snapshot()

    def check_integrity(self) -> None:
        """Prove the books balance; raises ``AssertionError`` naming the first broken invariant."""
        for w in self._windows:
            check_pool(w.pool, self._holders(w.index))
        check_tree(self._tree)
        check_sequences(self._seqs.values(), self.tokens_per_block)

    def _holders(self, window: int = 0) -> list[list[Block]]:
        """Every block list that holds references in ``window``: running sequences' (every beam's own) and pins."""
        pins = (p[window] for p in self._pinned.values())
        return [*(h for s in self._seqs.values() for h in s.held_in(window)), *pins]
