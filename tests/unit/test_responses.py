"""The Responses API on the fake engine, through the openai SDK (its own types parse every answer
and event) and raw HTTP: answers, incomplete answers, the event stream, stored responses and
conversation chains, tools, structured outputs, background runs and cancels, the cache, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from redis import Redis
from starlette.testclient import TestClient

from gateway.apis.responses import responses_serving as responses
from tests.fakes import FakeEngine, app_with
from tests.redis_server import RedisServer
from tests.sse import named as sse  # (event name, data) of every event of a named-event stream
from tests.unit.test_disconnect import drive
from tests.waits import until_sync

MODEL = "fake-model"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]




def sdk_for(client: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture
def scripted(engine: FakeEngine) -> FakeEngine:
    engine.reply = ["Hello", " there", "!"]
    return engine


def test_create_answers_a_response(sdk: openai.OpenAI, scripted: FakeEngine) -> None:
    answer = sdk.responses.create(model=MODEL, input="hi", instructions="Be brief.", metadata={"k": "v"}, user="u1")
    assert answer.object == "response"
    assert answer.id.startswith("resp_")
    assert answer.status == "completed"
    assert answer.output_text == "Hello there!"
    assert answer.completed_at is not None
    message = answer.output[0]
    assert message.type == "message"
    assert message.role == "assistant"
    assert message.status == "completed"
    assert answer.usage.output_tokens == 3
    assert answer.usage.total_tokens == answer.usage.input_tokens + 3
    assert (answer.instructions, answer.metadata, answer.user, answer.model) == ("Be brief.", {"k": "v"}, "u1", MODEL)
    assert scripted.requests[0].prompt_text == "<system> Be brief. <user> hi <assistant>"


def test_answers_keep_their_nulls_as_openai_sends_them(client: TestClient, scripted: FakeEngine) -> None:
    body = client.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
    assert body["error"] is None
    assert body["incomplete_details"] is None
    assert body["previous_response_id"] is None
    assert body["output"][0]["content"][0] == {"type": "output_text", "text": "Hello there!", "annotations": [],
                                               "logprobs": []}


def test_tool_choice_auto_without_tools_is_no_choice(sdk: openai.OpenAI, scripted: FakeEngine) -> None:
    assert sdk.responses.create(model=MODEL, input="hi", tool_choice="auto").output_text == "Hello there!"
    with pytest.raises(openai.BadRequestError) as refused:  # required with nothing to call is still a 400
        sdk.responses.create(model=MODEL, input="hi", tool_choice="required")
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]


def test_max_output_tokens_cut_is_incomplete(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    answer = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert answer.status == "incomplete"
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output[0].status == "incomplete"
    assert answer.completed_at is None
    assert answer.usage.output_tokens == 16
    assert engine.requests[0].sampling.max_tokens == 16


def test_stream_sends_openai_s_events_in_order(client: TestClient, scripted: FakeEngine) -> None:
    response = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    names = [name for name, _ in events]
    assert names == [*TEXT_EVENTS[:5], "response.output_text.delta", "response.output_text.delta", *TEXT_EVENTS[5:],
                     "response.completed"]
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert "".join(data["delta"] for name, data in events if name.endswith("delta")) == "Hello there!"
    item_id = events[2][1]["item"]["id"]
    assert {data.get("item_id", item_id) for _, data in events[3:-2]} == {item_id}
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["id"] == item_id
    assert client.get(f"/v1/responses/{final['id']}").json() == final


def test_stream_with_the_sdk(sdk: openai.OpenAI, scripted: FakeEngine) -> None:
    with sdk.responses.stream(model=MODEL, input="hi") as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Hello there!"
    assert sdk.responses.retrieve(final.id).output_text == "Hello there!"


def test_a_cut_stream_ends_incomplete(client: TestClient) -> None:
    events = sse(client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True,
                                                   "max_output_tokens": 16}).text)
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2][1]["item"]["status"] == "incomplete"


def test_an_engine_failure_mid_stream_is_response_failed(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_after = 2
    events = sse(client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}).text)
    name, data = events[-1]
    assert name == "response.failed"
    assert data["response"]["error"]["code"] == "server_error"
    assert client.get(f"/v1/responses/{data['response']['id']}").json()["status"] == "failed"


def test_previous_response_id_continues_the_conversation(sdk: openai.OpenAI, scripted: FakeEngine) -> None:
    first = sdk.responses.create(model=MODEL, input="hi", instructions="Be brief.")
    second = sdk.responses.create(model=MODEL, input="and again?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # the earlier turn, not its instructions (OpenAI does not carry those over)
    assert scripted.requests[1].prompt_text == "<user> hi <assistant> Hello there! <user> and again? <assistant>"
    items = list(sdk.responses.input_items.list(second.id))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[0].content[0].text == "and again?"
    assert items[1].id == first.output[0].id
    ascending = list(sdk.responses.input_items.list(second.id, order="asc", limit=1))  # the SDK pages with `after`
    assert [i.id for i in ascending] == [i.id for i in reversed(items)]


def test_input_items_page_by_page(client: TestClient, scripted: FakeEngine) -> None:
    texts = [{"role": "user", "content": f"m{i}"} for i in range(5)]
    answer = client.post("/v1/responses", json={"model": MODEL, "input": texts}).json()
    page = client.get(f"/v1/responses/{answer['id']}/input_items?limit=2&order=asc").json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["m0", "m1"]
    assert page["has_more"]
    rest = client.get(f"/v1/responses/{answer['id']}/input_items?limit=10&order=asc&after={page['last_id']}").json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["m2", "m3", "m4"]
    assert not rest["has_more"]
    bad = client.get(f"/v1/responses/{answer['id']}/input_items?limit=0")
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "limit"


def test_a_tool_call_round_trip(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = [CALL]
    asked = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER])
    call = asked.output[0]
    assert asked.status == "completed"
    assert len(asked.output) == 1
    assert call.type == "function_call"
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")
    assert call.id.startswith("fc_")
    engine.reply = ["It is sunny."]
    answered = sdk.responses.create(model=MODEL, previous_response_id=asked.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
    assert answered.output_text == "It is sunny."
    prompt = engine.requests[1].prompt_text
    assert prompt.index("Weather in Paris?") < prompt.index(CALL) < prompt.index("<tool> sunny, 21C")


def test_a_tool_call_sent_back_as_input_items(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    """Without a store: the client sends the call (the SDK's own output item) and its output."""
    engine.reply = [CALL]
    asked = sdk.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], store=False)
    engine.reply = ["Sunny."]
    history = [{"role": "user", "content": "Weather?"}, *asked.output,
               {"type": "function_call_output", "call_id": asked.output[0].call_id, "output": "sunny"}]
    assert sdk.responses.create(model=MODEL, input=history, tools=[WEATHER]).output_text == "Sunny."
    assert CALL in engine.requests[1].prompt_text


def test_a_named_tool_streams_its_arguments(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['{"city": ', '"Paris"}']
    choice = {"type": "function", "name": "get_weather"}
    with sdk.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice=choice) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[5].arguments == final.output[0].arguments == '{"city": "Paris"}'
    assert engine.requests[0].sampling.json_schema == WEATHER["parameters"]


def test_required_tool_choice_and_parallel_calls(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.reply = ['[{"name": "get_weather", "parameters": {"city": "Paris"}}]']
    answer = sdk.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False)
    assert answer.output[0].type == "function_call"
    assert answer.parallel_tool_calls is False
    assert engine.requests[0].sampling.json_schema["maxItems"] == 1
    sdk.responses.create(model=MODEL, input="Hi", tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in engine.requests[1].prompt_text


@pytest.mark.parametrize(("fmt", "constraint"), [
    ({"type": "json_schema", "name": "city", "schema": {"type": "object", "properties": {"c": {"type": "string"}}}},
     {"json_schema": {"type": "object", "properties": {"c": {"type": "string"}}}}),
    ({"type": "json_object"}, {"json_object": True}),
])
def test_text_format_constrains_the_output(sdk: openai.OpenAI, engine: FakeEngine, fmt: dict, constraint: dict) -> None:
    engine.reply = ['{"c": "Paris"}']
    answer = sdk.responses.create(model=MODEL, input="Capital?", text={"format": fmt})
    sampling = engine.requests[0].sampling
    assert {key: getattr(sampling, key) for key in constraint} == constraint
    assert answer.text.format.type == fmt["type"]
    assert json.loads(answer.output_text) == {"c": "Paris"}


def test_store_false_is_not_kept(sdk: openai.OpenAI, scripted: FakeEngine) -> None:
    answer = sdk.responses.create(model=MODEL, input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(answer.id)


def test_delete(sdk: openai.OpenAI, client: TestClient, scripted: FakeEngine) -> None:
    answer = sdk.responses.create(model=MODEL, input="hi")
    deleted = client.delete(f"/v1/responses/{answer.id}")
    assert deleted.json() == {"id": answer.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as error:
        sdk.responses.delete(answer.id)
    assert error.value.body["param"] == "response_id"


def test_responses_are_scoped_by_api_key(engine: FakeEngine) -> None:
    engine.reply = ["Hi!"]
    with TestClient(app_with(engine, api_keys=["sk-a", "sk-b"])) as client:
        mine, theirs = sdk_for(client, "sk-a"), sdk_for(client, "sk-b")
        answer = mine.responses.create(model=MODEL, input="hi")
        assert mine.responses.retrieve(answer.id).id == answer.id
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(answer.id)
        with pytest.raises(openai.NotFoundError) as error:
            theirs.responses.create(model=MODEL, input="more", previous_response_id=answer.id)
        assert error.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.AuthenticationError):
            sdk_for(client, "sk-wrong").responses.retrieve(answer.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "hi", "max_output_tokens": 8}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 2**63}, "max_output_tokens"),  # not chat's max_completion_tokens
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "background": True, "store": False}, None),
    ({"input": "hi", "background": True, "stream": True}, None),
    ({}, "input"),
    ({"input": "word " * 80}, "input"),  # past the fake model's 64-token context
])
def test_bad_requests_are_openai_400s(client: TestClient, body: dict, param: str | None) -> None:
    response = client.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


def test_unknown_ids_and_models_are_404s(client: TestClient) -> None:
    for method, path in [("GET", "/v1/responses/resp_nope"), ("DELETE", "/v1/responses/resp_nope"),
                         ("GET", "/v1/responses/resp_nope/input_items"), ("POST", "/v1/responses/resp_nope/cancel")]:
        response = client.request(method, path)
        assert response.status_code == 404, path
        assert response.json()["error"]["param"] == "response_id", path
    unknown = client.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"


def wait_for(sdk: openai.OpenAI, response_id: str, *statuses: str) -> Any:
    return until_sync(lambda: (found := sdk.responses.retrieve(response_id)).status in statuses and found,
                      what=f"{response_id} {statuses}")


def test_background_runs_and_a_cancel_aborts_the_engine(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.delay = 0.01
    started = sdk.responses.create(model=MODEL, input="hi", background=True)
    assert started.status == "in_progress"
    assert started.background is True
    assert sdk.responses.retrieve(started.id).status == "in_progress"
    with pytest.raises(openai.BadRequestError) as running:  # its output is not there yet to continue from
        sdk.responses.create(model=MODEL, input="and then?", previous_response_id=started.id)
    assert running.value.body["param"] == "previous_response_id"
    assert "in_progress" in running.value.message
    cancelled = sdk.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert engine.aborted == [engine.requests[0].request_id]
    assert not engine.running
    assert sdk.responses.retrieve(started.id).status == "cancelled"
    assert sdk.responses.cancel(started.id).status == "cancelled"  # again: no change


def test_a_background_response_completes_and_cannot_be_cancelled_after(sdk: openai.OpenAI, scripted: FakeEngine) -> None:
    started = sdk.responses.create(model=MODEL, input="hi", background=True)
    done = wait_for(sdk, started.id, "completed")
    assert done.output_text == "Hello there!"
    assert done.usage.output_tokens == 3
    assert sdk.responses.cancel(started.id).status == "completed"
    foreground = sdk.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.BadRequestError):
        sdk.responses.cancel(foreground.id)


def test_a_background_response_is_work_in_progress_for_the_drain(engine: FakeEngine) -> None:
    """It holds the lifecycle's count (a SIGTERM's drain waits for it, `gateway.server.http`) from its
    start to its end, here a cancel, after its own request has ended."""
    from gateway.app import create_app
    from gateway.pipeline.lifecycle import Lifecycle
    from tests.fakes import fake_settings

    engine.delay = 0.1  # about 5 s of output: running all through the test
    lifecycle = Lifecycle()
    app = create_app(fake_settings(), engine_starter=lambda es: engine, lifecycle=lifecycle)
    with TestClient(app) as client:
        sdk = sdk_for(client)
        started = sdk.responses.create(model=MODEL, input="hi", background=True)
        until_sync(lambda: lifecycle.active == 1, what="its request over, the background run counted")
        assert engine.running
        assert sdk.responses.cancel(started.id).status == "cancelled"
        until_sync(lambda: lifecycle.active == 0, what="the cancelled run over")
        assert not engine.running


def test_deterministic_answers_come_from_the_cache_under_new_ids(scripted: FakeEngine) -> None:
    with TestClient(app_with(scripted, cache={"backend": "memory"})) as client:
        body = {"model": MODEL, "input": "hi", "temperature": 0}
        first = client.post("/v1/responses", json=body)
        again = client.post("/v1/responses", json={**body, "metadata": {"turn": "2"}})
        assert (first.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
        one, two = first.json(), again.json()
        assert one["id"] != two["id"]
        assert one["output"][0]["id"] != two["output"][0]["id"]
        assert two["metadata"] == {"turn": "2"}
        assert two["output"][0]["content"] == one["output"][0]["content"]
        assert client.get(f"/v1/responses/{two['id']}").json() == two
        streamed = client.post("/v1/responses", json={**body, "stream": True})
        events = sse(streamed.text)
        assert streamed.headers["x-cache"] == "HIT"
        assert [name for name, _ in events] == [*TEXT_EVENTS, "response.completed"]
        assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
        assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "Hello there!"
        assert len(scripted.requests) == 1


def test_remote_models_are_refused(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: far, kind: remote, url: 'http://127.0.0.1:9/v1'}\n")
    with TestClient(app_with(FakeEngine(), models_file=models)) as client:
        response = client.post("/v1/responses", json={"model": "far", "input": "hi"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def replicas(redis: RedisServer, *engines: FakeEngine) -> list[Any]:
    cache = {"backend": "redis", "redis_url": redis.url, "store_ttl_s": 600, "redis_timeout_s": 0.3}
    return [app_with(engine, cache=cache) for engine in engines]


def test_two_replicas_share_conversations_through_redis(redis: RedisServer) -> None:
    engines = [FakeEngine(), FakeEngine()]
    engines[0].reply, engines[1].reply = ["Paris."], ["Lyon."]
    apps = replicas(redis, *engines)
    with TestClient(apps[0]) as one, TestClient(apps[1]) as two:
        first = sdk_for(one).responses.create(model=MODEL, input="Capital of France?")
        second = sdk_for(two).responses.create(model=MODEL, input="And a second city?", previous_response_id=first.id)
        assert engines[1].requests[0].prompt_text == (
            "<user> Capital of France? <assistant> Paris. <user> And a second city? <assistant>")
        assert sdk_for(one).responses.retrieve(second.id).output_text == "Lyon."
        ttl = Redis.from_url(redis.url).pttl(f"llm-gateway:cache:responses:anonymous:{first.id}")
        assert 0 < ttl <= 600_000
        redis.stop()
        down = two.post("/v1/responses", json={"model": MODEL, "input": "more", "previous_response_id": second.id})
        assert down.status_code == 503
        assert down.json()["error"]["type"] == "server_error"
        assert two.post("/v1/responses", json={"model": MODEL, "input": "hi"}).status_code == 200  # served, unstored


def test_a_cancel_on_another_replica_stops_a_background_response(redis: RedisServer, monkeypatch) -> None:
    monkeypatch.setattr(responses, "CANCEL_CHECK_S", 0.05)
    runner = FakeEngine(delay=0.01, max_model_len=100_000)
    apps = replicas(redis, runner, FakeEngine())
    with TestClient(apps[0]) as one, TestClient(apps[1]) as two:
        started = sdk_for(one).responses.create(model=MODEL, input="hi", background=True)
        assert sdk_for(two).responses.cancel(started.id).status == "cancelled"
        until_sync(lambda: runner.aborted, what="the run aborted")
        assert runner.aborted == [runner.requests[0].request_id]
        assert sdk_for(one).responses.retrieve(started.id).status == "cancelled"


async def test_a_stream_whose_client_leaves_is_stored_cancelled(engine: FakeEngine) -> None:
    engine.delay, body = 0.01, {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 50}
    app = app_with(engine, streams={"grace_s": 0})  # no grace for a reconnect: cancelled at once
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope: dict, receive: Any, send: Any) -> None:
            await app({**scope, "state": dict(state)}, receive, send)

        sent = await drive(with_state, body, disconnect_after_chunks=5, path="/v1/responses")
        first = json.loads(sent[1]["body"].split(b"data: ", 1)[1])
        stored = await state["gateway"].responses.of("anonymous").get(first["response"]["id"])
    assert engine.aborted == [engine.requests[0].request_id]
    assert stored.response.status == "cancelled"


def test_another_key_cannot_cancel_or_delete_a_running_background_response(engine: FakeEngine) -> None:
    """Key B's DELETE of key A's running response is a 404 that touches nothing: the run goes on."""
    engine.delay = 0.02
    with TestClient(app_with(engine, api_keys=["sk-a", "sk-b"])) as client:
        a, b = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 20, "background": True}
        started = client.post("/v1/responses", json=body, headers=a).json()
        refused = client.delete(f"/v1/responses/{started['id']}", headers=b)
        assert refused.status_code == 404
        assert refused.json()["error"]["param"] == "response_id"
        found = until_sync(lambda: (got := client.get(f"/v1/responses/{started['id']}", headers=a).json())["status"]
                           not in ("queued", "in_progress") and got, what="the run over")
        assert found["status"] == "incomplete"  # ran to its max_output_tokens, not cancelled
        assert engine.aborted == []
