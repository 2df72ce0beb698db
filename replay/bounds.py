"""Hit-rate bounds of a trace, at the ledgers' block granularity and with their prefix semantics.

A request's prompt of ``n`` tokens can reuse the full blocks of ``tokens[:-1]``
(the last token is always computed) up to its first missing block; a served
request leaves the full blocks of its whole prompt cached. Both bounds serve
requests one at a time in arrival order, instantly, from a single cache:

- ``infinite``: a cache that never forgets (the Mooncake README's upper bound);
- ``pooled LRU``: one LRU cache holding the cluster's total capacity in blocks
  (device and host tiers together).
  As in the ledgers, a request's blocks are released tail first, so its prefix
  outlives its suffix.

The pooled LRU figure is a reference, not a proof: a cluster of separate caches
with concurrency can in rare cases beat plain LRU, never the infinite bound
(unless the ledgers reuse partly matching blocks, ``--partial-reuse``, which
neither bound counts).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Bounds:
    infinite_hit_rate: float
    pooled_lru_hit_rate: float
    prompt_tokens: int
    infinite_cached_tokens: int
    pooled_lru_cached_tokens: int
    pooled_lru_capacity_blocks: int


def _held_prefix_tokens(ids: Sequence[int], n_tokens: int, tokens_per_block: int, held: Container[int]) -> int:
    """Tokens of the longest prefix of ``ids`` found in ``held``, over the full blocks before the last token."""
    m = (n_tokens - 1) // tokens_per_block
    j = 0
    while j < m and ids[j] in held:
        j += 1
    return j * tokens_per_block


def infinite_cached_tokens(chains: Sequence[Sequence[int]], lengths: Sequence[int], tokens_per_block: int) -> int:
    seen: set[int] = set()
    hits = 0
    for ids, n in zip(chains, lengths):
        hits += _held_prefix_tokens(ids, n, tokens_per_block, seen)
        seen.update(ids)
    return hits


def pooled_lru_cached_tokens(chains: Sequence[Sequence[int]], lengths: Sequence[int], tokens_per_block: int,
                             capacity_blocks: int) -> int:
    if type(capacity_blocks) is not int or capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be a positive int, got {capacity_blocks!r}")
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids, n in zip(chains, lengths):
        hits += _held_prefix_tokens(ids, n, tokens_per_block, lru)
        for b in reversed(ids):      # tail first: the head ends up most recent
            if b in lru:
                lru.move_to_end(b)
            else:
                lru[b] = None
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits


def compute_bounds(chains: Sequence[Sequence[int]], lengths: Sequence[int], tokens_per_block: int,
                   capacity_blocks: int) -> Bounds:
    """Both bounds; ``chains[i]`` are ``BlockChains.chain`` ids of request i, ``lengths[i]`` its prompt tokens."""
    total = sum(lengths)
    inf = infinite_cached_tokens(chains, lengths, tokens_per_block)
    lru = pooled_lru_cached_tokens(chains, lengths, tokens_per_block, capacity_blocks)
    return Bounds(inf / total if total else 0.0, lru / total if total else 0.0, total, inf, lru, capacity_blocks)
