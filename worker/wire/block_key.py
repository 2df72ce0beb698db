"""What a block's KV depends on, and the chained hash that names a whole prefix.

Two blocks stand in for each other only when every constraint field (LoRA id,
cache salt, per-token extra ids, multimodal keys) is equal; their tokens then
match by longest common prefix. The hash is ``blake2b(parent_hash, key)``
truncated to an unsigned 64-bit integer, so one hash names the prefix up to and
including its block, and is the same in every process (never Python's ``hash``).
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice, repeat
from typing import NamedTuple, NewType

import msgpack

BlockHash = NewType("BlockHash", int)

#: Parent of a prompt's first block; versioned so a change of key layout changes every hash.
ROOT_HASH = BlockHash(int.from_bytes(hashlib.blake2b(b"kvledger/block-hash/v1", digest_size=8).digest(), "big"))


@dataclass(frozen=True, slots=True)
class MmKey:
    """A multimodal item (image, audio) occupying prompt positions ``[start, start + length)``."""

    content_hash: str
    start: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.content_hash, str) or not self.content_hash:
            raise ValueError(f"MmKey.content_hash must be a non-empty str, got {self.content_hash!r}")
        if not _is_int(self.start) or self.start < 0 or not _is_int(self.length) or self.length <= 0:
            raise ValueError(f"MmKey needs start >= 0 and length > 0, got start={self.start!r} length={self.length!r}")


class BlockKey(NamedTuple):
    """Everything the KV of one block depends on besides the blocks before it.

    A tuple, so that the prefix tree's lookups hash and compare keys in C: a key is looked up several times
    (matched, stored, pruned), and a Python ``__hash__``/``__eq__`` per lookup was a large part of matching a long
    prompt. Like any tuple it equals a plain tuple of the same fields; the tree only ever holds keys. Its hash is
    Python's, so a key that crossed a process hashes anew there.
    """

    tokens: tuple[int, ...]
    extra_ids: tuple[int, ...] | None = None
    lora_id: int | None = None
    mm_keys: tuple[tuple[str, int], ...] = ()
    cache_salt: str | None = None

    def same_constraints(self, other: BlockKey) -> bool:
        """Whether ``other`` may stand in for this key once its tokens match."""
        return (self.lora_id == other.lora_id and self.cache_salt == other.cache_salt
                and self.mm_keys == other.mm_keys and self.extra_ids == other.extra_ids)

    def partial_match(self, other: BlockKey, limit: int) -> int:
        """Tokens (at most ``limit``) that ``other`` can supply for this key: 0 unless constraints agree.

        Per-token extra ids must agree on the matched tokens only.
        """
        if (self.lora_id != other.lora_id or self.cache_salt != other.cache_salt
                or self.mm_keys != other.mm_keys):
            return 0
        n = 0
        a, b = self.tokens, other.tokens
        ea, eb = self.extra_ids, other.extra_ids
        stop = min(limit, len(a), len(b))
        while n < stop and a[n] == b[n] and (ea is None) == (eb is None) and (ea is None or ea[n] == eb[n]):
            n += 1
        return n


_PACKER = msgpack.Packer()


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _unsigned(ints: list[int]) -> bool:
    """Whether no int is negative (or past 64 bits, which the slow path then allows): ``array`` checks in C, at
    twice the speed of ``min``."""
    try:
        array("Q", ints)
    except OverflowError:
        return False
    return True


def chain_hash(parent: int, key: BlockKey) -> BlockHash:
    """The hash of ``key`` following the prefix named by ``parent``."""
    return chain_hashes((key,), parent)[0]


def validate_prompt(tokens: Sequence[int], lora_id: int | None, cache_salt: str | None,
                    mm_keys: Sequence[MmKey], extra_ids: Sequence[int] | None) -> None:
    """Raise ``TypeError``/``ValueError`` naming the first bad field of a prompt."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}")
    if not (tokens and type(tokens) is list and list(map(type, tokens)).count(int) == len(tokens)
            and _unsigned(tokens)):   # the fast check, in C (counting the types beats a set of them)
        for i, t in enumerate(tokens):
            if not _is_int(t) or t < 0:
                raise ValueError(f"tokens[{i}] must be a non-negative int, got {t!r}")
    if lora_id is not None and (not _is_int(lora_id) or lora_id < 0):
        raise ValueError(f"lora_id must be None or a non-negative int, got {lora_id!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be None or a str, got {type(cache_salt).__name__}")
    for m in mm_keys:
        if not isinstance(m, MmKey):
            raise TypeError(f"mm_keys must hold MmKey items, got {type(m).__name__}")
    if extra_ids is not None:
        if len(extra_ids) != len(tokens):
            raise ValueError(f"extra_ids must have one id per token: {len(extra_ids)} ids for {len(tokens)} tokens")
        for i, e in enumerate(extra_ids):
            if not _is_int(e):
                raise ValueError(f"extra_ids[{i}] must be an int, got {e!r}")


def block_keys(tokens: Sequence[int], tokens_per_block: int, *, lora_id: int | None = None,
               cache_salt: str | None = None, mm_keys: Sequence[MmKey] = (),
               extra_ids: Sequence[int] | None = None, start_block: int = 0,
               include_partial: bool = False) -> list[BlockKey]:
    """Keys of the blocks of ``tokens`` from ``start_block`` on; the trailing partial block only if asked."""
    n, T = len(tokens), tokens_per_block
    if not mm_keys and extra_ids is None:   # the common case, keys built in C: each block's token tuple by ``zip``
        start = start_block * T
        new = tuple.__new__
        keys = [new(BlockKey, (t, None, lora_id, (), cache_salt))
                for t in zip(*repeat(islice(tokens, start, None) if start else iter(tokens), T))]
        if include_partial and n % T and start < n:
            keys.append(BlockKey(tuple(tokens[n - n % T:]), None, lora_id, (), cache_salt))
        return keys
    end = -(-n // T) if include_partial else n // T
    keys = []
    for b in range(start_block, end):
        lo, hi = b * T, min(n, (b + 1) * T)
        mm = tuple((m.content_hash, lo - m.start) for m in mm_keys if m.start < hi and lo < m.start + m.length)
        keys.append(BlockKey(tuple(tokens[lo:hi]), None if extra_ids is None else tuple(extra_ids[lo:hi]),
                             lora_id, mm, cache_salt))
    return keys


def chain_hashes(keys: Sequence[BlockKey], parent: int = ROOT_HASH) -> list[BlockHash]:
    """Chained hashes of consecutive keys following ``parent``: each ``blake2b`` (8 bytes, big-endian) of the
    msgpack of ``(parent, tokens, extra_ids, lora_id, mm_keys, cache_salt)``."""
    pack, blake2b, from_bytes = _PACKER.pack, hashlib.blake2b, int.from_bytes   # hashing every block: hot
    out = []
    for key in keys:
        parent = from_bytes(blake2b(pack((parent, *key)), digest_size=8).digest(), "big")
        out.append(parent)
    return out


def block_hashes(tokens: Sequence[int], tokens_per_block: int, *, lora_id: int | None = None,
                 cache_salt: str | None = None, mm_keys: Sequence[MmKey] = (),
                 extra_ids: Sequence[int] | None = None) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``tokens``: what ranks announce and the router probes."""
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block must be positive, got {tokens_per_block}")
    validate_prompt(tokens, lora_id, cache_salt, mm_keys, extra_ids)
    return chain_hashes(block_keys(tokens, tokens_per_block, lora_id=lora_id, cache_salt=cache_salt,
                                   mm_keys=mm_keys, extra_ids=extra_ids))
