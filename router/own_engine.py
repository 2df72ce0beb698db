"""kvledger's own ranks as ``Engine``s: a generation becomes the reference engine's requests, its outcomes OpenAI's
answer.

The ``n`` samplings of one generation go to the one rank it was routed to:
its prompt is computed once (a request of no output tokens, whose blocks the
ledger stores), then the ``n`` choices are one ``serve`` call that reuses
them, choice ``i`` seeded ``seed + i`` (so the choices differ but repeat). The sampling parameters become the reference
engine's ``Sampling`` (temperature, top-p, top-k, seed, log-probabilities;
greedy at temperature 0); a parameter it cannot honour (the penalties) is
refused by name rather than silently dropped, and stop strings cut the text
here. A Responses request is served as a chat (its text messages: the router
rendered them) and answered in the Responses shape (``router.responses``);
what it asks beyond text (tools, function calls and their outputs, reasoning,
a previous response: own ranks keep none) is refused by name. The rank's own
events come back with its reply and go to the router's feed (``publish``)
before the answer leaves, so the next prompt sharing the prefix is routed on
what this one stored.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from kvledger.router.chat import render_plain
from kvledger.router.engine import LEDGER, EngineInfo, Generated, Generation
from kvledger.router.openai_types import (MAX_N, ParamError, answer_chunks, completion_answer, make_choice, stops_of,
                                          usage)
from kvledger.router.rank_client import RankClient
from kvledger.router.responses import response_answer, response_events, response_usage
from kvledger.worker.wire.batches import PublishedBatch
from kvledger.worker.wire.messages import RankInfo, RankLoad, ServeOutcome
from kvledger.worker.wire.request import Request, RetentionConfig, Sampling, TokenRange

PENALTIES = ("presence_penalty", "frequency_penalty")
#: The client fields own ranks serve (``user`` and ``metadata`` only label a request); any other that asks for
#: something (not null, false, zero or empty, as clients send defaults) is refused by name, never dropped: vLLM
#: servers take every field as sent.
SERVED_FIELDS = frozenset({"temperature", "top_p", "top_k", "seed", "stop", "logprobs", "top_logprobs", "ignore_eos",
                           "use_beam_search", "length_penalty", "messages", "user", "metadata", *PENALTIES})
#: What a Responses request may carry to own ranks besides (``store``: own ranks keep no response, as vLLM without
#: ``VLLM_ENABLE_RESPONSES_API_STORE``, which ignores it too).
RESPONSES_FIELDS = frozenset({"input", "instructions", "max_output_tokens", "store"})


class PlainChat:
    """The reference engine's chat template (``router.chat.render_plain``)."""

    def render(self, messages, fields: dict | None = None) -> str:
        """``messages`` rendered; the plain template has no tools or options (the ranks refuse them by name)."""
        return render_plain(messages)


def engine_info(info: RankInfo) -> EngineInfo:
    """What a ready rank reports, as the router needs it: its full-attention pool bounds the context."""
    tok = info.tokenizer
    return EngineInfo(info.model, info.tokens_per_block, tok, info.max_context, tok.vocab_size, PlainChat(), LEDGER)


def retention_for(priority: int | None, duration_s: float | None = None) -> RetentionConfig | None:
    """The whole prompt and its decoded blocks at ``priority`` (``None``: the ledger's default), for ``duration_s``
    once they are free (``None``: for good; TensorRT-LLM's countdown)."""
    if priority is None:
        return None
    return RetentionConfig(ranges=(TokenRange(0, None, priority, duration_s),), decode_priority=priority,
                           decode_duration_s=duration_s)


def sampling_of(job: Generation, model: str, choice: int) -> Sampling:
    """How the reference engine samples choice ``choice`` of ``job``."""
    f = job.fields
    for name in PENALTIES:
        if f.get(name) not in (None, 0):
            raise ParamError(name, f"{name}={f[name]!r}: the {model} ranks apply no penalties (vLLM servers take "
                                   "every sampling parameter)")
    seed, top_p = f.get("seed"), f.get("top_p")
    return Sampling(f.get("temperature") or 0.0, 1.0 if top_p is None else top_p, max(f.get("top_k") or 0, 0),
                    None if seed is None else seed + choice, _top_logprobs(job))


def beam_search_of(job: Generation, model: str) -> Request:
    """``job``'s ``n`` choices as the beams of one beam search (vLLM's ``use_beam_search``): it scores tokens by
    their log-probability, so sampling parameters and log-probabilities are refused by name."""
    f = job.fields
    for name in ("temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs", *PENALTIES):
        if f.get(name) not in (None, 1.0 if name == "top_p" else 0):
            raise ParamError(name, f"{name}={f[name]!r}: a beam search on the {model} ranks samples nothing and "
                                   "scores by log-probability")
    if job.max_tokens < 1:
        raise ParamError("max_tokens", f"max_tokens={job.max_tokens}: a beam search generates a token at least")
    return Request(job.request_id, list(job.tokens), job.max_tokens, job.lora_id, job.cache_salt,
                   retention=retention_for(job.priority, job.priority_s), beam_width=job.n)


def _top_logprobs(job: Generation) -> int | None:
    """How many of the likeliest tokens' log-probabilities each token reports (``None``: none at all): the
    completions API's ``logprobs`` count, or the chat API's ``logprobs`` switch and ``top_logprobs`` count."""
    if not job.chat:
        return job.fields.get("logprobs")
    on, top = job.fields.get("logprobs"), job.fields.get("top_logprobs")
    if top and not on:
        raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
    return (top or 0) if on else None


class OwnEngine:
    """One own rank behind its ``RankClient`` (see the module docstring)."""

    def __init__(self, client: RankClient, info: EngineInfo,
                 publish: Callable[[int, PublishedBatch], None]) -> None:
        self.client = client
        self._info = info
        self._publish = publish

    @property
    def rank(self) -> int:
        return self.client.rank

    def info(self, refresh: bool = False) -> EngineInfo:
        if refresh:
            self._info = engine_info(self.client.info())
        return self._info

    def requests(self, job: Generation) -> list[Request]:
        """The ``n`` requests of ``job`` (ids ``request_id`` on; its prefill's is ``request_id + n``), or its one
        beam search of ``n`` beams, each checked; ``ValueError`` names a bad one."""
        if not 1 <= job.n <= MAX_N:
            raise ParamError("n", f"n must be 1..{MAX_N}, got {job.n!r}")
        served = SERVED_FIELDS | RESPONSES_FIELDS if job.responses else SERVED_FIELDS
        unserved = sorted(k for k, v in job.fields.items() if k not in served and v not in (None, 0, "", [], {}))
        if unserved:
            raise ParamError(unserved[0], f"{unserved[0]}: the {self._info.model} ranks do not serve it (vLLM "
                                          "servers take every field as sent)")
        items = job.fields.get("input") if job.responses else None
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if item.get("type", "message") != "message":
                raise ParamError(f"input[{i}].type", f"input[{i}]: the {self._info.model} ranks serve text messages, "
                                                     f"not {item['type']} items (vLLM servers serve them)")
        if job.fields.get("use_beam_search") and job.n > 1:
            return [beam_search_of(job, self._info.model)]
        retention = retention_for(job.priority, job.priority_s)
        return [Request(job.request_id + i, list(job.tokens), job.max_tokens, job.lora_id, job.cache_salt,
                        retention=retention, sampling=sampling_of(job, self._info.model, i)) for i in range(job.n)]

    def check(self, job: Generation) -> None:
        self.requests(job)

    def generate(self, job: Generation) -> Generated:
        requests = self.requests(job)
        cached = None
        if requests[0].beam_width > 1:
            return self._beams(job, requests[0])
        if len(requests) > 1:   # the prompt computed once: the choices then reuse its blocks
            (prefill,) = self._serve([Request(job.request_id + job.n, list(job.tokens), 0, job.lora_id,
                                              job.cache_salt, retention=requests[0].retention)])
            cached = prefill.cached_tokens
        outcomes = self._serve(requests)
        first = outcomes[0]
        cached = first.cached_tokens if cached is None else cached
        decode, stops = self._info.tokenizer.decode, stops_of(job.fields)
        choices = [make_choice(o.output_tokens, o.logprobs, o.top_logprobs, stops, job.chat, decode)
                   for o in outcomes]
        if job.responses:
            answer = response_answer(f"resp_{job.request_id}", self._info.model, choices[0].text,
                                     choices[0].finish_reason, response_usage(len(job.tokens),
                                                                              len(first.output_tokens), cached),
                                     job.fields)
            return Generated(answer, first.output_tokens, cached, first.onboarded_blocks, first.token_times_s)
        answer = completion_answer(f"{'chatcmpl' if job.chat else 'cmpl'}-{job.request_id}", self._info.model,
                                   choices, usage(len(job.tokens), sum(len(o.output_tokens) for o in outcomes),
                                                  cached), job.chat)
        return Generated(answer, first.output_tokens, cached, sum(o.onboarded_blocks for o in outcomes),
                         first.token_times_s)

    def _beams(self, job: Generation, request: Request) -> Generated:
        """A beam search's answer: a choice per beam, best first."""
        (out,) = self._serve([request])
        decode, stops = self._info.tokenizer.decode, stops_of(job.fields)
        choices = [make_choice(beam, None, None, stops, job.chat, decode) for beam in out.beams]
        answer = completion_answer(f"{'chatcmpl' if job.chat else 'cmpl'}-{job.request_id}", self._info.model,
                                   choices, usage(len(job.tokens), sum(len(b) for b in out.beams),
                                                  out.cached_tokens), job.chat)
        return Generated(answer, out.output_tokens, out.cached_tokens, out.onboarded_blocks)

    def _serve(self, requests: list[Request]) -> list[ServeOutcome]:
        """The rank's outcomes; its events to the feed before they are answered."""
        reply = self.client.serve(requests, publish=True)
        if reply.events is not None:
            self._publish(self.rank, reply.events)
        return reply.outcomes

    def stream(self, job: Generation) -> Iterator[dict | str]:
        """The answer computed whole, then streamed as OpenAI streams it: a chunk per choice, usage, ``[DONE]`` (a
        Responses request: its events)."""
        answer = self.generate(job).answer
        yield from response_events(answer) if job.responses else answer_chunks(answer, job.chat)

    def load(self) -> RankLoad:
        return self.client.load()

    def close(self) -> None:
        """The rank's set closes its clients."""
