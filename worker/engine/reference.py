"""The reference engine: serves requests through a ledger with the tiny paged model, greedily.

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
from kvledger.worker.engine.tokenizer import VOCAB_SIZE
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.wire.errors import OutOfBlocksError
from kvledger.worker.wire.request import Request


@dataclass(slots=True)
class ServeResult:
    """What serving one request produced and how much of its prompt the cache supplied."""

    request_id: int
    output_tokens: list[int]
    """Greedy tokens, ``max_new_tokens`` of them."""
    last_logits: torch.Tensor
    """Logits after the last prompt position: float32 ``[vocab]`` on the CPU."""
    cached_tokens: int
    """Prompt tokens whose KV the ledger supplied (reused, copied or onboarded)."""
    computed_tokens: int
    """Prompt tokens the prefill computed; at least 1, the last prompt token is never reused."""
    onboarded_blocks: int
    """Blocks brought back from the host tier to admit the request."""


class ReferenceEngine:
    """Prefill all requests in one batched step, then decode them together one token per step."""

    def __init__(self, config: CacheConfig, seed: int = 0) -> None:
        self.config = config
        self.model = TinyDecoder(config, seed)

    def serve(self, manager: KVCacheManager, requests: Sequence[Request]) -> list[ServeResult]:
        """Admit ``requests`` into ``manager``, run them to ``max_new_tokens`` and release them.

        Bad input raises before the ledger changes. Once prefill has written the
        prompts' KV, the requests leave the ledger even when decoding fails (for
        example ``OutOfBlocksError`` while growing), so only written KV is stored.
        """
        pool = self._check(manager, requests)
        if not requests:
            return []
        ids = [r.request_id for r in requests]
        cached = manager.add_sequences(list(requests))
        admissions = [manager.admission(rid) for rid in ids]
        try:
            logits = self.model.forward(pool, manager.block_table(ids),
                                        [r.tokens[c:] for r, c in zip(requests, cached)], cached,
                                        [r.lora_id for r in requests])
        except BaseException:
            for rid in ids:  # the prompts' KV was never written: nothing of it may become reusable
                manager.remove_sequence(rid, store=False)
            raise
        last_rows = torch.tensor([len(r.tokens) - c for r, c in zip(requests, cached)]).cumsum(0) - 1
        last = logits[last_rows.to(logits.device)]
        results = [ServeResult(r.request_id, [], last[i].float().cpu().clone(), c, len(r.tokens) - c,
                               a.onboarded_blocks)
                   for i, (r, c, a) in enumerate(zip(requests, cached, admissions))]
        try:
            for rid in ids:
                manager.store_context_blocks(rid)
            self._decode(manager, pool, requests, results, last)
        finally:
            for rid in ids:
                manager.remove_sequence(rid)
        return results

    def _decode(self, manager: KVCacheManager, pool: torch.Tensor, requests: Sequence[Request],
                results: list[ServeResult], last: torch.Tensor) -> None:
        """Greedy steps over every request that still wants tokens, batched into one forward each."""
        next_tok = last.argmax(dim=-1).tolist()
        active = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        for i in active:
            results[i].output_tokens.append(next_tok[i])
        while True:
            active = [i for i in active if len(results[i].output_tokens) < requests[i].max_new_tokens]
            if not active:
                self._count_final_tokens(manager, requests, results)
                return
            ids = [requests[i].request_id for i in active]
            toks = [results[i].output_tokens[-1] for i in active]
            # All or none: a step that grew some sequences and then failed would leave tokens
            # counted whose KV was never written, and removing them would store those blocks.
            need = sum(manager.get_needed_blocks_one_step(rid) for rid in ids)
            free = manager.stats().free_num_blocks
            if need > free:
                raise OutOfBlocksError(need, free, f"decode step of request(s) {ids}")
            for rid, t in zip(ids, toks):
                manager.add_token(rid, 1, tokens=[t])
            starts = [manager.num_tokens(rid) - 1 for rid in ids]
            step = self.model.forward(pool, manager.block_table(ids), [[t] for t in toks], starts,
                                      [requests[i].lora_id for i in active])
            for i, t in zip(active, step.argmax(dim=-1).tolist()):
                results[i].output_tokens.append(t)

    @staticmethod
    def _count_final_tokens(manager: KVCacheManager, requests: Sequence[Request], results: list[ServeResult]) -> None:
        """Count each request's last sampled token, as TensorRT-LLM does, so the ledger knows the whole sequence.

        Its KV is never computed, and the ledger stores all but the last counted
        token at release, so the block the final output completes becomes
        reusable (a follow-up turn that repeats the output reuses it). When the
        tokens would need more blocks than are free, they stay uncounted: that
        block then is not stored, and nothing fails.
        """
        done = [i for i, r in enumerate(requests) if r.max_new_tokens > 0]
        ids = [requests[i].request_id for i in done]
        if sum(manager.get_needed_blocks_one_step(rid) for rid in ids) > manager.stats().free_num_blocks:
            return
        for i, rid in zip(done, ids):
            manager.add_token(rid, 1, tokens=[results[i].output_tokens[-1]])

    def _check(self, manager: KVCacheManager, requests: Sequence[Request]) -> torch.Tensor:
        """Refuse a ledger whose geometry differs from the model's, and prompts outside the vocabulary."""
        mine, theirs = self.config, manager.config
        for f in ("tokens_per_block", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(mine, f) != getattr(theirs, f):
                raise ValueError(f"engine and manager disagree on {f}: {getattr(mine, f)} vs {getattr(theirs, f)}")
        pool = manager.pools.primary
        if pool is None:
            raise ValueError("the manager keeps only the books (CacheConfig.materialize=False); "
                             "the engine needs its pools")
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"serve takes Request objects, got {type(r).__name__}")
            r.validate()  # non-empty, non-negative ints: only the upper bound is the model's own
            if max(r.tokens) >= VOCAB_SIZE:
                raise ValueError(f"request {r.request_id}: token {max(r.tokens)} is outside the model's vocabulary "
                                 f"0..{VOCAB_SIZE - 1}")
        return pool
