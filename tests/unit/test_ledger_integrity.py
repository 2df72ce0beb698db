"""Negative tests of ``check_integrity``: every way of corrupting the books it guards against is named.

Each test builds the same small two-tier ledger (blocks stored and free,
empty and free, offloaded to the host tier, held by a running request, held
by a pin), breaks one thing the way a bug in a fast path would, and expects
the check to say what broke.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from ledger_helpers import make_manager, make_request, serve

from kvledger.worker.ledger import KVCacheManager
from kvledger.worker.ledger.block import PRIMARY, SECONDARY, Block
from kvledger.worker.ledger.eviction import level_of
from kvledger.worker.ledger.integrity import check_sequences
from kvledger.worker.wire.block_key import BlockKey

A = list(range(100, 112))  # three full blocks
B = list(range(200, 227))  # six full blocks and a partial one
C = [300, 301, 302, 303, 304]  # one full block and a partial one


@dataclass
class Books:
    mgr: KVCacheManager
    pinned: Block
    """A0: stored, held by a pin."""
    offloaded: Block
    """A1: stored, free, on the host tier (its child A2 too)."""
    offloaded_child: Block
    running: Block
    """B0: stored, held by the running request 2."""
    running_tail: Block
    """B's partial last block: held, not stored."""
    stored_free: Block
    """C0: stored, free, on the device."""
    empty_free: Block
    """C's partial last block after C finished: free, nothing reusable."""


@pytest.fixture
def books() -> Books:
    mgr = make_manager(primary=10, secondary=4)
    serve(mgr, make_request(1, A))
    a = mgr.get_block_ids(1)
    mgr.remove_sequence(1)
    serve(mgr, make_request(2, B))  # takes the seven empty device blocks
    serve(mgr, make_request(3, C))  # evicts A2, then A1: both offloaded
    c = mgr.get_block_ids(3)
    mgr.remove_sequence(3)
    assert mgr.pin_prefix(-1, A[:4] + [0]).slots == ([mgr.blocks[a[0]].slot],)
    bl, b = mgr.blocks, mgr.get_block_ids(2)
    books = Books(mgr, pinned=bl[a[0]], offloaded=bl[a[1]], offloaded_child=bl[a[2]], running=bl[b[0]],
                  running_tail=bl[b[-1]], stored_free=bl[c[0]], empty_free=bl[c[1]])
    # the scenario holds what the name says
    assert books.pinned.ref_count == 1 and books.pinned.node is not None
    assert books.offloaded.tier == books.offloaded_child.tier == SECONDARY and books.offloaded.node is not None
    assert books.offloaded_child.node.parent is books.offloaded.node
    assert books.running.ref_count == 1 and books.running.node is not None
    assert books.running_tail.ref_count == 1 and books.running_tail.node is None
    assert books.stored_free.tier == PRIMARY and books.stored_free.level > 0 and books.stored_free.node is not None
    assert books.empty_free.tier == PRIMARY and books.empty_free.level == 0
    return books


def pool(books: Books):
    return books.mgr._pool  # the books under test, reached past the manager on purpose


def broken(books: Books, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        books.mgr.check_integrity()


def test_untouched_ledger_passes(books):
    books.mgr.check_integrity()
    books.mgr.remove_sequence(2)
    books.mgr.unpin_sequence(-1)
    books.mgr.check_integrity()


# ------------------------------------------------------------------ reference counts and free lists


@pytest.mark.parametrize("which", ["running", "running_tail", "pinned"])
def test_ref_count_one_too_many(books, which):
    b = getattr(books, which)
    b.ref_count += 1
    broken(books, rf"block {b.block_id}: ref_count 2, held by 1 sequences")


def test_ref_count_one_too_few_on_a_held_block(books):
    books.pinned.ref_count -= 1
    broken(books, rf"block {books.pinned.block_id}: ref_count 0, held by 1 sequences")


def test_ref_count_on_a_block_nobody_holds(books):
    books.stored_free.ref_count = 1
    broken(books, rf"block {books.stored_free.block_id}: ref_count 1, held by 0 sequences")


def test_referenced_block_left_in_a_free_list(books):
    b = books.running
    pool(books).eviction.release(b)
    broken(books, rf"block {b.block_id}: ref_count 1 but free-list level {level_of(b)}")


def test_free_block_in_no_free_list(books):
    b = books.stored_free
    pool(books).eviction.claim(b)
    broken(books, rf"block {b.block_id}: ref_count 0 but free-list level -1")


def test_referenced_block_on_the_host_tier(books):
    books.running.tier = SECONDARY
    broken(books, rf"block {books.running.block_id}: referenced while on the host tier")


def test_block_in_the_wrong_free_level(books):
    """A priority changed without requeueing the free block (what ``refresh_blocks`` must not forget)."""
    b = books.stored_free
    b.priority = 80
    broken(books, rf"block {b.block_id}: in free level 36, belongs in 81")


def test_empty_block_in_a_stored_level(books):
    b = books.empty_free
    pool(books).eviction.claim(b)
    b.priority = 50
    b.key = books.stored_free.key  # released as if stored, then wiped without requeueing
    pool(books).eviction.release(b)
    b.key = None
    broken(books, rf"block {b.block_id}: in free level 51, belongs in 0")


@pytest.mark.parametrize("tier", [PRIMARY, SECONDARY])
def test_free_count_disagrees_with_the_lists(books, tier):
    ev = pool(books).eviction
    n = ev.num_free(tier)
    ev._free[tier] += 1
    broken(books, rf"tier {('GPU', 'CPU')[tier]}: free count {n + 1}, {n} blocks in its free lists")


def test_free_list_size_disagrees_with_its_blocks(books):
    lst = pool(books).eviction.lists(PRIMARY)[0]
    lst.size += 1
    broken(books, rf"tier GPU free list 0: size {lst.size}, {lst.size - 1} blocks walked")


def test_the_walk_finds_a_broken_link(books):
    ev = pool(books).eviction
    tier, level, lst = next((t, lv, lst) for t in (PRIMARY, SECONDARY) for lv, lst in enumerate(ev.lists(t))
                            if lst.size >= 2)
    second = lst.first().fl_next
    second.fl_prev = lst.sentinel
    medium = "GPU" if tier == PRIMARY else "CPU"
    broken(books, rf"tier {medium} free list {level}: block {second.block_id} does not point back to its predecessor")


def test_the_walk_finds_a_block_linked_into_the_wrong_level(books):
    empty = pool(books).eviction.lists(PRIMARY)[0]
    victim = empty.first()
    empty.remove(victim)
    pool(books).eviction.lists(PRIMARY)[50].append(victim)     # still says level 0; linked at level 50
    broken(books, rf"tier GPU free list 50: block {victim.block_id} of tier 0, level 0 \(belongs in 0\) is in it")


def test_the_walk_finds_a_block_in_two_lists(books):
    ev = pool(books).eviction
    b = ev.lists(PRIMARY)[0].first()
    ev.lists(SECONDARY)[0].append(b)   # linked into a second list as well (its links now point there)
    broken(books, r"free list")


def test_a_countdown_on_a_block_in_use_is_caught(books):
    b = books.pinned
    b.duration_s, b.expires_at = 10.0, 1010.0
    broken(books, rf"block {b.block_id}: a retention countdown runs while it is in use")


# ------------------------------------------------------------------ pool slots


def test_slot_used_twice(books):
    a, b = books.empty_free, books.stored_free
    first, second = sorted((a, b), key=lambda x: x.block_id)
    second.slot = first.slot
    broken(books, rf"block {second.block_id}: slot {first.slot} of tier 0 used twice")


def test_host_slot_used_twice(books):
    a, b = books.offloaded, books.offloaded_child
    first, second = sorted((a, b), key=lambda x: x.block_id)
    second.slot = first.slot
    broken(books, rf"block {second.block_id}: slot {first.slot} of tier 1 used twice")


@pytest.mark.parametrize("which, tier", [("stored_free", "GPU"), ("offloaded", "CPU")])
def test_slots_not_a_permutation(books, which, tier):
    getattr(books, which).slot = 99
    broken(books, rf"tier {tier}: slots are not a permutation of the pool")


# ------------------------------------------------------------------ keys, hashes and the tree


@pytest.mark.parametrize("which, field", [
    (which, field) for which in ("stored_free", "offloaded", "running", "pinned") for field in ("key", "block_hash", "node")
    if field != "key" or which in ("running", "pinned")  # a free block without a key is in the wrong level first
])
def test_key_hash_and_node_disagree(books, which, field):
    b = getattr(books, which)
    setattr(b, field, None)
    broken(books, rf"block {b.block_id}: key, hash and tree node disagree")


def test_unstored_block_with_a_hash(books):
    b = books.running_tail
    b.block_hash = books.running.block_hash
    broken(books, rf"block {b.block_id}: key, hash and tree node disagree")


def test_tree_node_holding_another_block(books):
    b = books.stored_free
    b.node.block = books.empty_free
    broken(books, rf"block {b.block_id}: its tree node does not point back")


def test_tree_node_with_another_key(books):
    b = books.offloaded
    b.key = books.running.key
    broken(books, rf"block {b.block_id}: its tree node does not point back")


def test_child_not_pointing_back_to_its_parent(books):
    books.offloaded_child.node.parent = pool(books).tree.root
    broken(books, "prefix tree: a child does not point back to its parent")


def test_child_under_another_key_than_its_own(books):
    b = books.stored_free
    b.key = b.node.key = BlockKey(tokens=(9, 9, 9, 9))  # the block agrees with its node; the parent does not
    broken(books, "prefix tree: a child does not point back to its parent")


def test_node_whose_block_points_elsewhere(books):
    tree = pool(books).tree
    b = books.stored_free
    tree.child_or_new(tree.root, BlockKey(tokens=(1, 2, 3, 4))).block = b
    broken(books, rf"prefix tree: node's block {b.block_id} points elsewhere")


def test_empty_leaf_not_pruned(books):
    tree = pool(books).tree
    tree.child_or_new(books.running.node, BlockKey(tokens=(7, 7, 7, 7)))
    broken(books, "prefix tree: an empty leaf was not pruned")


def test_node_count_disagrees(books):
    tree = pool(books).tree
    n = tree.num_nodes
    tree.num_nodes += 1
    broken(books, rf"prefix tree: {n} nodes reachable, {n + 1} counted")


@pytest.mark.parametrize("switch", [True, False])
def test_the_debug_switch_checks_after_every_public_call(switch):
    mgr = make_manager(primary=4, check_integrity=switch)
    serve(mgr, make_request(1, list(range(9))))
    mgr.blocks[mgr.get_block_ids(1)[0]].ref_count += 1     # corrupt the books behind the manager's back
    assert mgr.probe_prefix_match_length([1, 2, 3]) == 0    # a query is not checked ...
    if switch:
        with pytest.raises(AssertionError, match="ref_count 2, held by 1"):
            mgr.refresh_blocks()                           # ... a call that may change the books is
    else:
        mgr.refresh_blocks()
        with pytest.raises(AssertionError, match="ref_count 2, held by 1"):
            mgr.check_integrity()


def test_a_sequence_with_fewer_blocks_than_tokens_or_uneven_beams_is_named():
    mgr = make_manager(primary=8, check_integrity=False)
    mgr.add_sequence(make_request(1, list(range(10)), beam_width=2))
    seq = mgr._seqs[1]
    seq.num_tokens += 3                       # tokens past its last block
    with pytest.raises(AssertionError, match="request 1: 3 blocks for 13 tokens"):
        mgr.check_integrity()
    seq.num_tokens -= 3
    mgr.add_token(1, 3)
    seq.beams[0].pop()                        # beam 1 lost its decode block
    with pytest.raises(AssertionError, match="beams own"):
        check_sequences([seq], 4)
