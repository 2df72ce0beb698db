"""Configuration of one rank's ledger: block geometry, pool sizes, reuse and offload policy."""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal

import torch

from kvledger.worker.device import resolve_device
from kvledger.worker.ledger.block import NO_BLOCK
from kvledger.worker.wire.request import MAX_PRIORITY, MIN_PRIORITY


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """One tensor pool: the layers whose KV heads number ``num_kv_heads`` (VGQA keeps one pool per count)."""

    num_kv_heads: int
    layers: tuple[int, ...]
    """Model layers the pool holds, in order; a layer's K/V sit at its index in this tuple."""


WindowKind = Literal["full_attention", "sliding_window"]
"""A window group's attention, named as vLLM's ``kv_cache_spec_kind`` names it."""


def parse_window(text: str) -> int | None:
    """One attention window as a command line gives it: a positive number of tokens, or ``full``."""
    if text == "full":
        return None
    if not text.isdigit() or int(text) <= 0:
        raise ValueError(f"an attention window is a positive number of tokens or 'full', got {text!r}")
    return int(text)


@dataclass(frozen=True, slots=True)
class WindowLayout:
    """One attention window's group of layers (VSWA keeps one window manager, with its own pools, per window)."""

    window: int | None
    """Tokens a query attends to, itself included (``None``: full attention)."""
    layers: tuple[int, ...]
    pools: tuple[PoolLayout, ...]
    """One pool per distinct KV head count among the group's layers."""

    @property
    def kind(self) -> WindowKind:
        return "full_attention" if self.window is None else "sliding_window"


@dataclass
class CacheConfig:
    """Everything a ``KVCacheManager`` needs; validated on construction."""

    tokens_per_block: int = 16
    """Tokens whose K/V one block holds."""
    num_layers: int = 2
    """Transformer layers (each block holds K and V of every layer)."""
    num_kv_heads: int = 2
    """KV heads per layer."""
    num_kv_heads_per_layer: tuple[int, ...] | None = None
    """KV heads of each layer, one count per layer (VGQA, TensorRT-LLM's ``numKvHeadsPerLayer``); set, it replaces
    ``num_kv_heads``, and the ledger keeps one tensor pool per distinct count (``pool_layouts``)."""
    head_dim: int = 32
    """Width of one head."""
    dtype: torch.dtype = torch.float16
    """Element type of the pools."""
    device: str = "auto"
    """Primary pool device: ``auto`` (CUDA where it exists, else CPU), ``cpu`` or ``cuda[:N]``."""
    num_primary_blocks: int = 1024
    """Blocks in the device tier (ignored when ``primary_bytes`` is set)."""
    num_secondary_blocks: int = 0
    """Blocks in the host tier (ignored when ``secondary_bytes`` is set)."""
    primary_bytes: int | None = None
    """Byte budget of the device tier; the block count is what fits."""
    secondary_bytes: int | None = None
    """Byte budget of the host tier; the block count is what fits."""
    enable_block_reuse: bool = True
    """Keep full blocks in the prefix tree for later requests; off, the pool is a plain allocator: nothing is
    matched, stored or announced as stored (TensorRT-LLM's ``enable_block_reuse``)."""
    enable_partial_reuse: bool = True
    """Reuse a cached block whose tokens only partly match the prompt's next block."""
    copy_on_partial_reuse: bool = True
    """When that block is in use by others (or has children), copy it instead of taking it."""
    offload_min_priority: int = 30
    """Evicted device blocks with at least this priority move to the host tier instead of being dropped."""
    event_buffer_size: int = 10_000
    """Events kept until ``take_events``; beyond it the oldest are dropped and counted."""
    check_integrity: bool = False
    """Run the walking integrity check after every public call of the manager (slow: it walks every block and
    free list; for tests and debugging)."""
    materialize: bool = True
    """Allocate the KV tensors; ``False`` keeps only the books (for simulations)."""
    context_chunk_size: int | None = None
    """Prompt tokens one context chunk computes (TensorRT-LLM's context chunk size): a prompt is admitted chunk by
    chunk, its blocks allocated as each chunk is (``add_context_chunk``); ``None``: the whole prompt at once. A
    multiple of ``tokens_per_block``, so that every chunk but a prompt's last ends on a block boundary."""
    attention_windows: tuple[int | None, ...] | None = None
    """Attention window of each layer in tokens, ``None`` for full attention, cycled over the layers as
    TensorRT-LLM's ``max_attention_window_vec`` is (``(512, None)``: even layers slide over 512 tokens, odd layers
    see everything). A query at position ``p`` attends to the keys at positions ``> p - window``. The ledger keeps
    one window manager per distinct window (``window_layouts``), each with its own pools and block counts; ``None``
    (the default): one full-attention window."""
    window_shares: tuple[float, ...] | None = None
    """How the byte budget of each tier is split between the distinct windows, one positive share per window in
    ``window_layouts`` order; ``None``: equal shares of bytes."""
    window_blocks: tuple[tuple[int, int], ...] | None = None
    """Blocks of each distinct window as ``(device tier, host tier)``, replacing the budgets (set by a rank once
    the ranks agreed on them, see ``window_block_counts``)."""
    sink_tokens: int = 0
    """Attention-sink tokens of a StreamingLLM model. The unused slots of their last block (the sink bubble) are
    counted in the context budget, as TensorRT-LLM's ``mSinkBubbleLength`` is."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "num_layers", "num_kv_heads", "head_dim", "event_buffer_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {v!r}")
        h = self.num_kv_heads_per_layer
        if h is not None and not (type(h) is tuple and len(h) == self.num_layers
                                  and all(type(x) is int and x > 0 for x in h)):
            raise ValueError(f"CacheConfig.num_kv_heads_per_layer must be None or a tuple of {self.num_layers} "
                             f"positive ints (one per layer), got {h!r}")
        for name in ("num_primary_blocks", "num_secondary_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"CacheConfig.{name} must be a non-negative int, got {v!r}")
        for name in ("primary_bytes", "secondary_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise ValueError(f"CacheConfig.{name} must be None or a non-negative int, got {v!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"CacheConfig.dtype must be a torch.dtype, got {self.dtype!r}")
        c = self.context_chunk_size
        if c is not None and (type(c) is not int or c <= 0 or c % self.tokens_per_block):
            raise ValueError(f"CacheConfig.context_chunk_size must be None or a positive multiple of tokens_per_block "
                             f"({self.tokens_per_block}), got {c!r}")
        if type(self.sink_tokens) is not int or self.sink_tokens < 0:
            raise ValueError(f"CacheConfig.sink_tokens must be an int >= 0, got {self.sink_tokens!r}")
        if not MIN_PRIORITY <= self.offload_min_priority <= MAX_PRIORITY + 1:
            raise ValueError(f"CacheConfig.offload_min_priority must be in 0..101, got {self.offload_min_priority}")
        resolve_device(self.device)
        self._check_windows()
        counts = self.window_block_counts()
        if any(p == 0 for p, _ in counts):
            raise ValueError("CacheConfig: the primary tier needs at least one block")
        if any(p + s >= NO_BLOCK for p, s in counts):
            raise ValueError(f"CacheConfig: a window's pools hold {max(p + s for p, s in counts)} blocks; block ids "
                             f"and slots stay below {NO_BLOCK}, the id of no block")

    def _check_windows(self) -> None:
        w = self.attention_windows
        if w is not None and not (type(w) is tuple and 1 <= len(w) <= self.num_layers and all(
                x is None or type(x) is int and x > 0 for x in w)):
            raise ValueError(f"CacheConfig.attention_windows must be None or a tuple of 1..{self.num_layers} "
                             f"windows (a positive int of tokens, or None for full attention), got {w!r}")
        n = len(self.window_layouts)
        s = self.window_shares
        if s is not None and not (type(s) is tuple and len(s) == n and all(
                type(x) in (int, float) and x > 0 and x < float("inf") for x in s)):
            raise ValueError(f"CacheConfig.window_shares must be None or a tuple of {n} positive numbers (one per "
                             f"distinct window {[g.window for g in self.window_layouts]}), got {s!r}")
        b = self.window_blocks
        if b is not None and not (type(b) is tuple and len(b) == n and all(
                type(c) is tuple and len(c) == 2 and all(type(x) is int and x >= 0 for x in c) for c in b)):
            raise ValueError(f"CacheConfig.window_blocks must be None or a tuple of {n} (device, host) pairs of "
                             f"ints >= 0 (one per distinct window), got {b!r}")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Every layer's attention window: ``attention_windows`` cycled over the layers."""
        w = self.attention_windows or (None,)
        return tuple(w[layer % len(w)] for layer in range(self.num_layers))

    @property
    def window_layouts(self) -> tuple[WindowLayout, ...]:
        """One group per distinct window, in the order the windows first appear among the layers."""
        heads = self.kv_heads_per_layer
        groups: dict[int | None, list[int]] = {}
        for layer, w in enumerate(self.layer_windows):
            groups.setdefault(w, []).append(layer)
        out = []
        for w, layers in groups.items():
            by_heads: dict[int, list[int]] = {}
            for layer in layers:
                by_heads.setdefault(heads[layer], []).append(layer)
            out.append(WindowLayout(w, tuple(layers), tuple(PoolLayout(h, tuple(ls)) for h, ls in by_heads.items())))
        return tuple(out)

    def window_bytes_per_block(self, layout: WindowLayout) -> int:
        """K and V of one block of the window's layers, summed over its pools."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(len(p.layers) * 2 * self.tokens_per_block * p.num_kv_heads * self.head_dim
                   for p in layout.pools) * elem

    def window_block_counts(self) -> tuple[tuple[int, int], ...]:
        """``(device, host)`` blocks of each window: ``window_blocks``, else each tier's byte budget (or its block
        count of whole-model blocks, ``bytes_per_block`` each) split by ``window_shares``, then divided by the
        window's own bytes per block. One window takes the tier's block count as it is."""
        if self.window_blocks is not None:
            return self.window_blocks
        layouts = self.window_layouts
        if len(layouts) == 1:
            return ((self.primary_blocks(), self.secondary_blocks()),)
        shares = self.window_shares or (1,) * len(layouts)
        total = sum(shares)
        budgets = [self.num_primary_blocks * self.bytes_per_block if self.primary_bytes is None else self.primary_bytes,
                   self.num_secondary_blocks * self.bytes_per_block if self.secondary_bytes is None
                   else self.secondary_bytes]
        return tuple((int(budgets[0] * s / total) // bpb, int(budgets[1] * s / total) // bpb)
                     for s, bpb in ((s, self.window_bytes_per_block(g)) for s, g in zip(shares, layouts)))

    @property
    def kv_heads_per_layer(self) -> tuple[int, ...]:
        """Every layer's KV heads: ``num_kv_heads_per_layer``, or ``num_kv_heads`` for each."""
        h = self.num_kv_heads_per_layer
        return h if h is not None else (self.num_kv_heads,) * self.num_layers

    @property
    def pool_layouts(self) -> tuple[PoolLayout, ...]:
        """Every pool, window by window (``window_layouts``), in each one pool per distinct KV head count in the
        order the counts first appear among its layers."""
        return tuple(p for g in self.window_layouts for p in g.pools)

    @property
    def block_shapes(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """Shape of one block in each pool: ``[pool's layers, K|V, tokens, kv_heads, head_dim]``."""
        return tuple((len(p.layers), 2, self.tokens_per_block, p.num_kv_heads, self.head_dim)
                     for p in self.pool_layouts)

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block, summed over the pools (TensorRT-LLM's
        ``kvFactor * sum(numKvHeads) * sizePerHead`` per token)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return sum(prod(shape) for shape in self.block_shapes) * elem

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block of the one pool a config with a single KV head count has."""
        shapes = self.block_shapes
        if len(shapes) != 1:
            raise ValueError(f"CacheConfig with KV heads {self.kv_heads_per_layer} has {len(shapes)} pools; "
                             "see block_shapes")
        return shapes[0]

    def primary_blocks(self) -> int:
        return self.num_primary_blocks if self.primary_bytes is None else self.primary_bytes // self.bytes_per_block

    def secondary_blocks(self) -> int:
        return self.num_secondary_blocks if self.secondary_bytes is None else self.secondary_bytes // self.bytes_per_block
