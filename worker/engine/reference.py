"""The reference engine: the tiny paged model run over the block tables a rank's scheduler hands it.

It is the oracle for the ledger: whatever the manager reuses, copies, onboards
or migrates, a request must come out with the same logits and tokens as on a
fresh manager, because attention reads every position back from the pool
through the block table the manager hands out. It never calls the ledger:
the rank's ``BatchDriver`` plans each step in it and commits what the model
computed (as vLLM's model runner runs what its scheduler planned).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from kvledger.worker.engine.model import TinyDecoder
from kvledger.worker.engine.tokenizer import VOCAB_SIZE, ByteTokenizer
from kvledger.worker.ledger.config import CacheConfig
from kvledger.worker.ledger.manager import KVCacheManager
from kvledger.worker.wire.request import Request

#: The model the reference engine serves, as the router lists it.
MODEL_NAME = "kvledger-reference"
TOKENIZER = ByteTokenizer()


class ReferenceEngine:
    """Runs batched forwards of context chunks and decoded tokens over the pools (continuous batching)."""

    def __init__(self, config: CacheConfig, seed: int = 0) -> None:
        self.config = config
        self.model = TinyDecoder(config, seed)

    def forward(self, pools: Sequence[torch.Tensor], block_table: torch.Tensor, inputs: Sequence[Sequence[int]],
                starts: Sequence[int], lora_ids: Sequence[int | None]) -> torch.Tensor:
        """One batched forward: row ``i`` computes ``inputs[i]`` at positions ``starts[i]`` on, reading and writing
        the KV through ``block_table`` row ``i``; logits ``[sum(len(x)), vocab]``, a row per input token."""
        return self.model.forward(pools, block_table, inputs, starts, lora_ids)

    @staticmethod
    def copy_blocks(pools: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of pool slots ``src`` onto slots ``dst`` in every pool, every source read before any is
        written."""
        for pool in pools:
            pool[dst] = pool[src]   # the gather copies every source before the scatter writes

    def check(self, manager: KVCacheManager, requests: Sequence[Request]) -> None:
        """Refuse a ledger whose geometry differs from the model's, and requests the model cannot serve: prompts
        outside its vocabulary, and beam searches of no new tokens, with drafts, or sampled."""
        mine, theirs = self.config, manager.config
        for f in ("tokens_per_block", "num_layers", "kv_heads_per_layer", "head_dim", "layer_windows"):
            if getattr(mine, f) != getattr(theirs, f):
                raise ValueError(f"engine and manager disagree on {f}: {getattr(mine, f)} vs {getattr(theirs, f)}")
        if not manager.pools.primary_pools:
            raise ValueError("the manager keeps only the books (CacheConfig.materialize=False); "
                             "the engine needs its pools")
        for r in requests:
            if not isinstance(r, Request):
                raise TypeError(f"serve takes Request objects, got {type(r).__name__}")
            if max(r.tokens) >= VOCAB_SIZE:
                raise ValueError(f"request {r.request_id}: token {max(r.tokens)} is outside the model's vocabulary "
                                 f"0..{VOCAB_SIZE - 1}")
            if r.beam_width > 1:
                _check_beam_search(r)


def _check_beam_search(r: Request) -> None:
    if r.max_new_tokens < 1:
        raise ValueError(f"beam search: request {r.request_id} asks for no new tokens")
    if r.num_draft_tokens:
        raise ValueError(f"beam search: request {r.request_id} asks for {r.num_draft_tokens} draft tokens; beams "
                         "take none")
    if not r.sampling.greedy or r.sampling.logprobs is not None:
        raise ValueError(f"beam search: request {r.request_id} asks to sample (temperature "
                         f"{r.sampling.temperature}, logprobs {r.sampling.logprobs}); beams score every token "
                         "by its log-probability and sample nothing")
