"""The OpenAI request bodies the router takes and the answers it gives, as vLLM serves them.

Bodies are pydantic models: a field of the wrong type or out of range is a 400
naming it (``router.http``), an unknown field is ignored, as vLLM ignores it.
The sampling parameters go to the engine as the client sent them
(``Generation.fields``); what kvledger's own ranks make of them is
``router.own_engine``'s. The answers are built here for engines that make
token ids, not text (``make_choice`` with the model's ``decode``).
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, Tag


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
    """What every generating request shares: the model, streaming, sampling, and kvledger's own fields. Every
    other field the client sends is kept as sent (``passthrough``): a vLLM server gets it, own ranks refuse what
    they do not serve by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    """A model of ``GET /v1/models`` (none: the first listed)."""
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    """The newer name of ``max_tokens`` (chat); the smaller wins when both are given."""
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[StrictFloat, Field(ge=0, le=2)] | None = None
    top_p: Annotated[StrictFloat, Field(gt=0, le=1)] | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    presence_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[StrictFloat, Field(ge=-2, le=2)] | None = None
    ignore_eos: StrictBool | None = None
    """vLLM's extension: generate ``max_tokens`` even past the end-of-sequence token (the reference engine
    always does)."""
    use_beam_search: StrictBool | None = None
    """vLLM's extension: the ``n`` choices are the ``n`` beams of one beam search, best first."""
    length_penalty: StrictFloat | None = None
    """vLLM's beam-search extension: scores divided by length to this power (every beam here is as long as the
    others, so it orders nothing)."""
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

    def passthrough(self) -> dict:
        """The client's fields as it sent them, known or not (``Generation.fields``), less those the router
        decides itself (``ROUTER_FIELDS``)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if k not in ROUTER_FIELDS}


#: What the router decides itself rather than pass on: the model and the prompt (as the token ids it hashed),
#: how many tokens and choices, streaming, and kvledger's own fields (a salt namespaced per tenant, an adapter
#: and a retention priority, each sent to the engine in its own way).
ROUTER_FIELDS = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream",
                           "stream_options", "cache_salt", "lora_id", "priority"})


class CompletionBody(_Sampled):
    """``POST /v1/completions``."""

    prompt: Prompt
    """Text (tokenized the way the model's engines tokenize, ``router.prompt_tokenizer``) or token ids."""
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None


class Message(_Body):
    """A chat message: its role and content checked, every other field (an assistant's ``tool_calls``, a tool
    message's ``tool_call_id``, a ``name``) kept as sent. An assistant turn that calls tools has no content."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatBody(_Sampled):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    def message_dicts(self) -> list[dict]:
        """The messages as the client sent them (every field, ``content: null`` kept)."""
        return [m.model_dump(exclude_unset=True) for m in self.messages]


class _Item(_Body):
    """One item of a Responses ``input``: what the router renders checked, every other field kept as sent."""

    model_config = ConfigDict(extra="allow")


class TextPart(_Item):
    """A text part of reasoning or of a tool's output."""

    type: str
    text: str | None = None


class MessagePart(_Item):
    """A part of a message's content: only text is served, as in chats (``router.chat.TEXT_PARTS``)."""

    type: Literal["text", "input_text", "output_text"]
    text: str


class InputMessage(_Item):
    """A message item (``type`` ``message``, or none, as OpenAI's short form sends it)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[MessagePart]


class FunctionCallItem(_Item):
    """A function call the model made, sent back as the conversation so far."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class CustomToolCallItem(_Item):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str = ""


class FunctionCallOutputItem(_Item):
    """A tool's result for a call (``custom_tool_call_output``: a custom tool's)."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[MessagePart]


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    content: list[TextPart] | None = None
    summary: list[TextPart] = []
    encrypted_content: str | None = None


ITEM_TYPES = ("message", "function_call", "custom_tool_call", "function_call_output", "custom_tool_call_output",
              "reasoning")
"""The input items vLLM 0.32 renders (``construct_chat_messages_with_tool_call``); any other type it refuses."""


def _item_kind(item: object) -> str | None:
    """An item's union member: its ``type`` (a message when it has none, as OpenAI's short form sends it), named
    ``type=...`` so that an error's ``param`` is the item's own field (``router.http._param`` skips the name)."""
    kind = item.get("type", "message") if isinstance(item, dict) else None
    return f"type={kind}" if kind in ITEM_TYPES else None


InputItem = Annotated[Annotated[InputMessage, Tag("type=message")]
                      | Annotated[FunctionCallItem, Tag("type=function_call")]
                      | Annotated[CustomToolCallItem, Tag("type=custom_tool_call")]
                      | Annotated[FunctionCallOutputItem, Tag("type=function_call_output")]
                      | Annotated[FunctionCallOutputItem, Tag("type=custom_tool_call_output")]
                      | Annotated[ReasoningItem, Tag("type=reasoning")],
                      Discriminator(_item_kind, custom_error_type="input_item_type",
                                    custom_error_message=f"an input item is an object of a type of {ITEM_TYPES}")]


class ResponsesBody(_Sampled):
    """``POST /v1/responses``: what the router renders and routes by is checked (``router.responses``), every
    other field goes to the engine as sent."""

    input: str | list[InputItem]
    """A user message's text, or the conversation as items (messages, function calls and their outputs)."""
    instructions: str | None = None
    """The system message (it does not carry over to a follow-up)."""
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    """The response this one continues: served by the engine that keeps it."""
    max_output_tokens: Count | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    store: StrictBool | None = None
    """``false``: the response is not kept for a follow-up."""

    @property
    def max_new(self) -> int:
        return 16 if self.max_output_tokens is None else self.max_output_tokens

    def passthrough(self) -> dict:
        """Every field as the client sent it but the router's own (``RESPONSES_ROUTER_FIELDS``)."""
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if k not in RESPONSES_ROUTER_FIELDS}


#: What the router decides itself of a Responses request: the model, streaming and kvledger's own fields.
RESPONSES_ROUTER_FIELDS = frozenset({"model", "stream", "cache_salt", "lora_id", "priority"})


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


@dataclass(frozen=True, slots=True)
class Choice:
    """One generated choice as the reference ranks made it, the stop strings applied."""

    text: str
    finish_reason: str
    logprobs: dict | None


Decode = Callable[[Iterable[int]], str]


def stops_of(fields: dict) -> list[str]:
    """The request's stop strings (``stop``: one or a list)."""
    stop = fields.get("stop")
    return [stop] if isinstance(stop, str) else list(stop or [])


def make_choice(tokens: list[int], logprobs: list[float] | None, top: list[list[tuple[int, float]]] | None,
                stops: list[str], chat: bool, decode: Decode) -> Choice:
    """The choice's text, cut before the first stop string (``finish_reason`` ``stop``; else ``length``), and its
    log-probabilities in the completions or the chat shape, for the tokens that made the text."""
    text, reason = decode(tokens), "length"
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    if cut >= 0:
        text, reason = text[:cut], "stop"
        while tokens and len(decode(tokens)) > cut:   # bounded: one token fewer each time
            tokens = tokens[:-1]
    if logprobs is None:
        return Choice(text, reason, None)
    n = len(tokens)
    pieces = [decode([t]) for t in tokens]
    if chat:
        content = [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                    "top_logprobs": [{"token": decode([t]), "logprob": v, "bytes": list(decode([t]).encode())}
                                     for t, v in (top[i] if top else [])]}
                   for i, (p, lp) in enumerate(zip(pieces, logprobs[:n]))]
        return Choice(text, reason, {"content": content})
    offsets = [len(decode(tokens[:i])) for i in range(n)]
    return Choice(text, reason, {"tokens": pieces, "token_logprobs": logprobs[:n], "text_offset": offsets,
                                 "top_logprobs": [_by_text(top[i] if top else [], decode) for i in range(n)]})


def _by_text(top: list[tuple[int, float]], decode: Decode) -> dict[str, float]:
    """Completions' ``top_logprobs`` are keyed by token text; byte tokens that decode alike keep the likeliest."""
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(decode([t]), v)
    return out


def completion_answer(request_id: str, model: str, choices: list[Choice], usage_: dict, chat: bool) -> dict:
    """A whole answer of ``len(choices)`` choices, in the completions or the chat shape."""
    if chat:
        out = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": c.logprobs,
                "finish_reason": c.finish_reason} for i, c in enumerate(choices)]
    else:
        out = [{"index": i, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
               for i, c in enumerate(choices)]
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage_}


class Relayed(dict):
    """A streamed chunk as an engine sent it: decoded, for the router to read, and its bytes (``raw``), which go to
    the client as they came. A chunk the router changes is a new dict, encoded anew. Saves a JSON encoding per
    token of a stream (json.dumps took a quarter of the router's CPU for a streamed completion)."""

    __slots__ = ("raw",)

    @classmethod
    def of(cls, decoded: object, raw: bytes) -> object:
        """``decoded`` (the JSON of ``raw``) as a ``Relayed`` where it is an object."""
        if not isinstance(decoded, dict):
            return decoded
        out = cls(decoded)
        out.raw = raw
        return out


def sse(data: dict | str, ensure_ascii: bool = True) -> bytes:
    """One server-sent event: a ``Relayed`` chunk as the engine wrote it, else encoded (``ensure_ascii`` as
    ``json.dumps``)."""
    if type(data) is Relayed:
        return b"data: " + data.raw + b"\n\n"
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"), ensure_ascii=ensure_ascii)
    return f"data: {text}\n\n".encode()


def answer_chunks(answer: dict, chat: bool) -> Iterator[dict | str]:
    """An answer computed whole, as OpenAI streams one: a chunk per choice, the usage chunk, then ``[DONE]``."""
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    for c in answer["choices"]:
        if chat:
            choice = {"index": c["index"], "delta": {"role": "assistant", "content": c["message"]["content"]},
                      "logprobs": None, "finish_reason": c["finish_reason"]}
        else:
            choice = c
        yield {**head, "choices": [choice]}
    yield {**head, "choices": [], "usage": answer["usage"]}
    yield "[DONE]"
