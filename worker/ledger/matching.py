"""Matching a prompt against the prefix tree: what an admission could reuse, decided without changing anything.

One full-attention window matches as TensorRT-LLM does: full blocks along the
prompt's keys up to the first missing one, then possibly one partly matching
block. With attention windows (VSWA) a match follows the safe-prefix rule: a
prefix of ``n`` blocks counts only if every window can serve it, that is, holds
every block the queries from position ``n * tokens_per_block`` on attend to:
all ``n`` for full attention, only the blocks of the last ``window`` tokens for
a sliding window (whose earlier positions become placeholders). Partial
matches apply to one full-attention window only.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import islice, repeat
from operator import itemgetter

from kvledger.worker.ledger.block import PLACEHOLDER, Block
from kvledger.worker.ledger.prefix_tree import PrefixTree, TreeNode
from kvledger.worker.ledger.stats import PrefixReuseSummary
from kvledger.worker.ledger.window import WindowManager
from kvledger.worker.wire.block_key import BlockKey, MmKey, block_keys


@dataclass(slots=True)
class Match:
    """What the tree offers one prompt: full blocks, then possibly one partly matching block."""

    full: list[Block]
    """Window 0's blocks of the matched positions (placeholders where a sliding window 0 needs none)."""
    partial: Block | None = None
    partial_len: int = 0
    in_place: bool = False
    keys: list[BlockKey] | None = None
    """The prompt's block keys in order, reused by the store: every one (the trailing partial block's included), or,
    for a prompt without extra ids or multimodal items, those of the matched blocks and the next block."""
    windows: list[list[Block]] | None = None
    """Every window's blocks of the matched positions, ``full`` first; ``None`` for one full-attention window."""
    window_held: list[list[Block]] | None = None
    """Of each window, the blocks the match would hold (``windows`` without its placeholders)."""

    def held(self, window: int) -> list[Block]:
        """The blocks of window ``window`` the match would hold (placeholders left out)."""
        return self.full if self.window_held is None else self.window_held[window]

    def to_onboard(self, window: int) -> list[Block]:
        """Blocks of ``window`` the match uses in place (a copied partial block is read from wherever it lies)."""
        held = self.held(window)
        return [*held, self.partial] if self.in_place and window == 0 else held

    def held_by_running(self, num_windows: int) -> tuple[int, ...]:
        """Per window, the matched blocks that running requests hold: they cost that window's pool nothing."""
        return tuple(sum(1 for b in self.held(w) if b.ref_count > 0) for w in range(num_windows))

    def summary(self, tokens_per_block: int) -> PrefixReuseSummary:
        """What admitting the matched prompt now would reuse. With attention windows, a matched position counts as
        allocated when every window that keeps a block there has it held by a running request (a placeholder costs
        no block), so the figure does not depend on the order the windows are listed in."""
        rows = zip(*self.windows) if self.windows is not None else ((b,) for b in self.full)
        return PrefixReuseSummary(
            reusable_blocks_allocated=sum(1 for row in rows if all(b is PLACEHOLDER or b.ref_count > 0 for b in row)),
            reusable_blocks_all=len(self.full),
            total_matched_tokens=len(self.full) * tokens_per_block + self.partial_len,
            first_new_block=len(self.full))


def match_prompt(tree: PrefixTree, windows: Seq[WindowManager], tokens: Seq[int], lora_id: int | None,
                 cache_salt: str | None, mm_keys: Seq[MmKey], extra_ids: Seq[int] | None, partial: bool,
                 taken: set[int] | frozenset[int] = frozenset(), max_blocks: int | None = None) -> Match:
    """Walk the tree with the prompt's keys; the last prompt token is never matched. ``taken``: window 0's blocks
    an earlier request of the batch takes in place (not shareable); ``max_blocks``: the deepest prefix matched (a
    migration that moves part of one), the windows' blocks those of that prefix."""
    T = windows[0].tokens_per_block
    usable = len(tokens) - 1
    n_full = usable // T if max_blocks is None else min(usable // T, max_blocks)
    if len(windows) > 1 or windows[0].slides:
        return _match_windows(tree, windows, block_keys(tokens, T, lora_id=lora_id, cache_salt=cache_salt,
                                                        mm_keys=mm_keys, extra_ids=extra_ids, include_partial=True),
                              n_full)
    if mm_keys or extra_ids is not None:
        keys = block_keys(tokens, T, lora_id=lora_id, cache_salt=cache_salt, mm_keys=mm_keys, extra_ids=extra_ids,
                          include_partial=True)
        node, full = _walk(tree.root, keys[:n_full], taken)
    else:
        node, full, keys = _walk_plain(tree.root, tokens, T, n_full, lora_id, cache_salt, taken)
        # the next block's key, for a partial match; the store builds the rest when it needs them (``ensure_keys``)
        keys += block_keys(tokens[len(full) * T:(len(full) + 1) * T], T, lora_id=lora_id, cache_salt=cache_salt,
                           include_partial=True)
    m = Match(full, keys=keys)
    limit = min(T, usable - len(full) * T)
    if partial and limit > 0 and len(full) < len(keys):
        cand, n = tree.best_partial(node, keys[len(full)], limit)
        if cand is not None:  # a block taken in place by an earlier request can still be copied
            m.partial, m.partial_len = cand.block, n
    return m


def _walk(node: TreeNode, keys: list[BlockKey], taken: set[int] | frozenset[int]) -> tuple[TreeNode, list[Block]]:
    """Follow ``keys`` from ``node`` while each child holds a block not ``taken``: the last node and the blocks."""
    full: list[Block] = []
    for key in keys:
        child = node.children.get(key)
        if child is None or child.block is None or child.block.block_id in taken:
            break
        full.append(child.block)
        node = child
    return node, full


def _walk_plain(node: TreeNode, tokens: Seq[int], T: int, n_full: int, lora_id: int | None, cache_salt: str | None,
                taken: set[int] | frozenset[int]) -> tuple[TreeNode, list[Block], list[BlockKey]]:
    """``_walk`` for a prompt without per-token extra ids or multimodal items, building no key: each block's tokens
    (a tuple made by ``zip``, in C) are compared with the one child's key where the node has one (a chain), else
    looked up as the plain tuple of the key's fields (a key equals it, hash and all). Keeping no new object per
    matched block is most of what matching a long prompt cost; the matched nodes' own keys are returned."""
    full: list[Block] = []
    keys: list[BlockKey] = []
    for tk in islice(zip(*repeat(iter(tokens), T)), n_full):
        children = node.children
        if len(children) == 1:
            (child,) = children.values()
            if child.key != (tk, None, lora_id, (), cache_salt):
                break
        else:
            child = children.get((tk, None, lora_id, (), cache_salt))
            if child is None:
                break
        if child.block is None or child.block.block_id in taken:
            break
        full.append(child.block)
        keys.append(child.key)
        node = child
    return node, full, keys


def _match_windows(tree: PrefixTree, windows: Seq[WindowManager], keys: list[BlockKey], n_full: int) -> Match:
    """The longest prefix every window can serve (see the module docstring).

    A sliding window of ``size`` tokens serves a prefix of ``depth`` blocks when it holds the last
    ``min(depth, ceil((size - 1) / T))`` of them (``first_needed`` of the first computed position on).
    """
    T = windows[0].tokens_per_block
    reach = [w.reach() for w in windows]
    full = [w.index for w, r in zip(windows, reach) if r is None]
    of_full = itemgetter(*full, full[0]) if full else None   # a node's full-attention blocks, always as a tuple
    slide = [(w.index, r) for w, r in zip(windows, reach) if r is not None]
    runs = [0] * len(slide)   # blocks held back to back up to the current depth, per sliding window
    several = len(windows) > 1   # else the tree keeps no ``others``
    path: list[TreeNode] = []
    node = tree.root
    best = 0
    for depth, key in enumerate(keys[:n_full], 1):
        child = node.children.get(key)
        if child is None:
            break
        row = (child.block, *child.others) if several else (child.block,)   # the node's block of every window
        if of_full is not None and None in of_full(row):
            break   # a full-attention window misses a block: no longer prefix is servable
        path.append(child)
        node = child
        servable = True
        for j, (i, need) in enumerate(slide):
            run = runs[j] + 1 if row[i] is not None else 0
            runs[j] = run
            if run < need and run < depth:
                servable = False
        if servable:
            best = depth
    lists, held = [], []
    for w in windows:
        start = w.first_needed(best * T)
        nodes = path[start:best]
        own = [n.block for n in nodes] if w.index == 0 else [n.others[w.index - 1] for n in nodes]
        held.append(own)
        lists.append([PLACEHOLDER] * start + own if start else own)
    return Match(lists[0], keys=keys, windows=lists, window_held=held)


def decide_partial(m: Match, claimed: set[int], copy_on_partial_reuse: bool) -> None:
    """Reuse a partly matching block in place when nobody else holds it and it is a leaf, else copy it."""
    p = m.partial
    if p is None:
        return
    m.in_place = p.ref_count == 0 and p.block_id not in claimed and not p.node.children
    if not m.in_place and not copy_on_partial_reuse:
        m.partial, m.partial_len = None, 0
