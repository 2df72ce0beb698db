"""One attention window's manager, of the class its kind names: its pool and retention, and what differs by kind.

A model with attention windows of several sizes (VSWA, TensorRT-LLM's
``WindowBlockManager`` per window) keeps one of these per distinct window,
each with its own pools and block counts, all sharing one prefix tree (a node
holds one block per window) and one event stream (events name the window's
group). As vLLM's single-type managers do, each kind answers for itself what a
step or a whole request needs in its window, what slides out, what a prefix
match must hold and what bounds a context; the coordinator (coordinator.py)
picks the class from ``MANAGERS`` and never asks for the kind again. A query
at position ``p`` of a window of ``size`` tokens attends to the keys at
positions ``> p - size`` (``worker/wire/windows.py``: the router probes by the
same rule); the blocks before the first such key are needed by no later
query, so a sliding window releases them and leaves placeholders.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from kvledger.worker.ledger.block import PLACEHOLDER, Block
from kvledger.worker.ledger.block_pool import BlockPool
from kvledger.worker.ledger.budget import ContextBudget, ceil_div, context_budget
from kvledger.worker.ledger.config import CacheConfig, WindowKind
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.ledger.retention import Retention
from kvledger.worker.ledger.sequence import Sequence
from kvledger.worker.ledger.stats import PrefixReuseSummary
from kvledger.worker.wire.request import Request
from kvledger.worker.wire.windows import first_needed_block


class WindowManager(ABC):
    """The blocks of one attention window (see the module docstring); a subclass per kind says what differs."""

    __slots__ = ("index", "size", "kind", "tokens_per_block", "pool", "retention", "where")
    slides: ClassVar[bool]
    """Blocks slide out of this window: a sequence there is not rewound below its last step's start."""

    def __init__(self, config: CacheConfig, clock: Callable[[], float], index: int, tree: PrefixTree,
                 events: EventBuffer) -> None:
        layout = config.window_layouts[index]
        self.index = index
        self.size = layout.window
        """Tokens a query attends to, itself included; ``None``: full attention."""
        self.kind: WindowKind = layout.kind
        self.tokens_per_block = config.tokens_per_block
        self.pool = BlockPool(config, clock, index, tree, events)
        self.retention = Retention(self.pool, config.tokens_per_block)
        self.where = f" in attention window {index} ({self.size or 'full'})" if len(config.window_layouts) > 1 else ""
        """Where a refusal happened, for its message: nothing to add for one window."""

    def first_needed(self, pos: int) -> int:
        """The first block position that a query at ``pos``, or any later one, attends to."""
        return first_needed_block(self.size, pos, self.tokens_per_block)

    def alloc(self, n: int) -> list[Block]:
        """``n`` clean primary blocks held once (capacity was checked)."""
        out = self.pool.take_free_n(n, count_alloc=True)
        for b in out:
            b.ref_count = 1
        return out

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference of each of ``blocks`` (a sequence's, in order); placeholders hold none."""
        self.pool.release(blocks)

    def context_budget(self, request: Request, chunk: int, bubble: int,
                       reuse: PrefixReuseSummary | None) -> ContextBudget:
        """This window's price of admitting ``request``'s context (``budget.context_budget`` at this window's size)."""
        return context_budget(len(request.tokens), request.num_draft_tokens, request.max_new_tokens,
                              request.beam_width, self.tokens_per_block, chunk, self.size, bubble, reuse)

    @abstractmethod
    def reach(self) -> int | None:
        """Blocks held back to back at a prefix's end that the queries past it read (the safe-prefix rule of
        matching.py); ``None``: every block of the prefix."""

    @abstractmethod
    def sliding_gain(self, seq: Sequence, pos: int) -> int:
        """Blocks sliding out of ``seq`` before a step from ``pos`` would free here (those it alone holds)."""

    @abstractmethod
    def slide(self, seq: Sequence, pos: int) -> None:
        """Release ``seq``'s blocks here that no query from ``pos`` on attends to, leaving placeholders."""

    @abstractmethod
    def most_held(self, total: int, prompt_blocks: int, num_draft_tokens: int) -> int:
        """The most blocks this window holds at once for a request holding ``total`` blocks at its end."""

    @abstractmethod
    def matched_discount(self, held: int) -> int:
        """What ``held`` matched blocks that running requests hold save this window before admission."""

    @abstractmethod
    def context_limit(self) -> int | None:
        """The most tokens one request can hold in this window; ``None``: no bound (it slides)."""


class FullAttentionManager(WindowManager):
    """A full-attention window: every block is read by every later query, so nothing slides out."""

    __slots__ = ()
    slides = False

    def reach(self) -> int | None:
        return None

    def sliding_gain(self, seq: Sequence, pos: int) -> int:
        return 0

    def slide(self, seq: Sequence, pos: int) -> None:
        return None

    def most_held(self, total: int, prompt_blocks: int, num_draft_tokens: int) -> int:
        return total

    def matched_discount(self, held: int) -> int:
        return held

    def context_limit(self) -> int | None:
        return self.pool.num_primary * self.tokens_per_block


class SlidingWindowManager(WindowManager):
    """A sliding window of ``size`` tokens: blocks before the window slide out, as placeholders."""

    __slots__ = ()
    slides = True

    def reach(self) -> int | None:
        return ceil_div(self.size - 1, self.tokens_per_block)

    def sliding_out(self, seq: Sequence, pos: int) -> list[Block]:
        """The blocks of ``seq`` here that no query from ``pos`` on needs (held ones only)."""
        return [b for b in seq.windows[self.index][seq.slid[self.index]:self.first_needed(pos)] if b is not PLACEHOLDER]

    def sliding_gain(self, seq: Sequence, pos: int) -> int:
        return sum(1 for b in self.sliding_out(seq, pos) if b.ref_count == 1)

    def slide(self, seq: Sequence, pos: int) -> None:
        self.release(seq.slide(self.index, self.first_needed(pos)))

    def most_held(self, total: int, prompt_blocks: int, num_draft_tokens: int) -> int:
        """The prompt's blocks, then those of one window and one filling."""
        return min(total, max(prompt_blocks, ceil_div(self.size + num_draft_tokens, self.tokens_per_block) + 1))

    def matched_discount(self, held: int) -> int:
        return 0   # it may hold none of them when it needs its blocks

    def context_limit(self) -> int | None:
        return None


MANAGERS: dict[WindowKind, type[WindowManager]] = {"full_attention": FullAttentionManager,
                                                   "sliding_window": SlidingWindowManager}
"""The manager class of each window kind (vLLM's ``spec_manager_map``)."""
