"""Chat messages into the one prompt a model sees: its own chat template, or the reference engine's plain one.

The router must hash exactly the tokens the engine will compute, so a chat
request is rendered here the way the engine renders it: a model whose
``tokenizer_config.json`` carries a ``chat_template`` (Hugging Face's Jinja
format), or whose ``chat_template.jinja`` does (where current tokenizers save
it), is rendered with it, in a sandboxed Jinja environment as ``transformers``
does, with the request's ``tools``, ``add_generation_prompt`` and
``chat_template_kwargs``, over the messages as vLLM hands them to a template
(``conversation``); a model without one refuses chat (as vLLM does). Kvledger's reference engine has no template of its
own, so it takes this plain one (``PLAIN_TEMPLATE``), each message as::

    <|role|>
    content
    ...
    <|assistant|>

Message ``content`` is a string, a list of ``{"type": "text", "text": ...}``
parts (``input_text`` and ``output_text`` too, the Responses API's names;
joined by newlines, as vLLM joins them), or none (an assistant turn that only
calls tools); other part types are refused.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool", "developer")
#: The content parts vLLM reads as text (``renderers/chat_utils.py``).
TEXT_PARTS = ("text", "input_text", "output_text")


def message_text(content: str | Sequence[dict] | None) -> str:
    """A message's text: the string, its text parts joined by newlines, or empty for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValueError(f"messages content[{i}]: only text parts are served, got type {part.get('type')!r}")
        parts.append(part["text"])
    return "\n".join(parts)


def conversation(messages: Sequence[dict]) -> list[dict]:
    """The messages as vLLM hands them to a chat template: the role, the content as one string, an assistant's
    tool calls with their ``arguments`` parsed into objects (empty or malformed: ``{}``) and its ``reasoning``
    (also as ``reasoning_content``), a tool message's ``tool_call_id``, a ``name``; nothing else."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": message_text(m.get("content"))}
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and isinstance(calls, list) and calls:
            msg["tool_calls"] = [_parsed_arguments(c) for c in calls]
        if m["role"] == "assistant" and isinstance(m.get("reasoning"), str):
            msg["reasoning"] = msg["reasoning_content"] = m["reasoning"]
        if m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _parsed_arguments(call: dict) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ValueError("messages tool_calls: each call must be an object with a function object")
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            args = {}
    return {**call, "function": {**function, "arguments": args or {}}}


def render_plain(messages: Sequence[dict]) -> str:
    """The reference engine's template (see the module docstring)."""
    return "".join(f"<|{m['role']}|>\n{message_text(m.get('content'))}\n" for m in messages) + "<|assistant|>\n"


class ChatTemplate:
    """A model's Hugging Face chat template, rendered as ``transformers`` renders it."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(source)
        self._special = special

    @classmethod
    def of_model(cls, model_root: str | None) -> ChatTemplate | None:
        """The template in the model's ``tokenizer_config.json``, else its ``chat_template.jinja``; ``None`` when it
        has neither (or is not here)."""
        if model_root is None:
            return None
        root = Path(model_root)
        try:
            config = json.loads((root / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        source = config.get("chat_template")
        if isinstance(source, list):   # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            try:
                source = (root / "chat_template.jinja").read_text()
            except OSError:
                return None
        special = {k: v if isinstance(v, str) else v.get("content", "") for k in ("bos_token", "eos_token")
                   if (v := config.get(k)) is not None}
        return cls(source, special)

    def render(self, messages: Sequence[dict], fields: dict | None = None) -> str:
        """``messages`` rendered with the request's ``fields``: its ``tools``, ``add_generation_prompt`` (true
        unless given) and ``chat_template_kwargs``, as vLLM passes them to the template."""
        f = fields or {}
        kwargs = {**self._special, "add_generation_prompt": f.get("add_generation_prompt", True),
                  **(f.get("chat_template_kwargs") or {})}
        if f.get("tools") is not None:
            kwargs["tools"] = f["tools"]
        return self._template.render(messages=conversation(messages), **kwargs)


def _raise(message: str) -> None:
    raise ValueError(f"the chat template refused the messages: {message}")
