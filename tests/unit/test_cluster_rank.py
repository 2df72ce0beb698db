"""The rank's plain class and the manager calls migrations use, without Ray or a process group."""
from __future__ import annotations

import pytest
import torch
from ledger_helpers import make_manager, make_request, serve
from rank_fuzz import scratch_result

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.worker.ledger import CacheConfig, OutOfBlocksError
from kvledger.worker.ledger.block import SECONDARY
from kvledger.worker.rank.transfer import contiguous_view
from kvledger.worker.rank.worker import RankWorker
from kvledger.worker.wire.events import BlockStored, KVCacheCreated, decode_batch
from kvledger.worker.wire.request import Request

T = 4


def make_rank(primary_blocks: int = 32, secondary_blocks: int = 0, rank: int = 0, world: int = 1,
              context_chunk_size: int | None = None) -> RankWorker:
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", primary_bytes=primary_blocks * 2 * 2 * T * 2 * 8 * 4,
                      num_secondary_blocks=secondary_blocks, context_chunk_size=context_chunk_size)
    w = RankWorker(rank, world, cfg, seed=0)
    w.build_ledger(*w.local_block_counts())
    return w


def test_budget_gives_block_counts_and_ledger_is_built_with_them():
    w = make_rank(primary_blocks=20, secondary_blocks=3)
    assert w.local_block_counts() == (20, 3)
    assert (w.manager.num_primary, w.manager.num_secondary) == (20, 3)
    manager = w.manager
    assert w.build_ledger(20, 3) == (20, 3) and w.manager is manager, "same counts keep the ledger (and its cache)"
    w.build_ledger(10, 0)
    assert w.manager.num_primary == 10


def test_a_windowed_rank_reports_and_announces_each_window_pool_apart():
    """The issue's rank (windows of 32 and full, shares 9 and 1): its info lists each window's pool, as its first
    batch does (one ``KVCacheCreated`` per window), where one figure summed the two pools as if they were one."""
    cfg = CacheConfig(tokens_per_block=8, num_layers=4, num_kv_heads=2, head_dim=8, device="cpu",
                      num_primary_blocks=24, attention_windows=(32, None), window_shares=(9, 1))
    w = RankWorker(0, 1, cfg, seed=0)
    w.build_ledger(*w.local_block_counts())
    info = w.info()
    assert info.windows == ((32, 43, 0), (None, 4, 0)) and info.device_blocks == 47 and info.max_context == 32
    created = decode_batch(w.poll_events().data).events
    assert [(e.group_idx, e.kv_cache_spec_sliding_window, e.num_blocks["GPU"]) for e in created] == [(0, 32, 43),
                                                                                                  (1, None, 4)]


def test_serve_reuses_prefix_and_reports_load_in_one_answer():
    w = make_rank()
    prompt = list(range(10, 23))
    (first,) = w.serve([Request(1, prompt, 3)], logits=True).outcomes
    (second,) = w.serve([Request(2, prompt, 3)], logits=True).outcomes
    assert first.cached_tokens == 0 and second.cached_tokens == 12 and second.rank == 0
    assert first.output_tokens == second.output_tokens
    assert torch.allclose(torch.tensor(first.last_logits), torch.tensor(second.last_logits), atol=1e-4)
    assert w.serve([Request(3, prompt, 1)]).outcomes[0].last_logits is None, "logits only when asked"
    assert w.probe(prompt) == 12
    load = w.load()
    assert load.ready and load.served_requests == 3 and load.queued_prefill_tokens == 0
    assert load.device_blocks_used == 0 and load.device_blocks_free == 32 and load.cache_hit_rate > 0
    assert w.manager.stats().reused_blocks == 6
    b = w.poll_events()
    assert b.seq == 0 and any(isinstance(e, BlockStored) for e in decode_batch(b.data).events)
    assert len(w.snapshot()) == 3  # 13 prompt + 2 decoded tokens written: 3 full blocks
    w.check_integrity()


def test_serve_takes_typed_requests_and_refuses_anything_else_unchanged():
    w = make_rank()
    before = w.load()
    for bad in ({"request_id": 1, "tokens": [1, 2]}, [1, 2], "prompt"):
        with pytest.raises(TypeError, match="Request"):
            w.serve([bad])
    with pytest.raises(ValueError, match="vocabulary"):
        w.serve([Request(1, [1, 2, 600])])
    assert w.load() == before
    assert [type(e) for e in decode_batch(w.poll_events().data).events] == [KVCacheCreated], "no event but creation"


def test_unbuilt_ledger_is_a_clear_error():
    cfg = CacheConfig(tokens_per_block=T, num_layers=1, num_kv_heads=1, head_dim=4, device="cpu",
                      num_primary_blocks=8)
    w = RankWorker(0, 2, cfg)
    assert not w.load().ready and not w.info().ready
    with pytest.raises(RuntimeError, match="not built"):
        w.serve([Request(1, [1, 2])])
    with pytest.raises(ValueError):
        RankWorker(2, 2, cfg)


def test_export_pins_and_import_allocates_only_missing_blocks():
    src, dst = make_rank(), make_rank()
    prompt = list(range(50, 50 + 4 * T + 1))
    src.serve([Request(1, prompt)])
    dst.serve([Request(1, prompt[:2 * T + 1])])  # dst holds the first 2 blocks already
    export = src.export_begin(prompt)
    assert export.blocks == 4 and src.load().device_blocks_used == 4
    target = dst.import_begin(prompt, export.blocks)
    assert target.blocks == 2, "the two blocks dst holds are shared, not received"
    dst.import_abort(target.import_id)
    src.export_end(export.pin_id)
    assert src.load().device_blocks_used == 0 and dst.load().device_blocks_used == 0
    assert dst.probe(prompt) == 2 * T, "an aborted import stores nothing"
    src.check_integrity()
    dst.check_integrity()


def test_an_import_under_chunked_prefill_takes_the_whole_prefix_and_serves_the_sources_kv():
    """An import's blocks are received, not computed: it holds them all at once, never just a first context
    chunk's (it held 2 of 8 and stored the source's blocks 6 and 7 as the prompt's first two)."""
    src, dst = make_rank(context_chunk_size=2 * T), make_rank(context_chunk_size=2 * T)
    prompt = list(range(50, 50 + 8 * T + 1))
    src.serve([Request(1, prompt)])
    export = src.export_begin(prompt)
    target = dst.import_begin(prompt, export.blocks)
    assert export.blocks == target.blocks == 8
    dst.import_write(target.import_id, src.export_read(export.pin_id, export.blocks - target.blocks))
    assert dst.probe(prompt) == 8 * T
    here, there = (w.serve([Request(2, prompt[:T + 1], 1)], logits=True).outcomes[0] for w in (src, dst))
    assert here.cached_tokens == there.cached_tokens == T
    assert torch.allclose(torch.tensor(here.last_logits), torch.tensor(there.last_logits), atol=1e-5)
    src.check_integrity()
    dst.check_integrity()


def test_pin_prefix_onboards_host_blocks_and_refuses_duplicates():
    mgr = make_manager(primary=4, secondary=4)
    a = list(range(100, 109))
    serve(mgr, make_request(1, a))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [80 + i for i in range(13)]))  # pushes the prompt's blocks to the host tier
    mgr.remove_sequence(2)
    assert any(b.tier == SECONDARY and b.node is not None for b in mgr.blocks)
    pinned = mgr.pin_prefix(-5, a)
    assert pinned.blocks == 2 and [len(s) for s in pinned.slots] == [2]
    assert all(mgr.blocks[b].tier != SECONDARY for b in range(len(mgr.blocks)) if mgr.blocks[b].ref_count)
    with pytest.raises(ValueError, match="already"):
        mgr.pin_prefix(-5, a)
    mgr.check_integrity()
    mgr.unpin_sequence(-5)
    mgr.check_integrity()
    assert mgr.pin_prefix(-6, a, max_blocks=1).blocks == 1 and mgr.stats().used_num_blocks == 1


def test_pin_prefix_out_of_blocks_changes_nothing():
    mgr = make_manager(primary=3, secondary=4)
    a = list(range(100, 109))
    serve(mgr, make_request(1, a))
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, [7] * 12))  # still running: holds every device block, a's blocks went to the host
    assert mgr.stats().free_num_blocks == 0
    before = mgr.stats()
    with pytest.raises(OutOfBlocksError):
        mgr.pin_prefix(-1, a)
    assert mgr.stats() == before
    mgr.check_integrity()


def test_contiguous_view_only_for_one_ascending_run():
    pool = torch.arange(10.0).reshape(10, 1)
    view = contiguous_view(pool, [3, 4, 5])
    assert view is not None and view.data_ptr() == pool[3].data_ptr() and view.is_contiguous()
    assert contiguous_view(pool, [3, 5]) is None and contiguous_view(pool, [4, 3]) is None
    assert contiguous_view(pool, []) is None


def windowed_cache(windows: tuple[int | None, ...]) -> CacheConfig:
    """Two layers with ``windows`` (a sliding window of 8 tokens beside full attention, or two sliding ones)."""
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=32, attention_windows=windows)


@pytest.mark.parametrize("windows", [(8, None), (8, 12)])
def test_a_windowed_prefix_migrates_in_this_process_and_is_reused_as_scratch_computes_it(windows):
    """The source pins every window's blocks that a request past the prefix reads (the full window's whole prefix,
    a sliding window's last ones), the target receives them into each window's pools and stores them with the same
    hashes: the request it serves reuses the prefix and answers as if computed from scratch."""
    cache = windowed_cache(windows)
    cluster = LocalCluster.build(2, cache)
    prompt = list(range(30, 30 + 6 * T + 2))
    scratch = scratch_result(cache, Request(0, prompt, 4))
    cluster.client(0).serve([Request(1, prompt, 4)])
    m = cluster.migrator.migrate(prompt, src=0, dst=1)
    assert (m.matched_blocks, m.sent_blocks) == (6, 6)
    kept = [6 if w is None else -(-(w - 1) // T) for w in windows]   # each window's blocks a query at 24 reads
    stored = cluster.reach(1).manager.snapshot()
    assert [sum(1 for b in stored if b.group_idx == g) for g in range(2)] == kept
    source = {(b.group_idx, b.block_hash) for b in cluster.reach(0).manager.snapshot()}
    assert {(b.group_idx, b.block_hash) for b in stored} <= source, "the target stores the source's hashes"
    (moved,) = cluster.client(1).serve([Request(2, prompt, 4)], logits=True).outcomes
    assert moved.cached_tokens == 6 * T and moved.output_tokens == scratch.output_tokens
    assert torch.allclose(torch.as_tensor(moved.last_logits), torch.as_tensor(scratch.last_logits), atol=1e-4)
    for r in (0, 1):
        cluster.reach(r).check_integrity()
        assert cluster.reach(r).load().device_blocks_used == 0


@pytest.mark.parametrize("windows", [(8, None), (8, 12)])
def test_an_aborted_or_refused_windowed_import_stores_nothing(windows):
    src, dst = (RankWorker(r, 2, windowed_cache(windows), seed=0) for r in (0, 1))
    for w in (src, dst):
        w.build_ledger(*w.local_block_counts())
    prompt = list(range(30, 30 + 6 * T + 2))
    src.serve([Request(1, prompt, 2)])
    dst.poll_events()
    export = src.export_begin(prompt)
    target = dst.import_begin(prompt, export.blocks)
    assert export.blocks == target.blocks == 6
    dst.import_abort(target.import_id)
    with pytest.raises(ValueError, match="shapes"):
        dst.import_write(dst.import_begin(prompt, export.blocks).import_id, src.export_read(export.pin_id, 0)[:1])
    assert dst.probe(prompt) == 0 and dst.manager.snapshot() == [] and dst.load().device_blocks_used == 0
    assert dst.poll_events() is None, "nothing announced"
    assert src.load().device_blocks_used == 0, "the pin is released"
    src.check_integrity()
    dst.check_integrity()
