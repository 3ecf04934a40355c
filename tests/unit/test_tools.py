from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from tests.fakes import FakeEngine
from tests.unit.test_chat import sse_events

MODEL = "fake-model"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def test_named_tool_choice_constrains_to_the_function_schema(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['{"city": ', '"Paris"}']
    result = sdk.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert engine.requests[0].sampling.json_schema == WEATHER["function"]["parameters"]
    call = result.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    assert call.type == "function"
    assert result.choices[0].message.content is None
    assert result.choices[0].finish_reason == "stop"


def test_required_tool_choice_parses_calls(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['[{"name": "get_weather", "parameters": {"city": "Paris"}},', ' {"name": "get_time", "parameters": {}}]']
    result = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    schema = engine.requests[0].sampling.json_schema
    assert schema["type"] == "array"
    assert schema["minItems"] == 1
    assert {item["properties"]["name"]["enum"][0] for item in schema["items"]["anyOf"]} == {"get_weather", "get_time"}
    calls = result.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert result.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_allows_one_call(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ['[{"name": "get_time", "parameters": {}}]']
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.requests[0].sampling.json_schema["maxItems"] == 1


def test_auto_parses_tagged_calls_and_describes_tools(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ["Let me check. ", '<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Paris"}}</tool_call>']
    result = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER])
    assert "get_weather" in engine.requests[0].prompt_text  # described in a system message
    assert engine.requests[0].sampling.json_schema is None
    message = result.choices[0].message
    assert message.content == "Let me check."
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert result.choices[0].finish_reason == "tool_calls"


def test_auto_without_a_call_is_plain_content(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ["It is ", "sunny."]
    result = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto")
    assert result.choices[0].message.content == "It is sunny."
    assert result.choices[0].message.tool_calls is None
    assert result.choices[0].finish_reason == "stop"


def test_none_ignores_tools(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']
    result = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert result.choices[0].message.tool_calls is None
    assert "get_weather" not in engine.requests[0].prompt_text


def test_named_tool_streams_arguments(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ['{"city": ', '"Paris"}']
    body = {"model": MODEL, "messages": ASK, "tools": [WEATHER], "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    chunks = [json.loads(e) for e in sse_events(client.post("/v1/chat/completions", json=body).text)[:-1]]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks]
    assert calls[0]["function"]["name"] == "get_weather"
    assert calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'


def test_auto_streams_tool_calls_with_sdk(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>']
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True))
    deltas = [c.choices[0] for c in chunks]
    assert deltas[-1].finish_reason == "tool_calls"
    call = deltas[-1].delta.tool_calls[0]
    assert call.index == 0
    assert call.function.name == "get_weather"


def test_tool_messages_render_through_the_template(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    prompt = engine.requests[0].prompt_text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool> 18C and sunny" in prompt


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools.0"),
        # a function or name of the wrong type: a 400, not a 500 (AttributeError, unhashable name)
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": ["get_weather"]}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": {"a": 1}}}}, "tool_choice"),
    ],
)
def test_bad_tools_are_400(client: TestClient, extra: dict, param: str) -> None:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **extra})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


def test_required_keeps_complete_calls_of_a_cut_array(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['[{"name": "get_time", "parameters": {}}, ', '{"name": "get_weather", "parameters": {"ci']
    result = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    assert [c.function.name for c in result.choices[0].message.tool_calls] == ["get_time"]


@pytest.mark.parametrize("reply", [
    ["Let me ", "check. ", "<tool_", 'call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'],
    ["It is ", "sunny ", "today."],
    ["Use <tool", "s wisely"],  # what looked like a tag's start, and was not
    ["Hi ", "<tool_call>{not json</tool_call>"],  # a tag that holds no call: all of it is content
])
def test_auto_streams_the_text_before_a_call_as_it_comes(sdk: openai.OpenAI, engine: FakeEngine, reply: list[str]) -> None:
    """With tools and tool_choice auto the content streams token by token, held back only where a
    <tool_call> may begin; the stream adds up to the whole answer (content, calls, finish)."""
    engine.reply = reply
    whole = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER]).choices[0]
    chunks = [c.choices[0] for c in sdk.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True)
              if c.choices]
    assert chunks[0].delta.role == "assistant"
    assert all(c.delta.role is None for c in chunks[1:])
    assert "".join(c.delta.content or "" for c in chunks) == (whole.message.content or "")
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [(call.function.name, call.function.arguments) for call in calls] == [
        (call.function.name, call.function.arguments) for call in whole.message.tool_calls or []]
    assert chunks[-1].finish_reason == whole.finish_reason
    if reply[0] in ("Let me ", "It is "):
        assert len([c for c in chunks if c.delta.content]) >= 2  # streamed, not one chunk at the end
