from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from gateway.protocol.openai import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Usage,
)
from tests import sse
from tests.fakes import FakeEngine

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "hello there"}]


sse_events = sse.data  # each event's data (its id apart: a resumable stream's number)


def test_chat_non_stream_parses_with_sdk(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    result = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == "the quick brown"
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(engine.requests[0].prompt_token_ids)
    assert result.usage.completion_tokens == 3
    assert result.usage.total_tokens == result.usage.prompt_tokens + 3


def test_chat_renders_messages_through_template(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    prompt = engine.requests[0].prompt_text
    assert prompt == "<system> be brief <user> part one\ntwo <assistant> ok <user> again <assistant>"


def test_chat_stream_chunks_role_first_and_done(client: TestClient) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "stream": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == "the quick brown fox"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len({c["id"] for c in chunks}) == 1


def test_chat_stream_with_sdk_and_usage(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 3
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "the quick brown"


def test_chat_stream_n_choices_carry_their_index(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, n=3, stream=True))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {0: "the quick", 1: "the quick", 2: "the quick"}


def test_chat_sampling_parameters_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    body = {
        "model": MODEL, "messages": HELLO, "max_completion_tokens": 5, "max_tokens": 9,
        "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["x", "y"], "seed": 7,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_k": 5, "min_p": 0.1,
        "repetition_penalty": 1.1, "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [3],
        "logit_bias": {"12": 5}, "user": "u1",
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    s = engine.requests[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.stop, s.seed) == (5, 0.5, 0.9, 2, ("x", "y"), 7)
    assert (s.presence_penalty, s.frequency_penalty, s.top_k, s.min_p) == (0.5, -0.5, 5, 0.1)
    assert (s.repetition_penalty, s.min_tokens, s.ignore_eos, s.stop_token_ids) == (1.1, 1, True, (3,))
    assert s.logit_bias == {12: 5.0}


def test_chat_default_max_tokens_fills_the_context(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO})
    request = engine.requests[0]
    assert request.sampling.max_tokens == engine.info.max_model_len - len(request.prompt_token_ids)


def test_chat_logprobs(sdk: openai.OpenAI) -> None:
    result = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=2)
    content = result.choices[0].logprobs.content
    assert [c.token for c in content] == ["the", " quick"]
    assert len(content[0].top_logprobs) == 2


def test_chat_json_schema_reaches_engine(client: TestClient, engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {
        "model": MODEL, "messages": HELLO, "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}},
    }
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.requests[0].sampling.json_schema == schema


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_past_the_context_is_400_before_any_byte(client: TestClient, stream: bool) -> None:
    messages = [{"role": "user", "content": "word " * 100}]
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stream": stream})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_max_tokens_past_the_context_is_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1000})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "max_tokens"


def _chat_model_by_model(answer: ChatCompletion) -> ChatCompletion:
    """The answer built as before: each choice, message, logprobs and the usage a model of its own."""
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.message.content, tool_calls=c.message.tool_calls),
            finish_reason=c.finish_reason,
            logprobs=ChoiceLogprobs(**c.logprobs.model_dump()) if c.logprobs is not None else None,
        )
        for c in answer.choices
    ]
    u = answer.usage
    usage = Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                  total_tokens=u.total_tokens, prompt_tokens_details=u.prompt_tokens_details)
    return ChatCompletion(id=answer.id, created=answer.created, model=answer.model, choices=choices, usage=usage,
                          service_tier=answer.service_tier)


@pytest.mark.parametrize(
    ("fields", "reply"),
    [
        ({"max_tokens": 3}, None),
        ({"max_tokens": 2, "n": 2, "logprobs": True, "top_logprobs": 2}, None),
        ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]},
         ["Let me check. ", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>']),
    ],
)
def test_whole_chat_answer_is_what_the_models_one_by_one_make(fields: dict, reply: list[str] | None) -> None:
    """Validated in one step from plain fields: the same models (types, fields set) and the same JSON
    as building each choice, message, logprobs and usage apart."""
    import asyncio

    from gateway.apis.chat import chat_serving

    engine = FakeEngine()
    engine.reply = reply
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})
    answer = asyncio.run(chat_serving.complete(chat_serving.prepare(request, engine, None)))
    again = _chat_model_by_model(answer)
    assert all(type(c) is ChatChoice and type(c.message) is AssistantMessage for c in answer.choices)
    assert type(answer.usage) is Usage
    assert [(c.model_fields_set, c.message.model_fields_set) for c in answer.choices] == [
        (c.model_fields_set, c.message.model_fields_set) for c in again.choices
    ]
    assert answer.model_fields_set == again.model_fields_set
    assert answer.usage.model_fields_set == again.usage.model_fields_set
    serialize = ChatCompletion.__pydantic_serializer__.to_json
    assert serialize(answer, exclude_none=True) == serialize(again, exclude_none=True)
    assert serialize(answer) == serialize(again)
    if reply is not None:
        assert answer.choices[0].message.tool_calls
        assert answer.choices[0].finish_reason == "tool_calls"
