"""Small factories shared by the ledger tests."""
from __future__ import annotations

import torch

from kvledger.worker.ledger import NO_BLOCK, CacheConfig, KVCacheManager, Request
from kvledger.worker.ledger.block import PRIMARY


class FakeClock:
    """An injected clock: tests move time, they never sleep."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_manager(primary: int = 8, secondary: int = 0, clock: FakeClock | None = None, **kw) -> KVCacheManager:
    kw.setdefault("check_integrity", True)   # the walking check after every public call
    cfg = CacheConfig(tokens_per_block=4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      device="cpu", num_primary_blocks=primary, num_secondary_blocks=secondary, **kw)
    mgr = KVCacheManager(cfg, clock=clock or FakeClock())
    mgr.take_events()
    return mgr


def make_request(rid: int, tokens: list[int], **kw) -> Request:
    return Request(request_id=rid, tokens=list(tokens), **kw)


def token_value(prefix: tuple[int, ...], lora_id: int | None, salt: str | None) -> float:
    """A value standing in for the KV of the last token of ``prefix``: equal exactly when the KV would be."""
    return float(hash((lora_id, salt, prefix)) % 1_000_003)


def make_windowed_manager(blocks: tuple[tuple[int, int], ...] = ((8, 0), (8, 0)),
                          windows: tuple[int | None, ...] = (8, None), clock: FakeClock | None = None,
                          **kw) -> KVCacheManager:
    """Two layers: layer 0 slides over ``windows[0]`` tokens (window 0), layer 1 attends to everything (window 1),
    with ``blocks`` (device, host) blocks per window."""
    kw.setdefault("check_integrity", True)
    cfg = CacheConfig(tokens_per_block=4, num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      device="cpu", attention_windows=windows, window_blocks=blocks, **kw)
    mgr = KVCacheManager(cfg, clock=clock or FakeClock())
    mgr.take_events()
    return mgr


def window_pool(mgr: KVCacheManager, window: int) -> torch.Tensor:
    """The primary pool of one attention window (each of these ledgers has one KV head count)."""
    pools = mgr.pools.windows[window] if len(mgr.config.window_layouts) > 1 else mgr.pools
    return pools.primary


def write_kv(mgr: KVCacheManager, request: Request, start: int, end: int, tokens: list[int]) -> None:
    """Play the engine: write positions ``[start, end)`` of a running request through its blocks, in every
    attention window (a position the step computes is never a placeholder)."""
    T = mgr.tokens_per_block
    for w in range(len(mgr.config.window_layouts)):
        ids, pool = mgr.get_block_ids(request.request_id, window=w), window_pool(mgr, w)
        for pos in range(start, end):
            assert ids[pos // T] != NO_BLOCK, f"window {w}: position {pos} to compute sits in a placeholder"
            b = mgr.window_blocks(w)[ids[pos // T]]
            assert b.tier == PRIMARY
            pool[b.slot, :, :, pos % T] = token_value(tuple(tokens[:pos + 1]), request.lora_id, request.cache_salt)


def read_kv(mgr: KVCacheManager, request_id: int, pos: int, window: int = 0) -> float | None:
    """The value at ``pos`` of a running request in ``window``; ``None`` where the window holds a placeholder."""
    T = mgr.tokens_per_block
    bid = mgr.get_block_ids(request_id, window=window)[pos // T]
    if bid == NO_BLOCK:
        return None
    return float(window_pool(mgr, window)[mgr.window_blocks(window)[bid].slot, 0, 0, pos % T, 0, 0])


def prefill(mgr: KVCacheManager, request: Request) -> None:
    """Play the engine's prefill of an admitted request: write each context chunk, admit the next."""
    for _ in range(len(request.tokens)):
        start, end = mgr.context_chunk(request.request_id)
        write_kv(mgr, request, start, end, request.tokens)
        if end == len(request.tokens):
            return
        mgr.add_context_chunk(request.request_id)


def serve(mgr: KVCacheManager, request: Request) -> int:
    """Admit, 'prefill' the new positions (chunk by chunk where the ledger chunks), store the prompt; returns the
    prepopulated length."""
    pre = mgr.add_sequence(request)
    prefill(mgr, request)
    mgr.store_context_blocks(request.request_id)
    return pre
