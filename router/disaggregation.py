"""Prefill apart from decode on own ranks: when a request is worth splitting, and what a split costs.

Some of a cluster's ranks may only prefill (``RouterConfig.prefill_rank_ids``): they compute prompts and never
decode. The others serve whole requests, as in a cluster without roles, and decode the split ones. For each
request the router weighs two ways (``SplitPlanner.plan``), in seconds:

- *whole*, on the rank the policy picked among the serving ranks: its queued prefill, the part of the prompt it
  lacks, and the stall that prefill puts on each request in flight there (``interference_weight`` times the
  prefill's seconds per request: the inter-token gap those requests see);
- *split*: prefill on the prefill rank with the least queue and compute for this prompt (its cached prefix
  counts), then the prompt's full blocks move to the serving rank with the fewest requests in flight that has room for
  the request, which computes only the tail past the last full block (and stalls its decodes for that only).

Seconds per prompt token are each rank's learned figure (``router.engine_rates``), ``prefill_s_per_token`` until
learned; a transfer's seconds come from the migrations the router timed (``TransferRate``: setup plus per block,
the priors until two sizes were seen).

The KV moves on a ``Link``: own ranks migrate blocks over ``torch.distributed``; vLLM servers hand them over
through their KV connector (``router.kv_connector``), whose transfer is inside the two requests the router sends
(the prefill server's keeping of the KV, the decode server's taking it), so it is counted in the ranks' learned
rates, not apart. A prefill rank pairs only with serving ranks on its own link.

A prompt whose uncached part on the whole rank is shorter than ``min_split_tokens`` is never split: it is not
worth moving. In mode ``always`` every longer one is.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvledger.router.policies.base import RankState, RouteDecision, RouteRequest, Split, check_nonneg_numbers
from kvledger.router.policies.kv import KvCostModel
from kvledger.router.probe import PrefixMatch

_KV = KvCostModel()
SPLIT_MODES = ("cost", "always")


@dataclass(frozen=True, slots=True)
class SplitConfig:
    """When the router splits a request (see the module docstring); seconds are priors, replaced by
    measurements as the router makes them."""

    mode: Literal["cost", "always"] = "cost"
    """``cost``: split when the estimate says it pays; ``always``: split every prompt of ``min_split_tokens``
    uncached tokens or more (vllm-router's P/D mode, Dynamo's with a prefill-length threshold)."""
    min_split_tokens: int = 256
    """Uncached prompt tokens below which a request is served whole."""
    interference_weight: float = 1.0
    """Seconds of stall a prefill puts on each request decoding beside it, per second of the prefill (0: a
    prefill delays only its own first token)."""
    prefill_s_per_token: float = _KV.prefill_s_per_token
    """A rank's seconds per prompt token until it is learned."""
    transfer_setup_s: float = _KV.migrate_setup_s
    """A transfer's fixed seconds until measured."""
    transfer_s_per_block: float = _KV.migrate_s_per_block
    """A transfer's seconds per block until measured."""

    def __post_init__(self) -> None:
        if self.mode not in SPLIT_MODES:
            raise ValueError(f"split mode must be one of {', '.join(SPLIT_MODES)}, got {self.mode!r}")
        if type(self.min_split_tokens) is not int or self.min_split_tokens < 1:
            raise ValueError(f"min_split_tokens must be an int >= 1, got {self.min_split_tokens!r}")
        check_nonneg_numbers(self, skip=("mode", "min_split_tokens"), prefix="split: ")


class Link(enum.Enum):
    """The path a split's KV takes from the prefill rank to the decode rank (see the module docstring)."""

    MIGRATION = "migration"
    """Own ranks: blocks move over ``torch.distributed`` (``Engines.migrate``)."""
    CONNECTOR = "connector"
    """vLLM servers: the prefill server's KV connector hands them to the decode server's."""


class TransferRate:
    """Seconds a migration takes for its blocks, fitted (least squares, ``setup + blocks * per_block``) over the
    last ``window`` the router timed; thread-safe."""

    def __init__(self, setup_s: float, per_block_s: float, window: int = 64) -> None:
        self._prior = (setup_s, per_block_s)
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and math.isfinite(seconds) and seconds >= 0:
            with self._lock:
                self._samples.append((blocks, seconds))

    def figures(self) -> tuple[float, float]:
        """``(setup seconds, seconds per block)``: the fit once two block counts were seen, else the priors (with
        one count seen, its mean seconds per block over the prior setup)."""
        with self._lock:
            samples = list(self._samples)
        setup, per_block = self._prior
        if not samples:
            return setup, per_block
        xs, ys = [float(b) for b, _ in samples], [s for _, s in samples]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var == 0:
            return setup, max(0.0, (my - setup) / mx)
        slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var)
        return max(0.0, my - slope * mx), slope

    def seconds(self, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        setup, per_block = self.figures()
        return setup + blocks * per_block


class SplitPlanner:
    """Decides per request between serving whole and splitting (see the module docstring)."""

    def __init__(self, config: SplitConfig, transfer: TransferRate) -> None:
        self.config = config
        self.transfer = transfer

    def plan(self, request: RouteRequest, decision: RouteDecision, serving: Mapping[int, RankState],
             prefill: Sequence[RankState], matches: Mapping[int, PrefixMatch], rates: Mapping[int, float],
             links: Mapping[int, Link] | None = None) -> RouteDecision:
        """``decision``, or in its place the split that pays: decode on the rank it names, prefill on its
        ``split.prefill_rank``. ``serving``: the states the policy weighed; ``prefill``: the live prefill ranks';
        ``rates``: learned seconds per prompt token; ``links``: each rank's ``Link`` (a rank absent has none;
        ``None``: every rank migrates)."""
        c = self.config
        if not prefill:
            return decision
        n, bs = len(request.tokens), request.tokens_per_block
        full = len(request.block_hashes)

        def held(rank: int) -> int:
            m = matches.get(rank)
            return 0 if m is None else m.matched_tokens

        def rate(rank: int) -> float:
            return rates.get(rank) or c.prefill_s_per_token

        def link(rank: int) -> Link | None:
            return Link.MIGRATION if links is None else links.get(rank)

        whole = serving[decision.rank]
        lacks = n - held(whole.rank)
        if lacks < c.min_split_tokens or full == 0:
            return decision
        whole_s = self._compute(whole, lacks, rate(whole.rank))
        prefill_cost = {s.rank: (s.queued_prefill_tokens + n - held(s.rank)) * rate(s.rank) for s in prefill}
        need = -(-(n + request.max_tokens) // bs)
        best: tuple[float, int, int] | None = None
        for path in dict.fromkeys(link(s.rank) for s in prefill):
            decoders = [s for s in serving.values() if path is not None and link(s.rank) is path]
            if not decoders:
                continue
            p = min((s for s in prefill if link(s.rank) is path), key=lambda s: (prefill_cost[s.rank], s.rank))
            roomy = [s for s in decoders if _room(s) >= need - held(s.rank) // bs] or decoders
            d = min(roomy, key=lambda s: (s.inflight_requests, s.dispatched_blocks, -held(s.rank), s.rank))
            moved = self.transfer.seconds(full - held(d.rank) // bs) if path is Link.MIGRATION else 0.0
            split_s = prefill_cost[p.rank] + moved + self._compute(d, n - full * bs, rate(d.rank))
            if best is None or split_s < best[0]:
                best = (split_s, p.rank, d.rank)
        if best is None or (best[0] >= whole_s and c.mode == "cost"):
            return decision
        split_s, p_rank, d_rank = best
        return dataclasses.replace(decision, rank=d_rank, split=Split(p_rank, whole.rank, split_s, whole_s))

    def _compute(self, s: RankState, tokens: int, rate: float) -> float:
        """Seconds ``tokens`` of prefill on ``s`` cost: its queue and its own compute, plus the stall it puts on the
        requests in flight there (decoding, or to decode once their own prefill is done)."""
        own = tokens * rate
        return s.queued_prefill_tokens * rate + own + self.config.interference_weight * own * s.inflight_requests


def _room(s: RankState) -> int:
    """Device blocks free on ``s`` as far as the router knows (its report, or the blocks dispatched there); an
    unknown pool has room."""
    if not s.kv_total_blocks:
        return 1 << 62
    return s.kv_total_blocks - s.blocks_in_use
