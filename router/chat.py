"""Chat messages into the one prompt a model sees: its own chat template, or the reference engine's plain one.

The router must hash exactly the tokens the engine will compute, so a chat
request is rendered here the way the engine renders it: a model whose
``tokenizer_config.json`` carries a ``chat_template`` (Hugging Face's Jinja
format) is rendered with it, in a sandboxed Jinja environment as
``transformers`` does, with ``add_generation_prompt``; a model without one
refuses chat (as vLLM does). Kvledger's reference engine has no template of its
own, so it takes this plain one (``PLAIN_TEMPLATE``), each message as::

    <|role|>
    content
    ...
    <|assistant|>

Message ``content`` is a string or a list of ``{"type": "text", "text": ...}``
parts (joined); other part types are refused.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool", "developer")


def message_text(content: str | Sequence[dict]) -> str:
    """A message's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages content[{i}]: only text parts are served, got type {part.get('type')!r}")
        parts.append(part["text"])
    return "".join(parts)


def render_plain(messages: Sequence[dict]) -> str:
    """The reference engine's template (see the module docstring)."""
    return "".join(f"<|{m['role']}|>\n{message_text(m['content'])}\n" for m in messages) + "<|assistant|>\n"


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
        """The template in the model's ``tokenizer_config.json``, or ``None`` when it has none (or is not here)."""
        if model_root is None:
            return None
        path = Path(model_root) / "tokenizer_config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        source = config.get("chat_template")
        if isinstance(source, list):   # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        special = {k: v if isinstance(v, str) else v.get("content", "") for k in ("bos_token", "eos_token")
                   if (v := config.get(k)) is not None}
        return cls(source, special)

    def render(self, messages: Sequence[dict]) -> str:
        msgs = [{"role": m["role"], "content": message_text(m["content"])} for m in messages]
        return self._template.render(messages=msgs, add_generation_prompt=True, **self._special)


def _raise(message: str) -> None:
    raise ValueError(f"the chat template refused the messages: {message}")
