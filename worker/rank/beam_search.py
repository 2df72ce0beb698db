"""The hypotheses of one beam search while it decodes in a rank's running batch, and what it ends with.

The beams share the prompt's blocks, computed once; each beam holds its own
blocks past them (the ledger's beams). Every step feeds each beam's last
token through its own row of the block table; the beams are then chosen anew
from the ``width`` best continuations of them all, and a beam that takes up
another beam's hypothesis gets a copy of that beam's own blocks (TensorRT-LLM
reads them through a cache indirection instead; the KV each beam attends to is
the same).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BeamResult:
    """The beams a beam search ended with, best first."""

    tokens: list[list[int]]
    """Generated tokens of each beam, ``max_new_tokens`` each."""
    scores: list[float]
    """Each beam's summed log-probability of its tokens."""
    last_logits: torch.Tensor
    """Logits after each beam's whole sequence (prompt and generated tokens): float32 ``[width, vocab]``, CPU."""
    copied_blocks: int
    """Beam-owned blocks copied when beams took up another beam's hypothesis."""


@dataclass(slots=True)
class BeamSearch:
    """See the module docstring: the beams, their scores, and the final logits once the last step ran."""

    beams: list[list[int]]
    scores: torch.Tensor
    max_new_tokens: int
    copied_blocks: int = 0
    final_logits: torch.Tensor | None = None

    @classmethod
    def start(cls, prompt_logits: torch.Tensor, width: int, max_new_tokens: int) -> BeamSearch:
        """The first beams: the ``width`` likeliest tokens after the prompt."""
        scores, first = torch.log_softmax(prompt_logits.float(), dim=-1).topk(width)
        return cls([[t] for t in first.tolist()], scores, max_new_tokens)

    @property
    def done(self) -> bool:
        return self.final_logits is not None

    def inputs(self) -> list[list[int]]:
        """What this step feeds each beam's row: its last token."""
        return [[b[-1]] for b in self.beams]

    def advance(self, logits: torch.Tensor) -> list[int] | None:
        """Take a step's logits ``[width, vocab]``: after the last token they are the final ones (``None``);
        otherwise the beams are chosen anew, and each new beam's parent beam is returned."""
        if len(self.beams[0]) == self.max_new_tokens:
            self.final_logits = logits.float().cpu().clone()
            return None
        width, vocab = logits.shape
        scores, flat = (self.scores[:, None] + torch.log_softmax(logits.float(), dim=-1).to(self.scores.device)) \
            .flatten().topk(width)
        parents = (flat // vocab).tolist()
        self.beams = [self.beams[p] + [t] for p, t in zip(parents, (flat % vocab).tolist())]
        self.scores = scores
        return parents

    def result(self) -> BeamResult:
        assert self.final_logits is not None, "the beam search has not run its last step"
        return BeamResult(self.beams, self.scores.float().cpu().tolist(), self.final_logits, self.copied_blocks)
