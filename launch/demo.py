"""A short walk through one rank's ledger: prefix reuse, eviction, offload to the host tier and back."""
from __future__ import annotations

import torch

from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request, RetentionConfig, TokenRange
from kvledger.worker.wire.events import KVEvent


def _show_events(events: list[KVEvent]) -> None:
    for e in events:
        print(f"    event  {e}")


def run_demo() -> None:
    """Drive a small ledger (4 tokens per block, 8 device + 4 host blocks) and print what it did."""
    cfg = CacheConfig(tokens_per_block=4, num_primary_blocks=8, num_secondary_blocks=4, device="cpu",
                      dtype=torch.float32, offload_min_priority=30)
    mgr = KVCacheManager(cfg)
    print(f"ledger: {mgr.num_primary} device blocks, {mgr.num_secondary} host blocks, "
          f"{cfg.tokens_per_block} tokens per block, {cfg.bytes_per_block} bytes per block")
    _show_events(mgr.take_events())

    system = list(range(100, 112))
    print("\n1. a request with a 12-token system prompt is served and released")
    mgr.add_sequence(Request(1, system + [1, 2, 3], max_new_tokens=1))
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)
    _show_events(mgr.take_events())

    print("\n2. a second request shares the system prompt: its blocks are reused")
    reused = mgr.add_sequence(Request(2, system + [7, 8, 9], max_new_tokens=1))
    print(f"    reused {reused} of 15 prompt tokens; admission {mgr.admission(2)}")
    mgr.remove_sequence(2)
    _show_events(mgr.take_events())

    print("\n3. low-priority traffic fills the device tier: the system prompt (priority 80) is offloaded, not lost")
    keep = RetentionConfig(ranges=[TokenRange(0, 12, priority=80)])
    mgr.add_sequence(Request(3, system + [4], retention=keep))
    mgr.remove_sequence(3)
    for rid in range(10, 13):
        cheap = RetentionConfig(ranges=[TokenRange(0, None, priority=10)], decode_priority=10)
        mgr.add_sequence(Request(rid, [rid * 50 + i for i in range(24)], retention=cheap))
        mgr.remove_sequence(rid)
    _show_events(mgr.take_events())

    print("\n4. the system prompt comes back: its blocks are onboarded from the host tier")
    reused = mgr.add_sequence(Request(4, system + [5, 6], max_new_tokens=1))
    print(f"    reused {reused} tokens; admission {mgr.admission(4)}")
    mgr.remove_sequence(4)
    _show_events(mgr.take_events())

    mgr.check_integrity()
    print(f"\nstats: {mgr.stats()}")
    print("integrity check passed")
