"""A model's chat template as the router renders it to hash a chat: found where current tokenizers save it, fed
the tools and the messages as vLLM hands them to a template, so an agent's turns hash as the engine renders
them."""
from __future__ import annotations

import json

import pytest

from kvledger.router.chat import ChatTemplate, conversation

TOOLS_TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }})"
                  "{% endfor %}{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
AGENT = [{"role": "user", "content": [{"type": "text", "text": "weather"}, {"type": "text", "text": "in Paris?"}]},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny", "extra": "dropped"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_messages_reach_the_template_as_vllm_hands_them_over():
    """Text parts joined by newlines, no content as empty, tool-call arguments parsed (malformed: {}), a tool
    message's id kept, anything else dropped."""
    conv = conversation(AGENT + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])
    assert conv[0] == {"role": "user", "content": "weather\nin Paris?"}
    assert conv[1]["content"] == "" and conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert conv[3]["tool_calls"][0]["function"]["arguments"] == {}
    with pytest.raises(ValueError, match="tool_calls"):
        conversation([{"role": "assistant", "tool_calls": ["not a call"]}])


def test_a_template_in_chat_template_jinja_renders_the_tools_and_the_options(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.of_model(str(tmp_path)) is None, "no template anywhere: chat is refused"
    (tmp_path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    template = ChatTemplate.of_model(str(tmp_path))
    assert template.render(AGENT, {"tools": TOOLS}) == ("[tool get_weather]<user>weather\nin Paris?"
                                                        "<assistant>(call get_weather Paris)"
                                                        "<tool>sunny(result of c1)<assistant>")
    assert not template.render(AGENT, {"add_generation_prompt": False}).endswith("<assistant>")
    assert template.render(AGENT[:1], {"chat_template_kwargs": {"add_generation_prompt": False}}) == \
        "<user>weather\nin Paris?"
