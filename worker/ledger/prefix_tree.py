"""The prefix tree of stored full blocks, matched by key (never by hash alone).

A node stands for one block key following its parent's prefix and holds at
most one block. Evicting a block empties only its node: the descendants stay,
unreachable until the missing block is stored again. Nodes with neither a
block nor children are pruned.
"""
from __future__ import annotations

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
    children: dict[BlockKey, TreeNode] = field(default_factory=dict)
    by_bucket: dict[_Bucket, list[TreeNode]] = field(default_factory=dict)


class PrefixTree:
    __slots__ = ("root", "num_nodes")

    def __init__(self) -> None:
        self.root = TreeNode(key=None, parent=None)
        self.num_nodes = 0

    def child(self, node: TreeNode, key: BlockKey) -> TreeNode | None:
        return node.children.get(key)

    def best_partial(self, node: TreeNode, key: BlockKey, limit: int) -> tuple[TreeNode | None, int]:
        """The child (holding a block) sharing the longest token prefix with ``key``, at most ``limit`` tokens."""
        if limit <= 0 or not key.tokens:
            return None, 0
        best, best_len = None, 0
        for cand in node.by_bucket.get(_bucket(key), ()):
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
        new = TreeNode(key=key, parent=node)
        node.children[key] = new
        node.by_bucket.setdefault(_bucket(key), []).append(new)
        self.num_nodes += 1
        return new

    def attach(self, node: TreeNode, block: Block) -> None:
        assert node.block is None and block.node is None, "attach over an occupied node or a stored block"
        node.block, block.node = block, node

    def detach(self, block: Block) -> None:
        """Take ``block`` out of the tree; its node stays while it has children."""
        node = block.node
        assert node is not None and node.block is block, f"block {block.block_id} is not in the tree"
        node.block, block.node = None, None
        self._prune(node)

    def _prune(self, node: TreeNode) -> None:
        while node.parent is not None and node.block is None and not node.children:
            parent = node.parent
            del parent.children[node.key]
            bucket = parent.by_bucket[_bucket(node.key)]
            bucket.remove(node)
            if not bucket:
                del parent.by_bucket[_bucket(node.key)]
            node.parent = None
            self.num_nodes -= 1
            node = parent

    def has_stored_children(self, node: TreeNode) -> bool:
        return any(c.block is not None or c.children for c in node.children.values())
