"""Request traces for the bench: the Mooncake loader, a seeded synthetic generator, and token expansion.

A trace is Mooncake-shaped: each request names its prompt by prefix-block ids
(``hash_ids``) of ``block_size`` tokens; two requests share an id only if they
share the whole prefix up to and including that block. Each id expands into
``block_size`` deterministic token ids (seeded by the id: a splitmix64 of
``(id, position)``), and the last block is cut to ``input_length``. So a
request's tokens are real token lists the ledgers hash, yet nothing per token is
stored with the trace.

``BlockChains`` names each full *ledger* block of a prompt (``tokens_per_block``
may differ from the trace's block size) by a small int that is equal for two
blocks exactly when their content and everything before them is (plus LoRA id
and cache salt): what the bounds count and what the simulator keys its hash
memo on, without building any token list.
"""
from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Mooncake's traces name blocks of this many tokens.
MOONCAKE_BLOCK_SIZE = 512
#: Token ids are drawn below this (Llama 3's vocabulary size).
VOCAB_SIZE = 128_256

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace; ``timestamp_s`` is the trace's own clock (before ``--speed``)."""

    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    cache_salt: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    """Requests in arrival order, and the block size their ``hash_ids`` count in."""

    name: str
    block_size: int
    requests: list[TraceRequest]

    def __post_init__(self) -> None:
        if type(self.block_size) is not int or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    def limited(self, limit: int | None) -> Trace:
        """The first ``limit`` requests (all when None)."""
        if limit is None:
            return self
        if type(limit) is not int or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        return Trace(self.name, self.block_size, self.requests[:limit])

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


# --- tokens ---------------------------------------------------------------------------------------

def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def expand_tokens(hash_ids: Sequence[int], input_length: int, block_size: int,
                  vocab_size: int = VOCAB_SIZE) -> list[int]:
    """The prompt's token ids: ``block_size`` per id, seeded by the id, cut to ``input_length``.

    One vectorised pass per request; the same id always expands to the same tokens, so a cut
    block is a prefix of the same id's full block.
    """
    if not hash_ids:
        return []
    ids = np.asarray(hash_ids, dtype=np.uint64)
    pos = np.arange(block_size, dtype=np.uint64)
    z = _splitmix64((ids[:, None] << np.uint64(20)) ^ pos[None, :]).reshape(-1)[:input_length]
    return (z % np.uint64(vocab_size)).tolist()


def request_tokens(trace: Trace, req: TraceRequest) -> list[int]:
    return expand_tokens(req.hash_ids, req.input_length, trace.block_size)


# --- ledger-block identities ----------------------------------------------------------------------

class BlockChains:
    """Interned ids of a prompt's full ledger blocks (see the module docstring)."""

    __slots__ = ("block_size", "tokens_per_block", "_ids")

    def __init__(self, block_size: int, tokens_per_block: int) -> None:
        if type(tokens_per_block) is not int or tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be a positive int, got {tokens_per_block!r}")
        self.block_size = block_size
        self.tokens_per_block = tokens_per_block
        self._ids: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def chain(self, req: TraceRequest) -> list[int]:
        """Ids of the full ledger blocks of the whole prompt (``input_length // tokens_per_block``).

        The prefix a probe walks is the first ``(input_length - 1) // tokens_per_block`` of them.
        """
        B, T = self.block_size, self.tokens_per_block
        ids, hids = self._ids, req.hash_ids
        parent = -1
        out = []
        constraint = (req.lora_id, req.cache_salt)
        for k in range(req.input_length // T):
            start = k * T
            j0, j1 = start // B, (start + T - 1) // B
            what = hids[j0] if j0 == j1 else hids[j0:j1 + 1]
            key = (parent, what, start - j0 * B, constraint)
            v = ids.get(key)
            if v is None:
                v = ids[key] = len(ids)
            out.append(v)
            parent = v
        return out


# --- Mooncake -------------------------------------------------------------------------------------

def _field(d: dict, name: str, where: str, lo: int) -> int:
    v = d.get(name)
    if type(v) is not int or v < lo:
        raise ValueError(f"{where}: {name} must be an int >= {lo}, got {v!r}")
    return v


def parse_request(d: object, where: str, block_size: int) -> TraceRequest:
    """One trace line's object -> ``TraceRequest``; ``ValueError`` naming the line and field when malformed."""
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(d).__name__}")
    ts = d.get("timestamp")
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"{where}: timestamp must be a number of milliseconds >= 0, got {ts!r}")
    n = _field(d, "input_length", where, 1)
    out = _field(d, "output_length", where, 0)
    hids = d.get("hash_ids")
    if type(hids) is not list or not all(type(h) is int and h >= 0 for h in hids):
        raise ValueError(f"{where}: hash_ids must be a list of non-negative ints")
    if len(hids) != -(-n // block_size):
        raise ValueError(f"{where}: {len(hids)} hash_ids for input_length {n} at {block_size} tokens per block "
                         f"(expected {-(-n // block_size)})")
    salt = d.get("cache_salt")
    if salt is not None and type(salt) is not str:
        raise ValueError(f"{where}: cache_salt must be a string, got {salt!r}")
    lora = d.get("lora_id")
    if lora is not None and (type(lora) is not int or lora < 0):
        raise ValueError(f"{where}: lora_id must be a non-negative int, got {lora!r}")
    return TraceRequest(ts / 1000.0, n, out, tuple(hids), salt, lora)


def load_mooncake(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Read a Mooncake JSONL trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``,
    optional ``cache_salt`` and ``lora_id``); requests are sorted by timestamp (stable)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"trace file {str(p)!r} does not exist (give a Mooncake JSONL file or 'synthetic')")
    reqs = []
    with p.open() as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p.name}:{i}: not JSON ({e.msg})") from None
            reqs.append(parse_request(d, f"{p.name}:{i}", block_size))
    if not reqs:
        raise ValueError(f"trace file {str(p)!r} holds no requests")
    reqs.sort(key=lambda r: r.timestamp_s)
    return Trace(p.name, block_size, reqs)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as Mooncake JSONL (with ``cache_salt``/``lora_id`` where set)."""
    with Path(path).open("w") as f:
        for r in trace.requests:
            d: dict[str, object] = {"timestamp": round(r.timestamp_s * 1000.0, 3), "input_length": r.input_length,
                                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)}
            if r.cache_salt is not None:
                d["cache_salt"] = r.cache_salt
            if r.lora_id is not None:
                d["lora_id"] = r.lora_id
            f.write(json.dumps(d) + "\n")


# --- synthetic ------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    """A seeded multi-tenant chat workload; sizes are in tokens, times in seconds."""

    requests: int = 1000
    """Requests to generate (turns of all conversations together)."""
    block_size: int = 64
    """Tokens per hash id (use the bench's ``--tokens-per-block``)."""
    tenants: int = 4
    """Tenants; tenant ``i`` has cache salt ``tenant-i`` so tenants never share KV."""
    lora_tenants: int = 1
    """The last ``lora_tenants`` tenants serve a LoRA adapter (``lora_id`` = tenant index)."""
    system_prompts_per_tenant: int = 3
    system_prompt_tokens: tuple[int, int] = (512, 2048)
    """Range of a system prompt's length (rounded to whole blocks; shared by a tenant's conversations)."""
    user_tokens_mean: float = 300.0
    output_tokens_mean: float = 100.0
    turns_mean: float = 4.0
    """Turns per conversation (geometric)."""
    conversations_per_s: float = 1.0
    """Poisson rate of new conversations."""
    think_time_s: float = 8.0
    """Mean pause between a turn and the user's next one (exponential)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("requests", "block_size", "tenants", "system_prompts_per_tenant"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"SyntheticConfig.{name} must be a positive int, got {v!r}")
        if type(self.lora_tenants) is not int or not 0 <= self.lora_tenants <= self.tenants:
            raise ValueError(f"SyntheticConfig.lora_tenants must be in 0..tenants, got {self.lora_tenants!r}")
        lo, hi = self.system_prompt_tokens
        if not 0 < lo <= hi:
            raise ValueError(f"SyntheticConfig.system_prompt_tokens must be 0 < lo <= hi, "
                             f"got {self.system_prompt_tokens}")
        for name in ("user_tokens_mean", "output_tokens_mean", "conversations_per_s", "think_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SyntheticConfig.{name} must be > 0")
        if not self.turns_mean >= 1:
            raise ValueError("SyntheticConfig.turns_mean must be >= 1")


@dataclass(slots=True)
class _Conversation:
    salt: str
    lora: int | None
    ids: list[int]
    length: int
    turns_left: int
    last_output: int = 0


def generate_synthetic(config: SyntheticConfig = SyntheticConfig()) -> Trace:
    """Multi-turn conversations over shared per-tenant system prompts, each tenant with its cache salt.

    Each turn's prompt is the previous turn's prompt, its answer and a new user message, so it
    extends the same hash ids (a cut last block continues under the same id, which expands to
    the same leading tokens). System prompts are whole blocks so conversations share exactly them.
    """
    c = config
    rng = random.Random(c.seed)
    B = c.block_size
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        out = list(range(next_id, next_id + k))
        next_id += k
        return out

    systems: list[list[list[int]]] = []
    for _ in range(c.tenants):
        prompts = []
        for _ in range(c.system_prompts_per_tenant):
            blocks = max(1, rng.randint(*c.system_prompt_tokens) // B)
            prompts.append(fresh(blocks))
        systems.append(prompts)

    def draw(mean: float) -> int:
        return max(1, int(rng.expovariate(1.0 / mean)))

    out: list[TraceRequest] = []
    pending: list[tuple[float, int, _Conversation]] = []   # (next turn time, tie, conversation)
    t_new = 0.0
    tie = 0
    p_end = 1.0 / c.turns_mean
    while len(out) < c.requests:
        if not pending or t_new <= pending[0][0]:
            tenant = rng.randrange(c.tenants)
            lora = tenant if tenant >= c.tenants - c.lora_tenants else None
            sys_ids = rng.choice(systems[tenant])
            turns = 1
            while rng.random() > p_end and turns < 32:
                turns += 1
            conv = _Conversation(f"tenant-{tenant}", lora, list(sys_ids), len(sys_ids) * B, turns)
            at = t_new
            t_new += rng.expovariate(c.conversations_per_s)
        else:
            at, _, conv = heapq.heappop(pending)
        grow = conv.last_output + draw(c.user_tokens_mean)
        new_len = conv.length + grow
        have = len(conv.ids)
        need = -(-new_len // B)
        conv.ids.extend(fresh(need - have))
        conv.length = new_len
        output = draw(c.output_tokens_mean)
        out.append(TraceRequest(at, new_len, output, tuple(conv.ids), conv.salt, conv.lora))
        conv.last_output = output
        conv.turns_left -= 1
        if conv.turns_left > 0:
            tie += 1
            heapq.heappush(pending, (at + rng.expovariate(1.0 / c.think_time_s), tie, conv))
    out.sort(key=lambda r: r.timestamp_s)
    return Trace(f"synthetic(seed={c.seed})", B, out)
