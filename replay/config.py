"""What ``kvledger bench`` replays and how: the trace, the ranks, the policies, the engine and its options.

``BenchConfig`` is what the CLI (``launch/bench_cli.py``) parses its flags into;
``TinyOptions`` are the caps and client settings of ``--engine tiny``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvledger.replay.simulator import SimCosts, check_policy_options
from kvledger.replay.peers import parse_peers
from kvledger.router.disaggregation import SplitConfig
from kvledger.router.policies import policy_names

#: Block size of the tiny cluster's ledgers when ``--tokens-per-block`` is not given.
TINY_BLOCK_SIZE = 16
#: Requests replayed when ``--limit`` is not given.
DEFAULT_LIMIT = 200
#: Prompts are cut to this many tokens (the reference model on 2 CPU cores: ~0.1 s per 1024-token prefill).
MAX_INPUT_TOKENS = 1024
#: Completions ask for at most this many tokens.
MAX_OUTPUT_TOKENS = 8
#: Threads sending requests (the most requests in flight at once).
CONCURRENCY = 32
#: The synthetic workload for the tiny engine: the sim's shape (tenants with salts, a LoRA tenant, shared system
#: prompts, multi-turn chats) at sizes that mostly stay under ``MAX_INPUT_TOKENS``.
TINY_SYNTHETIC = dict(system_prompt_tokens=(128, 384), user_tokens_mean=60.0, output_tokens_mean=30.0)
#: Seconds a single completion may take before it counts as failed.
REQUEST_TIMEOUT_S = 120.0
#: Seconds a cluster or the router may take to start.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class TinyOptions:
    max_input_tokens: int = MAX_INPUT_TOKENS
    """Prompts cut to their first this many tokens (the reference model is slow on CPUs)."""
    max_output_tokens: int = MAX_OUTPUT_TOKENS
    """Outputs capped at this many tokens."""
    concurrency: int = CONCURRENCY
    """Threads sending requests: the most in flight at once."""
    request_timeout_s: float = REQUEST_TIMEOUT_S
    """Seconds one completion may take before it counts as failed."""
    num_cpus_per_rank: float = 0.5
    """Ray CPUs each rank actor of the tiny cluster takes."""
    prefill_ranks: int = 0
    """``engine="tiny"``: each policy runs twice on the same ``ranks``, whole and then with the first this many
    only prefilling (``kvledger up --prefill-ranks``), its row named ``<policy> P/D N:M``; 0: whole only."""
    split_mode: Literal["cost", "always"] = SplitConfig().mode
    """With ``prefill_ranks``: when the router splits a request (``RouterConfig.split_mode``)."""
    min_split_tokens: int = SplitConfig().min_split_tokens
    """With ``prefill_ranks``: uncached prompt tokens below which a request is served whole."""

    def __post_init__(self) -> None:
        if type(self.prefill_ranks) is not int or self.prefill_ranks < 0:
            raise ValueError(f"prefill_ranks must be an int >= 0, got {self.prefill_ranks!r}")
        SplitConfig(self.split_mode, self.min_split_tokens)   # the router's own checks, naming the field
        for name in ("max_input_tokens", "concurrency"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if type(self.max_output_tokens) is not int or self.max_output_tokens < 0:
            raise ValueError(f"max_output_tokens must be an int >= 0, got {self.max_output_tokens!r}")
        if not self.request_timeout_s > 0 or not self.num_cpus_per_rank > 0:
            raise ValueError("request_timeout_s and num_cpus_per_rank must be > 0")


SYNTHETIC = "synthetic"
#: Block size of generated traces when ``--tokens-per-block`` is not given.
SYNTHETIC_BLOCK_SIZE = 64
#: Requests of a generated trace when ``--limit`` is not given.
SYNTHETIC_REQUESTS = 1000
ENGINES = ("sim", "tiny", "vllm")
#: ``--routers N``: how late a rank's event batch reaches a replica's index (its publisher's push interval, 5 ms).
REPLICA_EVENT_LAG_S = 0.005
#: ``--routers N``: how often the replicas read the ranks' load reports (the live router's health round,
#: ``RouterActorConfig.health_interval_s``).
REPLICA_LOAD_REPORT_S = 1.0


@dataclass(frozen=True, slots=True)
class BenchConfig:
    trace: str = SYNTHETIC
    """A Mooncake JSONL file, ``synthetic`` for the seeded chat generator, or a named workload
    (``replay.workloads``: ``docs``, ``powerlaw``, ``unique``)."""
    ranks: int = 4
    """Ranks, one ledger each."""
    policy: str = "all"
    """A policy name, names separated by commas, or ``all`` (every registered policy on the same trace)."""
    capacity_blocks: int | None = None
    """Device blocks of the whole cluster; None = a quarter of the trace's unique blocks (at least room for
    two of its largest requests on every rank)."""
    host_blocks: int = 0
    """Host-tier blocks of the whole cluster."""
    tokens_per_block: int | None = None
    """Ledger block size; None = the trace's own (512 for Mooncake, 64 for synthetic; 16 with ``engine="tiny"``)."""
    engine: str = "sim"
    """``sim``: simulated time, metadata-only ledgers; ``tiny``: a real local cluster per policy (rank actors,
    reference engine, router over HTTP on 127.0.0.1), times measured (TTFT = completion latency; prompts and
    outputs capped by ``tiny``'s options); ``vllm``: the vLLM servers of ``vllm``, caches reset before each policy, times
    measured."""
    speed: float = 1.0
    """Replay this many times faster than the trace's timestamps."""
    limit: int | None = None
    """The first this many requests only; None = all (a synthetic trace: 1000 generated; ``engine="tiny"``: 200)."""
    seed: int = 0
    """Seed of the synthetic trace and of the policies' tie-breaking."""
    partial_reuse: bool = False
    """Let ledgers reuse partly matching blocks (off: block granularity, like the bounds)."""
    migration: bool = True
    """Let the ``kv`` policy migrate a prefix between ranks."""
    jobs: int = 0
    """Processes replaying policies side by side; 0 = min(policies, CPU cores)."""
    costs: SimCosts = field(default_factory=SimCosts)
    tiny: TinyOptions = field(default_factory=TinyOptions)
    """Prompt and output caps and client concurrency of ``engine="tiny"`` and ``"vllm"`` (``replay/tiny.py``)."""
    vllm: tuple[str, ...] = ()
    """``engine="vllm"``: the vLLM servers replayed through, ``http://HOST:PORT``, one rank each, started with
    ``VLLM_SERVER_DEV_MODE=1`` so the bench can reset their prefix caches (``replay/vllm.py``)."""
    peer: tuple[str, ...] = ()
    """``engine="vllm"``: the routers people pick instead, run after kvledger's policies in front of the same servers:
    ``sglang-router`` (its ``cache_aware``), ``vllm-router`` (``kv_aware``, ``cache_aware``, ``round_robin``), or
    ``NAME:POLICY`` for one (``replay/peers.py``; installed from PyPI on first use, never a dependency). With peers,
    every router gets the prompts as text."""
    routers: int = 1
    """Router replicas the simulated requests are spread over, each with its own index fed the same events and
    its own load account (``replay/replicas.py`` compares 1, 2, 4 ... N against the 1-router run; ``engine="sim"``
    only)."""
    event_lag_s: float = 0.0
    """Simulated delay of each event batch on its way to the routers' indexes (with ``routers`` above 1: the
    ranks' push interval)."""
    load_report_s: float = 0.0
    """How often the simulated routers read the ranks' load reports (with ``routers`` above 1: the live router's
    health round; 0: never)."""
    slowdown: tuple[float, ...] = ()
    """``engine="sim"``: per rank, from rank 0 (one flag each), how many times its prefill takes (another tenant on
    its GPU); the rest run at 1. The routers learn it from the queues it builds and from its answers
    (``SimConfig.slowdown``)."""
    policy_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Policy name -> fields of its config (``--kv-backlog-weight 6``: ``{"kv": {"backlog_weight": 6}}``), for a
    policy this replay runs."""

    def __post_init__(self) -> None:
        for name in ("ranks", "routers"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not 0 < self.speed < float("inf"):
            raise ValueError(f"speed must be a positive number, got {self.speed!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {ENGINES}, got {self.engine!r}")
        if (self.engine == "vllm") != bool(self.vllm):
            raise ValueError("--engine vllm replays through vLLM servers: give each with --vllm URL (and only then)")
        if self.peer and self.engine != "vllm":
            raise ValueError("--peer runs a peer router in front of vLLM servers: it needs --engine vllm")
        if self.slowdown and self.engine != "sim":
            raise ValueError("--slowdown slows simulated ranks: it needs --engine sim (slow a real engine with "
                             "another tenant's load, as benchmarks/bench_routers.py --slow does)")
        parse_peers(self.peer)
        if self.policy != "all":
            for name in self.policy.split(","):
                if name not in policy_names():
                    raise ValueError(f"unknown policy {name!r}; choose one of {policy_names()} or 'all'")
        stray = [name for name in self.policy_options if name not in self.policies]
        if stray:
            raise ValueError(f"options of policies {stray}, which this replay does not run ({self.policies})")
        check_policy_options(self.policy_options)
        if self.limit is not None and (type(self.limit) is not int or self.limit < 1):
            raise ValueError(f"--limit must be a positive int, got {self.limit!r}")
        if type(self.jobs) is not int or self.jobs < 0:
            raise ValueError(f"--jobs must be an int >= 0, got {self.jobs!r}")
        if self.tokens_per_block is not None and (type(self.tokens_per_block) is not int or self.tokens_per_block < 1):
            raise ValueError(f"--tokens-per-block must be a positive int, got {self.tokens_per_block!r}")
        if self.tiny.prefill_ranks and (self.engine != "tiny" or self.tiny.prefill_ranks >= self.ranks):
            raise ValueError(f"--prefill-ranks {self.tiny.prefill_ranks} splits --engine tiny's own ranks, leaving "
                             f"a decode rank at least: it needs --engine tiny and --ranks above it")
        if self.routers > 1 and self.engine != "sim":
            raise ValueError(f"--routers {self.routers} is measured in the simulator (--engine sim); "
                             f"--engine {self.engine} replays through one router")

    @property
    def policies(self) -> list[str]:
        return policy_names() if self.policy == "all" else list(dict.fromkeys(self.policy.split(",")))
