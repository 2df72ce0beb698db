"""How much of a prompt each rank already holds, read from the prefix index.

A rank can reuse the KV of a prompt's leading full blocks, but never of its
last token (the step computes it), so ranks answer for ``tokens[:-1]``: the
probe hashes the full blocks of ``tokens[:-1]`` and walks that chain. A rank's
match ends at its first missing block, even if it still holds later ones
(evicting a block detaches only that block). Within a match, a block held only
on the host tier counts towards ``host_blocks``: the rank must onboard it, not
compute it.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvledger.router.index import BlockIndex
from kvledger.worker.wire.block_key import MmKey, block_hashes


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One rank's longest held prefix of a prompt (any tier), and how many of those blocks sit on the host tier.

    Frozen, since one is shared by every rank and probe with that match (``_matcher`` makes each once).
    """

    matched_blocks: int
    matched_tokens: int
    host_blocks: int

    @property
    def device_blocks(self) -> int:
        return self.matched_blocks - self.host_blocks


@functools.cache
def _matcher(tokens_per_block: int) -> Callable[[int, int], PrefixMatch]:
    """``(blocks, host_blocks) -> PrefixMatch`` at ``tokens_per_block``, each made once (a probe answers with a few
    distinct ones); one cached function per block size, called straight from the index's C-level passes."""

    @functools.lru_cache(maxsize=1 << 14)
    def match(blocks: int, host_blocks: int) -> PrefixMatch:
        return PrefixMatch(blocks, blocks * tokens_per_block, host_blocks)

    return match


def prompt_hashes(tokens: Sequence[int], tokens_per_block: int, *, lora_id: int | None = None,
                  cache_salt: str | None = None, mm_keys: Sequence[MmKey] = (),
                  extra_ids: Sequence[int] | None = None) -> list[int]:
    """The hashes a probe walks for prompt ``tokens``: the full blocks of ``tokens[:-1]``."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    return block_hashes(tokens[:-1], tokens_per_block, lora_id=lora_id, cache_salt=cache_salt,
                        mm_keys=mm_keys, extra_ids=None if extra_ids is None else extra_ids[:-1])


def match_prefix(index: BlockIndex, hashes: Sequence[int], tokens_per_block: int | None = None,
                 ) -> dict[int, PrefixMatch]:
    """Per rank holding at least the chain's first block: its match along the chain ``hashes`` (each the
    child of the one before, as ``prompt_hashes`` makes them; blocks of ``tokens_per_block`` tokens, the
    index's default when ``None``), keyed by rank (in no set order)."""
    tpb = index.tokens_per_block if tokens_per_block is None else tokens_per_block
    found = index.match(hashes, _matcher(tpb))
    if index.other_block_sizes():   # a chain of one size names no block of another; this keeps it certain
        return {r: m for r, m in found.items() if index.block_size(r) == tpb}
    return found


def match_all_sizes(index: BlockIndex, tokens: Sequence[int], hashes: Sequence[int], *, lora_id: int | None = None,
                    cache_salt: str | None = None) -> dict[int, PrefixMatch]:
    """Every rank's match for prompt ``tokens``, at whatever block size it is indexed.

    ``hashes`` are the prompt's hashes at the index's default size (the caller has them); the prompt is
    hashed once more per other block size in use.
    """
    out = match_prefix(index, hashes)
    others = index.other_block_sizes()
    if not others:
        return out
    for size in sorted(others):
        out.update(match_prefix(index, prompt_hashes(tokens, size, lora_id=lora_id, cache_salt=cache_salt), size))
    return dict(sorted(out.items()))


def probe(index: BlockIndex, tokens: Sequence[int], *, lora_id: int | None = None,
          cache_salt: str | None = None, mm_keys: Sequence[MmKey] = (),
          extra_ids: Sequence[int] | None = None) -> dict[int, PrefixMatch]:
    """Matched tokens per rank for prompt ``tokens`` (ranks matching nothing are absent)."""
    return match_prefix(index, prompt_hashes(tokens, index.tokens_per_block, lora_id=lora_id,
                                             cache_salt=cache_salt, mm_keys=mm_keys, extra_ids=extra_ids))
