"""The Conversations API on the fake engine, through the openai SDK (its own types parse every answer) and raw
HTTP: every route, pagination, refusals of bad input (400 with its param, never a 5xx), `conversation` on Responses
requests (whole and streamed), another key's ids answering exactly as unknown ones on every route, a delete while a
response uses the conversation, two replicas sharing conversations through Redis and writing one at once (nothing
lost, nothing twice), what a turn adds under the guards, and what it costs (the key's tokens, the model's context)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from redis import Redis
from starlette.testclient import TestClient

from gateway.apis.conversations.conversations_serving import Conversations
from gateway.stores.responses import OwnedResponses, StoredResponse
from tests.fakes import FakeEngine, HeldEngine, app_with
from tests.redis_server import RedisServer
from tests.waits import until, until_sync

MODEL = "fake-model"
UNKNOWN = "conv_0123456789abcdef0123456789abcdef"
UNKNOWN_ITEM = "msg_0123456789abcdef0123456789abcdef"
A, B = {"authorization": "Bearer sk-a"}, {"authorization": "Bearer sk-b"}
USER = {"type": "message", "role": "user", "content": "Hi"}


def sdk_for(client: TestClient, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=key, http_client=client, max_retries=0)


@pytest.fixture
def two_keys(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(app_with(engine, api_keys=["sk-a", "sk-b"])) as client:
        yield client


def test_every_route_through_the_sdk(sdk: openai.OpenAI) -> None:
    made = sdk.conversations.create(items=[USER, {"type": "message", "role": "assistant", "content": "Hello!"}],
                                    metadata={"topic": "greeting"})
    assert made.id.startswith("conv_")
    assert (made.object, made.metadata) == ("conversation", {"topic": "greeting"})
    assert sdk.conversations.retrieve(made.id) == made
    updated = sdk.conversations.update(made.id, metadata={"topic": "other"})
    assert (updated.id, updated.created_at, updated.metadata) == (made.id, made.created_at, {"topic": "other"})
    added = sdk.conversations.items.create(made.id, items=[{"type": "message", "role": "user", "content": "More"}])
    assert [item.content[0].text for item in added.data] == ["More"]
    listed = sdk.conversations.items.list(made.id, order="asc")
    assert [(item.role, item.content[0].type) for item in listed.data] == [
        ("user", "input_text"), ("assistant", "output_text"), ("user", "input_text")]
    assert listed.data[-1].id == added.data[0].id
    first = listed.data[0]
    assert sdk.conversations.items.retrieve(first.id, conversation_id=made.id) == first
    after_delete = sdk.conversations.items.delete(first.id, conversation_id=made.id)
    assert (after_delete.object, after_delete.id) == ("conversation", made.id)
    assert len(sdk.conversations.items.list(made.id).data) == 2
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.items.retrieve(first.id, conversation_id=made.id)
    deleted = sdk.conversations.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted", True)
    with pytest.raises(openai.NotFoundError) as gone:
        sdk.conversations.retrieve(made.id)
    assert gone.value.body["param"] == "conversation_id"  # type: ignore[index]


def test_an_empty_conversation_and_metadata_set_to_null(client: TestClient) -> None:
    made = client.post("/v1/conversations", json={}).json()
    assert made["metadata"] == {}
    assert made["object"] == "conversation"
    assert client.post(f"/v1/conversations/{made['id']}", json={"metadata": {"a": "b"}}).json()["metadata"] == {"a": "b"}
    assert client.post(f"/v1/conversations/{made['id']}", json={"metadata": None}).json()["metadata"] == {}
    listed = client.get(f"/v1/conversations/{made['id']}/items").json()
    assert listed == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}


def test_items_page_in_both_orders(sdk: openai.OpenAI, client: TestClient) -> None:
    made = sdk.conversations.create(items=[{"role": "user", "content": f"m{i}"} for i in range(20)])
    sdk.conversations.items.create(made.id, items=[{"role": "user", "content": f"m{i}"} for i in range(20, 25)])
    texts = [item.content[0].text for item in sdk.conversations.items.list(made.id, limit=7, order="asc")]
    assert texts == [f"m{i}" for i in range(25)]  # the SDK walks the pages by `after`
    newest = sdk.conversations.items.list(made.id)
    assert [item.content[0].text for item in newest.data] == [f"m{i}" for i in range(24, 4, -1)]  # desc, 20
    assert newest.has_more
    assert newest.last_id == newest.data[-1].id
    rest = sdk.conversations.items.list(made.id, after=newest.last_id)
    assert [item.content[0].text for item in rest.data] == ["m4", "m3", "m2", "m1", "m0"]
    assert not rest.has_more
    unknown = client.get(f"/v1/conversations/{made.id}/items?after=msg_nope")
    assert (unknown.status_code, unknown.json()["error"]["param"]) == (400, "after")


BAD = [
    ("/v1/conversations", {"items": [{"type": "web_search_call"}]}, "items"),
    ("/v1/conversations", {"items": [USER] * 21}, "items"),
    ("/v1/conversations", {"items": "hi"}, "items"),
    ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}]},
     "items.0.content.0"),
    ("/v1/conversations", {"items": [{**USER, "id": "msg_1"}, {**USER, "id": "msg_1"}]}, "items.1.id"),
    ("/v1/conversations", {"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("/v1/conversations", {"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
    ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata.k"),
    ("/v1/conversations", {"metadata": {"k": "é" * 513}}, "metadata.k"),  # characters, not bytes
    ("/v1/conversations", {"metadata": {"ключ" * 16 + "!": "v"}}, "metadata." + "ключ" * 16 + "!"),
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata.k"),
    ("/v1/conversations", {"unknown": 1}, "unknown"),
    ("{conversation}", {}, "metadata"),  # an update names its metadata (null to clear it)
    ("{conversation}", {"metadata": {"k": "🙂" * 513}}, "metadata.k"),
    ("{conversation}/items", {}, "items"),
    ("{conversation}/items", {"items": [USER] * 21}, "items"),
    ("{conversation}/items", {"items": [{"type": "reasoning", "summary": []}]}, "items"),
    ("{conversation}/items", {"items": [{**USER, "id": "msg_first"}]}, "items.0.id"),  # already in it
    ("/v1/responses", {"model": MODEL, "input": "x", "conversation": "{id}", "previous_response_id": "resp_1"},
     "conversation"),
    ("/v1/responses", {"model": MODEL, "input": "x", "conversation": 12}, "conversation"),
    ("/v1/responses", {"model": MODEL, "input": [{**USER, "id": "msg_first"}], "conversation": "{id}"}, "input.0.id"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD)
def test_bad_input_is_a_400_naming_its_field(client: TestClient, path: str, body: dict[str, Any], param: str) -> None:
    made = client.post("/v1/conversations", json={"items": [{**USER, "id": "msg_first"}]}).json()
    path = path.replace("{conversation}", f"/v1/conversations/{made['id']}")
    body = {k: made["id"] if v == "{id}" else v for k, v in body.items()}
    refused = client.post(path, json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert client.get(f"/v1/conversations/{made['id']}/items").json()["data"][0]["id"] == "msg_first"  # untouched


def test_unicode_metadata_at_its_bounds_is_kept(sdk: openai.OpenAI) -> None:
    metadata = {"ключ" * 16: "🙂" * 512, **{f"k{i}": "é" for i in range(15)}}
    made = sdk.conversations.create(metadata=metadata)
    assert sdk.conversations.retrieve(made.id).metadata == metadata


@pytest.mark.parametrize(("query", "param"), [("limit=0", "limit"), ("limit=101", "limit"), ("order=sideways", "order")])
def test_a_bad_list_query_is_a_400(client: TestClient, query: str, param: str) -> None:
    made = client.post("/v1/conversations", json={}).json()
    refused = client.get(f"/v1/conversations/{made['id']}/items?{query}")
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, param)


def test_a_conversation_holds_at_most_a_bodys_bytes(client: TestClient) -> None:
    """The `client` fixture's body bound is 10,000 bytes: a conversation holds about that much, whatever the number of
    adds; a turn may take it past once, then it takes nothing more."""
    page = {"role": "user", "content": "x" * 3000}
    made = client.post("/v1/conversations", json={"items": [page, page]}).json()
    assert client.post(f"/v1/conversations/{made['id']}/items", json={"items": [page]}).status_code == 200
    refused = client.post(f"/v1/conversations/{made['id']}/items", json={"items": [page]})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "items")
    turn = {"model": MODEL, "input": "y" * 900, "conversation": made["id"], "max_output_tokens": 16}
    assert client.post("/v1/responses", json=turn).status_code == 200  # past the bound now
    refused = client.post("/v1/responses", json=turn)
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "conversation")
    assert len(client.get(f"/v1/conversations/{made['id']}/items").json()["data"]) == 5
    assert client.post("/v1/conversations", json={"items": [page] * 4}).status_code in (400, 413)


def test_conversation_on_responses_whole_then_streamed(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    made = sdk.conversations.create(items=[{"role": "developer", "content": "Answer in one word."}])
    engine.reply = ["Paris."]
    first = sdk.responses.create(model=MODEL, input="Capital of France?", conversation=made.id)
    assert first.conversation is not None
    assert first.conversation.id == made.id
    engine.reply = ["Lyon."]
    with sdk.responses.stream(model=MODEL, input="Another city?", conversation={"id": made.id}) as stream:
        second = stream.get_final_response()
    assert second.conversation is not None
    assert second.conversation.id == made.id
    assert engine.requests[-1].prompt_text == ("<system> Answer in one word. <user> Capital of France? "
                                               "<assistant> Paris. <user> Another city? <assistant>")
    items = sdk.conversations.items.list(made.id, order="asc").data
    assert [(item.role, item.content[0].text) for item in items] == [  # type: ignore[union-attr]
        ("developer", "Answer in one word."), ("user", "Capital of France?"), ("assistant", "Paris."),
        ("user", "Another city?"), ("assistant", "Lyon.")]
    assert [items[2].id, items[4].id] == [first.output[0].id, second.output[0].id]
    assert sdk.responses.retrieve(first.id).conversation.id == made.id  # type: ignore[union-attr]
    assert len(sdk.responses.input_items.list(second.id).data) == 4  # the conversation, then its input


def test_a_refused_turn_adds_nothing(client: TestClient) -> None:
    made = client.post("/v1/conversations", json={"items": [USER]}).json()
    refused = client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": made["id"],
                                                 "tool_choice": "required"})
    assert refused.status_code == 400
    assert len(client.get(f"/v1/conversations/{made['id']}/items").json()["data"]) == 1


def test_a_failed_or_cancelled_turn_adds_nothing(sdk: openai.OpenAI, client: TestClient, engine: FakeEngine) -> None:
    made = sdk.conversations.create(items=[USER])
    engine.fail_after = 2
    body = {"model": MODEL, "input": "x", "conversation": made.id, "stream": True}
    assert "response.failed" in client.post("/v1/responses", json=body).text
    engine.fail_after, engine.delay = None, 0.01
    started = sdk.responses.create(model=MODEL, input="y", conversation=made.id, background=True)
    assert sdk.responses.cancel(started.id).status == "cancelled"
    assert len(sdk.conversations.items.list(made.id).data) == 1  # its first item only


def test_a_background_turn_is_added_once_it_ends(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    made = sdk.conversations.create()
    engine.reply = ["Done."]
    started = sdk.responses.create(model=MODEL, input="Work.", conversation=made.id, background=True)
    assert started.conversation is not None
    assert started.conversation.id == made.id
    texts = until_sync(lambda: [item.content[0].text for item in sdk.conversations.items.list(made.id, order="asc")
                                .data] or None, what="the turn added")  # type: ignore[union-attr]
    assert texts == ["Work.", "Done."]
    assert sdk.responses.retrieve(started.id).status == "completed"


def attempts(conversation_id: str, item_id: str) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Every way a request can name a conversation or one of its items."""
    at, turn = f"/v1/conversations/{conversation_id}", {"model": MODEL, "input": "and?"}
    return [
        ("GET", at, None),
        ("POST", at, {"metadata": {"taken": "yes"}}),
        ("DELETE", at, None),
        ("GET", f"{at}/items", None),
        ("GET", f"{at}/items?order=asc&limit=1", None),
        ("POST", f"{at}/items", {"items": [USER]}),
        ("GET", f"{at}/items/{item_id}", None),
        ("DELETE", f"{at}/items/{item_id}", None),
        ("POST", "/v1/responses", {**turn, "conversation": conversation_id}),
        ("POST", "/v1/responses", {**turn, "conversation": {"id": conversation_id}, "stream": True}),
        ("POST", "/v1/responses", {**turn, "conversation": conversation_id, "background": True}),
    ]


def test_another_keys_conversation_answers_as_an_unknown_one_and_touches_nothing(
    two_keys: TestClient, engine: FakeEngine,
) -> None:
    client = two_keys
    theirs = client.post("/v1/conversations", json={"items": [USER], "metadata": {"k": "v"}}, headers=A).json()
    item_id = client.get(f"/v1/conversations/{theirs['id']}/items", headers=A).json()["data"][0]["id"]
    before = client.get(f"/v1/conversations/{theirs['id']}/items", headers=A).json()
    for (method, path, body), (_, unknown_path, unknown_body) in zip(
        attempts(theirs["id"], item_id), attempts(UNKNOWN, UNKNOWN_ITEM), strict=True
    ):
        refused = client.request(method, path, json=body, headers=B)
        expected = client.request(method, unknown_path, json=unknown_body, headers=B)
        assert refused.status_code == 404, (method, path, refused.text)
        assert refused.json() == expected.json() | {"error": {**expected.json()["error"], "message": expected.json()[
            "error"]["message"].replace(UNKNOWN, theirs["id"])}}, (method, path)
    assert engine.requests == []  # no turn reached the engine
    assert client.get(f"/v1/conversations/{theirs['id']}", headers=A).json() == theirs
    assert client.get(f"/v1/conversations/{theirs['id']}/items", headers=A).json() == before


def test_an_item_of_another_conversation_is_unknown_here(client: TestClient) -> None:
    one = client.post("/v1/conversations", json={"items": [USER]}).json()["id"]
    two = client.post("/v1/conversations", json={"items": [USER]}).json()["id"]
    item_of_two = client.get(f"/v1/conversations/{two}/items").json()["data"][0]["id"]
    for method in ("GET", "DELETE"):
        refused = client.request(method, f"/v1/conversations/{one}/items/{item_of_two}")
        assert (refused.status_code, refused.json()["error"]["param"]) == (404, "item_id")
    assert client.get(f"/v1/conversations/{two}/items/{item_of_two}").status_code == 200


@pytest.mark.parametrize("name", [
    "resp_0123456789abcdef0123456789abcdef", f"{UNKNOWN} ", f"x:{UNKNOWN}", "conv_é", "conv_" + "a" * 200, "",
])
def test_ids_of_another_kind_or_shape_name_no_conversation(client: TestClient, name: str) -> None:
    made = client.post("/v1/responses", json={"model": MODEL, "input": "hi"}).json()
    name = name or made["id"]  # a stored response's id is no conversation's
    turn = client.post("/v1/responses", json={"model": MODEL, "input": "x", "conversation": name})
    assert (turn.status_code, turn.json()["error"]["param"]) == (404, "conversation")
    assert client.get(f"/v1/conversations/{httpx.URL(path=name).raw_path.decode()}").status_code in (404, 405)


def test_a_conversations_id_names_no_stored_response(client: TestClient) -> None:
    conversation_id = client.post("/v1/conversations", json={"items": [USER]}).json()["id"]
    for method, path in [("GET", ""), ("GET", "/input_items"), ("POST", "/cancel"), ("DELETE", "")]:
        refused = client.request(method, f"/v1/responses/{conversation_id}{path}")
        assert (refused.status_code, refused.json()["error"]["param"]) == (404, "response_id")
    assert client.get(f"/v1/conversations/{conversation_id}").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
async def test_deleting_a_conversation_while_a_response_uses_it(stream: bool) -> None:
    """The answer completes; the conversation stays deleted (the turn is not added, nothing brings it back)."""
    engine = HeldEngine()
    engine.reply = ["late."]
    app = app_with(engine)
    async with serving(app) as client:
        made = (await client.post("/v1/conversations", json={"items": [USER]})).json()
        body = {"model": MODEL, "input": "x", "conversation": made["id"], "stream": stream}
        answering = asyncio.create_task(client.post("/v1/responses", json=body))
        await until(lambda: engine.held, what="the turn running")
        assert (await client.delete(f"/v1/conversations/{made['id']}")).status_code == 200
        engine.go.set()
        answer = await answering
        assert answer.status_code == 200
        assert "late." in answer.text
        assert (await client.get(f"/v1/conversations/{made['id']}")).status_code == 404


async def test_two_turns_at_once_with_the_same_input_add_it_once() -> None:
    """Both pass the check of their input ids when they start; the second to end finds its input there already."""
    engine = HeldEngine()
    app = app_with(engine)
    async with serving(app) as client:
        made = (await client.post("/v1/conversations", json={})).json()
        given = [{"type": "message", "id": "msg_retried", "role": "user", "content": "Hi"}]
        body = {"model": MODEL, "input": given, "conversation": made["id"], "max_output_tokens": 16}
        turns = [asyncio.create_task(client.post("/v1/responses", json=body)) for _ in range(2)]
        await until(lambda: len(engine.held) == 2, what="both turns running")
        engine.go.set()
        assert [(await turn).status_code for turn in turns] == [200, 200]
        items = (await client.get(f"/v1/conversations/{made['id']}/items", params={"order": "asc"})).json()["data"]
        assert [item["id"] for item in items].count("msg_retried") == 1
        assert [item["role"] for item in items] == ["user", "assistant", "assistant"]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


def test_two_replicas_share_conversations_through_redis(redis: RedisServer) -> None:
    engines = [FakeEngine(), FakeEngine()]
    engines[1].reply = ["Paris."]
    cache = {"backend": "redis", "redis_url": redis.url, "store_ttl_s": 600, "redis_timeout_s": 0.3}
    with TestClient(app_with(engines[0], cache=cache)) as one, TestClient(app_with(engines[1], cache=cache)) as two:
        made = sdk_for(one).conversations.create(items=[USER], metadata={"k": "v"})
        answer = sdk_for(two).responses.create(model=MODEL, input="Capital of France?", conversation=made.id)
        assert answer.output_text == "Paris."
        items = sdk_for(one).conversations.items.list(made.id, order="asc").data
        assert [item.content[0].text for item in items] == ["Hi", "Capital of France?", "Paris."]  # type: ignore[union-attr]
        ttl = Redis.from_url(redis.url).pttl(f"llm-gateway:cache:responses:anonymous:{made.id}")
        assert 0 < ttl <= 600_000
        sdk_for(two).conversations.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            sdk_for(one).conversations.retrieve(made.id)
        redis.stop()
        down = one.post("/v1/conversations", json={})
        assert down.status_code == 503  # not answered as if kept


async def test_two_replicas_writing_one_conversation_at_once_lose_nothing(redis: RedisServer) -> None:
    """Adds, turns, an update and an item's delete at once on two replicas: each change is made to the conversation
    as the other left it (no write undoes another's), and nothing is there twice."""
    cache = {"backend": "redis", "redis_url": redis.url, "store_ttl_s": 600}
    apps = [app_with(FakeEngine(), cache=cache), app_with(FakeEngine(), cache=cache)]
    async with serving(apps[0]) as one, serving(apps[1]) as two:
        clients = [one, two]
        made = (await clients[0].post("/v1/conversations", json={"items": [USER]})).json()
        first = (await clients[0].get(f"/v1/conversations/{made['id']}/items")).json()["data"][0]["id"]
        path = f"/v1/conversations/{made['id']}"
        writes = [clients[i % 2].post(f"{path}/items", json={"items": [{"role": "user", "content": f"m{i}"}]})
                  for i in range(6)]
        writes += [clients[i].post("/v1/responses", json={"model": MODEL, "input": f"turn {i}", "conversation": made["id"],
                                                          "max_output_tokens": 16}) for i in range(2)]
        writes += [clients[1].post(path, json={"metadata": {"k": "v"}}), clients[0].delete(f"{path}/items/{first}")]
        answers = await asyncio.gather(*writes)
        assert [answer.status_code for answer in answers] == [200] * 10, [answer.text for answer in answers]
        items = (await clients[1].get(f"{path}/items", params={"order": "asc", "limit": 100})).json()["data"]
        texts = [item["content"][0]["text"] for item in items if item["role"] == "user"]
        assert sorted(texts) == sorted([f"m{i}" for i in range(6)] + ["turn 0", "turn 1"])
        assert len([item for item in items if item["role"] == "assistant"]) == 2
        assert len({item["id"] for item in items}) == len(items) == 10
        assert (await clients[0].get(path)).json()["metadata"] == {"k": "v"}


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app in this process, its lifespan's state in every request's scope (ASGITransport runs no
    lifespan)."""

    async def with_state(scope: Any, receive: Any, send: Any) -> None:
        scope["state"] = dict(state)
        await app(scope, receive, send)

    async with app.router.lifespan_context(app) as state, httpx.AsyncClient(
        transport=httpx.ASGITransport(app=with_state), base_url="http://t"
    ) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_adds_the_answer_as_the_output_guards_let_it_out(tmp_path: Path, stream: bool) -> None:
    """The answer added is the one the client got (redacted, cut), never the model's raw text; the input is the
    client's own, as sent (the engine read it redacted, and reads it so again on every later turn)."""
    from tests.unit.test_guards import guarded_app

    engine = FakeEngine(max_model_len=4096)
    with TestClient(guarded_app(tmp_path, engine)) as client:
        made = client.post("/v1/conversations", json={}).json()
        turn = {"model": MODEL, "conversation": made["id"], "stream": stream}
        engine.reply = ["Ask eve@", "evil.example", " or the quick brown fox"]
        assert client.post("/v1/responses", json={**turn, "input": "Mail bob@corp.example"}).status_code == 200
        assert "bob@corp.example" not in engine.requests[-1].prompt_text
        assert client.post("/v1/responses", json={**turn, "input": "Project Hydra?"}).status_code == 400
        items = client.get(f"/v1/conversations/{made['id']}/items", params={"order": "asc"}).json()["data"]
        assert [(item["role"], item["content"][0]["text"], item["status"]) for item in items] == [
            ("user", "Mail bob@corp.example", "completed"), ("assistant", "Ask [EMAIL] or the quick brown ", "incomplete")]
        client.post("/v1/responses", json={**turn, "input": "again"})
        assert "bob@corp.example" not in engine.requests[-1].prompt_text


def test_a_turn_charges_the_conversations_tokens_to_the_key() -> None:
    """The prompt the key's tokens per minute count is the whole conversation, not only the request's input: a
    second turn on it no longer fits."""
    engine = FakeEngine(max_model_len=4096)
    with TestClient(app_with(engine, rate_limit_tpm=400)) as client:
        made = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "word " * 200}]}).json()
        turn = client.post("/v1/responses", json={"model": MODEL, "input": "q", "conversation": made["id"],
                                                  "max_output_tokens": 16})
        prompt = engine.requests[-1].prompt_token_ids
        assert len(prompt) > 200
        assert turn.headers["x-ratelimit-remaining-tokens"] == str(400 - len(prompt) - 16)
        again = client.post("/v1/responses", json={"model": MODEL, "input": "q", "conversation": made["id"],
                                                   "max_output_tokens": 16})
        assert again.status_code == 429


@pytest.mark.parametrize("how", [{}, {"stream": True}, {"background": True}])
def test_a_turn_is_in_its_conversation_before_its_response_reads_as_ended(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, how: dict[str, Any],
) -> None:
    """A client that sees the response ended (polling a background one) and sends the next turn at once finds the
    turn before it in the conversation."""
    found: list[int] = []
    put = OwnedResponses.put

    async def noting(self: OwnedResponses, stored: StoredResponse) -> None:
        if stored.response.status == "completed" and stored.response.conversation is not None:
            conversation = await Conversations(self, 1 << 30).get(stored.response.conversation.id)
            found.append(len(conversation.items))
        await put(self, stored)

    monkeypatch.setattr(OwnedResponses, "put", noting)
    engine.reply = ["Done."]
    made = client.post("/v1/conversations", json={"items": [USER]}).json()
    turn = {"model": MODEL, "input": "x", "conversation": made["id"], "max_output_tokens": 16, **how}
    assert client.post("/v1/responses", json=turn).status_code == 200
    assert until_sync(lambda: found, what="the response stored as completed") == [3]


@pytest.mark.parametrize("how", [{}, {"stream": True}, {"background": True}])
def test_a_conversation_past_the_models_context_is_a_400_before_the_engine(
    client: TestClient, engine: FakeEngine, how: dict[str, Any],
) -> None:
    """Nothing is truncated: the turn is refused as a prompt too long is, before the engine, and adds nothing."""
    made = client.post("/v1/conversations", json={"items": [{"role": "user", "content": "word " * 100}]}).json()
    refused = client.post("/v1/responses", json={"model": MODEL, "input": "q", "conversation": made["id"], **how})
    assert (refused.status_code, refused.json()["error"]["code"]) == (400, "context_length_exceeded")
    assert engine.requests == []
    assert len(client.get(f"/v1/conversations/{made['id']}/items").json()["data"]) == 1
