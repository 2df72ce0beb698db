"""Byte-level tokenizer for the reference engine: no vocabulary file, nothing to download.

Ids 0..255 are the UTF-8 bytes of the text; ``BOS``, ``EOS`` and ``PAD`` sit just
above them and the rest of ``VOCAB_SIZE`` is reserved. ``encode`` does not
prepend ``BOS`` unless asked: the ids of a text are exactly its bytes, so a text
prefix is a token prefix and prompts that share a prefix share cache blocks.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass

VOCAB_SIZE = 512
BOS, EOS, PAD = 256, 257, 258
NUM_BYTES = 256


def encode(text: str, *, add_bos: bool = False) -> list[int]:
    """UTF-8 bytes of ``text`` as ids (``add_bos`` puts ``BOS`` first, e.g. to make an empty text a valid prompt)."""
    if not isinstance(text, str):
        raise TypeError(f"encode takes a str, got {type(text).__name__}; decode bytes first or pass token ids directly")
    try:
        ids = list(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise ValueError(f"encode: the text has no UTF-8 form ({e.reason} at index {e.start}); "
                         "lone surrogates are not text") from None
    return [BOS, *ids] if add_bos else ids


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``: ids at or above 256 (special or reserved) are skipped, broken UTF-8 becomes U+FFFD."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"decode takes an iterable of int token ids, got {type(ids).__name__}")
    out = bytearray()
    for i, tok in enumerate(ids):
        if isinstance(tok, bool):
            raise TypeError(f"decode: id #{i} is a bool ({tok!r}); token ids are ints in 0..{VOCAB_SIZE - 1}")
        try:
            t = operator.index(tok)
        except TypeError:
            raise TypeError(f"decode: id #{i} is {type(tok).__name__} ({tok!r}); "
                            f"token ids are ints in 0..{VOCAB_SIZE - 1}") from None
        if not 0 <= t < VOCAB_SIZE:
            raise ValueError(f"decode: id #{i} is {t}, outside the vocabulary 0..{VOCAB_SIZE - 1}")
        if t < NUM_BYTES:
            out.append(t)
    return out.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """This tokenizer as an object a rank hands the router in its ``RankInfo``, so the router tokenizes text
    prompts and decodes answers the rank's way without importing the engine."""

    name: str = "bytes"
    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return encode(text)   # it has no special tokens

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)
