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


def static_split_cached_tokens(chains: Sequence[Sequence[int]], lengths: Sequence[int], tokens_per_block: int,
                               capacities: Sequence[int]) -> int:
    """The best static split's cached tokens: requests grouped by their first block past the head every request
    shares (a document; a chat or an agent session after the system prompt or tool definitions all of them start
    with), each group kept whole on one engine; groups placed one by one on the engine with the most room left for its
    capacity, the busiest groups first (traffic times size) or the largest first, whichever holds more. Each engine
    is an LRU of its capacity in blocks that frees a request's blocks tail first, one block more per request (its
    partial tail and output) before its chain, as vLLM frees them. What a router that knew the workload in advance
    and never moved a group would reach: the offline bound a live router is measured against."""
    if not capacities or any(type(c) is not int or c < 1 for c in capacities):
        raise ValueError(f"capacities must be positive ints, got {list(capacities)!r}")
    head = _common_head(chains)
    key = [ids[min(head, len(ids) - 1)] if ids else None for ids in chains]
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(key):
        if k is not None:
            groups.setdefault(k, []).append(i)
    sizes = {g: len({b for i in idx for b in chains[i]}) for g, idx in groups.items()}

    def cached(order: list[int]) -> int:
        load = [0] * len(capacities)
        home: dict[int, int] = {}
        for g in order:
            e = max(range(len(capacities)), key=lambda k: (capacities[k] - load[k]) / capacities[k])
            home[g] = e
            load[e] += sizes[g]
        caches: list[OrderedDict[object, None]] = [OrderedDict() for _ in capacities]
        hits = 0
        for i, (ids, n) in enumerate(zip(chains, lengths)):
            if not ids:
                continue
            e = home[key[i]]
            lru = caches[e]
            hits += _held_prefix_tokens(ids, n, tokens_per_block, lru)
            for b in (("tail", i), *reversed(ids)):
                lru[b] = None
                lru.move_to_end(b)
            while len(lru) > capacities[e]:
                lru.popitem(last=False)
        return hits

    by_traffic = sorted(groups, key=lambda g: -len(groups[g]) * sizes[g])
    by_size = sorted(groups, key=lambda g: -sizes[g])
    return max(cached(by_traffic), cached(by_size))


def _common_head(chains: Sequence[Sequence[int]]) -> int:
    """Blocks every non-empty chain starts with."""
    present = [ids for ids in chains if ids]
    if not present:
        return 0
    first, n = present[0], min(map(len, present))
    head = 0
    while head < n and all(ids[head] == first[head] for ids in present):   # bounded by the shortest chain
        head += 1
    return head


def compute_bounds(chains: Sequence[Sequence[int]], lengths: Sequence[int], tokens_per_block: int,
                   capacity_blocks: int) -> Bounds:
    """Both bounds; ``chains[i]`` are ``BlockChains.chain`` ids of request i, ``lengths[i]`` its prompt tokens."""
    total = sum(lengths)
    inf = infinite_cached_tokens(chains, lengths, tokens_per_block)
    lru = pooled_lru_cached_tokens(chains, lengths, tokens_per_block, capacity_blocks)
    return Bounds(inf / total if total else 0.0, lru / total if total else 0.0, total, inf, lru, capacity_blocks)
