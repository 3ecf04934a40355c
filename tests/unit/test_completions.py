from __future__ import annotations

import asyncio
import json

import openai
import pytest
from starlette.testclient import TestClient

from gateway.apis.completions import completions_serving
from gateway.protocol.openai import Completion, CompletionChoice, CompletionLogprobs, CompletionRequest, Usage
from tests.fakes import FakeEngine
from tests.unit.test_chat import sse_events

MODEL = "fake-model"


def test_completion_string_prompt(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model=MODEL, prompt="once upon a time", max_tokens=2)
    assert result.object == "text_completion"
    assert result.choices[0].text == "the quick"
    assert result.usage.prompt_tokens == 4
    assert result.usage.completion_tokens == 2


def test_completion_list_prompts_number_choices_prompt_major(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    result = sdk.completions.create(model=MODEL, prompt=["a b", "c d e"], max_tokens=1, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert len(engine.requests) == 2
    assert result.usage.prompt_tokens == 5
    assert result.usage.completion_tokens == 4


def test_completion_token_prompts(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("alpha beta")
    sdk.completions.create(model=MODEL, prompt=ids, max_tokens=1)
    sdk.completions.create(model=MODEL, prompt=[ids, ids[:1]], max_tokens=1)
    assert [r.prompt_token_ids for r in engine.requests] == [ids, ids, ids[:1]]


def test_completion_echo(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model=MODEL, prompt="say", max_tokens=2, echo=True)
    assert result.choices[0].text == "saythe quick"


def test_completion_echo_of_a_truncated_prompt_is_what_the_model_read(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    """truncate_prompt_tokens with echo: the echo is the tokens kept, so that the logprobs' tokens
    and text_offset match the text (it echoed the whole prompt, the offsets counting from the kept part)."""
    prompt = "alpha beta gamma delta"
    kept = engine.tokenizer.decode(engine.tokenizer.encode(prompt)[-2:])
    result = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                    extra_body={"truncate_prompt_tokens": 2})
    assert result.choices[0].text == kept + "the quick"
    assert kept == "gamma delta"
    whole = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                   extra_body={"truncate_prompt_tokens": 10})  # nothing cut: the client's own text
    assert whole.choices[0].text == prompt + "the quick"


def test_completion_logprobs_shape(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model=MODEL, prompt="say", max_tokens=2, logprobs=2)
    logprobs = result.choices[0].logprobs
    assert logprobs.tokens == ["the", " quick"]
    assert logprobs.token_logprobs == [-0.5, -0.5]
    assert logprobs.text_offset == [0, 3]
    assert len(logprobs.top_logprobs[0]) == 2


def test_completion_stream_multi_prompt(client: TestClient) -> None:
    body = {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, "stream": True}
    events = sse_events(client.post("/v1/completions", json=body).text)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for chunk in map(json.loads, events[:-1]):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "the quick", 1: "the quick"}


def test_completion_suffix_is_a_clear_400(client: TestClient) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "suffix": "z"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "suffix"


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
def test_completion_prompt_past_the_context_names_the_prompt(client: TestClient, route: str) -> None:
    """A completion has no `messages`: the param of a prompt that leaves no room is `prompt`."""
    response = client.post(route, json={"model": MODEL, "prompt": "word " * 100, "max_tokens": 2})
    error = response.json()["error"]
    assert response.status_code == 400
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "prompt"


def test_completion_token_outside_vocabulary(client: TestClient, engine: FakeEngine) -> None:
    engine.info.extra["vocab_size"] = 50
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 99]})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"


def test_text_only_stream_chunks_match_the_general_path(client: TestClient) -> None:
    """A one-prompt stream without echo or logprobs takes a leaner per-token path; its choices are
    what the general path (here, with logprobs on) sends, less the logprobs."""

    def choices(**extra: object) -> list[list[dict]]:
        body = {"model": MODEL, "prompt": "a b", "max_tokens": 3, "n": 2, "stream": True, **extra}
        events = sse_events(client.post("/v1/completions", json=body).text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(event)["choices"] for event in events[:-1]]
        return [[{k: v for k, v in c.items() if k != "logprobs"} for c in chunk] for chunk in chunks]

    plain = choices()
    assert plain == choices(logprobs=1)
    finishes = [c.get("finish_reason") for chunk in plain for c in chunk if c.get("finish_reason")]
    assert finishes == ["length", "length"]
    assert {c["index"] for chunk in plain for c in chunk} == {0, 1}


def _model_by_model(answer: Completion) -> Completion:
    """The answer built as before: each choice, its logprobs and the usage a model of its own."""
    choices = [
        CompletionChoice(
            index=c.index,
            text=c.text,
            finish_reason=c.finish_reason,
            logprobs=CompletionLogprobs(**c.logprobs.model_dump()) if c.logprobs is not None else None,
        )
        for c in answer.choices
    ]
    assert answer.usage is not None
    usage = Usage(
        prompt_tokens=answer.usage.prompt_tokens,
        completion_tokens=answer.usage.completion_tokens,
        total_tokens=answer.usage.total_tokens,
    )
    return Completion(id=answer.id, created=answer.created, model=answer.model, choices=choices, usage=usage)


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": "a b", "max_tokens": 2},
        {"prompt": ["a b", "c"], "max_tokens": 2, "n": 2},
        {"prompt": "say", "max_tokens": 2, "echo": True, "logprobs": 2},
        {"prompt": "say", "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": "say", "max_tokens": 2, "n": 1, "best_of": 3, "logprobs": 1},
    ],
)
def test_whole_answer_is_what_the_models_one_by_one_make(fields: dict[str, object]) -> None:
    """The whole answer is validated in one step from plain fields: the same models (types, fields
    set) and the same JSON, byte for byte, as building each choice, logprobs and usage apart."""
    engine = FakeEngine()
    request = CompletionRequest.model_validate({"model": MODEL, **fields})
    answer = asyncio.run(completions_serving.complete(completions_serving.prepare(request, engine, None)))
    again = _model_by_model(answer)
    assert all(type(c) is CompletionChoice for c in answer.choices)
    assert type(answer.usage) is Usage
    assert [c.model_fields_set for c in answer.choices] == [c.model_fields_set for c in again.choices]
    assert answer.model_fields_set == again.model_fields_set
    serialize = Completion.__pydantic_serializer__.to_json
    assert serialize(answer, exclude_none=True) == serialize(again, exclude_none=True)
    assert serialize(answer) == serialize(again)


def test_whole_answer_json() -> None:
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": "a b", "max_tokens": 2})
    answer = asyncio.run(completions_serving.complete(completions_serving.prepare(request, FakeEngine(), None)))
    written = json.loads(Completion.__pydantic_serializer__.to_json(answer, exclude_none=True))
    assert written == {
        "id": answer.id,
        "object": "text_completion",
        "created": answer.created,
        "model": MODEL,
        "choices": [{"index": 0, "text": "the quick", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4},
    }


def test_a_failing_prompt_ends_the_other_prompts_runs_at_once() -> None:
    """A non-streamed request of several prompts that fails on one (an engine error, or the client
    leaving) closes the other runs then and there: their engine requests end and the in-flight
    gauge comes back down (they were left to the garbage collector, and the gauge stayed up)."""
    from gateway.telemetry import metrics

    engine = FakeEngine(name="fail-model")
    engine.fail_after = 1
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 3})
    in_flight = metrics.labelled(metrics.IN_FLIGHT, "fail-model")

    async def go() -> None:
        with pytest.raises(RuntimeError, match="fake engine failure"):
            await completions_serving.complete(completions_serving.prepare(request, engine, None))
        assert not engine.running
        assert in_flight._value.get() == 0

    asyncio.run(go())


def test_an_empty_prompt_or_stop_string_is_refused_with_its_param(client: TestClient) -> None:
    """The engine refuses both, without a param; the gateway says which field, before the engine."""
    for extra, param in (({"prompt": ""}, "prompt"), ({"prompt": "hi", "stop": ""}, "stop"),
                         ({"prompt": "hi", "stop": ["ok", ""]}, "stop.1")):
        response = client.post("/v1/completions", json={"model": "fake-model", "max_tokens": 2, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.json())
    assert client.post("/v1/completions", json={"model": "fake-model", "prompt": "hi", "stop": ["ok"]}).status_code == 200


def test_a_failing_prompt_fails_a_stream_of_several_prompts() -> None:
    """Several prompts streamed (their outputs merged as they come): one prompt's failure is the
    stream's, and the other runs end with it."""
    engine = FakeEngine(name="fail-stream-model")
    engine.fail_after = 1
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": ["a", "b"], "max_tokens": 3, "stream": True})

    async def go() -> None:
        with pytest.raises(RuntimeError, match="fake engine failure"):
            async for _ in completions_serving.stream(completions_serving.prepare(request, engine, None)):
                pass
        assert not engine.running

    asyncio.run(go())
