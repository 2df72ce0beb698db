"""The typed messages between a router (or a coordinator) and a rank, besides the requests themselves.

Every method of the rank interface (``kvledger.router.rank_client.RankClient``)
answers with one of these or with a batch type from ``batches``: plain frozen
dataclasses that pickle across Ray and carry no torch, so the router can read
them without importing the ledger.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvledger.worker.wire.batches import PublishedBatch


@dataclass(frozen=True, slots=True)
class ServeOutcome:
    """What serving one request on one rank produced."""

    request_id: int
    rank: int
    output_tokens: list[int]
    cached_tokens: int
    """Prompt tokens whose KV the rank's ledger supplied (reused, copied or onboarded)."""
    computed_tokens: int
    """Prompt tokens the prefill computed; at least 1, the last prompt token is never reused."""
    onboarded_blocks: int
    """Blocks brought back from the host tier to admit the request."""
    last_logits: list[float] | None = None
    """Logits after the last prompt position (float32 values), when the caller asked for them."""
    logprobs: list[float] | None = None
    """Each output token's log-probability, when the request's ``sampling.logprobs`` asked for them."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per output token, the most likely tokens and their log-probabilities (``sampling.logprobs`` of them)."""
    admitted_step: int = 0
    """The rank's step at which the request joined the running batch (steps count from 1)."""
    finished_step: int = 0
    """The rank's step after which it left the batch, served."""
    beams: list[list[int]] | None = None
    """A beam search's beams, best first (``output_tokens`` is the first)."""
    beam_scores: list[float] | None = None
    """Each beam's summed log-probability of its tokens."""
    drafted_tokens: int = 0
    """Draft tokens the rank's steps checked for this request (prompt lookup)."""
    accepted_tokens: int = 0
    """Of those, the ones the model agreed with."""
    token_times_s: list[float] | None = None
    """Seconds from the rank taking the request to each output token (its queue wait included): the first is its
    time to first token on the rank, the gaps its inter-token latency (``None``: not timed, a beam search's)."""


class RankBusyError(RuntimeError):
    """The rank's queue is full: the requests were not taken (nothing changed); send them again later."""

    def __init__(self, rank: int, queued: int, limit: int) -> None:
        super().__init__(rank, queued, limit)
        self.rank, self.queued, self.limit = rank, queued, limit

    def __str__(self) -> str:
        return f"rank {self.rank} is busy: {self.queued} requests queued (max_queued_requests={self.limit})"


@dataclass(frozen=True, slots=True)
class ServeReply:
    """A served batch: one outcome per request, in order, and (when asked) the events serving it caused.

    ``events`` is the batch the rank published right after serving, before it let
    go of its ledger, so a router indexes what a request stored before it
    answers the request (the next prompt sharing the prefix is routed on it).
    """

    outcomes: list[ServeOutcome]
    events: PublishedBatch | None = None


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One rank's own report of its queue and its blocks, in one call."""

    rank: int
    ready: bool
    """Whether the rank has a ledger (block counts agreed); a rank that restarted has none until then."""
    publishing: bool = False
    """Whether a publisher thread pushes this rank's event batches."""
    queued_prefill_tokens: int = 0
    """Prompt tokens of the requests waiting to join the running batch."""
    queued_requests: int = 0
    """Requests waiting to join the running batch."""
    running_requests: int = 0
    """Requests in the running batch (prefilling or decoding)."""
    served_requests: int = 0
    device_blocks_used: int = 0
    device_blocks_free: int = 0
    host_blocks_used: int = 0
    host_blocks_free: int = 0
    cache_hit_rate: float = 0.0
    """The ledger's reused / (reused + missed) blocks."""
    published_batches: int = 0
    """Event batches the rank has published (the number its next one gets): a router behind it has lost some."""
    steps: int = 0
    """Steps the running batch has taken."""
    peak_running_requests: int = 0
    """Most requests the batch ever ran at once (at most ``max_num_seqs``)."""
    peak_step_tokens: int = 0
    """Most tokens one step ever computed (at most ``max_num_batched_tokens``)."""
    preempted_requests: int = 0
    """Requests taken out of the batch to start over because a step found its blocks taken."""
    refused_requests: int = 0
    """Requests refused because the queue was full."""
    onboard_s_per_block: float | None = None
    """Seconds the rank measured to bring one block up from its host tier (``None``: not measured)."""

    @property
    def device_blocks(self) -> int:
        return self.device_blocks_used + self.device_blocks_free


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where a rank lives and what it is made of (what ``kvledger status`` shows)."""

    rank: int
    device: str
    backend: str
    """The process group's backend: ``nccl`` between GPUs, ``gloo`` between CPUs."""
    in_group: bool
    ready: bool
    tokens_per_block: int
    device_blocks: int = 0
    """Device-tier blocks, summed over the attention windows' pools (``windows`` has each: no request can use the
    sum of several)."""
    host_blocks: int = 0
    transfers: dict[str, int] = field(default_factory=dict)
    """How this rank's migrations moved their bytes: sent/received straight from the pool or through staging."""
    model: str = ""
    """The model the rank serves (the reference engine's name)."""
    tokenizer: object = None
    """The model's tokenizer: ``encode(text, add_special_tokens)``, ``decode(ids)``, ``name`` and ``vocab_size``
    (``router.prompt_tokenizer.PromptTokenizer``), so the router needs no import from the engine."""
    max_context: int | None = None
    """The most prompt and output tokens one request can ever hold here (the full-attention window's pool;
    ``None``: no bound known)."""
    windows: tuple[tuple[int | None, int, int], ...] = ()
    """Each attention window's own pool: ``(window in tokens or None for full attention, device blocks, host
    blocks)``, in the ledger's window order; empty before the ledger is built."""


@dataclass(frozen=True, slots=True)
class ExportTicket:
    """The source side of a migration: ``blocks`` full prefix blocks pinned under ``pin_id``."""

    pin_id: int
    blocks: int


@dataclass(frozen=True, slots=True)
class ImportTicket:
    """The target side of a migration: ``blocks`` destination blocks allocated under ``import_id``.

    They are the last ``blocks`` of the source's pinned prefix (the target shares
    the ones it already holds); with none to receive, the import is already over.
    """

    import_id: int
    blocks: int
