"""One running request as the ledger tracks it: its blocks, its known tokens, its keys and hashes."""
from __future__ import annotations

from dataclasses import dataclass, field

from worker.block import Block
from worker.block_key import ROOT_HASH, BlockHash, BlockKey, block_keys, chain_hashes
from worker.request import Request
from worker.stats import Admission


@dataclass(slots=True, eq=False)
class Sequence:
    request: Request
    blocks: list[Block]
    num_tokens: int
    admission: Admission
    tokens: list[int] = field(default_factory=list)
    """Token ids known so far; a decode step that gives no ids ends what can be stored."""
    opaque: bool = False
    """Tokens past ``len(tokens)`` exist whose ids the ledger was not told."""
    keys: list[BlockKey] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)

    def storable_blocks(self, tokens_per_block: int) -> int:
        """Full blocks whose every token id is known."""
        return min(len(self.tokens), self.num_tokens) // tokens_per_block

    def ensure_keys(self, count: int, tokens_per_block: int) -> None:
        """Compute keys and chained hashes of the first ``count`` full blocks, each only once."""
        if len(self.keys) >= count:
            return
        r = self.request
        end = count * tokens_per_block
        new = block_keys(self.tokens[:end], tokens_per_block, lora_id=r.lora_id, cache_salt=r.cache_salt,
                         mm_keys=r.mm_keys, extra_ids=None if r.extra_ids is None else r.extra_ids[:end],
                         start_block=len(self.keys))
        self.keys.extend(new)
        self.hashes.extend(chain_hashes(new, self.hashes[-1] if self.hashes else ROOT_HASH))
