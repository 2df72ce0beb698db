"""sgl-router's approximate tree: a multi-tenant radix tree of the prompts each rank was sent.

The router never hears from the ranks; it remembers which rank it sent which
prompt to and assumes the rank still holds it, until the rank's share of the
tree passes ``max_tokens_per_rank`` and its least recently used leaves are
evicted. Each node carries an edge of tokens and, per rank (tenant), the tick
it was last used; a rank on a node is on all its ancestors too (the root, with
no tokens, holds no tenants).
"""
from __future__ import annotations

import heapq
from collections.abc import Set


class _Node:
    __slots__ = ("tokens", "children", "parent", "tenants")

    def __init__(self, tokens: tuple[int, ...], parent: _Node | None) -> None:
        self.tokens = tokens
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.tenants: dict[int, int] = {}   # rank -> last-used tick


def _common_prefix(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """How many of ``edge``'s tokens equal ``tokens[start:]``; one C-level compare when all do."""
    k = len(edge)
    if tokens[start:start + k] == edge:
        return k
    n = min(k, len(tokens) - start)
    i = 0
    while i < n and edge[i] == tokens[start + i]:
        i += 1
    return i


class ApproxTree:
    """Prompts per rank, by longest common prefix (see the module docstring)."""

    __slots__ = ("max_tokens_per_rank", "_root", "_sizes", "_tick")

    def __init__(self, max_tokens_per_rank: int) -> None:
        if type(max_tokens_per_rank) is not int or max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be a positive int, got {max_tokens_per_rank!r}")
        self.max_tokens_per_rank = max_tokens_per_rank
        self._root = _Node((), None)
        self._sizes: dict[int, int] = {}
        self._tick = 0

    def size(self, rank: int) -> int:
        """Tokens of the tree that ``rank`` is on."""
        return self._sizes.get(rank, 0)

    def insert(self, tokens: tuple[int, ...], rank: int) -> None:
        """Record that ``rank`` was sent ``tokens``; evicts that rank's oldest leaves past its budget."""
        self._tick += 1
        tick, node, i, n = self._tick, self._root, 0, len(tokens)
        added = 0
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node)
                leaf.tenants[rank] = tick
                node.children[tokens[i]] = leaf
                added += n - i
                break
            k = _common_prefix(child.tokens, tokens, i)
            if k < len(child.tokens):
                child = self._split(child, k)
            if rank not in child.tenants:
                added += k
            child.tenants[rank] = tick
            i += k
            node = child
        self._sizes[rank] = self._sizes.get(rank, 0) + added
        if self._sizes[rank] > self.max_tokens_per_rank:
            self._evict(rank)

    def match(self, tokens: tuple[int, ...], ranks: Set[int]) -> dict[int, int]:
        """Per rank of ``ranks`` on the path: how many leading tokens of ``tokens`` it was sent."""
        out: dict[int, int] = {}
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            here = ranks & child.tenants.keys()
            if not here:
                break
            k = _common_prefix(child.tokens, tokens, i)
            i += k
            for r in here:
                out[r] = i
            if k < len(child.tokens):
                break   # the prompt leaves the tree inside this edge
            node = child
        return out

    def remove_rank(self, rank: int) -> None:
        """Take ``rank`` off every node; nodes left without tenants go."""
        self._sizes.pop(rank, None)
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.tenants.pop(rank, None) is None:
                continue   # not on this node, so not below it either
            if not node.tenants:
                assert node.parent is not None, "the root is never pushed"
                del node.parent.children[node.tokens[0]]
            else:
                stack.extend(node.children.values())

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child``'s edge after ``k`` tokens; the upper part inherits its tenants (sizes unchanged)."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.tokens), "split inside a non-root edge"
        mid = _Node(child.tokens[:k], parent)
        mid.tenants = dict(child.tenants)
        parent.children[child.tokens[0]] = mid
        child.tokens = child.tokens[k:]
        child.parent = mid
        mid.children[child.tokens[0]] = child
        return mid

    def _evict(self, rank: int) -> None:
        """Drop ``rank``'s least recently used leaves until it is back to 80 % of its budget (so that
        eviction, a walk over the tree, stays rare)."""
        target = self.max_tokens_per_rank * 4 // 5
        heap: list[tuple[int, int, _Node]] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if rank not in node.tenants:
                continue
            below = [c for c in node.children.values() if rank in c.tenants]
            if below:
                stack.extend(below)
            else:
                heap.append((node.tenants[rank], id(node), node))
        heapq.heapify(heap)
        size = self._sizes[rank]
        while size > target and heap:
            _, _, node = heapq.heappop(heap)
            del node.tenants[rank]
            size -= len(node.tokens)
            parent = node.parent
            assert parent is not None, "the root is never a leaf here"
            if not node.tenants:
                del parent.children[node.tokens[0]]
            if parent is not self._root and not any(rank in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[rank], id(parent), parent))
        self._sizes[rank] = size
