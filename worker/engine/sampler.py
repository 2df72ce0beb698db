"""Choosing each request's next token from its logits: greedy, or seeded sampling, and the log-probabilities.

Greedy requests take the arg-max, exactly as the engine always did, so every
oracle comparison of greedy output holds bit for bit. A sampling request's
logits are divided by its temperature, cut to its ``top_k`` most likely tokens
and to the smallest set whose probability reaches ``top_p``, and drawn with a
``torch.Generator`` of its own, seeded once by ``Sampling.seed``: the same
seed gives the same tokens, whatever else is in the batch. Log-probabilities
are of the model's own distribution (the raw logits), as vLLM reports them.
"""
from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvledger.worker.wire.request import Request


@dataclass(slots=True)
class TokenLogprobs:
    """Per generated token: its log-probability, and the most likely tokens' (``Sampling.logprobs`` of them)."""

    chosen: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)


class Sampler:
    """The token choice of a batch of requests, which requests join and leave (see the module docstring)."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self.logprobs: dict[int, TokenLogprobs] = {}
        self.add(requests)

    def add(self, requests: Sequence[Request]) -> None:
        """Requests joining the batch: a generator of their own (seeded once) and their log-probabilities."""
        for r in requests:
            if not r.sampling.greedy:
                self._generators[r.request_id] = torch.Generator().manual_seed(
                    r.sampling.seed if r.sampling.seed is not None else secrets.randbits(63))
            if r.sampling.logprobs is not None:
                self.logprobs[r.request_id] = TokenLogprobs()

    def drop(self, request_id: int) -> None:
        """A request left the batch (finished, or preempted to start over: added again, it draws anew)."""
        self._generators.pop(request_id, None)
        self.logprobs.pop(request_id, None)

    def pick(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
        """One token per row of ``logits [n, vocab]``, row ``i`` for ``requests[i]``."""
        chosen = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(requests):
            if not r.sampling.greedy:
                chosen[i] = self._sample(logits[i].float(), r)
        if self.logprobs:
            log_p = torch.log_softmax(logits.float(), dim=-1)
            for i, r in enumerate(requests):
                out = self.logprobs.get(r.request_id)
                if out is not None:
                    out.chosen.append(log_p[i, chosen[i]].item())
                    k = r.sampling.logprobs
                    values, ids = log_p[i].topk(k) if k else (log_p[i, :0], log_p[i, :0].long())
                    out.top.append(list(zip(ids.tolist(), values.tolist())))
        return chosen

    def accept(self, logits: torch.Tensor, request: Request, drafts: Sequence[int]) -> list[int]:
        """The tokens a step that checked ``drafts`` emits, from its logits ``[1 + len(drafts), vocab]`` (row ``j``
        after the step's ``j``-th input): each row's pick in order, up to the first that differs from the draft
        it checks, and that pick too (after the last draft, the pick that follows it).

        The pick at row ``j`` is the one decoding without drafts would make
        there, since every draft before it was accepted; a seeded request draws
        once per emitted token, so it emits the tokens it would emit drafting
        nothing."""
        out: list[int] = []
        for j in range(len(drafts) + 1):
            (t,) = self.pick(logits[j:j + 1], [request])
            out.append(t)
            if j == len(drafts) or t != drafts[j]:
                break
        return out

    def _sample(self, logits: torch.Tensor, r: Request) -> int:
        s = r.sampling
        scaled = logits / s.temperature
        if s.top_k > 0 and s.top_k < scaled.numel():
            kth = scaled.topk(s.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if s.top_p < 1:
            sorted_p, order = probs.sort(descending=True)
            outside = sorted_p.cumsum(0) - sorted_p >= s.top_p   # tokens after the set has reached top_p
            outside[0] = False   # the most likely token always stays (a top_p below float32's least is 0)
            probs = probs.index_fill(0, order[outside], 0.0)
        return int(torch.multinomial(probs, 1, generator=self._generators[r.request_id]).item())
