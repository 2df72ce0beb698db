"""Prompts as text, for routers that take no token ids (sglang-router's ``cache_aware`` refuses them).

Each trace block id stands for ``chars`` deterministic lower-case characters,
so two prompts share text exactly where their block ids agree. A byte-level
tokenizer (the suite's tiny checkpoint: ``<s>`` then one token per character)
turns that into whole shared blocks; a subword tokenizer shares the same text
prefix, give or take the token at each block's edge.
"""
from __future__ import annotations

import random

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def block_text(block_id: int, chars: int) -> str:
    """The ``chars`` characters trace block ``block_id`` stands for: words of 2 to 7 letters, one space apart."""
    rng = random.Random(block_id * 7919 + 1)
    out: list[str] = []
    while len(out) < chars:   # bounded: every round adds at least 3 characters
        out.extend(rng.choice(LETTERS) for _ in range(rng.randint(2, 7)))
        out.append(" ")
    return "".join(out[:chars])


def prompt_text(ids: tuple[int, ...], length: int, chars: int) -> str:
    """A request's text: its blocks' characters, cut to ``length``."""
    return "".join(block_text(i, chars) for i in ids)[:length]


__all__ = ["block_text", "prompt_text"]
