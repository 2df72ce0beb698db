"""The router's settings, one frozen dataclass: ``kvledger up`` builds its flags from these fields."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from kvledger.router.admission import DISCIPLINES
from kvledger.router.disaggregation import SplitConfig
from kvledger.router.policies import DEFAULT_POLICY, RoutingPolicy, make_policy


@dataclass(frozen=True)
class RouterConfig:
    """How the router indexes, routes and retries; validated on construction."""

    tokens_per_block: int = 16
    """Block size of every rank (events with another size are refused)."""
    policy: str = DEFAULT_POLICY
    """Routing policy by name (``kvledger.router.policies.policy_names()``)."""
    policy_options: Mapping[str, float | int | bool] = field(default_factory=dict)
    """Fields of the policy's own config dataclass (``KvCostModel`` for ``kv``, ``LlmDWeights`` for ``llm_d``, ...)."""
    seed: int = 0
    """Seed of the policy's tie-breaking and random choices."""
    event_log_size: int = 10_000
    """Decoded events kept for monitors (``events``); older ones are dropped."""
    rate_window_s: float = 10.0
    """Window of the events-per-second rate."""
    load_refresh_s: float = 0.5
    """``refresh_loads`` asks the ranks at most this often (it is called before cluster summaries)."""
    max_retries: int = 8
    """Ranks a completion may be retried on when the rank it was sent to dies."""
    vllm: tuple[str, ...] = ()
    """vLLM OpenAI servers to route to as well, ``http://HOST:PORT`` each (their model, block size, events and
    tokenizer are asked of the server)."""
    vllm_prefill: tuple[str, ...] = ()
    """vLLM servers that only prefill (``http://HOST:PORT`` each, run with a KV connector that produces): a
    request split off to one is decoded on a ``vllm`` server whose connector takes its KV
    (``router.kv_connector``)."""
    tokenizer: str | None = None
    """Tokenizer of the vLLM servers' text prompts (a folder with ``tokenizer.json``); default: the model's own
    files when readable here, else the server's ``/tokenize``."""
    engine_timeout_s: float = 10.0
    """Timeout of the router's calls to a vLLM server other than completions."""
    max_inflight_completions: int = 256
    """Completions on the ranks at once (routed and not answered); more wait in the router's queue. Kept (over
    all router replicas) at most a rank's ``max_num_seqs + max_queued_requests``, a rank's other calls never
    wait behind serve calls for one of its threads."""
    max_queued_completions: int = 1024
    """Completions waiting for a slot, in the order ``admission`` gives them; past it the router answers 429 (0:
    at once, when every slot is taken)."""
    queue_timeout_s: float = 60.0
    """How long a completion waits for a slot before the router answers 429."""
    stored_responses: int = 10_000
    """Responses (``POST /v1/responses``) the router remembers the rank and conversation of, for follow-ups
    (``previous_response_id``); the oldest are forgotten first."""
    admission: Literal["fair", "fifo"] = "fair"
    """Which waiting completion a freed slot goes to: ``fair``, the tenant furthest below its weighted share
    (start-time fair queueing, with the ``--api-keys`` file's per-tenant limits); ``fifo``, the first to arrive
    (tenant limits not applied). See ``router.admission``."""
    session_ttl_s: float = 300.0
    """A session (``x-session-id``, ``metadata.session_id`` or ``user``) idle this long is forgotten; its turns'
    raised retention priority lasts as long once their blocks are free (``router.sessions``)."""
    max_sessions: int = 100_000
    """Sessions the router keeps; past it the oldest idle one is forgotten."""
    session_priority: int = 60
    """Retention priority of a session's blocks on kvledger's own ranks (0..100, default traffic 35), so they
    outlive other traffic's in the LRU while its agent runs a tool; a client's ``priority`` wins."""
    prefill_rank_ids: tuple[int, ...] = ()
    """Own ranks that only prefill (``kvledger up --prefill-ranks``); the others serve whole requests and decode
    split ones (``router.disaggregation``). Empty: every rank serves whole requests."""
    split_mode: Literal["cost", "always"] = SplitConfig().mode
    """With prefill ranks: ``cost`` splits a request when the estimate says it pays (``router.disaggregation``),
    ``always`` every request of ``min_split_tokens`` uncached tokens or more."""
    min_split_tokens: int = SplitConfig().min_split_tokens
    """With prefill ranks: uncached prompt tokens below which a request is served whole, never split."""
    split_interference: float = SplitConfig().interference_weight
    """With prefill ranks: seconds of stall a prefill puts on each request decoding beside it, per second of the
    prefill (what splitting saves the decodes)."""

    def __post_init__(self) -> None:
        if type(self.tokens_per_block) is not int or self.tokens_per_block <= 0:
            raise ValueError(f"tokens_per_block must be a positive int, got {self.tokens_per_block!r}")
        if type(self.event_log_size) is not int or self.event_log_size < 1:
            raise ValueError(f"event_log_size must be an int >= 1, got {self.event_log_size!r}")
        if not self.rate_window_s > 0 or not self.load_refresh_s >= 0:
            raise ValueError("rate_window_s must be > 0 and load_refresh_s >= 0")
        if type(self.max_retries) is not int or self.max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {self.max_retries!r}")
        for name in ("vllm", "vllm_prefill"):
            for url in getattr(self, name):
                if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name} servers are http://HOST:PORT, got {url!r}")
        servers = (*self.vllm, *self.vllm_prefill)
        if len(set(servers)) != len(servers):
            raise ValueError(f"vllm and vllm_prefill list a server twice: {list(servers)}")
        if not self.engine_timeout_s > 0:
            raise ValueError(f"engine_timeout_s must be > 0, got {self.engine_timeout_s!r}")
        for name, least in (("max_inflight_completions", 1), ("max_queued_completions", 0), ("stored_responses", 0)):
            if type(getattr(self, name)) is not int or getattr(self, name) < least:
                raise ValueError(f"{name} must be an int >= {least}, got {getattr(self, name)!r}")
        if not self.queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s!r}")
        if self.admission not in DISCIPLINES:
            raise ValueError(f"admission must be one of {', '.join(DISCIPLINES)}, got {self.admission!r}")
        if not 0 < self.session_ttl_s < float("inf"):
            raise ValueError(f"session_ttl_s must be a finite number > 0, got {self.session_ttl_s!r}")
        if type(self.max_sessions) is not int or self.max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {self.max_sessions!r}")
        if type(self.session_priority) is not int or not 0 <= self.session_priority <= 100:
            raise ValueError(f"session_priority must be an int in 0..100, got {self.session_priority!r}")
        ids = self.prefill_rank_ids
        if type(ids) is not tuple or any(type(r) is not int or r < 0 for r in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"prefill_rank_ids must be a tuple of distinct rank ids >= 0, got {ids!r}")
        self.split_config()
        self.make_policy()   # an unknown policy or option fails here, naming it

    def split_config(self) -> SplitConfig:
        """When a request is split between a prefill rank and a decode rank (``router.disaggregation``)."""
        return SplitConfig(self.split_mode, self.min_split_tokens, self.split_interference)

    def make_policy(self) -> RoutingPolicy:
        """A fresh policy of ``policy`` with ``policy_options`` and ``seed``."""
        return make_policy(self.policy, seed=self.seed, **dict(self.policy_options))
