"""What the migration tests share: the mixed-KV-head geometry, prompts, and the check that a target serves a
migrated prefix as scratch does."""
from __future__ import annotations

import random

import torch

from kvledger.coordinator.cluster import Cluster
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.request import Request

T = 4
HEADS = (2, 1, 2)   # two pools: layers 0 and 2 with 2 KV heads, layer 1 with 1
TIMEOUT = 60


def mixed_cache(blocks: int = 48) -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=3, num_kv_heads=2, num_kv_heads_per_layer=HEADS, head_dim=8,
                       dtype=torch.float32, device="cpu", num_primary_blocks=blocks)


def prompt(n_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n_tokens)]


def same_logits(a, b) -> bool:
    return torch.allclose(torch.tensor(a.last_logits), torch.tensor(b.last_logits), atol=1e-4, rtol=1e-4)


def served_as_scratch(c: Cluster, p: list[int], scratch) -> None:
    """Rank 1 serves ``p`` reusing its 6 migrated blocks and answers as ``scratch`` did; both ranks' books
    balance and hold nothing."""
    (moved,) = c.client(1).serve([Request(3, p, 3)], logits=True).outcomes
    assert moved.cached_tokens == 6 * T and moved.output_tokens == scratch.output_tokens
    assert same_logits(moved, scratch)
    for client in c.clients:
        client.check_integrity()
    assert [client.load().device_blocks_used for client in c.clients] == [0, 0]
