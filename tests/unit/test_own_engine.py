"""An own rank as an engine: the n choices of one generation compute its prompt once and then share its blocks."""
from __future__ import annotations

import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.engine import Generation
from kvledger.router.own_engine import OwnEngine, engine_info
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.messages import ServeReply

T = 4


class RecordingClient:
    """The in-process rank's client, keeping each reply it gave."""

    def __init__(self, client) -> None:
        self.inner, self.replies = client, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def serve(self, requests, logits: bool = False, publish: bool = False) -> ServeReply:
        reply = self.inner.serve(requests, logits, publish)
        self.replies.append(reply)
        return reply


def test_n_choices_compute_the_prompt_once_and_reuse_its_blocks():
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=64)
    client = RecordingClient(LocalCluster.build(1, cfg).client(0))
    engine = OwnEngine(client, engine_info(client.info()), lambda rank, batch: None)
    prompt = list(range(1, 4 * T + 3))   # 4 full blocks and 2 tokens
    got = engine.generate(Generation(1, prompt, 3, n=3, fields={"temperature": 1.0, "seed": 5}))
    prefill, choices = client.replies
    assert [o.computed_tokens for o in prefill.outcomes] == [len(prompt)] and prefill.outcomes[0].output_tokens == []
    assert [o.cached_tokens for o in choices.outcomes] == [4 * T] * 3, "each choice reuses the prompt's blocks"
    assert len(got.answer["choices"]) == 3 and got.answer["usage"]["completion_tokens"] == 9
    assert got.answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the prompt was new to the rank"
