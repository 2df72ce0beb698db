"""Block budgets as TensorRT-LLM computes them, as pure functions of lengths.

``getNeededBlocksOneStep`` (a context, a decode step) and
``getRemainingBlocksToCompletion`` in the manager's terms. Kept apart from the
books so that a scheduler's arithmetic is tested on its own, and take the
attention window as a number so that a sliding window plugs in by its size
(the ledger has one full-attention window today: ``window=None``).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvledger.worker.ledger.stats import PrefixReuseSummary


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sink_bubble(sink_tokens: int, tokens_per_block: int) -> int:
    """Slots the sink tokens leave empty in their last block (TensorRT-LLM's ``mSinkBubbleLength``)."""
    rest = sink_tokens % tokens_per_block
    return tokens_per_block - rest if rest else 0


@dataclass(frozen=True, slots=True)
class ContextBudget:
    """What admitting a request's context costs the scheduler."""

    blocks: int
    """Free blocks the context needs: shared full blocks once, the partial tail once per beam, minus the matched
    blocks that running requests already hold."""
    estimated_reusable_tokens: int
    """Prompt tokens the prefix tree is expected to supply: the compute the scheduler need not price."""


def context_budget(prompt_len: int, num_draft_tokens: int, max_new_tokens: int, beam_width: int,
                   tokens_per_block: int, chunk: int, window: int | None, bubble: int,
                   reuse: PrefixReuseSummary | None) -> ContextBudget:
    """TensorRT-LLM's budget of a context: ``min(prompt + drafts, window + chunk) + sink bubble`` tokens.

    Drafts count up to ``max_new_tokens`` (more cannot be written). A window
    keeps at most ``window`` tokens and a chunk adds ``chunk`` more. The
    discount of a prefix match is capped by the blocks the window can recover
    (the last prompt token is never reused); ``reuse=None`` when reuse is off.
    """
    T = tokens_per_block
    drafts = min(num_draft_tokens, max_new_tokens)
    span = prompt_len + drafts if window is None else min(prompt_len + drafts, window + chunk)
    shared, rest = divmod(span + bubble, T)
    blocks = shared + (beam_width if rest else 0)
    if reuse is None:
        return ContextBudget(blocks, 0)
    recoverable = ((prompt_len if window is None else min(prompt_len, window + chunk)) - 1) // T
    blocks -= min(reuse.reusable_blocks_allocated, shared, recoverable)
    return ContextBudget(blocks, min(reuse.reusable_blocks_all, shared, recoverable) * T)


def step_blocks(num_tokens: int, blocks_per_beam: int, num_draft_tokens: int, beam_width: int,
                tokens_per_block: int, two_steps_lookahead: bool) -> int:
    """Blocks the next decode step (or two, looking ahead) allocates: ``1 + drafts`` tokens a step, every beam."""
    add = (2 if two_steps_lookahead else 1) * (1 + num_draft_tokens)
    return max(0, ceil_div(num_tokens + add, tokens_per_block) - blocks_per_beam) * beam_width


def blocks_to_completion(prompt_len: int, max_new_tokens: int, num_draft_tokens: int, beam_width: int,
                         tokens_per_block: int) -> int:
    """Blocks a whole request holds at its end: the prompt's full blocks once, every later block per beam."""
    per_beam = ceil_div(prompt_len + max_new_tokens + num_draft_tokens, tokens_per_block)
    shared = prompt_len // tokens_per_block
    return shared + (per_beam - shared) * beam_width


def beam_tails(prompt_len: int, end: int, beam_width: int, tokens_per_block: int) -> int:
    """Blocks beams 1.. need of their own when a context chunk reaches ``end``: the prompt's last block, where
    the prompt ends mid-block (TensorRT-LLM shares it among the beams only when the prompt fills it)."""
    return beam_width - 1 if end == prompt_len and end % tokens_per_block else 0


def fit_token_counts(counts: list[int], cuttable: list[bool], max_num_tokens: int) -> list[int]:
    """``counts`` with the cuttable ones (context chunks) shrunk, last first and to one token at least, until they
    sum to ``max_num_tokens`` at most, if they can."""
    out = list(counts)
    over = sum(out) - max_num_tokens
    for i in reversed(range(len(out))):
        if over <= 0:
            break
        if cuttable[i] and out[i] > 1:
            cut = min(over, out[i] - 1)
            out[i] -= cut
            over -= cut
    return out
