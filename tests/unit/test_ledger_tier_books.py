"""Tier moves booked in bulk: a run of copies told without a sort, a chain of evicted nodes cut once at its top, and
the bucket index a node keeps only while it has two children or more."""
from __future__ import annotations

from ledger_helpers import make_manager, make_request, serve

from kvledger.worker.ledger.kv_pool import merge_slot_runs


def test_one_run_either_way_is_told_as_the_sorted_walk_tells_it():
    assert merge_slot_runs([4, 3, 2], [9, 8, 7]) == [(2, 7, 3)]   # an offload's slots, both sides descending
    assert merge_slot_runs([1, 2, 3], [5, 6, 7]) == [(1, 5, 3)]
    assert merge_slot_runs([7], [0]) == [(7, 0, 1)]
    assert merge_slot_runs([4, 3, 2], [7, 8, 9]) == [(2, 9, 1), (3, 8, 1), (4, 7, 1)]   # opposite ways: no run
    assert merge_slot_runs([2, 2, 3], [5, 6, 7]) == [(2, 5, 1), (2, 6, 2)]   # equal sources in the given order


def test_evicting_a_chain_prunes_every_node_it_empties_and_keeps_its_parent():
    mgr = make_manager(primary=6)
    serve(mgr, make_request(1, list(range(13))))   # three stored blocks: a chain of three nodes
    mgr.remove_sequence(1)
    tree = mgr._tree
    assert tree.num_nodes == 3
    (top,) = tree.root.children.values()
    mgr.add_sequence(make_request(2, [50] * 17))   # five blocks: the three clean ones and the two stored tail blocks
    assert tree.num_nodes == 1 and not top.children and top.block is not None
    assert mgr.probe_prefix_match_length(list(range(13))) == 4


def test_a_node_indexes_its_children_only_while_it_has_two_and_partial_matches_see_them_all():
    mgr = make_manager(primary=12, enable_partial_reuse=True)
    serve(mgr, make_request(1, [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    mgr.remove_sequence(1)
    (first,) = mgr._tree.root.children.values()
    assert first.by_bucket == {}
    serve(mgr, make_request(2, [1, 2, 3, 4, 9, 9, 9, 9, 0]))
    mgr.remove_sequence(2)
    assert len(first.children) == 2 and [len(b) for b in first.by_bucket.values()] == [1, 1]
    assert mgr.analyze_prefix_reuse([1, 2, 3, 4, 5, 6, 0, 0, 0]).total_matched_tokens == 6
    assert mgr.analyze_prefix_reuse([1, 2, 3, 4, 9, 9, 9, 0, 0]).total_matched_tokens == 7
    mgr.add_sequence(make_request(3, [70] * 45))   # every block: both children evicted, then their parent
    assert mgr._tree.num_nodes == 0 and mgr._tree.root.by_bucket == {}
