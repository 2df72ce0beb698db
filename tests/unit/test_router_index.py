"""The router's block store: refcounts, snapshots, purge, atomic batches, tier moves, chains, window groups,
and the foreign (vLLM) hash mapping; fed through the numbering (``test_router_numbering`` tests that part)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from index_helpers import H, TPB, batch, ingest, make_index, removed, state, stored

from kvledger.router.foreign import ForeignFeed
from kvledger.router.groups import WindowedIndex
from kvledger.router.numbering import ApplyStatus, SequencedIndex
from kvledger.router.probe import match_prefix, prompt_hashes
from kvledger.router.snapshot import SnapshotBlock
from kvledger.worker.wire.block_key import ROOT_HASH, block_keys, chain_hashes
from kvledger.worker.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, BlockUpdated

@pytest.fixture
def index():
    return make_index()


# --- refcounts --------------------------------------------------------------------------------

def test_two_stores_one_removal_leave_the_block_held(index):
    assert index.apply(0, 0, batch(stored(H[:3]), stored(H[:1]))).applied
    assert index.store.refs(0, H[0]) == (2, 0)
    assert index.store.refs(0, H[1]) == (1, 0)
    assert index.apply(0, 1, batch(removed([H[0]]))).applied
    assert index.store.refs(0, H[0]) == (1, 0)
    assert index.store.holders(H[0]) == [0]
    assert index.apply(0, 2, batch(removed([H[0]]))).applied
    assert index.store.refs(0, H[0]) == (0, 0)
    assert index.store.holders(H[0]) == []
    assert index.num_blocks(0) == 2


def test_refcounts_are_per_rank(index):
    index.apply(0, 0, batch(stored(H[:2])))
    index.apply(1, 0, batch(stored(H[:1])))
    assert index.store.holders(H[0]) == [0, 1]
    index.apply(1, 1, batch(removed(H[:1])))
    assert index.store.holders(H[0]) == [0]
    assert index.num_blocks() == 2


def test_tier_moves_and_priority_updates(index):
    index.apply(0, 0, batch(stored(H[:3])))
    index.apply(0, 1, batch(BlockUpdated(H[1], "GPU", "CPU", 35, 35)))
    assert index.store.refs(0, H[1]) == (0, 1)
    assert index.store.longest_prefixes(H[:3]) == {0: (3, 1)}
    index.apply(0, 2, batch(BlockUpdated(H[1], None, None, 35, 80)))      # priority only
    assert index.store.refs(0, H[1]) == (0, 1)
    index.apply(0, 3, batch(BlockUpdated(H[1], "CPU", "GPU")))            # onboard
    assert index.store.refs(0, H[1]) == (1, 0)
    assert index.store.longest_prefixes(H[:3]) == {0: (3, 0)}
    index.apply(0, 4, batch(BlockUpdated(H[2], "GPU", "CPU"), removed([H[2]], "CPU")))
    assert index.store.holders(H[2]) == []


def test_all_blocks_cleared_drops_only_that_rank(index):
    index.apply(0, 0, batch(stored(H[:3])))
    index.apply(1, 0, batch(stored(H[:3])))
    assert index.apply(0, 1, batch(AllBlocksCleared(), stored(H[5:6]))).applied
    assert index.num_blocks(0) == 1
    assert index.store.holders(H[0]) == [1]


def test_load_snapshot_counts_duplicates_and_replaces_holdings(index):
    index.apply(0, 0, batch(stored(H[:4])))
    index.load_snapshot(0, [SnapshotBlock(H[5]), SnapshotBlock(H[5])], next_seq=9)
    assert index.store.refs(0, H[5]) == (2, 0)
    assert index.store.holders(H[0]) == []
    assert index.next_seq(0) == 9


def test_load_snapshot_accepts_the_ledgers_snapshot_entries(index):
    from kvledger.worker.wire.batches import StoredBlock
    index.load_snapshot(1, [StoredBlock(H[0], None, [1] * TPB, "CPU", None, None, 35)], next_seq=0)
    assert index.store.refs(1, H[0]) == (0, 1)


@pytest.mark.parametrize("blocks, exc", [
    ([SnapshotBlock(H[0]), (H[1], "GPU")], TypeError),
    ([SnapshotBlock(H[0]), SnapshotBlock(-1)], ValueError),
    ([SnapshotBlock(H[0]), SnapshotBlock(H[1], "disk")], ValueError),
])
def test_bad_snapshot_changes_nothing(index, blocks, exc):
    index.apply(0, 0, batch(stored(H[:2])))
    before = state(index)
    with pytest.raises(exc):
        index.load_snapshot(0, blocks, next_seq=3)
    assert state(index) == before


# --- purge --------------------------------------------------------------------------------------

def test_remove_rank_purges_at_once_and_forgets_numbering(index):
    for r in range(3):
        index.apply(r, 0, batch(stored(H[:4])))
    index.apply(1, 1, batch(BlockUpdated(H[3], "GPU", "CPU")))
    index.remove_rank(1)
    assert index.store.holders(H[0]) == [0, 2]
    assert index.store.longest_prefixes(H[:4]) == {0: (4, 0), 2: (4, 0)}
    assert index.ranks() == [0, 2] and index.next_seq(1) == 0
    index.remove_rank(7)                                    # unknown: ignored
    assert index.apply(5, 0, batch(stored(H[:2]))).applied  # reuses the freed bit
    assert index.store.holders(H[1]) == [0, 2, 5]
    assert index.store.longest_prefixes(H[:4]) == {0: (4, 0), 2: (4, 0), 5: (2, 0)}


# --- atomic batches -------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, exc", [
    (BlockStored([H[5], -1], None, [], TPB), ValueError),
    (BlockStored([H[5], "x"], None, [], TPB), ValueError),
    (BlockStored([H[5], 2**64], None, [], TPB), ValueError),
    (BlockStored([H[5], 1.5], None, [], TPB), ValueError),
    (BlockStored("abc", None, [], TPB), ValueError),
    (BlockStored([H[5]], None, [], TPB + 1), ValueError),
    (BlockRemoved([H[0]], "disk"), ValueError),
    (BlockUpdated(H[0], "GPU", "NVMe"), ValueError),
    ("BlockStored", TypeError),
])
def test_malformed_event_rejects_the_whole_batch(index, bad, exc):
    index.apply(0, 0, batch(stored(H[:3])))
    before = state(index)
    with pytest.raises(exc):
        index.apply(0, 1, batch(stored(H[3:5]), removed(H[:1]), bad))
    assert state(index) == before


def test_divergent_removal_rolls_the_batch_back(index):
    index.apply(0, 0, batch(stored(H[:3])))
    index.apply(0, 1, batch(BlockUpdated(H[2], "GPU", "CPU")))
    before = state(index)
    r = index.apply(0, 2, batch(stored(H[3:6], parent=H[2]), BlockUpdated(H[0], "GPU", "CPU"), AllBlocksCleared(),
                                stored(H[:2]), removed([H[0], H[1], H[9]])))
    assert r.status is ApplyStatus.SNAPSHOT and "diverged" in r.reason and r.next_seq == 2
    assert state(index)[1:] == before[1:]      # holdings untouched; the rank now waits for its snapshot
    assert index.awaiting_snapshot(0)


def test_moving_a_block_from_a_tier_that_lacks_it_diverges(index):
    index.apply(0, 0, batch(stored(H[:2])))
    before = state(index)
    r = index.apply(0, 1, batch(removed(H[:1]), BlockUpdated(H[1], "CPU", "GPU")))
    assert r.status is ApplyStatus.SNAPSHOT
    assert state(index)[1:] == before[1:]


# --- model-based property: refcounts and rollback agree with a plain dict -------------------------

_op = st.tuples(st.sampled_from(["store", "remove", "offload", "onboard", "clear"]),
                st.integers(0, 2), st.lists(st.sampled_from(H[:6]), min_size=1, max_size=3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_op, max_size=5), max_size=12))
def test_index_matches_a_reference_model(batches):
    index = make_index()
    model: dict[tuple[int, int], list[int]] = {}   # (rank, hash) -> [device refs, host refs]
    seqs = {0: 0, 1: 0, 2: 0}
    for ops in batches:
        by_rank: dict[int, list] = {}
        for kind, rank, hashes in ops:
            by_rank.setdefault(rank, []).append((kind, hashes))
        for rank, rank_ops in by_rank.items():
            trial = {k: list(v) for k, v in model.items()}
            events, ok = [], True
            for kind, hashes in rank_ops:
                if kind == "store":
                    events.append(stored(hashes))
                    for h in hashes:
                        trial.setdefault((rank, h), [0, 0])[0] += 1
                elif kind == "clear":
                    events.append(AllBlocksCleared())
                    trial = {k: v for k, v in trial.items() if k[0] != rank}
                else:
                    src, dst = {"remove": (0, None), "offload": (0, 1), "onboard": (1, 0)}[kind]
                    h = hashes[0]
                    medium = ("GPU", "CPU")[src]
                    events.append(removed([h], medium) if dst is None
                                  else BlockUpdated(h, medium, ("GPU", "CPU")[dst]))
                    refs = trial.get((rank, h), [0, 0])
                    if refs[src] == 0:
                        ok = False
                        continue
                    refs[src] -= 1
                    if dst is not None:
                        refs[dst] += 1
                    trial[(rank, h)] = refs
            r = index.apply(rank, seqs[rank], batch(*events))
            if ok:
                assert r.applied, r
                model = {k: v for k, v in trial.items() if v != [0, 0]}
                seqs[rank] += 1
            else:
                assert r.status is ApplyStatus.SNAPSHOT
                blocks = [SnapshotBlock(h, m) for (rr, h), v in model.items() if rr == rank
                          for m, n in zip(("GPU", "CPU"), v) for _ in range(n)]
                index.load_snapshot(rank, blocks, seqs[rank])
            for rr in range(3):
                for h in H[:6]:
                    assert index.store.refs(rr, h) == tuple(model.get((rr, h), [0, 0]))
            for h in H[:6]:
                assert index.store.holders(h) == sorted({rr for (rr, hh) in model if hh == h})
            for rr in range(3):
                expect = 0
                while expect < 6 and (rr, H[expect]) in model:
                    expect += 1
                host = sum(1 for h in H[:expect] if model[(rr, h)][0] == 0)
                got = index.store.longest_prefixes(H[:6]).get(rr, (0, 0))
                assert got == ((expect, host) if expect else (0, 0))


# --- foreign engine (vLLM hashes) -------------------------------------------------------------------

def _ours(tokens, parent=ROOT_HASH, **kw):
    return chain_hashes(block_keys(tokens, TPB, **kw), parent)


def test_foreign_stores_are_rehashed_with_ours_and_chained():
    index = make_index()
    feed = ForeignFeed(index)
    tokens = list(range(100, 125))              # a 25-token prompt: 6 full blocks before the last token
    ours = prompt_hashes(tokens, TPB)
    v = [9000 + i for i in range(6)]            # vLLM's own hashes, unrelated to ours
    assert feed.apply(3, 0, batch(BlockStored(v[:4], None, tokens[:16], TPB),
                                  BlockStored(v[4:], v[3], tokens[16:24], TPB))).applied
    assert [feed.mapped(3, h) for h in v] == ours
    assert match_prefix(index.store, ours)[3].matched_blocks == 6
    # removals by vLLM hash reach our entries; the chain then breaks there
    assert feed.apply(3, 1, batch(BlockRemoved([v[2]]))).applied
    assert match_prefix(index.store, ours)[3].matched_blocks == 2
    assert feed.mapped(3, v[2]) is None
    assert feed.stats.blocks_mapped == 6


def test_foreign_mapping_is_per_rank_and_refcounted():
    index = make_index()
    feed = ForeignFeed(index)
    tokens = list(range(8))
    ours = _ours(tokens, lora_id=2, cache_salt="t")
    ev = BlockStored([1, 2], None, tokens, TPB, lora_id=2, cache_salt="t")
    feed.apply(0, 0, batch(ev, ev))            # two stores of the same vLLM blocks
    feed.apply(1, 0, batch(BlockStored([5, 6], None, tokens, TPB, lora_id=2, cache_salt="t")))
    assert index.store.refs(0, ours[1]) == (2, 0)
    assert index.store.holders(ours[0]) == [0, 1]
    feed.apply(0, 1, batch(BlockRemoved([1, 2])))
    assert feed.mapped(0, 2) == ours[1] and index.store.refs(0, ours[1]) == (1, 0)
    assert feed.mapped(1, 2) is None           # rank 1 named the same prefix 5, 6


def test_foreign_events_built_in_process_are_checked_before_anything_changes():
    """``apply`` takes events from any caller, so it checks them as the codec would (``apply_decoded``, which the
    vLLM subscriber uses for what ``decode_batch`` returned, does not check again)."""
    index = make_index()
    feed = ForeignFeed(index)
    with pytest.raises(ValueError, match=r"events\[1\]\.block_hashes"):
        feed.apply(0, 0, batch(BlockStored([1], None, [1, 2, 3, 4], TPB), BlockStored([-2], 1, [5, 6, 7, 8], TPB)))
    assert feed.mapped(0, 1) is None and index.next_seq(0) == 0 and index.num_blocks() == 0
    assert feed.apply_decoded(0, 0, batch(BlockStored([1], None, [1, 2, 3, 4], TPB))).applied
    assert feed.mapped(0, 1) == _ours([1, 2, 3, 4])[0]


def test_foreign_unknown_parent_and_unknown_removal_are_skipped():
    index = make_index()
    feed = ForeignFeed(index)
    r = feed.apply(0, 0, batch(BlockStored([11], 10, [1, 2, 3, 4], TPB), BlockRemoved([77]),
                               BlockUpdated(78, "GPU", "CPU")))
    assert r.applied and index.num_blocks() == 0
    assert (feed.stats.stores_skipped, feed.stats.hashes_unmapped) == (1, 2)


def test_foreign_batch_not_applied_leaves_the_map_alone():
    index = make_index()
    feed = ForeignFeed(index)
    feed.apply(0, 0, batch(BlockStored([1], None, [1, 2, 3, 4], TPB)))
    assert feed.apply(0, 5, batch(BlockStored([2], 1, [5, 6, 7, 8], TPB))).status is ApplyStatus.REPLAY
    assert feed.mapped(0, 2) is None
    with pytest.raises(ValueError, match="token_ids"):
        feed.apply(0, 1, batch(BlockStored([2], 1, [5, 6, 7, 8], TPB), BlockStored([3], 2, [9], TPB)))
    assert feed.mapped(0, 2) is None and index.next_seq(0) == 1
    # a restart: numbering back at 0; the map goes with the rank's blocks, then the rank starts empty
    assert feed.apply(0, 0, batch(BlockStored([1], None, [1, 2, 3, 4], TPB))).status is ApplyStatus.SNAPSHOT
    assert feed.mapped(0, 1) is None and index.num_blocks(0) == 0
    feed.reset(0, next_seq=0)
    assert feed.apply(0, 0, batch(BlockStored([1], None, [1, 2, 3, 4], TPB))).applied
    feed.remove_rank(0)
    assert index.ranks() == [] and feed.mapped(0, 1) is None


# --- chains: binary search where ranks hold whole prefixes, block by block elsewhere ------------------------

CHAINS = [[0x5000 + 16 * c + j for j in range(10)] for c in range(3)]   # chain 1 and 2 share chain 0's root
CHAINS[1][:3] = CHAINS[0][:3]
CHAINS[2][:1] = CHAINS[0][:1]

_chain_op = st.tuples(st.sampled_from(["store", "store", "remove", "evict", "evict_tail_first", "offload", "clear"]),
                      st.integers(0, 2),
                      st.integers(0, 2), st.integers(0, 9), st.integers(1, 6))


def _orphans(index: SequencedIndex, rank: int) -> int:
    """Blocks ``rank`` holds whose chain parent (in CHAINS) it does not: what the index must count."""
    parent = {h: (c[j - 1] if j else None) for c in CHAINS for j, h in enumerate(c)}
    held = {h for c in CHAINS for h in c if index.store.refs(rank, h) != (0, 0)}
    return sum(1 for h in held if parent[h] is not None and parent[h] not in held)


def _check_orphan_books(index: SequencedIndex) -> None:
    for rank in range(3):
        feed = index.store._holdings.get(rank)
        if feed is not None and not feed.untracked:
            assert feed.orphans == _orphans(index, rank)
            assert bool(index.store._walked & feed.bit) == bool(feed.orphans)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(_chain_op, max_size=4), max_size=12))
def test_chain_prefixes_agree_with_the_block_by_block_walk(batches):
    index = make_index(WindowedIndex)
    for ops in batches:
        for kind, rank, c, start, n in ops:
            chain = CHAINS[c]
            hs = chain[start:start + n]
            if kind == "store":
                ev = stored(hs, chain[start - 1] if start else None)
            elif kind == "remove":
                ev = removed(hs[:1])
            elif kind == "evict":
                ev = removed(hs)
            elif kind == "evict_tail_first":
                ev = removed(hs[::-1])
            elif kind == "offload":
                ev = BlockUpdated(hs[0], "GPU", "CPU")
            else:
                ev = AllBlocksCleared()
            r = index.apply(rank, index.next_seq(rank), batch(ev))
            _check_orphan_books(index)   # after a roll-back too
            if r.status is ApplyStatus.SNAPSHOT:   # removed or moved what it lacks: rebuilt, parents known
                index.load_snapshot(rank, [], index.next_seq(rank))
        for chain in CHAINS:
            for end in (1, 4, 10):
                assert index.store.chain_prefixes(chain[:end]) == index.store.longest_prefixes(chain[:end])


LONG = [[0x9000_0000 + 1000 * c + j for j in range(200)] for c in range(2)]   # past several of the probe's grid steps
LONG[1][:70] = LONG[0][:70]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1), st.integers(1, 200), st.integers(0, 199),
                          st.booleans()), max_size=30))
def test_chain_prefixes_of_long_chains_agree_with_the_block_by_block_walk(ops):
    """Many ranks ending their matches all along chains of many grid steps (bisected in C while no rank holds an
    orphan), and mid-chain evictions that make some ranks walked: the answers are the walk's."""
    index = make_index(WindowedIndex)
    for rank, c, length, cut, mid_chain in ops:
        held = index.store.chain_prefixes(LONG[c]).get(rank, (0, 0))[0]
        if length > held:   # grow the rank's prefix of chain c to ``length`` blocks
            ev = stored(LONG[c][held:length], LONG[c][held - 1] if held else None)
        elif mid_chain and index.store.refs(rank, LONG[c][cut]) != (0, 0):
            ev = removed([LONG[c][cut]])   # an orphan-making eviction (or a tail, if ``cut`` is the last)
        else:
            ev = removed(LONG[c][length:held][::-1])   # a tail, newest first
        if ev.block_hashes:
            assert index.apply(rank, index.next_seq(rank), batch(ev)).applied
        for chain in LONG:
            for end in (1, 31, 33, 64, 150, 200):
                assert index.store.chain_prefixes(chain[:end]) == index.store.longest_prefixes(chain[:end])


def test_chain_prefixes_walk_ranks_with_holes_and_sequences_that_are_not_chains():
    index = make_index(WindowedIndex)
    c = CHAINS[0]
    index.apply(0, 0, batch(stored(c[:8])))
    index.apply(1, 0, batch(stored(c[:8])))
    assert index.store.chain_prefixes(c) == {0: (8, 0), 1: (8, 0)}
    index.apply(1, 1, batch(removed(c[3:4])))            # an eviction mid-chain: rank 1 holds 0-2 and 4-7
    assert index.store.chain_prefixes(c) == index.store.longest_prefixes(c) == {0: (8, 0), 1: (3, 0)}
    index.apply(1, 2, batch(stored(c[3:4], c[2])))        # the hole refilled: whole prefixes again
    assert index.store._walked == 0
    assert index.store.chain_prefixes(c) == {0: (8, 0), 1: (8, 0)}
    not_a_chain = [c[0], c[5], c[1], c[2]]                # held blocks, but not each the child of the one before
    assert index.store.chain_prefixes(not_a_chain) == index.store.longest_prefixes(not_a_chain) \
        == {0: (4, 0), 1: (4, 0)}


def test_snapshot_of_blocks_of_unknown_parent_is_walked_block_by_block():
    index = make_index(WindowedIndex)
    c = CHAINS[0]
    index.load_snapshot(2, [SnapshotBlock(h) for h in c[:5]], 0)
    assert index.store._walked == 1 << 0                        # rank 2 took slot 0
    assert index.store.chain_prefixes(c) == {2: (5, 0)}
    index.apply(2, 0, batch(AllBlocksCleared(), stored(c[:2])))
    assert index.store._walked == 0 and index.store.chain_prefixes(c) == {2: (2, 0)}


# --- KV cache groups (attention windows) --------------------------------------------------------------------------

def group_stored(hashes, group, window=None, parent=None):
    """A store of one KV cache group, described as vLLM and our windowed ledgers describe theirs."""
    ev = stored(hashes, parent)
    ev.group_idx = group
    ev.kv_cache_spec_kind = "full_attention" if window is None else "sliding_window"
    ev.kv_cache_spec_sliding_window = window
    return ev


def group_removed(hashes, group):
    ev = removed(hashes)
    ev.group_idx = group
    return ev


def matched(index, rank, n=8):
    return index.store.chain_prefixes(H[:n]).get(rank, (0, 0))[0]


def test_a_prefix_counts_for_a_windowed_rank_only_as_far_as_every_group_serves_it(index):
    """Group 0 slides over 8 tokens (2 blocks of 4), group 1 attends to everything."""
    index.apply(0, 0, batch(group_stored(H[:8], 0, window=8), group_stored(H[:8], 1)))
    index.apply(1, 0, batch(stored(H[:8])))
    assert matched(index, 0) == matched(index, 1) == 8
    # group 0 lets its early blocks go (they slid out): the query after 8 blocks reads blocks 6 and 7 only
    assert index.apply(0, 1, batch(group_removed(H[:5], 0))).applied
    assert matched(index, 0) == 8 and index.store.refs(0, H[0]) == (0, 0)
    assert index.store.chain_prefixes(H[:6]).get(0, (0, 0))[0] == 0   # 6 blocks would need blocks 4 and 5 of group 0
    # the full-attention group loses block 3: nothing past it counts, whatever group 0 holds
    assert index.apply(0, 2, batch(group_removed([H[3]], 1))).applied
    assert matched(index, 0) == 0 and matched(index, 1) == 8
    assert match_prefix(index.store, H[:8])[1].matched_tokens == 8 * TPB and 0 not in match_prefix(index.store, H[:8])


def test_a_group_removal_of_a_block_it_does_not_hold_rolls_the_batch_back(index):
    index.apply(0, 0, batch(group_stored(H[:6], 0, window=8), group_stored(H[:4], 1)))
    before = state(index)[1:], matched(index, 0, 6)
    assert before[1] == 4
    result = index.apply(0, 1, batch(group_stored(H[4:6], 1, parent=H[3]), group_removed([H[9]], 1)))
    assert result.status is ApplyStatus.SNAPSHOT and "group 1" in result.reason
    assert (state(index)[1:], matched(index, 0, 6)) == before   # group 1's store of blocks 4, 5 is undone


def test_a_snapshot_rebuilds_every_group_and_a_clear_empties_them(index):
    from kvledger.worker.wire.batches import StoredBlock

    index.apply(0, 0, batch(group_stored(H[:4], 0, window=8), group_stored(H[:4], 1)))
    snap = [StoredBlock(h, None, [7] * TPB, "GPU", None, None, 35, group_idx=g) for g in (0, 1) for h in H[:4]]
    index.load_snapshot(0, snap[2:4] + snap[4:], 5)   # group 0 kept only its last two blocks
    assert matched(index, 0, 4) == 4 and index.num_blocks(0) == 2
    assert index.apply(0, 5, batch(AllBlocksCleared())).applied
    assert matched(index, 0, 4) == 0
    with pytest.raises(ValueError, match="group_idx"):
        index.load_snapshot(0, [StoredBlock(H[0], None, [7] * TPB, "GPU", None, None, 35, group_idx=-1)], 0)


def test_vllm_style_group_maps_decode_and_index(index):
    """vLLM's map events with its group fields (and without them, as older ones are) through the wire."""
    import msgpack

    def ev(kind, group, hashes, **kw):
        base = {"type": kind, "block_hashes": hashes, "medium": "GPU"}
        if kind == "BlockStored":
            base.update(parent_block_hash=None, token_ids=[1] * TPB * len(hashes), block_size=TPB, lora_id=None,
                        lora_name=None)
        return {**base, **({} if group is None else {"group_idx": group}), **kw}

    data = msgpack.packb([1.0, [ev("BlockStored", None, H[:4]),
                                ev("BlockStored", 1, H[:4], kv_cache_spec_kind="sliding_window",
                                   kv_cache_spec_sliding_window=8),
                                ev("BlockRemoved", 1, H[:1])], 0])
    assert ingest(index, 0, 0, data).applied
    assert matched(index, 0, 4) == 4 and matched(index, 0, 1) == 0   # one block needs group 1's block 0
