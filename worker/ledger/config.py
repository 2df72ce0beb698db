"""Configuration of one rank's ledger: block geometry, pool sizes, reuse and offload policy."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvledger.worker.device import resolve_device
from kvledger.worker.wire.request import MAX_PRIORITY, MIN_PRIORITY


@dataclass
class CacheConfig:
    """Everything a ``KVCacheManager`` needs; validated on construction."""

    tokens_per_block: int = 16
    """Tokens whose K/V one block holds."""
    num_layers: int = 2
    """Transformer layers (each block holds K and V of every layer)."""
    num_kv_heads: int = 2
    """KV heads per layer."""
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

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "num_layers", "num_kv_heads", "head_dim", "event_buffer_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {v!r}")
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
        if not MIN_PRIORITY <= self.offload_min_priority <= MAX_PRIORITY + 1:
            raise ValueError(f"CacheConfig.offload_min_priority must be in 0..101, got {self.offload_min_priority}")
        resolve_device(self.device)
        if self.primary_blocks() == 0:
            raise ValueError("CacheConfig: the primary tier needs at least one block")

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.tokens_per_block * self.num_kv_heads * self.head_dim * elem

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block in a pool: ``[layers, K|V, tokens, kv_heads, head_dim]``."""
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def primary_blocks(self) -> int:
        return self.num_primary_blocks if self.primary_bytes is None else self.primary_bytes // self.bytes_per_block

    def secondary_blocks(self) -> int:
        return self.num_secondary_blocks if self.secondary_bytes is None else self.secondary_bytes // self.bytes_per_block
