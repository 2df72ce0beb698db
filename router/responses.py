"""OpenAI's Responses API as a chat: a request's ``instructions`` and ``input`` (after the stored conversation it
follows) as the chat messages vLLM renders, its tools and template options as the template sees them, and the
answer and server-sent events kvledger's own ranks give.

vLLM 0.32 serves ``POST /v1/responses`` by building chat messages
(``entrypoints/openai/responses/utils.py``: ``construct_input_messages``,
``construct_tool_dicts``) and rendering them with the model's chat template, so
the router hashes the same tokens by building the same messages here and
rendering them with ``router.chat``:

- ``instructions`` become a system message, first;
- after a ``previous_response_id``, the messages that response's request was
  rendered from (its system messages dropped: instructions do not carry over),
  then the text of each part of its output messages as an assistant message
  (its function calls and reasoning are not: vLLM skips them);
- a string ``input`` is one user message; a list of items: a message as it is
  (an assistant's content its first part's text), a function call as an
  assistant turn's tool call (merged into the assistant turn before it), a
  call's output as a tool message, reasoning as an assistant's ``reasoning``.

The rendered text is tokenized with the special tokens (vLLM's ``TokenizeParams``
default, which a Responses request does not change; a chat is tokenized
without). A stored response's messages are kept by the router
(``router.response_store``).
A model with its own reasoning format (gpt-oss, "harmony") is rendered
otherwise by vLLM; its prompts are hashed as a chat here, which costs only
the prediction.
"""
from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator, Sequence

from kvledger.router.openai_types import ParamError, sse

#: vLLM's names: a namespaced tool is flattened to ``<namespace>__<name>``; a custom tool's free text travels as the
#: one string argument of a function (``tool_parsers/utils.py``).
NAMESPACE_SEPARATOR = "__"
CUSTOM_TOOL_INPUT_KEY = "input"


def input_messages(instructions: str | None, items: str | Sequence[dict], previous: Sequence[dict] = (),
                   previous_output: Sequence[dict] = ()) -> list[dict]:
    """The chat messages vLLM renders for a Responses request (see the module docstring). ``items`` as the client
    sent them (checked by ``openai_types.ResponsesBody``); ``previous``: the messages the previous response's
    request was rendered from, ``previous_output`` its output items."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    messages += [dict(m) for m in previous if m.get("role") != "system"]
    messages += [{"role": "assistant", "content": part.get("text")} for item in previous_output
                 if item.get("type") == "message" for part in item.get("content") or ()]
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    new: list[dict] = []
    for i, item in enumerate(items):
        message = _message_of(item, new[-1] if new and new[-1].get("role") == "assistant" else None, i)
        if message is not None:
            new.append(message)
    return messages + new


def _message_of(item: dict, assistant: dict | None, i: int) -> dict | None:
    """``item`` as a chat message, or ``None`` where it joined the assistant turn before it (``assistant``)."""
    kind = item.get("type", "message")
    if kind in ("function_call", "custom_tool_call"):
        name = item["name"] if not item.get("namespace") else f"{item['namespace']}{NAMESPACE_SEPARATOR}{item['name']}"
        arguments = (item["arguments"] if kind == "function_call"
                     else json.dumps({CUSTOM_TOOL_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False))
        call = {"id": item["call_id"], "function": {"name": name, "arguments": arguments}, "type": "function"}
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "reasoning":
        if item.get("encrypted_content"):
            raise ParamError(f"input[{i}].encrypted_content", "encrypted reasoning content is not supported")
        parts = item.get("content") or item.get("summary") or [{}]
        reasoning = parts[0].get("text") or ""
        if assistant is not None and "reasoning" not in assistant:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if kind in ("function_call_output", "custom_tool_call_output"):
        return {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
    content = item.get("content")
    if item["role"] == "assistant":
        text = content if isinstance(content, str) else (content[0].get("text") if content else None)
        if text is not None:
            if assistant is not None and assistant.get("content") is None:
                assistant["content"] = text
                return None
            return {"role": "assistant", "content": text}
    return {k: v for k, v in item.items() if k != "type"}


def template_fields(fields: dict) -> dict:
    """What a Responses request gives the chat template (``ChatTemplate.render``), as vLLM's
    ``ResponsesRequest.build_chat_params`` does: its function tools in the chat shape, the generation prompt unless
    the last item is an unfinished assistant message (then it is continued), and ``chat_template_kwargs`` with the
    reasoning effort."""
    items = fields.get("input")
    last = items[-1] if isinstance(items, list) and items else {}
    cont = last.get("type", "message") in ("message", "reasoning") and last.get("status") in ("in_progress",
                                                                                                "incomplete")
    effort = (fields.get("reasoning") or {}).get("effort") if isinstance(fields.get("reasoning"), dict) else None
    kwargs = {**(fields.get("chat_template_kwargs") or {}), "add_generation_prompt": not cont,
              "continue_final_message": cont, "reasoning_effort": effort}
    if effort is not None and "enable_thinking" not in (fields.get("chat_template_kwargs") or {}):
        kwargs["enable_thinking"] = effort != "none"
    return {"tools": template_tools(fields.get("tools") or []), "add_generation_prompt": not cont,
            "chat_template_kwargs": kwargs}


def template_tools(tools: Sequence[dict]) -> list[dict] | None:
    """The Responses tools the model is shown, as the chat template sees them (vLLM's ``get_function_tools``, then
    ``ChatCompletionToolsParam``): functions (a namespace's flattened), a custom tool as a one-string function;
    other tool types are not rendered. ``None`` when the request has no tools."""
    if not tools:
        return None
    shown = []
    for t in tools:
        kind = t.get("type")
        if kind == "namespace":
            shown += [{**f, "name": f"{t.get('name')}{NAMESPACE_SEPARATOR}{f.get('name')}"}
                      for f in t.get("tools") or () if isinstance(f, dict) and f.get("type") == "function"]
        elif kind == "custom":
            shown.append({"name": t.get("name"), "description": t.get("description"), "parameters": {
                "type": "object", "properties": {CUSTOM_TOOL_INPUT_KEY: {
                    "type": "string", "description": "The freeform text payload for this tool."}},
                "required": [CUSTOM_TOOL_INPUT_KEY], "additionalProperties": False}})
        elif kind == "function":
            shown.append(t)
    out = []
    for f in shown:
        function = {"name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters")}
        function.update({k: f[k] for k in ("strict", "defer_loading") if f.get(k) is not None})
        out.append({"type": "function", "function": function})
    return out


# --- what own ranks answer -----------------------------------------------------------------------------------

def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def response_answer(response_id: str, model: str, text: str, finish_reason: str, usage: dict, fields: dict) -> dict:
    """A whole Responses answer of one output message; cut by ``max_output_tokens`` it is ``incomplete``, as vLLM
    says."""
    done = finish_reason == "stop"
    message = {"type": "message", "id": f"msg_{response_id.removeprefix('resp_')}", "status": "completed",
               "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": [],
                                                 "logprobs": []}]}
    return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
            "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"},
            "instructions": fields.get("instructions"), "max_output_tokens": fields.get("max_output_tokens"),
            "previous_response_id": None, "output": [message], "parallel_tool_calls": True, "tool_choice": "auto",
            "tools": [], "temperature": fields.get("temperature"), "top_p": fields.get("top_p"), "error": None,
            "metadata": fields.get("metadata"), "usage": usage}


def response_events(answer: dict) -> Iterator[dict]:
    """An answer computed whole, as vLLM streams one: created, in progress, each output item and its text parts
    added, their text, done, then ``response.completed`` with the whole answer (no ``[DONE]``)."""
    numbers = itertools.count()
    begun = {**answer, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    yield {"type": "response.created", "sequence_number": next(numbers), "response": begun}
    yield {"type": "response.in_progress", "sequence_number": next(numbers), "response": begun}
    for i, item in enumerate(answer["output"]):
        yield {"type": "response.output_item.added", "sequence_number": next(numbers), "output_index": i,
               "item": {**item, "status": "in_progress", "content": []}}
        for j, part in enumerate(item["content"]):
            at = {"item_id": item["id"], "output_index": i, "content_index": j}
            yield {"type": "response.content_part.added", "sequence_number": next(numbers), **at,
                   "part": {**part, "text": ""}}
            yield {"type": "response.output_text.delta", "sequence_number": next(numbers), **at,
                   "delta": part["text"], "logprobs": []}
            yield {"type": "response.output_text.done", "sequence_number": next(numbers), **at,
                   "text": part["text"], "logprobs": []}
            yield {"type": "response.content_part.done", "sequence_number": next(numbers), **at, "part": part}
        yield {"type": "response.output_item.done", "sequence_number": next(numbers), "output_index": i,
               "item": item}
    yield {"type": "response.completed", "sequence_number": next(numbers), "response": answer}


def sse_event(event: dict | str) -> bytes:
    """One server-sent event as vLLM writes a Responses event: named by its ``type`` (vLLM's
    ``_convert_stream_to_sse_events`` names each by the ``type`` it carries); one without (an error) is data only."""
    name = event.get("type") if isinstance(event, dict) else None
    return (f"event: {name}\n".encode() if name else b"") + sse(event, ensure_ascii=False)
