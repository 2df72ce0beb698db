"""Storing: a sequence's full blocks become reusable in the prefix tree, and the stores are announced.

A block is stored at the tree node of its key, following its predecessor's
node, unless the node holds a block of its window already (another request
stored the same prefix first: the sequence's own block stays unshared).
Each newly stored run is announced as one ``BlockStored``; with attention
windows, one per window, naming its group and its kind as vLLM does, and a
window's placeholders store nothing. The snapshot lists every stored block of
every window for a router that lost track.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

from kvledger.worker.ledger.block import PLACEHOLDER
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.event_buffer import EventBuffer
from kvledger.worker.ledger.prefix_tree import PrefixTree, TreeNode
from kvledger.worker.ledger.sequence import Sequence
from kvledger.worker.ledger.window import WindowManager
from kvledger.worker.wire.batches import StoredBlock
from kvledger.worker.wire.events import BlockStored


class Storer:
    """Stores sequences' blocks in the one prefix tree of a ledger's windows and announces them."""

    __slots__ = ("config", "tokens_per_block", "_tree", "_events", "_windows", "_windowed", "_described")

    def __init__(self, config: CacheConfig, tree: PrefixTree, events: EventBuffer, windows: Seq[WindowManager],
                 windowed: bool) -> None:
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self._tree, self._events, self._windows, self._windowed = tree, events, windows, windowed
        self._described = [dict(kv_cache_spec_kind=w.kind, kv_cache_spec_sliding_window=w.size) if windowed else {}
                           for w in windows]
        """What a snapshot entry says of its window's group, as ``BlockStored`` events do."""

    def store(self, seq: Sequence, count: int) -> None:
        """Put the first ``count`` blocks of ``seq`` in the tree; announce the newly stored runs."""
        if count <= 0 or not self.config.enable_block_reuse:
            return
        T = self.tokens_per_block
        c = seq.stored
        if c >= count:
            return
        seq.ensure_keys(count, T)
        if self._windowed:
            self._store_windows(seq, count)
            return
        tree = self._tree
        child_or_new, attach = tree.child_or_new, tree.attach
        keys, hashes, blocks = seq.keys, seq.hashes, seq.blocks
        node = blocks[c - 1].node if c else tree.root
        run: list[int] = []
        for i in range(c, count):
            key, b = keys[i], blocks[i]
            node = child_or_new(node, key)
            if node.block is None and b.node is None:
                attach(node, b)
                b.key, b.block_hash, b.is_full = key, hashes[i], True
                b.prev = blocks[i - 1] if i else None
                if run and blocks[run[-1]].priority != b.priority:
                    self._announce(seq, run)
                    run = []
                run.append(i)
            else:
                if run:
                    self._announce(seq, run)
                    run = []
                assert node.block is b or b.node is None, f"block {b.block_id} stored at two nodes"
            if c == i and b.node is node:
                c += 1
        seq.stored = c
        if run:
            self._announce(seq, run)

    def _store_windows(self, seq: Sequence, count: int) -> None:
        """``_store`` with attention windows: one walk of the tree, each window's held blocks attached at their
        nodes (a placeholder stores nothing), each window's newly stored runs announced in its group."""
        tree = self._tree
        c = seq.stored
        anchor = next((blocks[c - 1].node for blocks in seq.windows if c and blocks[c - 1].node is not None), None)
        node = anchor if anchor is not None else tree.root
        runs: list[list[int]] = [[] for _ in self._windows]
        for i in range(seq.stored if anchor is not None else 0, count):
            key = seq.keys[i]
            node = tree.child_or_new(node, key)
            if i < c:
                continue
            for w, blocks in zip(self._windows, seq.windows):
                b, run = blocks[i], runs[w.index]
                if b is not PLACEHOLDER and node.block_of(w.index) is None and b.node is None:
                    tree.attach(node, b)
                    b.key, b.block_hash, b.is_full = key, seq.hashes[i], True
                    b.prev = blocks[i - 1] if i and blocks[i - 1] is not PLACEHOLDER else None
                    if run and (run[-1] != i - 1 or blocks[run[-1]].priority != b.priority):
                        self._announce(seq, run, w)
                        run.clear()
                    run.append(i)
                elif run:
                    self._announce(seq, run, w)
                    run.clear()
            if c == i and all(blocks[i] is PLACEHOLDER or blocks[i].node is node for blocks in seq.windows):
                c += 1
        seq.stored = c
        for w, run in zip(self._windows, runs):
            if run:
                self._announce(seq, run, w)

    def _announce(self, seq: Sequence, run: list[int], window: WindowManager | None = None) -> None:
        T, r = self.tokens_per_block, seq.request
        first = run[0]
        blocks = seq.blocks if window is None else seq.windows[window.index]
        event = BlockStored(
            block_hashes=[seq.hashes[i] for i in run],
            parent_block_hash=seq.hashes[first - 1] if first else None,
            token_ids=seq.tokens[first * T:(run[-1] + 1) * T], block_size=T, lora_id=r.lora_id,
            medium="GPU", cache_salt=r.cache_salt, priority=blocks[first].priority)
        if window is not None:
            event.group_idx, event.kv_cache_spec_kind = window.index, window.kind
            event.kv_cache_spec_sliding_window = window.size
        self._events.put(event)

    def snapshot(self) -> list[StoredBlock]:
        """Every reusable block (of every window), parents before children: enough for a router to rebuild this
        rank's index."""
        out = []
        windows = range(len(self._windows))
        stack: list[TreeNode] = [self._tree.root]
        while stack:
            node = stack.pop()
            parent = node.parent
            parent_hash = None
            if parent is not None:
                parent_hash = next((pb.block_hash for w in windows if (pb := parent.block_of(w)) is not None), None)
            for w in windows:
                b = node.block_of(w)
                if b is not None:
                    out.append(StoredBlock(block_hash=b.block_hash, parent_hash=parent_hash,
                                           token_ids=list(b.key.tokens), medium=b.medium, lora_id=b.key.lora_id,
                                           cache_salt=b.key.cache_salt, priority=b.priority, group_idx=w,
                                           **self._described[w]))
            stack.extend(node.children.values())
        return out
