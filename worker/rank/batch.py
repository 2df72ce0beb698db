"""A rank's running batch and its steps: the one driver of the rank's ledger.

As vLLM splits its scheduler from its model runner, ``BatchDriver`` makes
every call into the ledger (admission, each step's blocks, storing, rewinding,
finishing, aborting) and the ``ReferenceEngine`` only runs the model over the
inputs and block tables it is handed. A step is planned, then committed:

- **planned**: every block the step needs is taken before any sequence moves.
  The decoding requests grow first, all of them in every window or none
  (``check_decode_step``; a request with drafts by ``1 + drafts`` tokens, a
  beam search by a token per beam), then context chunks take what is left, in
  batch order, while the step's token budget lasts. A step that cannot be
  planned raises ``OutOfBlocksError`` having changed nothing, and the caller
  preempts or waits: no request ever counts a token whose KV is not written.
- **run**: one batched forward of every chunk and decoded token.
- **committed**: a finished prompt's blocks are stored and its first token
  picked; a decoder's drafts are checked against what the model picks after
  each (``Sampler.accept``) and the rejected ones rewound; a beam search's
  beams are chosen anew, copying the blocks of the beams taken up.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.engine.sampler import Sampler, TokenLogprobs
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.rank.beam_search import BeamResult, BeamSearch
from kvledger.worker.rank.drafts import propose_drafts
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.request import Request


@dataclass(slots=True)
class ServeResult:
    """What serving one request produced and how much of its prompt the cache supplied."""

    request_id: int
    output_tokens: list[int]
    """``max_new_tokens`` tokens, greedy or sampled as the request's ``sampling`` says (a beam search's best beam)."""
    last_logits: torch.Tensor
    """Logits after the last prompt position: float32 ``[vocab]`` on the CPU."""
    cached_tokens: int
    """Prompt tokens whose KV the ledger supplied (reused, copied or onboarded)."""
    computed_tokens: int
    """Prompt tokens the prefill computed; at least 1, the last prompt token is never reused."""
    onboarded_blocks: int
    """Blocks brought back from the host tier to admit the request."""
    logprobs: TokenLogprobs | None = None
    """Each output token's log-probability and the most likely ones', when the request asked for them."""
    drafted_tokens: int = 0
    """Draft tokens the steps checked (``Request.num_draft_tokens`` at most per step)."""
    accepted_tokens: int = 0
    """Of those, the ones the model picked too: tokens gained over decoding one a step."""
    beams: BeamResult | None = None
    """A beam search's beams, best first."""
    token_times: list[float] = field(default_factory=list)
    """``time.monotonic()`` when each step's tokens of ``output_tokens`` were picked, one entry per token (a step
    that accepts drafts emits several at once): what a client streaming them would see."""


@dataclass(slots=True, eq=False)
class RunningRequest:
    """One request of a running batch: what the cache supplied, and its result once its prompt is computed."""

    request: Request
    cached_tokens: int
    onboarded_blocks: int
    result: ServeResult | None = None
    """Set when the last context chunk is computed (``prefilled``); its tokens grow a step at a time."""
    next_chunk: bool = False
    """The current context chunk is computed and the next one is not admitted yet (``add_context_chunk``)."""
    search: BeamSearch | None = None
    """A beam search's beams, from its prompt's last chunk on."""

    @property
    def prefilled(self) -> bool:
        return self.result is not None

    @property
    def finished(self) -> bool:
        if self.result is None:
            return False
        if self.search is not None:
            return self.search.done
        return len(self.result.output_tokens) >= self.request.max_new_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step computed: context-chunk tokens, decoded tokens (drafts and beams included), requests in it."""

    prefill_tokens: int
    decode_tokens: int
    requests: int

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(slots=True)
class _Decode:
    """A decoding request's part of a planned step: a row per beam, each its tokens at ``start`` on."""

    running: RunningRequest
    rows: list[list[int]]
    start: int
    drafts: list[int]


@dataclass(slots=True)
class StepPlan:
    """A step whose blocks are all taken: the context chunks ``(request, start, end)`` and the decodes."""

    chunks: list[tuple[RunningRequest, int, int]]
    decodes: list[_Decode]

    def inputs(self) -> tuple[list[RunningRequest], list[list[int]], list[int]]:
        """Per row of the forward: its request, its tokens and their first position (chunks, then decodes)."""
        owners = [r for r, _, _ in self.chunks] + [d.running for d in self.decodes for _ in d.rows]
        tokens = [r.request.tokens[s:e] for r, s, e in self.chunks] + [row for d in self.decodes for row in d.rows]
        starts = [s for _, s, _ in self.chunks] + [d.start for d in self.decodes for _ in d.rows]
        return owners, tokens, starts


class BatchDriver:
    """See the module docstring; ``serve`` runs a batch to completion on its own."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine

    def serve(self, manager: KVCacheManager, requests: Sequence[Request]) -> list[ServeResult]:
        """Admit ``requests`` into ``manager``, run them to ``max_new_tokens`` and release them.

        Bad input raises before the ledger changes. Once prefill has written the
        prompts' KV, the requests leave the ledger even when a step fails, so
        only written KV is stored.
        """
        self.engine.check(manager, requests)
        sampler = Sampler(())
        batch = self.admit(manager, requests, sampler)
        try:
            while unfinished := [r for r in batch if not r.finished]:
                self.step(manager, unfinished, sampler)
        except BaseException:
            self.abort(manager, batch)
            raise
        return self.finish(manager, batch)

    def admit(self, manager: KVCacheManager, requests: Sequence[Request], sampler: Sampler) -> list[RunningRequest]:
        """Admit checked ``requests`` together (``add_sequences``: their first context chunks) into a running
        batch, their token choice into ``sampler``; ``OutOfBlocksError`` before anything changes."""
        if not requests:
            return []
        cached = manager.add_sequences(list(requests))
        sampler.add(requests)
        return [RunningRequest(r, c, manager.admission(r.request_id).onboarded_blocks)
                for r, c in zip(requests, cached)]

    def step(self, manager: KVCacheManager, batch: Sequence[RunningRequest], sampler: Sampler,
             max_tokens: int | None = None) -> StepRecord:
        """Plan, run and commit one step of the unfinished ``batch`` (see the module docstring), computing
        ``max_tokens`` tokens at most; raises ``OutOfBlocksError`` having changed nothing when the decoding
        requests cannot grow, or when no chunk can be admitted and nothing decodes."""
        plan = self.plan(manager, batch, max_tokens)
        owners, tokens, starts = plan.inputs()
        logits = self.engine.forward(manager.pools.primary_pools, self._table(manager, plan), tokens, starts,
                                     [r.request.lora_id for r in owners])
        self._commit(manager, plan, [len(t) for t in tokens], logits, sampler)
        return StepRecord(sum(e - s for _, s, e in plan.chunks), sum(len(r) for d in plan.decodes for r in d.rows),
                          len(plan.chunks) + len(plan.decodes))

    def plan(self, manager: KVCacheManager, batch: Sequence[RunningRequest], max_tokens: int | None) -> StepPlan:
        """Take every block the step needs (see the module docstring)."""
        decoding = [r for r in batch if r.prefilled]
        # all or none: every decoder's growth, in every window, is checked before any is taken, and taken before
        # any context chunk may take a block
        manager.check_decode_step([r.request.request_id for r in decoding])
        drafts = self._drafts(decoding, max_tokens)
        decodes = []
        for r, d in zip(decoding, drafts):
            rid = r.request.request_id
            if r.search is not None:
                manager.add_token(rid, 1)
                decodes.append(_Decode(r, r.search.inputs(), manager.num_tokens(rid) - 1, []))
                continue
            row = [r.result.output_tokens[-1], *d]
            manager.add_token(rid, len(row), tokens=row)
            decodes.append(_Decode(r, [row], manager.num_tokens(rid) - len(row), d))
        left = None if max_tokens is None else max_tokens - sum(len(row) for d in decodes for row in d.rows)
        chunks: list[tuple[RunningRequest, int, int]] = []
        for r in batch:
            if r.prefilled or (left is not None and left < 1):
                continue
            rid = r.request.request_id
            if r.next_chunk:
                try:
                    manager.add_context_chunk(rid)
                except OutOfBlocksError:
                    continue
                r.next_chunk = False
            start, end = manager.context_chunk(rid)
            if left is not None and end - start > left:
                manager.fit_token_budget([rid], left)
                end = start + left
            chunks.append((r, start, end))
            left = None if left is None else left - (end - start)
        if not chunks and not decodes:
            ids = [r.request.request_id for r in batch]
            raise OutOfBlocksError(1, manager.stats().free_num_blocks, f"admitting the next context chunk of "
                                                                       f"request(s) {ids}")
        return StepPlan(chunks, decodes)

    @staticmethod
    def _drafts(decoding: Sequence[RunningRequest], max_tokens: int | None) -> list[list[int]]:
        """Each decoder's drafts: prompt lookup, ``num_draft_tokens`` at most and never past ``max_new_tokens``;
        the last decoders' are cut while the step's decode tokens would pass ``max_tokens``."""
        drafts = []
        for r in decoding:
            req, out = r.request, r.result.output_tokens
            k = 0 if r.search is not None else min(req.num_draft_tokens, req.max_new_tokens - len(out) - 1)
            drafts.append(propose_drafts(req.tokens + out, k) if k > 0 else [])
        over = 0 if max_tokens is None else sum(
            r.request.beam_width + len(d) for r, d in zip(decoding, drafts)) - max_tokens
        for d in reversed(drafts):
            if over <= 0:
                break
            cut = min(over, len(d))
            del d[len(d) - cut:]
            over -= cut
        return drafts

    @staticmethod
    def _table(manager: KVCacheManager, plan: StepPlan) -> torch.Tensor:
        """The block table's rows the step's inputs read: beam 0's for a context chunk, every beam's to decode."""
        running = [r for r, _, _ in plan.chunks] + [d.running for d in plan.decodes]
        widths = [r.request.beam_width for r in running]
        table = manager.block_table([r.request.request_id for r in running])
        if max(widths) == 1:
            return table
        first = (torch.tensor(widths).cumsum(0) - torch.tensor(widths)).tolist()
        rows = first[:len(plan.chunks)] + [f + b for f, d in zip(first[len(plan.chunks):], plan.decodes)
                                           for b in range(len(d.rows))]
        return table[torch.tensor(rows, device=table.device)]

    def _commit(self, manager: KVCacheManager, plan: StepPlan, lens: list[int], logits: torch.Tensor,
                sampler: Sampler) -> None:
        """Store finished prompts, pick tokens, check drafts and choose beams, from the step's ``logits`` (``lens``
        tokens per input row, in ``StepPlan.inputs`` order)."""
        ends = torch.tensor(lens).cumsum(0).tolist()
        now = time.monotonic()
        picking: list[tuple[RunningRequest, int]] = []
        for (r, _, end), row_end in zip(plan.chunks, ends):
            rid, n = r.request.request_id, len(r.request.tokens)
            if end < n:
                r.next_chunk = True
                continue
            last = logits[row_end - 1]
            r.result = ServeResult(rid, [], last.float().cpu().clone(), r.cached_tokens, n - r.cached_tokens,
                                   r.onboarded_blocks, sampler.logprobs.get(rid))
            manager.store_context_blocks(rid)
            if r.request.beam_width > 1:
                self._start_beams(manager, r, last)
            elif r.request.max_new_tokens > 0:
                picking.append((r, row_end - 1))
        row = len(plan.chunks)
        for d in plan.decodes:
            r, first = d.running, ends[row] - lens[row]
            row += len(d.rows)
            if r.search is not None:
                parents = r.search.advance(logits[first:first + len(d.rows)])
                if parents is not None:
                    r.search.copied_blocks += self._copy_beams(manager, r.request, parents)
            elif d.drafts:
                emitted = sampler.accept(logits[first:first + len(d.drafts) + 1], r.request, d.drafts)
                if len(emitted) <= len(d.drafts):
                    manager.rewind(r.request.request_id, len(d.drafts) - len(emitted) + 1)
                r.result.output_tokens += emitted
                r.result.token_times += [now] * len(emitted)
                r.result.drafted_tokens += len(d.drafts)
                r.result.accepted_tokens += len(emitted) - 1
            else:
                picking.append((r, first))
        if picking:
            picked = sampler.pick(logits[torch.tensor([i for _, i in picking], device=logits.device)],
                                  [r.request for r, _ in picking])
            for (r, _), t in zip(picking, picked):
                r.result.output_tokens.append(t)
                r.result.token_times.append(now)

    def _start_beams(self, manager: KVCacheManager, r: RunningRequest, prompt_logits: torch.Tensor) -> None:
        """A beam search's prompt is computed: its last, partly filled block's positions are written into every
        other beam's own copy of it, and the first beams are the likeliest tokens after the prompt."""
        req = r.request
        T = manager.tokens_per_block
        start, n = len(req.tokens) // T * T, len(req.tokens)
        if start < n:
            others = req.beam_width - 1
            self.engine.forward(manager.pools.primary_pools, manager.block_table([req.request_id])[1:],
                                [req.tokens[start:]] * others, [start] * others, [req.lora_id] * others)
        r.search = BeamSearch.start(prompt_logits, req.beam_width, req.max_new_tokens)

    def _copy_beams(self, manager: KVCacheManager, request: Request, parents: list[int]) -> int:
        """Give beam ``b`` the own blocks of beam ``parents[b]``; returns the blocks copied."""
        T = manager.tokens_per_block
        rid = request.request_id
        own = manager.block_table([rid])[:, len(request.tokens) // T:-(-manager.num_tokens(rid) // T)]
        moved = [b for b, p in enumerate(parents) if p != b]
        if not moved:
            return 0
        src = own[torch.tensor([parents[b] for b in moved], device=own.device)].flatten().long()
        dst = own[torch.tensor(moved, device=own.device)].flatten().long()
        self.engine.copy_blocks(manager.pools.primary_pools, src, dst)
        return dst.numel()

    def finish(self, manager: KVCacheManager, done: Sequence[RunningRequest]) -> list[ServeResult]:
        """Release finished requests (their last sampled token counted first, ``_count_final_tokens``)."""
        self._count_final_tokens(manager, done)
        for r in done:
            if r.search is not None:
                r.result.beams = r.search.result()
                r.result.output_tokens = list(r.result.beams.tokens[0])
            manager.remove_sequence(r.request.request_id)
        return [r.result for r in done]

    @staticmethod
    def abort(manager: KVCacheManager, batch: Sequence[RunningRequest]) -> None:
        """Take ``batch`` out of the ledger unfinished: only KV that was written is stored (a context chunk
        admitted and not computed never becomes reusable)."""
        for r in batch:
            manager.remove_sequence(r.request.request_id, store=r.prefilled)

    @staticmethod
    def _count_final_tokens(manager: KVCacheManager, done: Sequence[RunningRequest]) -> None:
        """Count each request's last sampled token, as TensorRT-LLM does, so the ledger knows the whole sequence.

        Its KV is never computed, and the ledger stores all but the last counted
        token at release, so the block the final output completes becomes
        reusable (a follow-up turn that repeats the output reuses it). When the
        tokens would need more blocks than are free, they stay uncounted: that
        block then is not stored, and nothing fails. A beam search counted its
        every token as it computed it.
        """
        done = [r for r in done if r.request.max_new_tokens > 0 and r.search is None]
        ids = [r.request.request_id for r in done]
        try:
            manager.check_decode_step(ids)
        except OutOfBlocksError:
            return
        for r, rid in zip(done, ids):
            manager.add_token(rid, 1, tokens=[r.result.output_tokens[-1]])
