"""An own rank as an engine: the n choices of one generation compute its prompt once and then share its blocks;
a beam search is one request of n beams."""
from __future__ import annotations

import pytest
import torch

from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.engine import Generation
from kvledger.router.openai_types import ParamError
from kvledger.router.own_engine import OwnEngine, engine_info
from kvledger.worker.engine.reference import ReferenceEngine
from kvledger.worker.ledger import CacheConfig, KVCacheManager
from kvledger.worker.rank.batch import BatchDriver
from kvledger.worker.wire.messages import ServeReply
from kvledger.worker.wire.request import Request

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


def test_use_beam_search_answers_the_n_beams_of_one_search_and_refuses_sampling_by_name():
    """vLLM's ``use_beam_search``: one request of ``n`` beams, one serve call, a choice per beam (best first), each
    the text of the beam the reference engine's search finds alone; sampling fields are refused by name."""
    cfg = CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                      device="cpu", num_primary_blocks=64)
    client = RecordingClient(LocalCluster.build(1, cfg).client(0))
    info = engine_info(client.info())
    engine = OwnEngine(client, info, lambda rank, batch: None)
    prompt = list(range(1, 3 * T + 2))
    got = engine.generate(Generation(1, prompt, 4, n=3, fields={"use_beam_search": True, "length_penalty": 1.0}))
    (reply,) = client.replies
    (want,) = BatchDriver(ReferenceEngine(cfg)).serve(KVCacheManager(cfg), [Request(9, prompt, 4, beam_width=3)])
    assert len(reply.outcomes) == 1 and reply.outcomes[0].beams == want.beams.tokens
    assert [c["text"] for c in got.answer["choices"]] == [info.tokenizer.decode(b) for b in want.beams.tokens]
    assert got.answer["usage"]["completion_tokens"] == 12
    with pytest.raises(ParamError, match="temperature"):
        engine.check(Generation(2, prompt, 4, n=2, fields={"use_beam_search": True, "temperature": 0.7}))
