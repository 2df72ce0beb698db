"""The router's summary of the cluster as typed data: what ``/v1/cluster``, ``/metrics`` and ``monitor`` show.

``RouterService.report()`` fills a ``ClusterReport``; the HTTP API sends
``to_dict()`` as JSON, the Prometheus collector reads its fields, and
``kvledger monitor`` reads the JSON back with ``from_dict`` and then by field,
so a field renamed here is renamed for every reader at once.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierBlocks:
    used: int
    free: int


@dataclass(frozen=True, slots=True)
class RankReport:
    """One live rank: its blocks and hit rate (from its last load report), its events, what was routed to it."""

    rank: int
    alive: bool
    blocks: dict[str, TierBlocks] | None
    """Per tier (``GPU``, ``CPU``); ``None`` before the rank's first load report."""
    cache_hit_rate: float | None
    index_blocks: int
    """Distinct block hashes the router's index holds for the rank."""
    next_seq: int
    """The event batch number the router expects next from the rank."""
    events_total: int
    events_per_s: float
    batches: int
    decisions: int
    completions: int
    prompt_tokens: int
    cached_tokens: int
    inflight_requests: int
    queued_prefill_tokens: int
    predicted_tokens: int
    """Cached tokens the index predicted for the completions routed here (``cached_tokens``: delivered)."""
    model: str
    block_size: int
    engine: str | None
    """The vLLM server's URL, for a rank that is one."""
    rejected: dict[str, int]
    """Events the index could not take from this rank, per reason (``router.rejections``)."""
    prefill_s_per_token: float | None = None
    """Seconds per uncached prompt token the router learned of it (``router.engine_rates``); ``None``: not yet."""
    decode_s_per_token: float | None = None
    """Seconds per decoded token the router learned of it from its streams; ``None``: not yet."""
    data_parallel_rank: int | None = None
    """Which engine core of its vLLM server it is, for a rank that is one of a data-parallel server's."""
    onboard_s_per_block: float | None = None
    """Seconds it measured to onboard one block from its host tier (``None``: not measured yet)."""


@dataclass(frozen=True, slots=True)
class ForeignReport:
    """A foreign engine (a real vLLM) whose events the router indexes under a rank of its own."""

    rank: int
    endpoint: str
    """Its server's URL (a rank requests are routed to), or its events endpoint (indexed only)."""
    index_blocks: int
    next_seq: int
    live: bool
    block_size: int
    rejected: dict[str, int]
    data_parallel_rank: int | None = None
    """Which engine core of its server it is (``None``: the server runs one)."""
    host_blocks: int = 0
    """Of ``index_blocks``, those the index holds on its host tier only (vLLM's CPU offloading)."""
    prefill_only: bool = False
    """Its server only prefills, for decode servers' KV connectors (``RouterConfig.vllm_prefill``)."""


@dataclass(frozen=True, slots=True)
class RouterTotals:
    completions: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    """Cached / prompt tokens over the router's completions."""
    migrations: int
    migrated_blocks: int
    retries: int
    ranks_removed: int
    index_blocks: int
    batches_applied: int
    batches_duplicate: int
    replays: int
    snapshots: int
    events_logged: int
    """Events the router has logged for monitors so far (the id the next one gets)."""
    predicted_tokens: int
    """Cached tokens the index predicted, over the completions (``cached_tokens`` is what was delivered)."""
    delivered_ratio: float | None
    """Delivered / predicted cached tokens (``None`` before any prediction): 1.0 when the index is exact."""
    events_rejected: int


@dataclass(frozen=True, slots=True)
class TenantReport:
    """One tenant at the router's admission (``router.admission``): its settings, what waits and runs, its share."""

    tenant: str
    weight: float
    max_inflight: int | None
    tokens_per_s: float | None
    running: int
    queued: int
    shed: int
    """Its completions refused with a 429."""
    served: int
    """Its completions let onto the ranks."""
    served_tokens: int
    """Their cost (prompt tokens + ``n * max_tokens``)."""
    token_share: float
    """``served_tokens`` over every tenant's (0.0 before any)."""
    mean_queue_s: float | None
    """Mean time from arrival to a slot (``None`` before any)."""


@dataclass(frozen=True, slots=True)
class SessionsReport:
    """The router's agent sessions (``router.sessions``): live now, waiting on a tool now, and over every session
    turn served, its prompt and cached tokens."""

    live: int
    waiting_on_tool: int
    turns: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    """Cached / prompt tokens over the session turns."""


@dataclass(frozen=True, slots=True)
class ClusterReport:
    policy: str
    tokens_per_block: int
    ranks: list[RankReport]
    foreign: list[ForeignReport]
    router: RouterTotals
    tenants: list[TenantReport]
    sessions: SessionsReport

    def to_dict(self) -> dict:
        """JSON-ready, nested the way the dataclasses are."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ClusterReport:
        """The report from ``to_dict``'s JSON (what ``GET /v1/cluster`` answers)."""
        ranks = [RankReport(**{**r, "blocks": None if r["blocks"] is None else
                               {tier: TierBlocks(**b) for tier, b in r["blocks"].items()}}) for r in d["ranks"]]
        return cls(d["policy"], d["tokens_per_block"], ranks, [ForeignReport(**f) for f in d["foreign"]],
                   RouterTotals(**d["router"]), [TenantReport(**t) for t in d["tenants"]],
                   SessionsReport(**d["sessions"]))
