"""Anthropic's Messages API on the fake engine: requests translated onto the chat pipeline, answers
and event streams checked against the anthropic SDK's own types, its SSE decoder and its stream
accumulator; errors in Anthropic's shape, on every layer that answers one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic.types as sdk
import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming._messages import accumulate_event
from pydantic import TypeAdapter
from starlette.testclient import TestClient

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
EVENT = TypeAdapter(sdk.RawMessageStreamEvent)


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(max_model_len=1024)  # room for tool descriptions


@pytest.fixture
def app_client(engine: FakeEngine) -> Iterator[TestClient]:
    settings = fake_settings(embedding_model="fake-embed")
    app = create_app(settings, engine_starter=lambda es: engine if es.task == "generate" else FakeEngine("fake-embed", task="embed"))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def create(client: TestClient, **extra: Any) -> sdk.Message:
    response = client.post("/v1/messages", json=body(**extra))
    assert response.status_code == 200, response.text
    return sdk.Message.model_validate(response.json())


def events(client: TestClient, **extra: Any) -> list[tuple[str | None, dict[str, Any]]]:
    response = client.post("/v1/messages", json=body(stream=True, **extra))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return [(sse.event, sse.json()) for sse in SSEDecoder().iter_bytes(iter([response.content]))]


def accumulated(stream: list[tuple[str | None, dict[str, Any]]]) -> sdk.Message:
    """The message the SDK's `messages.stream()` builds from these events."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for name, data in stream:
        if name != "ping":
            snapshot = accumulate_event(event=EVENT.validate_python(data), current_snapshot=snapshot, json_bufs=bufs)
    assert snapshot is not None
    return snapshot


def test_a_message_in_anthropic_s_shape(app_client: TestClient, engine: FakeEngine) -> None:
    raw = app_client.post("/v1/messages", json=body()).json()
    message = sdk.Message.model_validate(raw)
    assert message.id.startswith("msg_")
    assert message.type == "message"
    assert message.role == "assistant"
    assert [(b.type, b.text) for b in message.content] == [("text", "the quick brown")]
    assert message.stop_reason == "max_tokens"
    assert message.model == "fake-model"
    assert "stop_sequence" in raw
    assert raw["stop_sequence"] is None
    assert message.usage.input_tokens == len(engine.requests[-1].prompt_token_ids)
    assert message.usage.output_tokens == 3


def test_end_turn_and_stop_sequences(app_client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ["Hello", " world", "END", " more"]
    assert create(app_client, max_tokens=20).stop_reason == "end_turn"
    stopped = create(app_client, max_tokens=20, stop_sequences=["a", "b", "c", "d", "END"])  # more than OpenAI's 4
    assert stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "END"
    assert stopped.content[0].text == "Hello world"
    assert engine.requests[-1].sampling.stop == ("a", "b", "c", "d", "END")


def test_sampling_parameters_reach_the_engine(app_client: TestClient, engine: FakeEngine) -> None:
    create(app_client, temperature=0.5, top_p=0.9, top_k=40)
    sampling = engine.requests[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.5, 0.9, 40, 3)


def test_system_text_tool_use_and_tool_result_blocks_become_chat_messages(app_client: TestClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "thanks"},
        ]},
    ]
    create(app_client, system=[{"type": "text", "text": "Be brief."}], messages=messages, tools=[WEATHER])
    prompt = engine.requests[-1].prompt_text or ""
    assert prompt.startswith("<system> Be brief.")
    assert "get_weather" in prompt
    assert "<user> weather in Paris?" in prompt
    assert '<assistant> Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<tool> sunny <user> thanks" in prompt
    create(app_client, system="Be kind.")
    assert (engine.requests[-1].prompt_text or "").startswith("<system> Be kind. <user> hi")


def test_the_stream_is_anthropic_s_event_sequence(app_client: TestClient) -> None:
    stream = events(app_client)
    names = [name for name, _ in stream]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in stream)  # every event is named, as the SDK needs
    for name, data in stream:
        if name != "ping":
            EVENT.validate_python(data)
    start = stream[0][1]["message"]
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert "stop_sequence" in start
    delta = stream[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 3
    whole = create(app_client)
    streamed = accumulated(stream)
    assert streamed.content[0].text == whole.content[0].text == "the quick brown"
    assert streamed.usage.output_tokens == 3
    assert streamed.stop_reason == "max_tokens"


def test_a_named_tool_streams_its_input_as_json_deltas(app_client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ['{"city":', ' "Paris"}']
    choice = {"type": "tool", "name": "get_weather"}
    whole = create(app_client, tools=[WEATHER], tool_choice=choice, max_tokens=50)
    assert engine.requests[-1].sampling.json_schema == WEATHER["input_schema"]
    block = whole.content[0]
    assert block.type == "tool_use"
    assert block.name == "get_weather"
    assert block.input == {"city": "Paris"}
    assert block.id.startswith("toolu_")
    assert whole.stop_reason == "tool_use"
    stream = events(app_client, tools=[WEATHER], tool_choice=choice, max_tokens=50)
    deltas = [data["delta"] for name, data in stream if name == "content_block_delta"]
    assert deltas == [{"type": "input_json_delta", "partial_json": '{"city":'},
                      {"type": "input_json_delta", "partial_json": ' "Paris"}'}]
    streamed = accumulated(stream)
    assert streamed.content[0].input == {"city": "Paris"}
    assert streamed.stop_reason == "tool_use"


def test_auto_tools_stream_the_text_and_then_the_call(app_client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ["Let me", " check.", " <tool", "_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}',
                    "</tool_call>"]
    whole = create(app_client, tools=[WEATHER], max_tokens=50)
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.stop_reason == "tool_use"
    assert whole.content[0].text == "Let me check."
    assert whole.content[1].input == {"city": "Paris"}
    stream = events(app_client, tools=[WEATHER], max_tokens=50)
    texts = [data["delta"]["text"] for name, data in stream if data.get("delta", {}).get("type") == "text_delta"]
    assert "".join(texts) == "Let me check."  # nothing of the tag leaked as text
    streamed = accumulated(stream)
    assert [b.type for b in streamed.content] == ["text", "tool_use"]
    assert streamed.content[1].input == {"city": "Paris"}
    assert streamed.content[1].id.startswith("toolu_")
    engine.reply = ["No", " tools <b>", "needed"]
    assert "".join(d["delta"]["text"] for _, d in events(app_client, tools=[WEATHER], max_tokens=50)
                   if d["type"] == "content_block_delta") == "No tools <b>needed"


def test_any_tool_and_disable_parallel_tool_use(app_client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ['[{"name": "get_weather", "parameters": {"city": "Oslo"}}]']
    choice = {"type": "any", "disable_parallel_tool_use": True}
    whole = create(app_client, tools=[WEATHER], tool_choice=choice, max_tokens=50)
    assert engine.requests[-1].sampling.json_schema["maxItems"] == 1
    assert whole.content[0].input == {"city": "Oslo"}
    assert whole.stop_reason == "tool_use"
    assert accumulated(events(app_client, tools=[WEATHER], tool_choice=choice, max_tokens=50)).content[0].name == "get_weather"
    engine.reply = ["plain"]
    create(app_client, tools=[WEATHER], tool_choice={"type": "none"})
    assert engine.requests[-1].sampling.json_schema is None
    assert "get_weather" not in (engine.requests[-1].prompt_text or "")


def test_output_config_format_is_a_structured_output(app_client: TestClient, engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    create(app_client, output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert engine.requests[-1].sampling.json_schema == schema


def test_count_tokens_counts_the_prompt_messages_renders(app_client: TestClient, engine: FakeEngine) -> None:
    request = {"model": "fake-model", "system": "Be brief.", "messages": [{"role": "user", "content": "hi there"}],
               "tools": [WEATHER]}
    counted = app_client.post("/v1/messages/count_tokens", json=request)
    assert counted.status_code == 200, counted.text
    sdk.MessageTokensCount.model_validate(counted.json())
    create(app_client, **request)
    assert counted.json()["input_tokens"] == len(engine.requests[-1].prompt_token_ids)


def test_a_deterministic_message_is_cached_and_replayed_as_a_stream(engine: FakeEngine) -> None:
    app = create_app(fake_settings(cache={"backend": "memory"}), engine_starter=lambda es: engine)
    with TestClient(app) as client:
        first = client.post("/v1/messages", json=body(temperature=0))
        second = client.post("/v1/messages", json=body(temperature=0))
        assert (first.headers["x-cache"], second.headers["x-cache"]) == ("MISS", "HIT")
        assert second.json()["content"] == first.json()["content"]
        assert second.json()["id"] != first.json()["id"]
        replayed = client.post("/v1/messages", json=body(temperature=0, stream=True))
        assert replayed.headers["x-cache"] == "HIT"
        assert len(engine.requests) == 1
        stream = [(e.event, e.json()) for e in SSEDecoder().iter_bytes(iter([replayed.content]))]
        assert [n for n, _ in stream][:3] == ["message_start", "ping", "content_block_start"]
        assert accumulated(stream).content[0].text == first.json()["content"][0]["text"]


def anthropic_error(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    error = sdk.ErrorResponse.model_validate(response.json()) if hasattr(sdk, "ErrorResponse") else None
    data = response.json()
    assert data["type"] == "error", data
    assert data["error"]["type"] == kind, data
    assert error is None or error.error.type == kind
    return str(data["error"]["message"])


def test_errors_come_in_anthropic_s_shape(app_client: TestClient) -> None:
    missing = dict(body())
    del missing["max_tokens"]
    assert "max_tokens" in anthropic_error(app_client.post("/v1/messages", json=missing), 400, "invalid_request_error")
    assert "temperature" in anthropic_error(app_client.post("/v1/messages", json=body(temperature=1.5)), 400,
                                            "invalid_request_error")
    image = {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "xx"}}]}
    assert "image" in anthropic_error(app_client.post("/v1/messages", json=body(messages=[image])), 400,
                                      "invalid_request_error")
    anthropic_error(app_client.post("/v1/messages", json=body(model="ghost")), 404, "not_found_error")
    anthropic_error(app_client.post("/v1/messages/nothing", json=body()), 404, "not_found_error")  # under its route
    assert "stop_sequences" in anthropic_error(app_client.post("/v1/messages", json=body(stop_sequences=[""])), 400,
                                               "invalid_request_error")
    anthropic_error(app_client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid_request_error")
    assert "embedding model" in anthropic_error(app_client.post("/v1/messages", json=body(model="fake-embed")), 400,
                                                "invalid_request_error")
    anthropic_error(app_client.post("/v1/messages/count_tokens", json={"model": "x"}), 400, "invalid_request_error")
    openai_shape = app_client.post("/v1/chat/completions", json={"model": "ghost", "messages": []}).json()
    assert set(openai_shape) == {"error"}  # OpenAI's routes keep OpenAI's shape


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ({"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
         "tool_use blocks are not supported in a user message (it takes text and tool_result blocks)"),
        ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}]},
         "tool_result blocks are not supported in an assistant message (it takes text and tool_use blocks)"),
        ({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                       "content": [{"type": "image", "source": {}}]}]},
         "image blocks are not supported in a tool_result's content (it takes text blocks)"),
    ],
)
def test_a_block_in_the_wrong_place_is_a_400_that_says_where(app_client: TestClient, message: dict, says: str) -> None:
    """It named the block's own kind among the supported ones ("tool_use blocks are not supported
    here (text, tool_use and tool_result are)")."""
    assert anthropic_error(app_client.post("/v1/messages", json=body(messages=[message])), 400,
                           "invalid_request_error") == says


@pytest.mark.parametrize("extra", [{"top_k": 2**64}, {"max_tokens": 2**64}])
def test_integers_past_int64_are_400_before_the_engine(app_client: TestClient, engine: FakeEngine, extra: dict) -> None:
    """Bounded as OpenAI's fields are: top_k 2**64 reached the engine, whose wire format cannot take
    it (a 500, "the engine failed")."""
    (name,) = extra
    message = anthropic_error(app_client.post("/v1/messages", json=body(**extra)), 400, "invalid_request_error")
    assert name in message
    assert engine.requests == []


def test_middleware_errors_speak_the_route_s_dialect(engine: FakeEngine) -> None:
    from gateway.pipeline.lifecycle import Lifecycle

    lifecycle = Lifecycle()
    settings = fake_settings(api_keys=["sk-a"], rate_limit_rpm=2)
    with TestClient(create_app(settings, engine_starter=lambda es: engine, lifecycle=lifecycle)) as client:
        message = anthropic_error(client.post("/v1/messages", json=body()), 401, "authentication_error")
        assert "x-api-key" in message
        anthropic_error(client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-wrong"}), 401,
                        "authentication_error")
        assert client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-a"}).status_code == 200
        assert client.post("/v1/models", headers={"x-api-key": "sk-a"}).status_code == 405  # the key passed
        anthropic_error(client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-a"}), 429, "rate_limit_error")
        lifecycle.start_drain()
        anthropic_error(client.post("/v1/messages", json=body(), headers={"x-api-key": "sk-a"}), 503, "api_error")
        assert client.post("/v1/chat/completions", json={}).json()["error"]["code"] == "service_unavailable"


def test_an_error_after_the_stream_started_is_an_error_event(app_client: TestClient, engine: FakeEngine) -> None:
    engine.fail_after = 1
    stream = events(app_client)
    assert stream[-1][0] == "error"
    assert stream[-1][1]["type"] == "error"
    assert stream[-1][1]["error"]["type"] == "api_error"
    assert "[DONE]" not in json.dumps(stream)


def test_remote_models_are_refused_clearly(engine: FakeEngine, tmp_path: Any) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models: [{name: fake-model}, {name: far, kind: remote, url: 'http://127.0.0.1:9/v1'}]")
    with TestClient(create_app(fake_settings(models_file=models), engine_starter=lambda es: engine)) as client:
        message = anthropic_error(client.post("/v1/messages", json=body(model="far")), 400, "invalid_request_error")
        assert "embedded models only" in message
        assert "remote" in anthropic_error(client.post("/v1/messages/count_tokens", json={
            "model": "far", "messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error")
