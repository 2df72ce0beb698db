"""What every routing policy reads and answers, and the interface they share.

A policy is a plain object: ``route`` picks a live rank from the ranks' load
(``RankState``), the request, and the prefix matches the caller probed from the
index (``router.probe``); policies that learn from their own decisions (SGLang's
``cache_aware`` keeps a history of routed prompts) get ``on_routed`` and
``on_rank_removed``. Nothing here knows Ray or HTTP.
"""
from __future__ import annotations

import abc
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar

from kvledger.router.probe import PrefixMatch, prompt_hashes
from kvledger.worker.wire.block_key import validate_prompt


class NoLiveRankError(RuntimeError):
    """Every rank is dead (or none was given): there is nowhere to route."""


def _nonneg_int(value: object, name: str) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True, slots=True)
class RankState:
    """One rank's load as the router last saw it."""

    rank: int
    alive: bool = True
    queued_requests: int = 0
    """Requests admitted but not yet prefilled."""
    queued_prefill_tokens: int = 0
    """Prompt tokens those queued requests still have to compute."""
    running_requests: int = 0
    """Requests decoding."""
    running_decode_blocks: int = 0
    """KV blocks the decoding requests hold (their decode load)."""
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    """Device-tier blocks in the pool; 0 = unknown (utilisation then reads 0)."""
    migratable: bool = True
    """Whether KV can be moved to or from it (kvledger's own ranks; not a vLLM server)."""
    dispatched_blocks: int = 0
    """Blocks the router's requests in flight here hold or will hold together (queued and running; a block they
    share counted once): what its last report of ``kv_used_blocks`` may not show yet."""
    session_blocks: int = 0
    """Device blocks live sessions (``router.sessions``) left here for their next turn: free in the rank's books,
    occupied in ``kv``'s (its protection term)."""
    prefill_s_per_token: float = 0.0
    """Seconds the rank takes per uncached prompt token, learned from its answers (``router.engine_rates``); 0: not
    learned yet, a policy's own figure stands."""
    onboard_s_per_block: float | None = None
    """Seconds the rank measured to bring one block up from its host tier (``None``: not measured; ``kv`` takes
    its cost model's figure)."""
    shared_prompt_blocks: int = 0
    """Of the prompt being placed, the full blocks that requests in flight here hold already (from the first): it
    takes no more room for them beside those requests."""

    def __post_init__(self) -> None:
        for name in ("rank", "queued_requests", "queued_prefill_tokens", "running_requests",
                     "running_decode_blocks", "kv_used_blocks", "kv_total_blocks", "dispatched_blocks",
                     "session_blocks", "shared_prompt_blocks"):
            _nonneg_int(getattr(self, name), name)
        if type(self.prefill_s_per_token) not in (int, float) or not 0 <= self.prefill_s_per_token < math.inf:
            raise ValueError(f"prefill_s_per_token must be a finite number >= 0, got {self.prefill_s_per_token!r}")
        if type(self.alive) is not bool or type(self.migratable) is not bool:
            raise TypeError("alive and migratable must be bools")
        v = self.onboard_s_per_block
        if v is not None and (type(v) not in (int, float) or not math.isfinite(v) or v < 0):
            raise ValueError(f"onboard_s_per_block must be None or a finite number >= 0, got {v!r}")
        if self.kv_total_blocks and self.kv_used_blocks > self.kv_total_blocks:
            raise ValueError(f"kv_used_blocks {self.kv_used_blocks} exceeds kv_total_blocks {self.kv_total_blocks}")

    @property
    def inflight_requests(self) -> int:
        """Queued plus running: the load that SGLang's and vLLM's routers count."""
        return self.queued_requests + self.running_requests

    @property
    def blocks_in_use(self) -> int:
        """Device blocks taken as far as the router knows: the rank's report, or the distinct blocks the router's
        requests in flight there hold if more (a report lags them; it counts them too, so the two are not added)."""
        return max(self.kv_used_blocks, self.dispatched_blocks)

    @property
    def kv_utilisation(self) -> float:
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0


@dataclass(frozen=True, slots=True)
class SessionAt:
    """Where the request's own session lives (``router.sessions``): its rank, the prompt tokens the rank held of
    it at its last turn that this prompt starts with, and the device blocks its last turn left there."""

    rank: int
    held_tokens: int
    blocks: int

    def __post_init__(self) -> None:
        for name in ("rank", "held_tokens", "blocks"):
            _nonneg_int(getattr(self, name), name)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """A prompt to place; ``block_hashes`` are those of ``tokens[:-1]`` (see ``router.probe``)."""

    tokens: tuple[int, ...]
    block_hashes: tuple[int, ...]
    tokens_per_block: int
    max_tokens: int = 16
    cache_salt: str | None = None
    lora_id: int | None = None
    session: SessionAt | None = None
    """The live session it is a turn of (``None``: none, or one the router no longer knows)."""

    def __post_init__(self) -> None:
        if type(self.tokens) is not tuple or type(self.block_hashes) is not tuple:
            raise TypeError("tokens and block_hashes must be tuples; build requests with RouteRequest.of")
        if type(self.tokens_per_block) is not int or self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be a positive int, got {self.tokens_per_block!r}")
        if not self.tokens:
            raise ValueError("a prompt needs at least one token")
        expected = (len(self.tokens) - 1) // self.tokens_per_block
        if len(self.block_hashes) != expected:
            raise ValueError(f"{len(self.tokens)} tokens have {expected} full blocks before the last token, "
                             f"got {len(self.block_hashes)} block hashes")
        _nonneg_int(self.max_tokens, "max_tokens")
        if self.session is not None and not isinstance(self.session, SessionAt):
            raise TypeError(f"session must be a SessionAt, got {type(self.session).__name__}")

    @classmethod
    def of(cls, tokens: Sequence[int], tokens_per_block: int, *, max_tokens: int = 16,
           cache_salt: str | None = None, lora_id: int | None = None) -> RouteRequest:
        """Hash the prompt's blocks the way ranks announce them."""
        validate_prompt(tokens, lora_id, cache_salt, (), None)
        hashes = prompt_hashes(tokens, tokens_per_block, lora_id=lora_id, cache_salt=cache_salt)
        return cls(tuple(tokens), tuple(hashes), tokens_per_block, max_tokens, cache_salt, lora_id)

    @property
    def num_blocks(self) -> int:
        """Blocks the whole prompt occupies (the partial last one included)."""
        return -(-len(self.tokens) // self.tokens_per_block)


@dataclass(frozen=True, slots=True)
class Split:
    """Prefill on ``prefill_rank``, then decode where the decision says (``router.disaggregation``), and the two
    estimates, in seconds, the choice was made on."""

    prefill_rank: int
    whole_rank: int
    """Where the policy would have served it whole (and where it goes if the prefill rank cannot take it)."""
    split_s: float
    """The prefill rank's queue and compute, the transfer of the prompt's full blocks, the decode rank's tail."""
    whole_s: float
    """Serving whole on the policy's rank: its queue, the prompt it lacks, the stall that puts on its decodes."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where to serve a request, and the numbers behind the choice."""

    rank: int
    policy: str
    scores: dict[int, float] = field(default_factory=dict)
    """The policy's number per rank it weighed; ``lower_is_better`` says which way it ranks."""
    lower_is_better: bool = True
    matched_tokens: dict[int, int] = field(default_factory=dict)
    """Prompt tokens each live rank already holds (from the probe), for reporting."""
    migrate_from: int | None = None
    """Pull the prefix from this rank before serving (``kv`` only)."""
    migrate_blocks: int = 0
    loads: dict[int, RankState] = field(default_factory=dict)
    """The load each live rank was weighed with (set by ``RouteStep``): a decision explained, stale reports
    included."""
    split: Split | None = None
    """Prefill elsewhere first (set by ``RouteStep`` when the cluster has prefill ranks and splitting pays)."""


class RoutingPolicy(abc.ABC):
    """Picks a live rank for a request; see the module docstring."""

    name: ClassVar[str]
    config_type: ClassVar[type | None] = None
    """The dataclass ``make_policy`` builds from its options; None = the policy takes none."""

    @abc.abstractmethod
    def route(self, request: RouteRequest, ranks: Sequence[RankState],
              matches: Mapping[int, PrefixMatch]) -> RouteDecision:
        """Choose a live rank; raises ``NoLiveRankError`` if there is none."""

    def on_routed(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The request was sent where ``decision`` says (policies with their own history learn here)."""

    def on_rank_removed(self, rank: int) -> None:
        """``rank`` left the cluster; forget what is kept about it."""


def check_nonneg_numbers(config: object, skip: tuple[str, ...] = (), prefix: str = "") -> None:
    """Raise ``ValueError`` naming the first dataclass field of ``config`` (not in ``skip``) that is not a
    finite number >= 0: the check every cost or weight dataclass makes."""
    for f in fields(config):
        v = getattr(config, f.name)
        if f.name not in skip and (type(v) not in (int, float) or not math.isfinite(v) or v < 0):
            raise ValueError(f"{prefix}{f.name} must be a finite number >= 0, got {v!r}")


class ConfiguredPolicy(RoutingPolicy):
    """A policy built from an instance of its ``config_type`` dataclass, with a seeded tie-breaker."""

    def __init__(self, config: object | None = None, seed: int = 0) -> None:
        config_type = type(self).config_type
        assert config_type is not None, f"{type(self).__name__} declares no config_type"
        if config is None:
            config = config_type()
        if not isinstance(config, config_type):
            raise TypeError(f"config must be a {config_type.__name__}, got {type(config).__name__}")
        self.config = config
        self._rng = random.Random(seed)


def live_ranks(ranks: Sequence[RankState]) -> list[RankState]:
    """The live ones, by rank id; raises on a duplicate id or when none is alive."""
    seen: set[int] = set()
    live = []
    for s in ranks:
        if not isinstance(s, RankState):
            raise TypeError(f"ranks must hold RankState, got {type(s).__name__}")
        if s.rank in seen:
            raise ValueError(f"rank {s.rank} listed twice")
        seen.add(s.rank)
        if s.alive:
            live.append(s)
    if not live:
        raise NoLiveRankError(f"no live rank among {sorted(seen)}" if seen else "no ranks given")
    live.sort(key=lambda s: s.rank)
    return live


def matched_tokens(live: Sequence[RankState], matches: Mapping[int, PrefixMatch]) -> dict[int, int]:
    """Matched prompt tokens per live rank (0 where the probe found nothing)."""
    out = {}
    for s in live:
        m = matches.get(s.rank)
        out[s.rank] = 0 if m is None else m.matched_tokens
    return out


def pick_best(scores: Mapping[int, float], lower_is_better: bool, rng: random.Random) -> int:
    """The best-scoring rank; ties broken by the policy's seeded ``rng`` so runs repeat."""
    best = min(scores.values()) if lower_is_better else max(scores.values())
    tied = [r for r, v in scores.items() if v == best]
    return tied[0] if len(tied) == 1 else rng.choice(sorted(tied))
