"""The engine interface's contract, over every engine the router sends work to.

``Engine`` (``kvledger.router.engine``) is all the router's serving path
calls; the same tests run over an own rank in this process, an own rank actor
on a real local Ray, and a real vLLM server, so each answers alike: what it is,
its load, a generation whole or streamed in OpenAI's shapes with the engine's
own cached-token count, ``n`` choices in one generation, and bad input refused
as a ``ValueError``.
"""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from vllm_engines import START_TIMEOUT_S

from kvledger.coordinator.cluster import Cluster
from kvledger.coordinator.config import ClusterConfig
from kvledger.coordinator.local_cluster import LocalCluster
from kvledger.router.engine import LEDGER, Engine, Generation
from kvledger.router.engines import Engines
from kvledger.router.feed import FOREIGN_RANK_BASE
from kvledger.router.vllm_engine import VllmEngine
from kvledger.worker.ledger import CacheConfig
from kvledger.worker.wire.messages import RankLoad

T = 16
TIMEOUT = 60
pytestmark = pytest.mark.timeout(int(START_TIMEOUT_S) + 300)   # the vLLM server's start-up counts as set-up


def cache() -> CacheConfig:
    return CacheConfig(tokens_per_block=T, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       device="cpu", num_primary_blocks=64, num_secondary_blocks=0)


@pytest.fixture(scope="module", params=["in-process", "ray", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request) -> Iterator[Engine]:
    """One engine: an own rank in this process or on Ray (through ``Engines``, as the router gets it), or a
    real vLLM server."""
    if request.param == "vllm":
        server = request.getfixturevalue("vllm_server")
        [e] = VllmEngine.connect_all(FOREIGN_RANK_BASE, server.url, timeout_s=TIMEOUT)
        yield e
        e.close()
        return
    if request.param == "in-process":
        yield Engines(LocalCluster.build(1, cache()), lambda rank, batch: None).engine(0)
        return
    request.getfixturevalue("ray_session")
    cluster = Cluster.start(ClusterConfig(num_ranks=1, device="cpu", cache=cache(), name_prefix="kvledger-engine",
                                          group_timeout_s=30, call_timeout_s=TIMEOUT))
    try:
        yield Engines(cluster, lambda rank, batch: None).engine(0)
    finally:
        cluster.shutdown()


_ids = iter(range(1, 10**6, 16))


def job(engine: Engine, text: str, max_tokens: int = 4, **kw) -> Generation:
    """A greedy generation of ``max_tokens`` tokens exactly, the prompt tokenized the engine's way."""
    fields = {"temperature": 0, "ignore_eos": True, **kw.pop("fields", {})}
    return Generation(next(_ids), engine.info().tokenizer.encode(text), max_tokens, fields=fields, **kw)


def test_info_says_what_it_serves_and_how_it_tokenizes(engine):
    info = engine.info()
    assert info.model and info.block_size > 0 and info.max_context > info.block_size
    ids = info.tokenizer.encode("What the engine computes KV for.")
    assert ids and all(isinstance(t, int) and t >= 0 for t in ids)
    assert info.vocab_size is None or max(ids) < info.vocab_size
    assert info.capabilities in (frozenset(), LEDGER)
    assert info.chat_template is not None and "user" in info.chat_template.render([{"role": "user", "content": "x"}])


def test_load_is_a_typed_report_of_an_idle_engine(engine):
    load = engine.load()
    assert isinstance(load, RankLoad) and load.rank == engine.rank and load.ready
    assert load.queued_requests == 0 and load.device_blocks_used + load.device_blocks_free > 0


def test_a_generation_answers_in_openai_shape_and_reuses_its_own_prefix(engine):
    text = "A prompt long enough to fill several blocks of the cache, whatever the tokenizer makes of it. " * 3
    first = engine.generate(job(engine, text))
    again = engine.generate(job(engine, text))
    prompt = len(engine.info().tokenizer.encode(text))
    assert first.answer["object"] == "text_completion" and len(first.answer["choices"]) == 1
    assert first.answer["usage"]["prompt_tokens"] == prompt and first.answer["usage"]["completion_tokens"] == 4
    assert len(first.output_tokens) == 4 and again.output_tokens == first.output_tokens, "greedy repeats"
    assert again.cached_tokens >= (prompt - 1) // engine.info().block_size * engine.info().block_size > 0
    assert again.answer["usage"]["prompt_tokens_details"]["cached_tokens"] == again.cached_tokens


def test_a_streamed_generation_joins_to_the_whole_one_and_ends_with_usage(engine):
    text = "Streamed, then joined: "
    whole = engine.generate(job(engine, text, 5))
    chunks = list(engine.stream(job(engine, text, 5)))
    assert chunks[-1] == "[DONE]"
    *parts, usage = chunks[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert "".join(c["choices"][0]["text"] for c in parts if c["choices"]) == whole.answer["choices"][0]["text"]


def test_n_choices_are_one_generation_and_a_seed_repeats_them(engine):
    sampled = {"temperature": 1.5, "seed": 3}
    several = engine.generate(job(engine, "Choices: ", 6, n=3, fields=sampled))
    again = engine.generate(job(engine, "Choices: ", 6, n=3, fields=sampled))
    texts = [c["text"] for c in several.answer["choices"]]
    assert [c["index"] for c in several.answer["choices"]] == [0, 1, 2]
    assert several.answer["usage"]["completion_tokens"] == 18
    assert texts == [c["text"] for c in again.answer["choices"]], "the same seed, the same choices"


def test_a_chat_is_answered_in_the_chat_shape(engine):
    info = engine.info()
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    tokens = info.tokenizer.encode(info.chat_template.render(messages), add_special_tokens=False)
    got = engine.generate(Generation(next(_ids), tokens, 3, fields={"temperature": 0, "messages": messages},
                                     chat=True))
    assert got.answer["object"] == "chat.completion"
    assert got.answer["choices"][0]["message"]["role"] == "assistant"


def test_bad_input_is_a_value_error_naming_it(engine):
    bad = Generation(next(_ids), [1, 2, 3], 2, fields={"temperature": -1.0})
    with pytest.raises(ValueError, match="temperature"):
        engine.check(bad)
        engine.generate(bad)
