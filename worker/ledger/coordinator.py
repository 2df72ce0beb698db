"""The ledger coordinator: one window manager per attention window, of its kind's class, and the loops over them.

As vLLM's ``KVCacheCoordinator`` does over its single-type managers, it
builds each window's manager from ``window.MANAGERS`` by the window's kind,
once, and then asks every window the same question in one loop: whether a
step fits, what to allocate, slide and release, and each window's budgets,
which it answers against that window's own pool (never a sum over windows).
The running sequences keep their own block lists (sequence.py); the manager
(manager.py) is the facade that validates calls and drives both.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import replace

import torch

from kvledger.worker.ledger.block import NO_BLOCK, PLACEHOLDER, PRIMARY, SECONDARY, Block
from kvledger.worker.ledger.budget import ContextBudget, blocks_to_completion, ceil_div, sink_bubble
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.kv_pool import TieredPools
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.ledger.sequence import Sequence
from kvledger.worker.ledger.stats import KvCacheStats, PrefixReuseSummary, WindowStats
from kvledger.worker.ledger.storing import Storer
from kvledger.worker.ledger.window import MANAGERS, WindowManager
from kvledger.worker.ledger.window_pools import WindowPools
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.events import KVCacheCreated
from kvledger.worker.wire.request import Request


class LedgerCoordinator:
    """Every attention window's manager (``CacheConfig.window_layouts`` order) and what is asked of all of them."""

    __slots__ = ("config", "tokens_per_block", "windows", "windowed", "sliding", "pools", "storer")

    def __init__(self, config: CacheConfig, clock: Callable[[], float], tree: PrefixTree,
                 events: EventBuffer) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.windows: list[WindowManager] = [MANAGERS[layout.kind](config, clock, i, tree, events)
                                             for i, layout in enumerate(config.window_layouts)]
        self.windowed = len(self.windows) > 1 or self.windows[0].slides
        """Some window slides: matches follow the safe-prefix rule and events name each window's group."""
        self.sliding = [w for w in self.windows if w.slides]
        self.pools: TieredPools | WindowPools = self.windows[0].pool.pools if len(self.windows) == 1 else \
            WindowPools([w.pool.pools for w in self.windows])
        """The tensors: window 0's ``TieredPools`` for one window, else every window's (``WindowPools``)."""
        self.storer = Storer(config, tree, events, self.windows, self.windowed)

    def created_events(self) -> list[KVCacheCreated]:
        """One ``KVCacheCreated`` per window, each with its own pool, its group named as ``BlockStored`` names it."""
        return [KVCacheCreated(num_blocks={"GPU": w.pool.num_primary, "CPU": w.pool.num_secondary},
                               block_size=self.tokens_per_block, group_idx=w.index,
                               kv_cache_spec_kind=w.kind if self.windowed else None,
                               kv_cache_spec_sliding_window=w.size) for w in self.windows]

    # ------------------------------------------------------------------ growth and release

    def admit_chunk(self, seq: Sequence, start: int, end: int, what: str) -> None:
        """Store the chunk before ``start``, slide past it and allocate the chunk ``start..end-1`` (``what``: the
        refusal's words); raises ``OutOfBlocksError``, changing nothing, when some window lacks the blocks."""
        need, tails = seq.chunk_blocks(end, self.tokens_per_block)
        self.check_growth(what, self.per_window(need + tails, need), self.sliding_gains(seq, start))
        self.storer.store(seq, start // self.tokens_per_block)
        self.slide(seq, start)
        first_new = len(seq.blocks)
        self.allocate(seq, need, [1] * tails)
        seq.admit_chunk(start, end)
        self.apply_retention(seq, first_new)
        self.pools.flush()

    def decode(self, seq: Sequence, n: int, tokens: Seq[int] | None, what: str) -> None:
        """Grow ``seq`` by ``n`` decoded tokens in every window (``KVCacheManager.add_token``); raises
        ``OutOfBlocksError``, changing nothing, when some window lacks the blocks."""
        T = self.tokens_per_block
        need = max(0, ceil_div(seq.num_tokens + n, T) - len(seq.blocks))
        old = seq.num_tokens
        # every beam grows alike
        self.check_growth(what, self.per_window(need * seq.request.beam_width, need), self.sliding_gains(seq, old))
        if self.sliding and not seq.opaque:   # store what a window is about to release: every token before ``old``
            self.storer.store(seq, old // T)   # is written
        self.slide(seq, old)
        first_new = len(seq.blocks)
        if need > 0:
            self.allocate(seq, need, [need] * len(seq.beams))
        seq.decoded(n, tokens)
        self.apply_retention(seq, first_new)
        self.pools.flush()
        if not seq.opaque:   # everything before this step's tokens is written (rejected drafts were rewound)
            self.storer.store(seq, old // T)

    def per_window(self, first: int, rest: int) -> tuple[int, ...]:
        """``first`` for window 0 (the only one with beams), ``rest`` for every other window."""
        return (first,) + (rest,) * (len(self.windows) - 1)

    def check_growth(self, what: str, needs: Seq[int], gains: Seq[int] = ()) -> None:
        """Raise ``OutOfBlocksError`` unless every window has its ``needs`` free (counting the ``gains`` that a sliding
        window frees first)."""
        for w, need in zip(self.windows, needs):
            free = w.pool.num_free(PRIMARY) + (gains[w.index] if gains else 0)
            if need > free:
                raise OutOfBlocksError(need, free, f"{what}{w.where}")

    def sliding_gains(self, seq: Sequence, pos: int) -> list[int]:
        """Per window, the blocks sliding out before a step from ``pos`` would free (those ``seq`` alone holds)."""
        return [w.sliding_gain(seq, pos) for w in self.windows]

    def slide(self, seq: Sequence, pos: int) -> None:
        """Release the blocks of sliding windows that no query from ``pos`` on attends to, leaving placeholders; the
        sequence can no longer be rewound below ``pos``."""
        if self.sliding:
            seq.floor = pos
            for w in self.sliding:
                w.slide(seq, pos)

    def allocate(self, seq: Sequence, need: int, beam_needs: Seq[int]) -> None:
        """Grow every window of ``seq`` by ``need`` blocks, and beam ``i + 1`` by ``beam_needs[i]`` (capacity was
        checked)."""
        w0 = self.windows[0]
        seq.grow(0, w0.alloc(need))
        seq.grow_beams([w0.alloc(n) for n in beam_needs])
        for w in self.windows[1:]:
            seq.grow(w.index, w.alloc(need))

    def release(self, held: Seq[list[Block]]) -> None:
        """Drop one reference of each block of ``held[w]`` in window ``w``."""
        for w, blocks in zip(self.windows, held):
            w.release(blocks)

    def apply_retention(self, seq: Sequence, first: int) -> None:
        """Give ``seq``'s blocks from position ``first`` on, in every window, the priorities its request asks for."""
        for w, blocks in zip(self.windows, seq.windows):
            w.retention.apply(seq.request, blocks, first)

    def hold(self, held: Seq[list[Block]], what: str) -> None:
        """Take a reference of each block of ``held[w]`` in window ``w``, onboarding the host-tier ones; raises
        ``OutOfBlocksError`` (changing nothing) when some window cannot onboard them."""
        for w, blocks in zip(self.windows, held):
            free_claimed = sum(1 for b in blocks if b.tier == PRIMARY and b.ref_count == 0)
            onboards = sum(1 for b in blocks if b.tier == SECONDARY)
            if onboards > w.pool.num_free(PRIMARY) - free_claimed:
                raise OutOfBlocksError(onboards, w.pool.num_free(PRIMARY) - free_claimed, f"{what}{w.where}")
        for w, blocks in zip(self.windows, held):
            w.pool.ref_n(blocks)
            w.pool.onboard_n([b for b in blocks if b.tier == SECONDARY])
        self.pools.flush()

    # ------------------------------------------------------------------ budgets by window

    def step_blocks(self, seq: Sequence, two_steps_lookahead: bool) -> tuple[int, ...]:
        """Per window, the blocks the next step of ``seq`` allocates: its next context chunk's (of the default
        size), or its next decode step's."""
        prompt = len(seq.request.tokens)
        if not seq.decoding and seq.num_tokens < prompt:
            end = min(prompt, seq.num_tokens + (self.config.context_chunk_size or prompt))
            need, tails = seq.chunk_blocks(end, self.tokens_per_block)
            return self.per_window(need + tails, need)
        need = seq.step_blocks(self.tokens_per_block, two_steps_lookahead)
        return self.per_window(need, need)   # every window grows alike

    def context_budgets(self, request: Request, reuse: PrefixReuseSummary | None,
                        held: Seq[int] | None) -> tuple[ContextBudget, ...]:
        """Each window's price of ``request``'s context, its reuse discounted by the matched blocks ``held`` there."""
        bubble = sink_bubble(self.config.sink_tokens, self.tokens_per_block)
        chunk = self.config.context_chunk_size or len(request.tokens)
        return tuple(w.context_budget(request, chunk, bubble, None if reuse is None or held is None
                                      else replace(reuse, reusable_blocks_allocated=held[w.index]))
                     for w in self.windows)

    def blocks_to_completion(self, request: Request) -> tuple[int, ...]:
        """The most blocks each window holds for ``request`` at once."""
        T = self.tokens_per_block
        total = blocks_to_completion(len(request.tokens), request.max_new_tokens, request.num_draft_tokens,
                                     request.beam_width, T)
        prompt = ceil_div(len(request.tokens), T)
        return tuple(w.most_held(total, prompt, request.num_draft_tokens) for w in self.windows)

    def remaining_blocks(self, totals: Seq[int], seq: Sequence | None, held: Seq[int]) -> tuple[int, ...]:
        """Per window, ``totals`` less what running ``seq`` holds there, or, before admission, less the ``held``
        matched blocks that window is spared."""
        if seq is not None:
            return tuple(max(0, t - sum(1 for h in seq.held_in(w.index) for b in h if b is not PLACEHOLDER))
                         for t, w in zip(totals, self.windows))
        return tuple(t - w.matched_discount(held[w.index]) for t, w in zip(totals, self.windows))

    def context_limit(self) -> int | None:
        """The least bound of the windows that bound a context; ``None`` when none does."""
        limits = [limit for w in self.windows if (limit := w.context_limit()) is not None]
        return min(limits) if limits else None

    def free_blocks(self) -> tuple[int, ...]:
        return tuple(w.pool.num_free(PRIMARY) for w in self.windows)

    # ------------------------------------------------------------------ reports

    def block_table(self, seqs: Iterable[Sequence]) -> torch.Tensor:
        """Primary pool slots of ``seqs``, a row per beam (``KVCacheManager.block_table``)."""
        seqs = list(seqs)
        if len(self.windows) > 1:
            width = max((len(s.blocks) for s in seqs), default=0)
            table = torch.full((len(seqs), len(self.windows), width), NO_BLOCK, dtype=torch.int32)
            for i, s in enumerate(seqs):
                table[i, :, :len(s.blocks)] = torch.tensor([[b.slot for b in w] for w in s.windows], dtype=torch.int32)
            return table.to(self.pools.device)
        rows = [row for s in seqs for row in s.slot_rows(self.tokens_per_block)]
        width = max((len(r) for r in rows), default=0)
        table = torch.full((len(rows), width), NO_BLOCK, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(self.pools.device)

    def stats(self, reused: int, missed: int, events_dropped: int) -> KvCacheStats:
        """Every window's counts, and their sums over the windows."""
        pools = [w.pool for w in self.windows]
        per = tuple(WindowStats(w.size, p.num_primary, p.num_free(PRIMARY), p.num_primary - p.num_free(PRIMARY),
                                p.num_free(SECONDARY)) for w, p in zip(self.windows, pools))
        num_primary, num_secondary = sum(p.num_primary for p in pools), sum(p.num_secondary for p in pools)
        free = sum(w.free_num_blocks for w in per)
        looked = reused + missed
        total_blocks = num_primary + num_secondary
        return KvCacheStats(
            max_num_blocks=num_primary, free_num_blocks=free, used_num_blocks=num_primary - free,
            tokens_per_block=self.tokens_per_block, alloc_total_blocks=sum(p.alloc_total for p in pools),
            alloc_new_blocks=sum(p.alloc_new for p in pools), reused_blocks=reused, missed_blocks=missed,
            cache_hit_rate=reused / looked if looked else 0.0,
            num_free_secondary_blocks=sum(w.num_free_secondary_blocks for w in per),
            allocated_bytes=total_blocks * self.config.bytes_per_block if self.config.materialize else 0,
            max_num_secondary_blocks=num_secondary, offloaded_blocks=sum(p.offloaded for p in pools),
            onboarded_blocks=sum(p.onboarded for p in pools), events_dropped=events_dropped, windows=per)
