"""Anthropic's Messages API on the real engine (the session's gateway), through the official
`anthropic` SDK: create, stream, count_tokens, a tool-call round trip, and errors in its shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest

from tests.integration.conftest import MODEL

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the Messages API here runs on the chat pipeline")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
FRESH = {"Cache-Control": "no-cache"}  # answered by the engine, not replayed from the cache
# This anthropic SDK (2.x) no longer offers temperature, top_p and top_k as arguments; the API takes them
GREEDY = {"temperature": 0}


@pytest.fixture
def claude(server: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def test_create_answers_as_anthropic_does(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=QUESTION,
                                     system="You are a helpful assistant.")
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.model == MODEL
    assert message.content[0].type == "text"
    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn"
    assert message.stop_sequence is None
    assert message.usage.output_tokens > 0
    counted = claude.messages.count_tokens(model=MODEL, messages=QUESTION, system="You are a helpful assistant.")
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)


def test_stop_sequences_and_max_tokens(claude: anthropic.Anthropic) -> None:
    stopped = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=QUESTION,
                                     stop_sequences=["Paris"])
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "Paris"
    assert "Paris" not in stopped.content[0].text
    assert "France" in stopped.content[0].text
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=QUESTION, extra_body={"top_k": 5, "top_p": 0.9})
    assert cut.stop_reason == "max_tokens"
    assert cut.usage.output_tokens == 3


def test_stream_gives_anthropic_s_events_and_the_same_answer(claude: anthropic.Anthropic) -> None:
    whole = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=QUESTION,
                                   extra_headers=FRESH)
    with claude.messages.stream(model=MODEL, max_tokens=30, extra_body=GREEDY, messages=QUESTION,
                                extra_headers=FRESH) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 3
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = [event.type for event in claude.messages.create(model=MODEL, max_tokens=5, messages=QUESTION,
                                                              stream=True, extra_headers=FRESH)]
    assert events[:2] == ["message_start", "content_block_start"]  # the SDK skips ping
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_a_tool_call_round_trip(claude: anthropic.Anthropic) -> None:
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]
    asked = claude.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=question, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert asked.stop_reason == "tool_use"
    [call] = [block for block in asked.content if block.type == "tool_use"]
    assert call.name == "get_weather"
    assert isinstance(call.input.get("city"), str)
    assert call.id.startswith("toolu_")
    with claude.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=question, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_headers=FRESH) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "tool_use"
    assert streamed.content[0].input == call.input
    answered = claude.messages.create(
        model=MODEL, max_tokens=30, extra_body=GREEDY, tools=[WEATHER],
        messages=[*question, {"role": "assistant", "content": asked.content},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                "content": "Sunny, 24 degrees Celsius"}]}],
    )
    assert answered.content
    assert answered.stop_reason in ("end_turn", "tool_use", "max_tokens")


def test_structured_output(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}},
              "required": ["capital"], "additionalProperties": False}
    message = claude.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=QUESTION,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(message.content[0].text)) == {"capital"}


def test_errors_in_anthropic_s_shape(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=5, messages=QUESTION, extra_body={"temperature": 1.5})
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-ghost", max_tokens=5, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as image:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert "image" in image.value.body["error"]["message"]


def test_embeddings_from_a_chat_model_are_a_clear_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model=MODEL, input="hello")
    assert "embedding model" in refused.value.body["message"]
    assert refused.value.body["param"] == "model"
