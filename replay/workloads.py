"""Named workloads that tell routers apart when the caches are full (``--trace docs|powerlaw|unique``).

Each is a seeded Mooncake-shaped trace (``replay.trace``) in blocks of the
bench's block size:

- ``docs``: shared documents, each asked several questions. Every document's first question comes first (in
  order), the rest in random order: a router must spread the documents so that each engine's share fits its cache.
- ``powerlaw``: shared prefixes whose popularity falls as a power law (Zipf, exponent 1.1), each request a prefix
  and a question of its own: the head is hot, the tail barely repeats.
- ``unique``: the control, nothing shared at all: a router that weighs reuse must still balance like round robin.

Requests arrive as a Poisson stream (``rate_per_s``); sizes are in tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvledger.replay.trace import Trace, TraceRequest


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What the named workloads are built from."""

    block_size: int = 32
    prefixes: int = 12
    """Documents (``docs``) or shared prefixes (``powerlaw``)."""
    prefix_tokens: int = 800
    """Tokens of one document or shared prefix (whole blocks)."""
    questions: int = 10
    """``docs``: questions per document; ``powerlaw`` and ``unique``: requests per prefix, on average."""
    question_tokens: int = 48
    output_tokens: int = 4
    rate_per_s: float = 15.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("block_size", "prefixes", "prefix_tokens", "questions", "question_tokens"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if type(self.output_tokens) is not int or self.output_tokens < 0:
            raise ValueError(f"output_tokens must be an int >= 0, got {self.output_tokens!r}")
        if not self.rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got {self.rate_per_s!r}")


class _Ids:
    """Fresh block ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, k: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + k))
        self.next += k
        return out


def _requests(c: WorkloadConfig, rng: random.Random, prompts: list[tuple[int, ...]], name: str) -> Trace:
    """``prompts`` (the leading blocks of each request, in order) each followed by a question of its own, arriving as
    a Poisson stream."""
    ids, B = _Ids(), c.block_size
    ids.next = 1 + max(max(p) for p in prompts)
    shared = c.prefix_tokens // B * B
    q_blocks = -(-c.question_tokens // B)
    out, t = [], 0.0
    for p in prompts:
        length = shared + c.question_tokens
        out.append(TraceRequest(t, length, c.output_tokens, p + ids.take(q_blocks)))
        t += rng.expovariate(c.rate_per_s)
    return Trace(f"{name}(seed={c.seed})", B, out)


def documents(c: WorkloadConfig) -> Trace:
    """``docs`` (module docstring)."""
    rng, ids = random.Random(c.seed), _Ids()
    docs = [ids.take(c.prefix_tokens // c.block_size) for _ in range(c.prefixes)]
    rest = [d for d in docs for _ in range(c.questions - 1)]
    rng.shuffle(rest)
    return _requests(c, rng, docs + rest, "docs")


def power_law(c: WorkloadConfig, exponent: float = 1.1) -> Trace:
    """``powerlaw`` (module docstring)."""
    rng, ids = random.Random(c.seed), _Ids()
    heads = [ids.take(c.prefix_tokens // c.block_size) for _ in range(c.prefixes)]
    weights = [1.0 / (i + 1) ** exponent for i in range(c.prefixes)]
    return _requests(c, rng, rng.choices(heads, weights, k=c.prefixes * c.questions), "powerlaw")


def unique(c: WorkloadConfig) -> Trace:
    """``unique`` (module docstring): prompts of ``prefix_tokens`` each, none shared."""
    rng, ids = random.Random(c.seed), _Ids()
    return _requests(c, rng, [ids.take(c.prefix_tokens // c.block_size) for _ in range(c.prefixes * c.questions)],
                     "unique")


WORKLOADS = {"docs": documents, "powerlaw": power_law, "unique": unique}


def workload(name: str, config: WorkloadConfig) -> Trace:
    """The named workload; ``ValueError`` naming the choices for an unknown one."""
    make = WORKLOADS.get(name)
    if make is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return make(config)


__all__ = ["WORKLOADS", "WorkloadConfig", "documents", "power_law", "unique", "workload"]
