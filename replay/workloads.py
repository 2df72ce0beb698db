"""Named workloads that tell routers apart when the caches are full (``--trace docs|powerlaw|conversation|agents|unique``).

Each is a seeded Mooncake-shaped trace (``replay.trace``) in blocks of the
bench's block size:

- ``docs``: shared documents, each asked several questions. Every document's first question comes first (in
  order), the rest in random order: a router must spread the documents so that each engine's share fits its cache.
- ``powerlaw``: shared prefixes whose popularity falls as a power law (Zipf, exponent 1.1), each request a prefix
  and a question of its own: the head is hot, the tail barely repeats.
- ``conversation``: multi-turn chats from Mooncake's conversation trace, scaled to the engines: the ``prefixes``
  conversations of the most turns (their first ``questions`` turns each), each of the trace's 512-token blocks one
  block of ``block_size`` tokens, a prompt cut at ``max_prompt_tokens``, the turns in the trace's order. Every turn
  extends an earlier one of its chat; a router must keep each chat where its last turn is.
- ``agents``: tool-calling agent sessions (Mooncake's tool-agent trace is not published with the traces this
  project holds; this is its shape): every session starts with the same tool definitions (``prefix_tokens``),
  then a task of its own, and each of its ``questions`` turns appends the last answer and the tool's output
  (``question_tokens``) to the turn before. The sessions interleave, each one's turns in order.
- ``unique``: the control, nothing shared at all: a router that weighs reuse must still balance like round robin.

Requests arrive as a Poisson stream (``rate_per_s``); sizes are in tokens.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvledger.replay.trace import MOONCAKE_BLOCK_SIZE, Trace, TraceRequest, load_mooncake

#: Where a checkout's shared data keeps Mooncake's conversation trace (beside the repository, as the README's
#: ``kvledger bench`` commands name it).
CONVERSATION_TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What the named workloads are built from."""

    block_size: int = 32
    prefixes: int = 12
    """Documents (``docs``), shared prefixes (``powerlaw``), conversations (``conversation``) or sessions
    (``agents``)."""
    prefix_tokens: int = 800
    """Tokens of one document or shared prefix (whole blocks); ``agents``: of the tool definitions every session
    starts with."""
    questions: int = 10
    """``docs``: questions per document; ``powerlaw`` and ``unique``: requests per prefix, on average;
    ``conversation`` and ``agents``: turns per conversation or session (at most)."""
    question_tokens: int = 48
    """A question's tokens; ``agents``: a task's, and what each turn adds."""
    output_tokens: int = 4
    rate_per_s: float = 15.0
    seed: int = 0
    max_prompt_tokens: int = 1920
    """``conversation``: a longer turn is cut to its first whole blocks within this (the bench's tiny checkpoint
    takes 2048 tokens with the output)."""
    conversation_trace: str | None = None
    """``conversation``'s Mooncake trace (default ``CONVERSATION_TRACE``)."""

    def __post_init__(self) -> None:
        for name in ("block_size", "prefixes", "prefix_tokens", "questions", "question_tokens", "max_prompt_tokens"):
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
    return _arriving(c, rng, [(shared + c.question_tokens, p + ids.take(q_blocks)) for p in prompts], name)


def _arriving(c: WorkloadConfig, rng: random.Random, prompts: list[tuple[int, tuple[int, ...]]], name: str) -> Trace:
    """``(tokens, blocks)`` prompts, in order, as a Poisson stream of requests of ``output_tokens``."""
    out, t = [], 0.0
    for length, blocks in prompts:
        out.append(TraceRequest(t, length, c.output_tokens, blocks))
        t += rng.expovariate(c.rate_per_s)
    return Trace(f"{name}(seed={c.seed})", c.block_size, out)


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


def conversation(c: WorkloadConfig) -> Trace:
    """``conversation`` (module docstring). A turn belongs to the chat of the earlier request holding its deepest
    shared block, once it shares more than the first block (the trace's system prompt, which every request
    shares)."""
    path = Path(c.conversation_trace) if c.conversation_trace is not None else CONVERSATION_TRACE
    if not path.is_file():
        raise ValueError(f"conversation_trace: {str(path)!r} does not exist (Mooncake's conversation_trace.jsonl)")
    reqs = load_mooncake(path).requests
    first_seen: dict[int, int] = {}
    chat_of: list[int] = []
    for i, r in enumerate(reqs):
        depth = 0
        while depth < len(r.hash_ids) and r.hash_ids[depth] in first_seen:
            depth += 1
        chat_of.append(chat_of[first_seen[r.hash_ids[depth - 1]]] if depth > 1 else i)
        for h in r.hash_ids:
            first_seen.setdefault(h, i)
    turns: dict[int, list[int]] = {}
    for i, chat in enumerate(chat_of):
        turns.setdefault(chat, []).append(i)
    chats = sorted(turns.values(), key=lambda t: (-len(t), t[0]))[:c.prefixes]
    most = c.max_prompt_tokens // c.block_size
    picked = sorted(i for t in chats for i in t[:c.questions])
    return _arriving(c, random.Random(c.seed), [_scaled(reqs[i], c.block_size, most) for i in picked], "conversation")


def _scaled(r: TraceRequest, block_size: int, most: int) -> tuple[int, tuple[int, ...]]:
    """A trace request's prompt with each of its 512-token blocks one of ``block_size`` tokens (its last, partial
    block in proportion), cut at ``most`` blocks."""
    blocks = r.hash_ids[:most]
    if len(blocks) < len(r.hash_ids):
        return len(blocks) * block_size, blocks
    last = r.input_length - (len(blocks) - 1) * MOONCAKE_BLOCK_SIZE
    return (len(blocks) - 1) * block_size + max(1, -(-last * block_size // MOONCAKE_BLOCK_SIZE)), blocks


def agents(c: WorkloadConfig) -> Trace:
    """``agents`` (module docstring)."""
    rng, ids, B = random.Random(c.seed), _Ids(), c.block_size
    tools = ids.take(c.prefix_tokens // B)
    step = -(-c.question_tokens // B)
    sessions = [tools + ids.take(step) for _ in range(c.prefixes)]
    left = [c.questions] * c.prefixes
    prompts = []
    while any(left):   # bounded: every round takes one turn of one session
        s = rng.choice([i for i, n in enumerate(left) if n])
        prompts.append((len(sessions[s]) * B, sessions[s]))
        sessions[s] += ids.take(step)
        left[s] -= 1
    return _arriving(c, rng, prompts, "agents")


WORKLOADS = {"docs": documents, "powerlaw": power_law, "unique": unique, "conversation": conversation,
             "agents": agents}


def workload(name: str, config: WorkloadConfig) -> Trace:
    """The named workload; ``ValueError`` naming the choices for an unknown one."""
    make = WORKLOADS.get(name)
    if make is None:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    return make(config)


__all__ = ["CONVERSATION_TRACE", "WORKLOADS", "WorkloadConfig", "agents", "conversation", "documents", "power_law",
           "unique", "workload"]
