"""The reference engine: serves requests through a ledger with the tiny paged model, greedily or sampled.

It is the oracle for the ledger: whatever the manager reuses, copies, onboards
or migrates, a request must come out with the same logits and tokens as on a
fresh manager, because attention reads every position back from the pool
through the block table the manager hands out.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvledger.worker.engine.model import TinyDecoder
from kvledger.worker.engine.sampler import Sampler, TokenLogprobs
from kvledger.worker.engine.tokenizer import VOCAB_SIZE, ByteTokenizer
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.request import Request

#: The model the reference engine serves, as the router lists it.
MODEL_NAME = "kvledger-reference"
TOKENIZER = ByteTokenizer()


@dataclass(slots=True)
class ServeResult:
    """What serving one request produced and how much of its prompt the cache supplied."""

    request_id: int
    output_tokens: list[int]
    """``max_new_tokens`` tokens, greedy or sampled as the request's ``sampling`` says."""
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


@dataclass(slots=True)
class BeamSearchResult:
    """The beams a beam search ended with, best first."""

    request_id: int
    beams: list[list[int]]
    """Generated tokens of each beam, ``max_new_tokens`` each."""
    scores: list[float]
    """Each beam's summed log-probability of its tokens."""
    last_logits: torch.Tensor
    """Logits after each beam's whole sequence (prompt and generated tokens): float32 ``[beam_width, vocab]``, CPU."""
    cached_tokens: int
    """Prompt tokens whose KV the ledger supplied."""
    copied_blocks: int
    """Beam-owned blocks copied when beams took up another beam's hypothesis."""


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

    @property
    def prefilled(self) -> bool:
        return self.result is not None

    @property
    def finished(self) -> bool:
        return self.result is not None and len(self.result.output_tokens) >= self.request.max_new_tokens


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step computed: context-chunk tokens, decoded tokens (one per decoding request), requests in it."""

    prefill_tokens: int
    decode_tokens: int
    requests: int

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


class ReferenceEngine:
    """Steps over a running batch: each step one batched forward of context chunks and decoded tokens together
    (continuous batching); ``serve`` runs a batch to completion."""

    def __init__(self, config: CacheConfig, seed: int = 0) -> None:
        self.config = config
        self.model = TinyDecoder(config, seed)

    def serve(self, manager: KVCacheManager, requests: Sequence[Request]) -> list[ServeResult]:
        """Admit ``requests`` into ``manager``, run them to ``max_new_tokens`` and release them.

        Bad input raises before the ledger changes. Once prefill has written the
        prompts' KV, the requests leave the ledger even when decoding fails (for
        example ``OutOfBlocksError`` while growing), so only written KV is stored.
        """
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
        """Admit ``requests`` together (``add_sequences``: their first context chunks) into a running batch, their
        token choice into ``sampler``; bad input and ``OutOfBlocksError`` raise before anything changes."""
        self.check(manager, requests, beams=False)
        if not requests:
            return []
        cached = manager.add_sequences(list(requests))
        sampler.add(requests)
        return [RunningRequest(r, c, manager.admission(r.request_id).onboarded_blocks)
                for r, c in zip(requests, cached)]

    def step(self, manager: KVCacheManager, batch: Sequence[RunningRequest], sampler: Sampler,
             max_tokens: int | None = None) -> StepRecord:
        """One batched forward over the unfinished ``batch``: a token of every decoding request, then context
        chunks in ``batch`` order while ``max_tokens`` lasts (a chunk longer than what is left is cut with
        ``fit_token_budget``; the rest waits for a later step).

        The decoding requests grow first, all of them in every window or none (``check_decode_step``); the
        context chunks then take what is left. A request whose last chunk is computed gets its result and first
        token, and its prompt's blocks are stored. Raises ``OutOfBlocksError`` before anything changes when the
        decoding requests cannot grow, or when no chunk can be admitted and nothing decodes (the caller preempts
        or waits).
        """
        decoding = [r for r in batch if r.prefilled]
        # all or none: every decoder's growth, in every window, is checked and taken before any context chunk
        # may take a block, so no request counts a token whose KV this step does not write
        manager.check_decode_step([r.request.request_id for r in decoding])
        for r in decoding:
            manager.add_token(r.request.request_id, 1, tokens=[r.result.output_tokens[-1]])
        left = None if max_tokens is None else max_tokens - len(decoding)
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
        if not chunks and not decoding:
            ids = [r.request.request_id for r in batch]
            raise OutOfBlocksError(1, manager.stats().free_num_blocks, f"admitting the next context chunk of "
                                                                       f"request(s) {ids}")
        order = [r for r, _, _ in chunks] + decoding
        ids = [r.request.request_id for r in order]
        inputs = [r.request.tokens[s:e] for r, s, e in chunks] + [[r.result.output_tokens[-1]] for r in decoding]
        starts = [s for _, s, _ in chunks] + [manager.num_tokens(r.request.request_id) - 1 for r in decoding]
        logits = self.model.forward(manager.pools.primary_pools, manager.block_table(ids), inputs, starts,
                                    [r.request.lora_id for r in order])
        rows = (torch.tensor([len(x) for x in inputs]).cumsum(0) - 1).tolist()   # each request's last position
        picking: list[tuple[RunningRequest, int]] = []
        for (r, _, end), row in zip(chunks, rows):
            rid, n = r.request.request_id, len(r.request.tokens)
            if end < n:
                r.next_chunk = True
                continue
            r.result = ServeResult(rid, [], logits[row].float().cpu().clone(), r.cached_tokens, n - r.cached_tokens,
                                   r.onboarded_blocks, sampler.logprobs.get(rid))
            manager.store_context_blocks(rid)
            if r.request.max_new_tokens > 0:
                picking.append((r, row))
        picking += zip(decoding, rows[len(chunks):])
        if picking:
            picked = sampler.pick(logits[torch.tensor([row for _, row in picking], device=logits.device)],
                                  [r.request for r, _ in picking])
            for (r, _), t in zip(picking, picked):
                r.result.output_tokens.append(t)
        return StepRecord(sum(e - s for _, s, e in chunks), len(decoding), len(order))

    def finish(self, manager: KVCacheManager, done: Sequence[RunningRequest]) -> list[ServeResult]:
        """Release finished requests (their last sampled token counted first, ``_count_final_tokens``)."""
        self._count_final_tokens(manager, done)
        for r in done:
            manager.remove_sequence(r.request.request_id)
        return [r.result for r in done]

    @staticmethod
    def abort(manager: KVCacheManager, batch: Sequence[RunningRequest]) -> None:
        """Take ``batch`` out of the ledger unfinished: only KV that was written is stored (a context chunk
        admitted and not computed never becomes reusable)."""
        for r in batch:
            manager.remove_sequence(r.request.request_id, store=r.prefilled)

    def prefill(self, manager: KVCacheManager, requests: Sequence[Request]) -> torch.Tensor:
        """Compute the admitted requests' prompts, one batched forward per round of context chunks, and return the
        logits after each last prompt position, ``[len(requests), vocab]``.

        Each round computes every unfinished request's current chunk
        (``context_chunk``) and admits its next (``add_context_chunk``); a
        chunk reads the positions before it back from the pool. The last chunks
        are left for the caller to store.
        """
        pools = manager.pools.primary_pools
        last: list[torch.Tensor | None] = [None] * len(requests)
        active = list(range(len(requests)))
        for _ in range(max(len(r.tokens) for r in requests)):   # every round computes a token of each at least
            ids = [requests[i].request_id for i in active]
            spans = [manager.context_chunk(rid) for rid in ids]
            widths = torch.tensor([requests[i].beam_width for i in active])
            table = manager.block_table(ids)[(widths.cumsum(0) - widths).to(manager.pools.device)]   # beam 0's rows
            logits = self.model.forward(pools, table, [requests[i].tokens[s:e] for i, (s, e) in zip(active, spans)],
                                        [s for s, _ in spans], [requests[i].lora_id for i in active])
            rows = torch.tensor([e - s for s, e in spans]).cumsum(0) - 1
            still = []
            for i, (_, e), row in zip(active, spans, rows.tolist()):
                if e == len(requests[i].tokens):
                    last[i] = logits[row]
                else:
                    manager.add_context_chunk(requests[i].request_id)
                    still.append(i)
            active = still
            if not active:
                return torch.stack(last)
        raise AssertionError("prefill made no progress")

    def beam_search(self, manager: KVCacheManager, request: Request) -> BeamSearchResult:
        """Serve one request by beam search over ``request.beam_width`` beams, ``max_new_tokens`` tokens each.

        The beams share the prompt's blocks, computed once (chunk by chunk
        where the ledger chunks prompts); the prompt's last block, where it is
        not full, is each beam's own, and its positions are computed again
        through every other beam's row. Every step feeds each beam's last token
        through its own row of the block table. When the beams are selected
        anew, a beam continuing another beam's hypothesis gets a copy of that
        beam's own blocks (TensorRT-LLM reads them through a cache indirection
        instead; the KV each beam attends to is the same).
        """
        pools = self.check(manager, [request])
        if request.max_new_tokens < 1:
            raise ValueError(f"beam_search: request {request.request_id} asks for no new tokens")
        rid, width, vocab = request.request_id, request.beam_width, VOCAB_SIZE
        cached = manager.add_sequence(request)
        try:
            last = self.prefill(manager, [request])[0]
        except BaseException:
            manager.remove_sequence(rid, store=False)
            raise
        try:
            manager.store_context_blocks(rid)
            self._fill_beam_tails(manager, pools, request)
            scores, first = torch.log_softmax(last, dim=-1).topk(width)
            beams = [[t] for t in first.tolist()]
            copied = 0
            for _ in range(request.max_new_tokens):   # a step per generated token; the last gives the final logits
                manager.add_token(rid, 1)
                pos = manager.num_tokens(rid) - 1
                logits = self.model.forward(pools, manager.block_table([rid]), [[b[-1]] for b in beams], [pos] * width,
                                            [request.lora_id] * width)
                if len(beams[0]) == request.max_new_tokens:
                    break
                scores, flat = (scores[:, None] + torch.log_softmax(logits, dim=-1)).flatten().topk(width)
                parents = (flat // vocab).tolist()
                copied += self._reorder(manager, pools, request, parents)
                beams = [beams[p] + [t] for p, t in zip(parents, (flat % vocab).tolist())]
        finally:
            manager.remove_sequence(rid)
        return BeamSearchResult(rid, beams, scores.float().cpu().tolist(), logits.float().cpu().clone(), cached,
                                copied)

    def _fill_beam_tails(self, manager: KVCacheManager, pools: list[torch.Tensor], request: Request) -> None:
        """Write the prompt's last, partly filled block's positions into every other beam's own copy of it."""
        T = self.config.tokens_per_block
        start, n = len(request.tokens) // T * T, len(request.tokens)
        if request.beam_width == 1 or start == n:
            return
        others = request.beam_width - 1
        self.model.forward(pools, manager.block_table([request.request_id])[1:], [request.tokens[start:]] * others,
                           [start] * others, [request.lora_id] * others)

    def _reorder(self, manager: KVCacheManager, pools: list[torch.Tensor], request: Request, parents: list[int]) -> int:
        """Give beam ``b`` the own blocks of beam ``parents[b]``, all read before any is written; returns the
        blocks copied."""
        T = self.config.tokens_per_block
        shared = len(request.tokens) // T
        own = manager.block_table([request.request_id])[:, shared:-(-manager.num_tokens(request.request_id) // T)]
        moved = [b for b, p in enumerate(parents) if p != b]
        if not moved:
            return 0
        src = own[torch.tensor([parents[b] for b in moved], device=own.device)].flatten().long()
        dst = own[torch.tensor(moved, device=own.device)].flatten().long()
        for pool in pools:
            pool[dst] = pool[src]   # the gather copies every source before the scatter writes
        return dst.numel()

    @staticmethod
    def _count_final_tokens(manager: KVCacheManager, done: Sequence[RunningRequest]) -> None:
        """Count each request's last sampled token, as TensorRT-LLM does, so the ledger knows the whole sequence.

        Its KV is never computed, and the ledger stores all but the last counted
        token at release, so the block the final output completes becomes
        reusable (a follow-up turn that repeats the output reuses it). When the
        tokens would need more blocks than are free, they stay uncounted: that
        block then is not stored, and nothing fails.
        """
        done = [r for r in done if r.request.max_new_tokens > 0]
        ids = [r.request.request_id for r in done]
        try:
            manager.check_decode_step(ids)
        except OutOfBlocksError:
            return
        for r, rid in zip(done, ids):
            manager.add_token(rid, 1, tokens=[r.result.output_tokens[-1]])

    def check(self, manager: KVCacheManager, requests: Sequence[Request], beams: bool = True) -> list[torch.Tensor]:
        """Refuse a ledger whose geometry differs from the model's, prompts outside the vocabulary and (unless
        ``beams``) beam searches; the pools."""
        mine, theirs = self.config, manager.config
        for f in ("tokens_per_block", "num_layers", "kv_heads_per_layer", "head_dim", "layer_windows"):
            if getattr(mine, f) != getattr(theirs, f):
                raise ValueError(f"engine and manager disagree on {f}: {getattr(mine, f)} vs {getattr(theirs, f)}")
        pools = manager.pools.primary_pools
        if not pools:
            raise ValueError("the manager keeps only the books (CacheConfig.materialize=False); "
                             "the engine needs its pools")
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"serve takes Request objects, got {type(r).__name__}")
            r.validate()  # non-empty, non-negative ints: only the upper bound is the model's own
            if max(r.tokens) >= VOCAB_SIZE:
                raise ValueError(f"request {r.request_id}: token {max(r.tokens)} is outside the model's vocabulary "
                                 f"0..{VOCAB_SIZE - 1}")
            if r.beam_width > 1 and not beams:
                raise ValueError(f"serve decodes greedily; request {r.request_id} asks for {r.beam_width} beams "
                                 "(use beam_search)")
        return pools
