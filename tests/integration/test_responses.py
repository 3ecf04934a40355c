"""The Responses API on the real engine (the session's gateway), through the openai SDK: answers,
the event stream, structured outputs, a tool-call round trip, stored responses and their
chains, background runs and cancels, errors. The same conversation continued on another replica
through Redis is in test_backends.py (it needs a second gateway)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.integration.conftest import MODEL
from tests.integration.test_conformance import engine_running, wait_for_idle
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("stored responses and chains need the gateway's store")]
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}
CITY = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 30}}, "required": ["capital"],
        "additionalProperties": False}


def test_create_and_retrieve(sdk: openai.OpenAI) -> None:
    answer = sdk.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30)
    assert answer.status == "completed"
    assert "Paris" in answer.output_text
    assert answer.usage.input_tokens > 5
    assert 0 < answer.usage.output_tokens <= 30
    assert sdk.responses.retrieve(answer.id).output_text == answer.output_text


def test_stream_events_in_order(sdk: openai.OpenAI) -> None:
    fresh = {"Cache-Control": "no-cache"}  # not the cached answer of the test above (a replay is one delta)
    with sdk.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=30,
                              extra_headers=fresh) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    deltas = types.count("response.output_text.delta")
    assert deltas > 3
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "Paris" in final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert sdk.responses.retrieve(final.id).output_text == final.output_text


def test_max_output_tokens_makes_it_incomplete(sdk: openai.OpenAI) -> None:
    answer = sdk.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=16)
    assert answer.status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 16


def test_text_format_json_schema(sdk: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    answer = sdk.responses.create(model=MODEL, input=QUESTION, text={"format": fmt}, temperature=0, max_output_tokens=60)
    assert isinstance(json.loads(answer.output_text)["capital"], str)


def test_a_tool_call_round_trip(sdk: openai.OpenAI) -> None:
    """function_call → the client runs it → function_call_output → the answer."""
    choice = {"type": "function", "name": "get_weather"}
    asked = sdk.responses.create(model=MODEL, input="What's the weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                 temperature=0, max_output_tokens=60)
    call = asked.output[0]
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert "city" in json.loads(call.arguments)
    answered = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[WEATHER], temperature=0,
                                    max_output_tokens=40, input=[
                                        {"type": "function_call_output", "call_id": call.call_id,
                                         "output": "18 degrees and sunny"}])
    assert answered.output[0].type == "message"
    assert answered.output_text
    kinds = [item.type for item in sdk.responses.input_items.list(answered.id, order="asc")]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_previous_response_id_keeps_the_conversation(sdk: openai.OpenAI) -> None:
    first = sdk.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", temperature=0, max_output_tokens=30)
    second = sdk.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id, temperature=0,
                                  max_output_tokens=30)
    # the prompt held the first turn, question and answer (too small a model to rely on its memory)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = list(sdk.responses.input_items.list(second.id))
    assert [item.role for item in items] == ["user", "assistant", "user"]
    sdk.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=MODEL, input="again", previous_response_id=first.id)


def test_background_completes(sdk: openai.OpenAI) -> None:
    started = sdk.responses.create(model=MODEL, input=QUESTION, background=True, temperature=0, max_output_tokens=20)
    assert started.status == "in_progress"
    found = until_sync(lambda: (got := sdk.responses.retrieve(started.id)).status != "in_progress" and got, 120,
                       "the response done", step_s=0.2)
    assert found.status in ("completed", "incomplete")
    assert "Paris" in found.output_text


def test_cancel_stops_a_background_response(sdk: openai.OpenAI, base_url: str) -> None:
    started = sdk.responses.create(model=MODEL, input="Write the numbers from 1 to 1000, separated by commas.",
                                   background=True, temperature=0, max_output_tokens=1500)
    until_sync(lambda: engine_running(base_url) >= 1, what="the request in vLLM's gauges", step_s=0.1)
    cancelled = sdk.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert sdk.responses.retrieve(started.id).status == "cancelled"
    assert wait_for_idle(base_url) == 0


def test_errors_in_openai_s_shape(sdk: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.retrieve("resp_does_not_exist")
    assert missing.value.body["param"] == "response_id"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
    assert bad.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16).id)
    unknown = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi", "seed": 1})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "seed"
    paths = httpx.get(f"{base_url}/openapi.json").json()["paths"]
    assert {"/v1/responses", "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items",
            "/v1/responses/{response_id}/cancel"} <= set(paths)
