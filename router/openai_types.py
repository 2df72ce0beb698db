"""The OpenAI request bodies the router takes and the answers it gives, as vLLM serves them.

Bodies are pydantic models: a field of the wrong type or out of range is a 400
naming it (``router.http``), an unknown field is ignored, as vLLM ignores it.
The sampling parameters go to a vLLM server as the client sent them; the
reference engine decodes greedily, so for kvledger's own ranks a parameter
that would change greedy output is refused by name (``check_greedy``) rather
than silently dropped. ``n`` choices are served as ``n`` requests (the later
ones reuse the first one's cached prompt).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

MAX_TOKENS = 4096
"""The most tokens one request may ask for."""
MAX_N = 16

TokenId = Annotated[StrictInt, Field(ge=0)]
Prompt = Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
Count = Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS)]


class ParamError(ValueError):
    """Bad input in one named field of the request (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampled(_Body):
    """What every generating request shares: the model, streaming, sampling, and kvledger's own fields."""

    model: str | None = None
    """A model of ``GET /v1/models`` (none: the first listed)."""
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    """The newer name of ``max_tokens`` (chat); the smaller wins when both are given."""
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    ignore_eos: StrictBool | None = None
    """vLLM's extension: generate ``max_tokens`` even past the end-of-sequence token (the reference engine
    always does)."""
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    """Only requests with the same salt share KV (under a tenant, namespaced under it: ``router.tenants``)."""
    lora_id: Annotated[StrictInt, Field(ge=0)] | None = None
    priority: Annotated[StrictInt, Field(ge=0, le=100)] | None = None
    """Retention priority of the prompt's and the output's blocks (``RetentionConfig``)."""

    @property
    def max_new(self) -> int:
        given = [v for v in (self.max_tokens, self.max_completion_tokens) if v is not None]
        return min(given) if given else 16

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling(self) -> dict:
        """The sampling parameters given, as a vLLM server is sent them."""
        return {k: v for k in SAMPLING if (v := getattr(self, k)) is not None}

    def check_greedy(self, model: str) -> None:
        """Refuse, by name, a parameter that would change greedy decoding (the reference engine's)."""
        for name, value in self.sampling().items():
            if name in ("seed", "ignore_eos") or value in GREEDY.get(name, ()):
                continue
            raise ParamError(name, f"{name}={value!r}: the {model} ranks decode greedily and cannot honour it "
                                   "(vLLM servers take every sampling parameter)")


#: Values of the sampling parameters that leave greedy decoding as it is.
GREEDY: dict[str, tuple[object, ...]] = {"temperature": (0,), "top_p": (1,), "top_k": (-1, 0),
                                         "presence_penalty": (0,), "frequency_penalty": (0,), "logprobs": (False,)}
#: The sampling parameters a vLLM server gets as the client sent them (``n`` and the token limits apart).
SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "ignore_eos",
            "logprobs")


class CompletionBody(_Sampled):
    """``POST /v1/completions``."""

    prompt: Prompt
    """Text (tokenized the way the model's engines tokenize, ``router.prompt_tokenizer``) or token ids."""
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class Message(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict]


class ChatBody(_Sampled):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: StrictBool | None = None

    def message_dicts(self) -> list[dict]:
        return [m.model_dump() for m in self.messages]


class RouteBody(_Body):
    """``POST /v1/route``: where the prompt would go, without sending it."""

    prompt: Prompt
    model: str | None = None
    max_tokens: Count = 16
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    lora_id: Annotated[StrictInt, Field(ge=0)] | None = None


class ProbeBody(_Body):
    """``POST /v1/probe``: how much of the prompt each rank holds; ``exact`` asks the ranks' ledgers."""

    prompt: Prompt
    model: str | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    lora_id: Annotated[StrictInt, Field(ge=0)] | None = None
    exact: StrictBool = False


# --- answers -----------------------------------------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_answer(request_id: str, model: str, texts: list[str], usage_: dict, chat: bool) -> dict:
    """A whole answer of ``n = len(texts)`` choices, in the completions or the chat shape."""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": "length"} for i, t in enumerate(texts)]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": "length"}
                   for i, t in enumerate(texts)]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n".encode()


def whole_as_stream(answer: dict, include_usage: bool, chat: bool) -> Iterator[bytes]:
    """An answer computed whole (kvledger's own ranks), streamed as OpenAI streams: a chunk per choice, the usage
    chunk when asked (carrying the ``kvledger`` block), then ``[DONE]``."""
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    for c in answer["choices"]:
        if chat:
            choice = {"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                      "logprobs": None, "finish_reason": c["finish_reason"]}
        else:
            choice = c
        yield sse({**head, "choices": [choice]})
    if include_usage:
        yield sse({**head, "choices": [], "usage": answer["usage"], "kvledger": answer["kvledger"]})
    yield sse("[DONE]")
