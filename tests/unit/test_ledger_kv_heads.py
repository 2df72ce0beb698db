"""Per-layer KV heads (VGQA): one tensor pool per distinct head count, bytes per block summed over the pools.

Every pool is indexed by the same slots, so a block's copy (partial reuse,
offload, onboard) must move its K/V in each pool.
"""
from __future__ import annotations

import pytest
import torch
from ledger_helpers import FakeClock

from kvledger.worker.ledger import CacheConfig, KVCacheManager, Request
from kvledger.worker.ledger.block import PRIMARY, SECONDARY
from kvledger.worker.ledger.config import PoolLayout


def config(**kw: object) -> CacheConfig:
    base: dict[str, object] = dict(tokens_per_block=4, num_layers=3, num_kv_heads_per_layer=(2, 1, 2),
                                   head_dim=8, dtype=torch.float16, device="cpu", num_primary_blocks=4,
                                   check_integrity=True)
    base.update(kw)
    return CacheConfig(**base)  # type: ignore[arg-type]


def test_one_pool_per_head_count_and_bytes_per_block_summed_over_them():
    cfg = config()
    assert cfg.kv_heads_per_layer == (2, 1, 2)
    assert cfg.pool_layouts == (PoolLayout(2, (0, 2)), PoolLayout(1, (1,)))
    assert cfg.block_shapes == ((2, 2, 4, 2, 8), (1, 2, 4, 1, 8))
    # K and V, 4 tokens, 8 wide, 2 bytes, for 2 + 1 + 2 heads: TensorRT-LLM's kvFactor * sum(heads) * head size.
    assert cfg.bytes_per_block == 2 * 4 * 8 * 2 * 5 == 640
    assert config(num_primary_blocks=0, primary_bytes=640 * 7 + 639).primary_blocks() == 7
    with pytest.raises(ValueError, match="see block_shapes"):
        cfg.block_shape
    uniform = config(num_kv_heads_per_layer=None, num_kv_heads=2)
    assert uniform.pool_layouts == (PoolLayout(2, (0, 1, 2)),) and uniform.block_shape == (3, 2, 4, 2, 8)
    assert uniform.bytes_per_block == 2 * 4 * 8 * 2 * 6

    mgr = KVCacheManager(config(num_secondary_blocks=2))
    assert [tuple(p.shape) for p in mgr.pools.primary_pools] == [(4, 2, 2, 4, 2, 8), (4, 1, 2, 4, 1, 8)]
    assert [tuple(p.shape) for p in mgr.pools.secondary_pools] == [(2, 2, 2, 4, 2, 8), (2, 1, 2, 4, 1, 8)]
    assert mgr.stats().allocated_bytes == 6 * 640
    with pytest.raises(ValueError, match="primary_pools"):
        mgr.pools.primary


@pytest.mark.parametrize("bad", [(2, 1), (2, 0, 2), [2, 1, 2], 2, (2, 1.0, 2), (2, True, 2)])
def test_bad_head_counts_are_refused(bad):
    with pytest.raises(ValueError, match="num_kv_heads_per_layer"):
        config(num_kv_heads_per_layer=bad)


def fill(mgr: KVCacheManager, slot: int, value: float) -> None:
    """Stand-in KV of one primary slot: ``value`` in the first pool, ``-value`` in the second."""
    first, second = mgr.pools.primary_pools
    first[slot], second[slot] = value, -value


def held(mgr: KVCacheManager, block_id: int) -> tuple[float, float]:
    """What each pool holds where a block lives now (either tier)."""
    b = mgr.blocks[block_id]
    pools = mgr.pools.primary_pools if b.tier == PRIMARY else mgr.pools.secondary_pools
    return float(pools[0][b.slot].unique().item()), float(pools[1][b.slot].unique().item())


def test_offload_onboard_and_partial_copy_move_the_kv_in_every_pool():
    mgr = KVCacheManager(config(num_primary_blocks=4, num_secondary_blocks=3), clock=FakeClock())
    prompt = list(range(10, 19))                      # two full blocks and a tail
    mgr.add_sequence(Request(1, prompt))
    ids = mgr.get_block_ids(1)
    for i, bid in enumerate(ids):
        fill(mgr, mgr.blocks[bid].slot, 1.0 + i)
    mgr.store_context_blocks(1)
    mgr.remove_sequence(1)

    mgr.add_sequence(Request(2, list(range(50, 66))))   # needs every device block: the stored ones go to the host
    assert [mgr.blocks[b].tier for b in ids[:2]] == [SECONDARY, SECONDARY]
    assert [held(mgr, b) for b in ids[:2]] == [(1.0, -1.0), (2.0, -2.0)]
    mgr.remove_sequence(2, store=False)

    assert mgr.add_sequence(Request(3, prompt[:6] + [7, 7])) == 6   # onboards both, the second taken in place
    assert mgr.admission(3).onboarded_blocks == 2
    assert mgr.get_block_ids(3) == ids[:2] and [held(mgr, b) for b in ids[:2]] == [(1.0, -1.0), (2.0, -2.0)]

    assert mgr.add_sequence(Request(4, prompt[:3] + [9, 9, 9])) == 3   # three tokens of a held block: copied
    assert mgr.admission(4).copied_blocks == 1
    assert held(mgr, mgr.get_block_ids(4)[0]) == (1.0, -1.0)
