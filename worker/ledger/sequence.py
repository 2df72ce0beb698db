"""One running request as the ledger tracks it: its blocks, its known tokens, its keys and hashes.

The sequence keeps its own block lists (every window's, every beam's): it grows, slides and rewinds them and says
what it holds; the window managers supply and release the blocks, so no caller reaches into the lists."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvledger.worker.ledger.block import PLACEHOLDER, Block
from kvledger.worker.ledger.budget import beam_tails, ceil_div, step_blocks
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

    def held_in(self, window: int) -> tuple[list[Block], ...]:
        """The block lists this sequence holds references through in ``window``: in window 0 every beam's."""
        return self.holders() if window == 0 else (self.windows[window],)

    def held_lists(self) -> tuple[list[Block], ...]:
        """Every block this sequence holds, one list per window (window 0's beams' own after beam 0's)."""
        blocks = self.blocks if not self.beams else [b for own in self.holders() for b in own]
        return (blocks, *self.windows[1:])

    def grow(self, window: int, blocks: list[Block]) -> None:
        """Append newly allocated ``blocks`` to window ``window``'s list (beam 0's in window 0)."""
        self.windows[window].extend(blocks)

    def grow_beams(self, blocks: Seq[list[Block]]) -> None:
        """Append ``blocks[i]`` to beam ``i + 1``'s own blocks."""
        for own, new in zip(self.beams, blocks):
            own.extend(new)

    def slide(self, window: int, end: int) -> list[Block]:
        """Put placeholders at window ``window``'s positions before ``end`` not slid yet; returns what they replace
        (for the window to release)."""
        start = self.slid[window]
        if end <= start:
            return []
        blocks = self.windows[window]
        out = blocks[start:end]
        blocks[start:end] = [PLACEHOLDER] * (end - start)
        self.slid[window] = end
        return out

    def rewindable(self, tokens_per_block: int) -> int:
        """Tokens that may be rewound: generated past the prompt, the stored blocks and a sliding window's floor."""
        return self.num_tokens - max(len(self.request.tokens), self.stored * tokens_per_block, self.floor)

    def rewind(self, n: int, tokens_per_block: int) -> list[list[Block]]:
        """Drop the last ``n`` tokens and the block positions past the new end; returns per window the blocks
        dropped (window 0's beams' own after beam 0's), for the windows to release."""
        T = tokens_per_block
        self.num_tokens -= n
        del self.tokens[self.num_tokens:]
        keep = ceil_div(self.num_tokens, T)
        full = self.num_tokens // T
        assert self.stored <= full, f"request {self.request.request_id}: a stored block would be rewound"
        del self.keys[full:], self.hashes[full:]
        dropped, self.blocks[keep:] = self.blocks[keep:], []
        own_keep = keep - len(self.request.tokens) // T
        for own in self.beams:
            dropped += own[own_keep:]
            del own[own_keep:]
        out = [dropped]
        for blocks in self.windows[1:]:
            out.append(blocks[keep:])
            del blocks[keep:]
        return out

    def chunk_blocks(self, end: int, tokens_per_block: int) -> tuple[int, int]:
        """Blocks beam 0 and the other beams' tails still need for a context chunk ending at ``end``; blocks a
        trimmed chunk left allocated count as had."""
        need = max(0, ceil_div(end, tokens_per_block) - len(self.blocks))
        r = self.request
        return need, 0 if not self.beams or self.beams[0] else beam_tails(len(r.tokens), end, r.beam_width,
                                                                            tokens_per_block)

    def step_blocks(self, tokens_per_block: int, two_steps_lookahead: bool) -> int:
        """Blocks one window of this decoding sequence allocates in its next step (two, looking ahead)."""
        r = self.request
        return step_blocks(self.num_tokens, len(self.blocks), r.num_draft_tokens, r.beam_width, tokens_per_block,
                           two_steps_lookahead)

    def decoded(self, n: int, tokens: Seq[int] | None) -> None:
        """Count ``n`` decoded tokens; their ids, when given and the sequence is still storable, are kept."""
        self.decoding = True
        if tokens is None or self.opaque or self.request.extra_ids is not None:
            self.opaque = True
        else:
            self.add_tokens(tokens)
        self.num_tokens += n

    def block_ids(self, beam: int, window: int, tokens_per_block: int) -> list[int]:
        """Block ids of one beam (window 0) or of one window, in sequence order (``KVCacheManager.get_block_ids``)."""
        if window != 0:
            if type(window) is not int or not 0 < window < len(self.windows):
                raise ValueError(f"get_block_ids: window must be an int in 0..{len(self.windows) - 1}, got {window!r}")
            return [b.block_id for b in self.windows[window]]
        if beam == 0:
            return [b.block_id for b in self.blocks]
        if type(beam) is not int or not 0 < beam < self.request.beam_width:
            raise ValueError(f"get_block_ids: beam must be an int in 0..{self.request.beam_width - 1}, got {beam!r}")
        return [b.block_id for b in self.beam_rows(tokens_per_block)[beam]]

    def arrange_slots(self, start: int, slots: Seq[int], window: int) -> None:
        """Trade the slots of this sequence's own unstored blocks (``KVCacheManager.arrange_slots``); raises
        ``ValueError``, changing nothing, for any other."""
        rid = self.request.request_id
        if type(window) is not int or not 0 <= window < len(self.windows):
            raise ValueError(f"arrange_slots: window must be an int in 0..{len(self.windows) - 1}, got {window!r}")
        blocks = self.windows[window][start:start + len(slots)] if type(start) is int and start >= 0 else None
        if blocks is None or len(blocks) != len(slots) or sorted(b.slot for b in blocks) != sorted(slots):
            raise ValueError(f"arrange_slots: slots must be an order of the slots of request {rid}'s blocks "
                             f"{start}..{start + len(slots) - 1}, got start={start!r}, slots={list(slots)!r}")
        if self.beams or any(b is PLACEHOLDER or b.ref_count != 1 or b.node is not None for b in blocks):
            raise ValueError(f"arrange_slots: request {rid}'s blocks {start}.. are shared or stored")
        for b, slot in zip(blocks, slots):
            b.slot = slot

    def step_tokens(self) -> int:
        """Tokens the next step computes: the current context chunk's, or ``1 + num_draft_tokens`` decoding."""
        return 1 + self.request.num_draft_tokens if self.decoding else self.num_tokens - self.chunk_start

    def trim_chunk(self, n: int) -> None:
        """End the current context chunk ``n`` tokens earlier; they go to the next chunk, the blocks stay."""
        self.num_tokens -= n

    def admit_chunk(self, start: int, end: int) -> None:
        """The next context chunk computes prompt positions ``start..end-1``."""
        self.chunk_start, self.num_tokens = start, end

    def window_slots(self, start: int, end: int) -> tuple[list[int], ...]:
        """Each window's slots of the block positions ``start..end-1`` it holds (placeholders left out)."""
        return tuple([b.slot for b in blocks[start:end] if b is not PLACEHOLDER] for blocks in self.windows)

    def slot_rows(self, tokens_per_block: int) -> list[list[int]]:
        """Primary pool slots of every beam's row, beam 0 first."""
        if self.beams:
            return [[b.slot for b in row] for row in self.beam_rows(tokens_per_block)]
        return [[b.slot for b in self.blocks]]

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
