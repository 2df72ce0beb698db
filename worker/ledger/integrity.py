"""The integrity check: proof that one rank's books balance, for tests and a rank's health check.

It recounts everything from scratch (references from the holders, free
blocks from the free lists, slots, tree links) and compares with what the
pool keeps incrementally, so a bug in any fast path shows up as the first
invariant it broke, named. The free lists are walked link by link, not
trusted by their counters: every link points back, every block in a list
belongs to that tier and level and is unreferenced, no block is in two
places, and each list's size is what the walk found. Kept apart from the pool
and the manager: it only reads them, and all the invariants are in one place.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvledger.worker.ledger.block import PLACEHOLDER, PRIMARY, SECONDARY, TIER_MEDIUM, Block
from kvledger.worker.ledger.block_pool import BlockPool
from kvledger.worker.ledger.eviction import level_of
from kvledger.worker.ledger.prefix_tree import PrefixTree
from kvledger.worker.ledger.sequence import Sequence


def check_pool(pool: BlockPool, holders: Iterable[list[Block]]) -> None:
    """Raise ``AssertionError`` naming the first broken invariant of ``pool`` (one window's blocks).

    ``holders`` are the block lists of everything that holds references in it:
    running sequences and pins, one reference per appearance (placeholders hold none).
    """
    refs: dict[int, int] = {}
    for holder in holders:
        for b in holder:
            if b is PLACEHOLDER:
                continue
            if b.window != pool.window:
                raise AssertionError(f"block {b.block_id} of window {b.window} is held as one of window {pool.window}")
            refs[b.block_id] = refs.get(b.block_id, 0) + 1
    slots: tuple[set[int], set[int]] = (set(), set())
    free = [0, 0]
    for b in pool.blocks:
        want = refs.get(b.block_id, 0)
        if b.ref_count != want:
            raise AssertionError(f"block {b.block_id}: ref_count {b.ref_count}, held by {want} sequences")
        if (b.ref_count > 0) == (b.level >= 0):
            raise AssertionError(f"block {b.block_id}: ref_count {b.ref_count} but free-list level {b.level}")
        if b.ref_count > 0 and b.tier != PRIMARY:
            raise AssertionError(f"block {b.block_id}: referenced while on the host tier")
        if b.level >= 0:
            free[b.tier] += 1
            if b.level != level_of(b):
                raise AssertionError(f"block {b.block_id}: in free level {b.level}, belongs in {level_of(b)}")
        if b.slot in slots[b.tier]:
            raise AssertionError(f"block {b.block_id}: slot {b.slot} of tier {b.tier} used twice")
        slots[b.tier].add(b.slot)
        if (b.node is None) != (b.key is None) or (b.key is None) != (b.block_hash is None):
            raise AssertionError(f"block {b.block_id}: key, hash and tree node disagree")
        if b.window != pool.window:
            raise AssertionError(f"block {b.block_id}: of window {b.window}, in the pool of window {pool.window}")
        if b.node is not None and (b.node.block_of(pool.window) is not b or b.node.key != b.key):
            raise AssertionError(f"block {b.block_id}: its tree node does not point back")
        if b.expires_at is not None and (b.level < 0 or b.duration_s is None):
            raise AssertionError(f"block {b.block_id}: a retention countdown runs while it is in use or has no "
                                 "duration")
    _walk_free_lists(pool)
    evict = pool.eviction
    for tier, size in ((PRIMARY, pool.num_primary), (SECONDARY, pool.num_secondary)):
        if slots[tier] != set(range(size)):
            raise AssertionError(f"tier {TIER_MEDIUM[tier]}: slots are not a permutation of the pool")
        if free[tier] != evict.num_free(tier) or sum(evict.list_sizes(tier)) != free[tier]:
            raise AssertionError(f"tier {TIER_MEDIUM[tier]}: free count {evict.num_free(tier)}, "
                                 f"{free[tier]} blocks in its free lists")
        if free[tier] > size:
            raise AssertionError(f"tier {TIER_MEDIUM[tier]}: more free blocks than the pool holds")


def check_tree(tree: PrefixTree) -> None:
    """Raise ``AssertionError`` naming the first broken link of the prefix tree (every window's blocks)."""
    stack = [tree.root]
    nodes = 0
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            nodes += 1
            if child.parent is not node or child.key != key:
                raise AssertionError("prefix tree: a child does not point back to its parent")
            for w in range(tree.num_windows):
                b = child.block_of(w)
                if b is not None and (b.node is not child or b.window != w):
                    raise AssertionError(f"prefix tree: node's block {b.block_id} points elsewhere (window {w})")
            if child.is_empty() and not child.children:
                raise AssertionError("prefix tree: an empty leaf was not pruned")
            stack.append(child)
    if nodes != tree.num_nodes:
        raise AssertionError(f"prefix tree: {nodes} nodes reachable, {tree.num_nodes} counted")


def check_sequences(seqs: Iterable[Sequence], tokens_per_block: int) -> None:
    """Raise ``AssertionError`` naming the first running sequence whose blocks do not fit its tokens.

    Every admitted token has a block (a chunk cut by ``fit_token_budget``
    keeps more); once the whole prompt is admitted, every beam owns as many
    blocks past the shared context as beam 0 does.
    """
    for seq in seqs:
        rid, prompt = seq.request.request_id, len(seq.request.tokens)
        if len(seq.blocks) < -(-seq.num_tokens // tokens_per_block) or not 0 <= seq.chunk_start <= seq.num_tokens:
            raise AssertionError(f"request {rid}: {len(seq.blocks)} blocks for {seq.num_tokens} tokens, chunk "
                                 f"from {seq.chunk_start}")
        for w, blocks in enumerate(seq.windows):
            if len(blocks) != len(seq.blocks) or (PLACEHOLDER in blocks and seq.sliding[w] is None):
                raise AssertionError(f"request {rid}: window {w} has {len(blocks)} block positions, window 0 "
                                     f"{len(seq.blocks)}; placeholders only in sliding windows")
        own = len(seq.blocks) - prompt // tokens_per_block
        if len(seq.beams) != seq.request.beam_width - 1 or (seq.decoding or seq.num_tokens == prompt) and any(
                len(b) != own for b in seq.beams):
            raise AssertionError(f"request {rid}: beams own {[len(b) for b in seq.beams]} blocks, beam 0 {own} "
                                 "past the shared context")


def _walk_free_lists(pool: BlockPool) -> None:
    """Follow every free list from its sentinel and back; see the module docstring."""
    seen: set[int] = set()
    for tier in (PRIMARY, SECONDARY):
        walked = 0
        for level, lst in enumerate(pool.eviction.lists(tier)):
            head = lst.sentinel
            prev, b, n = head, head.fl_next, 0
            while b is not head:
                where = f"tier {TIER_MEDIUM[tier]} free list {level}"
                if b is None or n > len(pool.blocks):
                    raise AssertionError(f"{where}: the links do not lead back to its head")
                if b.fl_prev is not prev:
                    raise AssertionError(f"{where}: block {b.block_id} does not point back to its predecessor")
                if b.block_id in seen:
                    raise AssertionError(f"{where}: block {b.block_id} is in a free list twice")
                if b.tier != tier or b.level != level or level_of(b) != level:
                    raise AssertionError(f"{where}: block {b.block_id} of tier {b.tier}, level {b.level} "
                                         f"(belongs in {level_of(b)}) is in it")
                if b.ref_count:
                    raise AssertionError(f"{where}: block {b.block_id} is referenced {b.ref_count} times")
                seen.add(b.block_id)
                prev, b, n = b, b.fl_next, n + 1
            if head.fl_prev is not prev:
                raise AssertionError(f"tier {TIER_MEDIUM[tier]} free list {level}: its head does not point back "
                                     "to its last block")
            if lst.size != n:
                raise AssertionError(f"tier {TIER_MEDIUM[tier]} free list {level}: size {lst.size}, {n} blocks "
                                     "walked")
            walked += n
        if walked != pool.eviction.num_free(tier):
            raise AssertionError(f"tier {TIER_MEDIUM[tier]}: free count {pool.eviction.num_free(tier)}, {walked} "
                                 "blocks in its free lists")
    free = {b.block_id for b in pool.blocks if b.level >= 0}
    if free != seen:
        missing = sorted(free - seen)[:5]
        raise AssertionError(f"blocks {missing} say they are free but are in no free list")
