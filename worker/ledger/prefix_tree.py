"""The prefix tree of stored full blocks, matched by key (never by hash alone).

A node stands for one block key following its parent's prefix and holds at
most one block per attention window (one tree for every window, as
TensorRT-LLM's VSWA keeps). Evicting a block empties only its node: the descendants stay,
unreachable until the missing block is stored again. Nodes with neither a
block nor children are pruned.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvledger.worker.ledger.block import Block
from kvledger.worker.wire.block_key import BlockKey

_Bucket = tuple[int, int | None, str | None, tuple[tuple[str, int], ...]]


def _bucket(key: BlockKey) -> _Bucket:
    """Children that could partly match ``key`` share its first token and constraints."""
    return (key.tokens[0], key.lora_id, key.cache_salt, key.mm_keys)


@dataclass(slots=True, eq=False)
class TreeNode:
    key: BlockKey | None
    parent: TreeNode | None
    block: Block | None = None
    """Window 0's block, so that the common one-window tree reads one attribute."""
    others: list[Block | None] | None = None
    """The blocks of windows 1.. (``None`` in a one-window tree)."""
    children: dict[BlockKey, TreeNode] = field(default_factory=dict)
    by_bucket: dict[_Bucket, list[TreeNode]] = field(default_factory=dict)
    """The children by ``_bucket``, in ``children``'s order, kept only while there are two or more: a chain's node
    (one child) keeps none, so storing and evicting a long prompt builds and frees no index."""


    def block_of(self, window: int) -> Block | None:
        return self.block if window == 0 else self.others[window - 1]

    def is_empty(self) -> bool:
        """Whether no window holds a block here."""
        return self.block is None and (self.others is None or not any(self.others))


class PrefixTree:
    __slots__ = ("root", "num_nodes", "num_windows")

    def __init__(self, num_windows: int = 1) -> None:
        self.num_windows = num_windows
        self.root = TreeNode(key=None, parent=None, others=[None] * (num_windows - 1) if num_windows > 1 else None)
        self.num_nodes = 0

    def child(self, node: TreeNode, key: BlockKey) -> TreeNode | None:
        return node.children.get(key)

    def best_partial(self, node: TreeNode, key: BlockKey, limit: int) -> tuple[TreeNode | None, int]:
        """The child (holding a block) sharing the longest token prefix with ``key``, at most ``limit`` tokens."""
        if limit <= 0 or not key.tokens:
            return None, 0
        best, best_len = None, 0
        where = _bucket(key)
        children = node.children
        cands = node.by_bucket.get(where, ()) if len(children) > 1 else [
            c for c in children.values() if _bucket(c.key) == where]
        for cand in cands:
            if cand.block is None:
                continue
            n = key.partial_match(cand.key, limit)
            if n > best_len:
                best, best_len = cand, n
        return best, best_len

    def child_or_new(self, node: TreeNode, key: BlockKey) -> TreeNode:
        found = node.children.get(key)
        if found is not None:
            return found
        new = TreeNode(key, node)
        if self.num_windows > 1:
            new.others = [None] * (self.num_windows - 1)
        children = node.children
        if len(children) == 1:   # a second child: index the first
            (first,) = children.values()
            node.by_bucket[_bucket(first.key)] = [first]
        if children:
            node.by_bucket.setdefault(_bucket(key), []).append(new)
        children[key] = new
        self.num_nodes += 1
        return new

    def attach(self, node: TreeNode, block: Block) -> None:
        assert block.node is None, f"block {block.block_id} is stored already"
        w = block.window
        if w == 0:
            assert node.block is None, "attach over an occupied node"
            node.block = block
        else:
            assert node.others[w - 1] is None, "attach over an occupied node"
            node.others[w - 1] = block
        block.node = node

    def detach(self, block: Block) -> None:
        """Take ``block`` out of the tree; its node stays while it holds another window's block or has children."""
        self.detach_n((block,))

    def detach_n(self, blocks: Sequence[Block]) -> None:
        """``detach`` each block, then prune: the tree ends as pruning after each would leave it (the nodes left
        with no block and no children go, and so do their ancestors left so), but a run of evicted victims (a
        chain's nodes, deepest first) is cut once, at its top."""
        nodes: list[TreeNode] = []
        for block in blocks:
            node, w = block.node, block.window
            if w == 0:
                assert node is not None and node.block is block, f"block {block.block_id} is not in the tree"
                node.block = None
            else:
                assert node is not None and node.others[w - 1] is block, f"block {block.block_id} is not in the tree"
                node.others[w - 1] = None
            block.node = None
            nodes.append(node)
        prune = self._prune
        for node in nodes:
            if node.parent is not None and not node.children:   # else pruned already, or kept by its children
                prune(node)

    def _prune(self, node: TreeNode) -> None:
        """Remove childless ``node`` if it holds no block, and each ancestor left so. The nodes of such a chain
        are unlinked from their parents only at its top (the rest go with it, their parent links cut)."""
        if not node.is_empty():
            return
        parent = node.parent
        while parent.parent is not None and len(parent.children) == 1 and parent.block is None and (
                parent.others is None or not any(parent.others)):   # ``parent.is_empty()``, inlined
            node.parent = None
            self.num_nodes -= 1
            node, parent = parent, parent.parent
        node.parent = None
        self.num_nodes -= 1
        if len(parent.children) == 1:   # the only child (a chain's node): no key to hash, no bucket to look up
            parent.children.clear()
            return
        key = node.key
        del parent.children[key]
        if len(parent.children) == 1:   # one child left: no index
            parent.by_bucket.clear()
            return
        where = _bucket(key)
        bucket = parent.by_bucket[where]
        bucket.remove(node)
        if not bucket:
            del parent.by_bucket[where]

    def has_stored_children(self, node: TreeNode) -> bool:
        return any(not c.is_empty() or c.children for c in node.children.values())
