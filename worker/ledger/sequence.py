"""One running request as the ledger tracks it: its blocks, its known tokens, its keys and hashes."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvledger.worker.ledger.block import Block
from kvledger.worker.ledger.stats import Admission
from kvledger.worker.wire.block_key import ROOT_HASH, BlockHash, BlockKey, block_keys, chain_hashes
from kvledger.worker.wire.request import Request


@dataclass(slots=True, eq=False)
class Sequence:
    request: Request
    blocks: list[Block]
    num_tokens: int
    admission: Admission
    tokens: list[int] = field(default_factory=list)
    """Token ids known so far; a decode step that gives no ids ends what can be stored. The request's own prompt list
    until the first decode step's ids are added (``add_tokens``): a copy made at admission, and freed at the end,
    touches every id of a long prompt (freeing it cost about 30 ns per block of a sequence's free here)."""
    opaque: bool = False
    """Tokens past ``len(tokens)`` exist whose ids the ledger was not told."""
    keys: list[BlockKey] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    stored: int = 0
    """Leading blocks known to sit in the prefix tree as themselves (held, so they stay there)."""
    chunk_start: int = 0
    """First prompt position of the current context chunk, which ends at ``num_tokens``."""
    decoding: bool = False
    """The first decode step was taken: no context chunk is left."""
    beams: tuple[list[Block], ...] = ()
    """Own blocks of beams 1.. of a beam search (``blocks`` is beam 0's row); each beam's row is
    ``blocks[:len(prompt) // tokens_per_block]`` (shared) followed by its own blocks."""
    windows: tuple[list[Block], ...] = ()
    """The block list of every attention window, ``blocks`` first (window 0); all as long as ``blocks``, a sliding
    window's with ``PLACEHOLDER`` where its blocks slid out (or were never needed)."""
    sliding: tuple[int | None, ...] = ()
    """Each window's size in tokens (``None``: full attention), as ``windows``."""
    slid: list[int] = field(default_factory=list)
    """Per window, the leading block positions no longer held (placeholders from the start up to there)."""
    floor: int = 0
    """Fewest tokens the sequence can be rewound to: a sliding window released what queries before it needed."""

    def beam_rows(self, tokens_per_block: int) -> list[list[Block]]:
        """Every beam's blocks in order, beam 0 first."""
        shared = self.blocks[:len(self.request.tokens) // tokens_per_block]
        return [self.blocks, *(shared + own for own in self.beams)]

    def holders(self) -> tuple[list[Block], ...]:
        """The block lists this sequence holds a reference through, one per appearance."""
        return (self.blocks, *self.beams)

    def add_tokens(self, tokens: Seq[int]) -> None:
        """Append known token ids, the first time into a copy of the prompt (the request's list stays as given)."""
        if self.tokens is self.request.tokens:
            self.tokens = [*self.tokens, *tokens]
        else:
            self.tokens.extend(tokens)

    def storable_blocks(self, tokens_per_block: int) -> int:
        """Full blocks whose every token id is known and whose every token's KV is written.

        The last counted token's KV is not: it is the one the next step computes
        (TensorRT-LLM stores ``tokens[:-1]`` at release for this reason), so an
        engine that counts its final sampled token never publishes a block with
        an unwritten slot. The prompt's own blocks are stored after prefill
        (``store_context_blocks``), when every prompt token's KV is written.
        """
        return (min(len(self.tokens), self.num_tokens) - 1) // tokens_per_block

    def ensure_keys(self, count: int, tokens_per_block: int) -> None:
        """Compute keys and chained hashes of the first ``count`` full blocks, each only once."""
        if len(self.keys) < count:
            r = self.request
            end = count * tokens_per_block
            self.keys.extend(block_keys(self.tokens[:end], tokens_per_block, lora_id=r.lora_id,
                                        cache_salt=r.cache_salt, mm_keys=r.mm_keys,
                                        extra_ids=None if r.extra_ids is None else r.extra_ids[:end],
                                        start_block=len(self.keys)))
        done = len(self.hashes)
        if done < count:
            self.hashes.extend(chain_hashes(self.keys[done:count], self.hashes[-1] if done else ROOT_HASH))
