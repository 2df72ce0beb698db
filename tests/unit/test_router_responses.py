"""A Responses request rendered as the chat vLLM 0.32 renders for it (``construct_input_messages``): instructions
first, the stored conversation a follow-up continues, then the input items as chat messages; its tools and options
as the template sees them; and the stored responses kept within their bound."""
from __future__ import annotations

import json

import pytest

from kvledger.router.chat import ChatTemplate, conversation
from kvledger.router.response_store import ResponseStore, StoredResponse, UnknownResponseError
from kvledger.router.responses import input_messages, template_fields, template_tools

pytestmark = pytest.mark.unit

CALL = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}',
        "id": "fc_1", "status": "completed"}


def test_a_text_input_is_one_user_message_after_the_instructions():
    assert input_messages("be terse", "hi") == [{"role": "system", "content": "be terse"},
                                                {"role": "user", "content": "hi"}]
    assert input_messages(None, "hi") == input_messages("", "hi") == [{"role": "user", "content": "hi"}]


def test_items_become_chat_messages_with_calls_merged_into_the_assistant_turn_before_them():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "weather"},
                                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             CALL, {**CALL, "call_id": "c2", "namespace": "maps"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "it is sunny"}]},
             {"type": "custom_tool_call", "call_id": "c3", "name": "shell", "input": "ls"}]
    got = input_messages(None, items)
    assert got[0] == {"role": "user", "content": items[0]["content"]}, "a message as it is, its type dropped"
    assert got[1]["content"] == "Let me look." and [c["function"]["name"] for c in got[1]["tool_calls"]] == [
        "get_weather", "maps__get_weather"], "both calls join the assistant turn; a namespace is flattened"
    assert got[1]["tool_calls"][0] == {"id": "c1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert got[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert got[3]["reasoning"] == "it is sunny" and got[3]["role"] == "assistant"
    assert got[3]["tool_calls"][0]["function"] == {"name": "shell", "arguments": json.dumps({"input": "ls"})}
    conv = conversation(got)
    assert conv[0]["content"] == "weather\nin Paris?", "input_text parts are text, joined by newlines"
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert conv[3]["reasoning"] == conv[3]["reasoning_content"] == "it is sunny"


def test_a_follow_up_renders_the_stored_conversation_without_its_instructions_then_its_answer_text():
    before = input_messages("old rules", "first question")
    output = [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hidden"}]},
              {**CALL}, {"type": "message", "role": "assistant", "content": [
                  {"type": "output_text", "text": "part one"}, {"type": "output_text", "text": "part two"}]}]
    assert input_messages("new rules", "second question", before, output) == [
        {"role": "system", "content": "new rules"}, {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "part one"}, {"role": "assistant", "content": "part two"},
        {"role": "user", "content": "second question"}], "function calls and reasoning of the output are skipped"


def test_tools_and_template_options_as_the_template_sees_them():
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True},
             {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "g"}]},
             {"type": "web_search"}]
    assert template_tools(tools) == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"},
                                          "strict": True}},
        {"type": "function", "function": {"name": "ns__g", "description": None, "parameters": None}}]
    assert template_tools([]) is None
    plain = template_fields({"input": "hi"})
    assert plain["add_generation_prompt"] and plain["tools"] is None
    assert plain["chat_template_kwargs"]["reasoning_effort"] is None
    partial = template_fields({"input": [{"role": "assistant", "content": "Once upon", "status": "incomplete"}],
                               "reasoning": {"effort": "low"}})
    assert not partial["add_generation_prompt"] and partial["chat_template_kwargs"]["continue_final_message"]
    assert partial["chat_template_kwargs"]["enable_thinking"] is True


def test_rendered_through_a_template():
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}", {})
    fields = {"input": "hi", "instructions": "be terse"}
    assert template.render(input_messages("be terse", "hi"), template_fields(fields)) == \
        "<system>be terse<user>hi<assistant>"


def test_the_store_answers_as_vllm_for_an_unknown_id_and_forgets_the_oldest_first():
    store = ResponseStore(2)
    for i in range(3):
        store.remember(f"resp_{i}", StoredResponse(i, [{"role": "user", "content": str(i)}], []))
    assert len(store) == 2 and store.get("resp_2").rank == 2
    with pytest.raises(UnknownResponseError, match="Response with id 'resp_0' not found"):
        store.get("resp_0")
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(-1)
