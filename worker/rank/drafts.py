"""Draft tokens by prompt lookup: speculative decoding with no draft model, as vLLM's n-gram proposer drafts.

A sequence that repeats itself (code, quotes, a document asked about) is
likely to go on as it went on before: the tokens that followed the latest
earlier occurrence of its last few tokens are proposed as the next ones. The
model then checks every draft in one step, and what it rejects is rewound.
"""
from __future__ import annotations

from collections.abc import Sequence

#: The longest and the shortest suffix looked up (vLLM's ``prompt_lookup_max`` / ``prompt_lookup_min``).
LOOKUP_MAX, LOOKUP_MIN = 3, 1


def propose_drafts(tokens: Sequence[int], k: int, lookup_max: int = LOOKUP_MAX,
                   lookup_min: int = LOOKUP_MIN) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens`` of
    ``lookup_max`` down to ``lookup_min`` tokens; none when no such suffix occurs before."""
    n_tokens = len(tokens)
    if k < 1:
        return []
    for n in range(min(lookup_max, n_tokens - 1), lookup_min - 1, -1):
        suffix = list(tokens[n_tokens - n:])
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start] == suffix[0] and list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []
