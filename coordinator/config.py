"""Configuration of a cluster of rank actors: how many, where, with what ledger geometry and budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from kvledger.worker.device import DeviceChoice
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.rank.scheduler import BatchingConfig, CapacityPolicy

MiB = 1 << 20


def default_cache() -> CacheConfig:
    """The ledger geometry every rank shares; budgets in bytes (block counts are agreed at start)."""
    return CacheConfig(tokens_per_block=16, num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                       device="auto", primary_bytes=64 * MiB, secondary_bytes=16 * MiB)


@dataclass
class ClusterConfig:
    """One cluster of rank actors; the CLI's ``up`` flags are built from these fields."""

    num_ranks: int = 2
    """Rank actors (one per GPU on a GPU cluster); 0: none, the router fronts vLLM servers only (``--vllm``)."""
    device: DeviceChoice = "auto"
    """``cuda`` (one GPU per rank, NCCL), ``cpu`` (fractional CPUs, gloo) or ``auto`` (CUDA when the cluster
    has a GPU for every rank)."""
    cache: CacheConfig = field(default_factory=default_cache)
    """Ledger geometry and per-rank budget. On CUDA without ``primary_bytes`` the device tier takes
    ``gpu_memory_fraction`` of the free GPU memory."""
    primary_bytes_per_rank: list[int] | None = None
    """Per-rank device-tier budgets overriding ``cache.primary_bytes`` (ranks then agree on the smallest)."""
    gpu_memory_fraction: float | None = 0.5
    """On CUDA the device tier takes this share of the GPU's free memory (each rank measures its own, then
    all agree on the smallest); ``None`` keeps ``cache``'s budget on GPUs too."""
    num_cpus_per_rank: float = 0.5
    """CPUs each rank actor reserves (CPU-only clusters; a GPU rank reserves one CPU)."""
    placement_strategy: Literal["auto", "PACK", "SPREAD", "STRICT_SPREAD"] = "auto"
    """Placement-group strategy; ``auto`` spreads across nodes when there are several."""
    namespace: str = "kvledger"
    """Ray namespace of the named actors."""
    name_prefix: str = "kvledger-rank"
    """Actors are named ``<prefix>-<rank>``; the placement group ``<prefix>-pg``."""
    detached: bool = False
    """Actors (and their placement group) outlive the driver that created them."""
    group_timeout_s: float = 60.0
    """Timeout of the process group's rendezvous and collectives."""
    call_timeout_s: float = 120.0
    """Timeout of every call the coordinator waits on."""
    max_restarts: int = 1
    """How often Ray restarts a dead rank actor."""
    seed: int = 0
    """Reference-engine seed: the same on every rank, so any rank's KV is valid on any other."""
    max_num_seqs: int = BatchingConfig().max_num_seqs
    """Requests each rank runs in its batch at once (continuous batching: new ones join at step boundaries)."""
    max_num_batched_tokens: int = BatchingConfig().max_num_batched_tokens
    """Tokens one step of a rank computes at most (one per decoding request; long prompts prefill in chunks)."""
    max_queued_requests: int = BatchingConfig().max_queued_requests
    """Requests waiting on each rank to join its batch; past it the rank refuses (the router answers 429)."""
    capacity_policy: CapacityPolicy = BatchingConfig().capacity_policy
    """How each rank admits blocks: ``guaranteed_no_evict`` (to completion; nothing admitted is paused) or
    ``max_utilization`` (the next step's; more run at once, the latest admitted pauses when a step is short)."""
    num_speculative_tokens: int = BatchingConfig().num_speculative_tokens
    """Draft tokens each decode step proposes by prompt lookup and the model checks (0: none)."""
    prefill_ranks: int = 0
    """Of the ranks, the first this many only prefill: the router computes long prompts there and moves their
    KV to the others, which decode (``kvledger.router.disaggregation``). 0: every rank serves whole requests."""
    decode_ranks: int | None = None
    """The ranks that serve whole requests and decode split ones: the rest (``None``), or this many, which
    must be the rest (``kvledger up --prefill-ranks N --decode-ranks M`` starts N + M ranks)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks < 0:
            raise ValueError(f"ClusterConfig.num_ranks must be an int >= 0, got {self.num_ranks!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"ClusterConfig.device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.primary_bytes_per_rank is not None and len(self.primary_bytes_per_rank) != self.num_ranks:
            raise ValueError(f"primary_bytes_per_rank has {len(self.primary_bytes_per_rank)} entries "
                             f"for {self.num_ranks} ranks")
        if self.gpu_memory_fraction is not None and not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(f"ClusterConfig.gpu_memory_fraction must be in (0, 1] or None, "
                             f"got {self.gpu_memory_fraction!r}")
        if not self.num_cpus_per_rank > 0:
            raise ValueError(f"ClusterConfig.num_cpus_per_rank must be > 0, got {self.num_cpus_per_rank!r}")
        if type(self.prefill_ranks) is not int or not 0 <= self.prefill_ranks < max(self.num_ranks, 1):
            raise ValueError(f"ClusterConfig.prefill_ranks must be an int in 0..num_ranks-1 (a decode rank at "
                             f"least), got {self.prefill_ranks!r} of {self.num_ranks} ranks")
        if self.decode_ranks is not None and self.prefill_ranks + self.decode_ranks != self.num_ranks:
            raise ValueError(f"ClusterConfig: {self.prefill_ranks} prefill ranks and {self.decode_ranks} decode "
                             f"ranks make {self.prefill_ranks + self.decode_ranks}, not num_ranks={self.num_ranks}")
        if self.placement_strategy not in ("auto", "PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"unknown placement strategy {self.placement_strategy!r}")
        if not self.group_timeout_s > 0 or not self.call_timeout_s > 0:
            raise ValueError("ClusterConfig timeouts must be > 0")
        self.batching()   # bounds out of range fail here, naming the field

    def batching(self) -> BatchingConfig:
        """Each rank's batch and queue bounds."""
        return BatchingConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_queued_requests,
                              self.capacity_policy, self.num_speculative_tokens)
