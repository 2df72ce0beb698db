"""Small factories shared by the ledger tests."""
from __future__ import annotations

import torch

from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request
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


def write_kv(mgr: KVCacheManager, request: Request, start: int, end: int, tokens: list[int]) -> None:
    """Play the engine: write positions ``[start, end)`` of a running request through its blocks."""
    T = mgr.tokens_per_block
    blocks = [mgr.blocks[i] for i in mgr.get_block_ids(request.request_id)]
    for pos in range(start, end):
        b = blocks[pos // T]
        assert b.tier == PRIMARY
        mgr.pools.primary[b.slot, :, :, pos % T] = token_value(tuple(tokens[:pos + 1]), request.lora_id,
                                                                request.cache_salt)


def read_kv(mgr: KVCacheManager, request_id: int, pos: int) -> float:
    T = mgr.tokens_per_block
    b = mgr.blocks[mgr.get_block_ids(request_id)[pos // T]]
    return float(mgr.pools.primary[b.slot, 0, 0, pos % T, 0, 0])


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
