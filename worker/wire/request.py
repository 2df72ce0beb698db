"""A request as a rank receives it and the ledger sees it: prompt tokens, reuse constraints, retention wishes.

Plain data with no torch: the router builds it and a rank (over Ray, or in
this process) admits it, so it belongs to the wire.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvledger.worker.wire.block_key import MmKey, validate_prompt

#: Retention priorities run 0..100; blocks with no retention config get this one.
DEFAULT_PRIORITY = 35
MIN_PRIORITY, MAX_PRIORITY = 0, 100


def _check_priority(what: str, p: object) -> None:
    if not isinstance(p, int) or isinstance(p, bool) or not MIN_PRIORITY <= p <= MAX_PRIORITY:
        raise ValueError(f"{what} must be an int in {MIN_PRIORITY}..{MAX_PRIORITY}, got {p!r}")


def _check_duration(what: str, d: object) -> None:
    if d is not None and (not isinstance(d, (int, float)) or isinstance(d, bool) or d <= 0):
        raise ValueError(f"{what} must be None or a positive number of seconds, got {d!r}")


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Blocks overlapping prompt positions ``[start, end)`` get ``priority`` (for ``duration_s``, or for good)."""

    start: int
    end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or self.start < 0:
            raise ValueError(f"TokenRange.start must be a non-negative int, got {self.start!r}")
        if self.end is not None and (not isinstance(self.end, int) or self.end <= self.start):
            raise ValueError(f"TokenRange.end must be None or an int > start, got {self.end!r}")
        _check_priority("TokenRange.priority", self.priority)
        _check_duration("TokenRange.duration_s", self.duration_s)


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """Retention priorities by prompt position, and for blocks written while decoding (TensorRT-LLM's)."""

    ranges: Sequence[TokenRange] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        for r in self.ranges:
            if not isinstance(r, TokenRange):
                raise TypeError(f"RetentionConfig.ranges must hold TokenRange items, got {type(r).__name__}")
        _check_priority("RetentionConfig.decode_priority", self.decode_priority)
        _check_duration("RetentionConfig.decode_duration_s", self.decode_duration_s)

    def for_block(self, lo: int, hi: int, prompt_len: int) -> tuple[int, float | None]:
        """Priority and duration of the block covering positions ``[lo, hi)``.

        A block past the prompt is a decode block. Otherwise the highest priority
        among the ranges that overlap it wins; no range means the default.
        """
        if lo >= prompt_len:
            return self.decode_priority, self.decode_duration_s
        best: tuple[int, float | None] | None = None
        for r in self.ranges:
            if r.start < hi and (r.end is None or lo < r.end) and (best is None or r.priority > best[0]):
                best = (r.priority, r.duration_s)
        return best if best is not None else (DEFAULT_PRIORITY, None)


@dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is chosen. The default is greedy (the arg-max, bit for bit what it always was);
    otherwise logits are divided by ``temperature``, cut to the ``top_k`` most likely and to the smallest set
    whose probability reaches ``top_p``, and sampled with a generator seeded by ``seed`` (the same seed, the same
    tokens). ``logprobs``: also return each chosen token's log-probability under the model, and that many of the
    most likely tokens' (``None``: none)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1): no cut."""
    seed: int | None = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in 0..100, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if type(self.top_k) is not int or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1, got {self.top_k!r}")
        if self.seed is not None and type(self.seed) is not int:
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.logprobs is not None and (type(self.logprobs) is not int or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an int in 0..20, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


@dataclass(frozen=True, slots=True)
class Request:
    """One generation request: its prompt and what its KV may be shared with.

    Checked once, when it is made (``__post_init__`` raises naming the first bad
    field), and never changed after: whoever holds a ``Request`` holds a valid
    one, so the ledger, the scheduler and the engine take it as it is. Its
    ``tokens`` list is the request's own; nobody mutates it.
    """

    request_id: int
    tokens: list[int]
    max_new_tokens: int = 0
    lora_id: int | None = None
    cache_salt: str | None = None
    mm_keys: Sequence[MmKey] = ()
    extra_ids: list[int] | None = None
    retention: RetentionConfig | None = None
    num_draft_tokens: int = 0
    """Speculative tokens each decode step proposes besides the one it samples: a step adds ``1 + num_draft_tokens``
    tokens, and the budgets count them (TensorRT-LLM's draft tokens); the rejected ones are rewound."""
    beam_width: int = 1
    """Beams of a beam search: they share the prompt's full blocks (its last block too when the prompt ends on a
    block boundary) and each holds its own blocks past them; block budgets count every beam."""
    sampling: Sampling = GREEDY

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, int) or isinstance(self.request_id, bool):
            raise TypeError(f"request_id must be an int, got {self.request_id!r}")
        validate_prompt(self.tokens, self.lora_id, self.cache_salt, self.mm_keys, self.extra_ids)
        if len(self.tokens) == 0:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        if type(self.num_draft_tokens) is not int or self.num_draft_tokens < 0:
            raise ValueError(f"request {self.request_id}: num_draft_tokens must be an int >= 0, "
                             f"got {self.num_draft_tokens!r}")
        if type(self.beam_width) is not int or self.beam_width < 1:
            raise ValueError(f"request {self.request_id}: beam_width must be an int >= 1, got {self.beam_width!r}")
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"request {self.request_id}: sampling must be a Sampling, got {type(self.sampling).__name__}")
        if self.retention is not None and not isinstance(self.retention, RetentionConfig):
            raise TypeError(f"request {self.request_id}: retention must be a RetentionConfig, got {type(self.retention).__name__}")
