"""Resumable streams (`stores.streams`, written by `web.sse`): every streaming API's stream resumed at every point
(before its first event, in the middle, after its end), from the in-process ring and from a real redis-server; bad
`Last-Event-ID` / `starting_after` is a 400 naming it; another key's stream id a 404 exactly as an unknown one; a
client that leaves does not stop the generation within the grace; a producer that dies ends a resumed stream with
one error event in the API's shape (or the continuation, when one is plugged in)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.backends.admission import Admission
from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.batch_objects import Owner
from gateway.settings import AdmissionSettings, StreamSettings
from gateway.stores.redis import RedisPools
from gateway.stores.streams import MemoryLog, RedisLog, StreamStore, Takeover, not_found
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.redis_server import RedisServer
from tests.unit.test_responses import sdk_for
from tests.waits import until, until_awaited

MODEL = "fake-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 6, "stream": True},
    "/v1/messages": {"model": MODEL, "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
    "/stream-generate": {"model": MODEL, "prompt": "hi", "max_tokens": 6},  # the native API's: resumable too
    "/chat": {**CHAT},
}
KEYS = ["sk-a", "sk-b"]


def auth(key: str = "sk-a") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def events(text: str) -> list[str]:
    """An SSE body's events, each its block of lines."""
    return [block for block in text.split("\n\n") if block.strip()]


def ids(text: str) -> list[int]:
    return [int(line[4:]) for block in events(text) for line in block.split("\n") if line.startswith("id: ")]


@asynccontextmanager
async def gateway(engine: FakeEngine, redis_url: str | None = None, admission: dict[str, Any] | None = None,
                  overrides: dict[str, Any] | None = None, **streams: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app in-process, its lifespan state in every scope (as the server gives it), resumable streams on (in
    Redis at `redis_url`, else in memory); `overrides`: other top-level settings. The client's `app_state` is the
    lifespan's state and its `asgi` the app as the client calls it (for a hand-driven ASGI call)."""
    cache = {"backend": "redis", "redis_url": redis_url} if redis_url else {"backend": "off"}
    settings = fake_settings(api_keys=KEYS, cache=cache, streams={"resumable": True, **streams},
                             admission={"adaptive": False, **(admission or {})}, **(overrides or {}))
    app = create_app(settings, engine_starter=lambda es: engine)
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope: dict, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://gw") as client:
            client.app_state = state  # type: ignore[attr-defined]
            client.asgi = with_state  # type: ignore[attr-defined]
            yield client


@pytest.mark.parametrize("path", list(BODIES))
async def test_every_streaming_api_resumes_at_every_point(path: str) -> None:
    async with gateway(FakeEngine()) as client:
        whole = await client.post(path, json=BODIES[path], headers=auth())
        stream_id = whole.headers["x-stream-id"]
        numbered = ids(whole.text)
        assert numbered == list(range(len(numbered)))
        assert len(numbered) >= 4
        resume = f"{path}/streams/{stream_id}"
        from_start = await client.get(resume, headers=auth())
        assert from_start.status_code == 200
        assert from_start.text == whole.text
        assert from_start.headers["x-stream-id"] == stream_id
        for after in (0, len(numbered) // 2, numbered[-1]):
            again = await client.get(resume, headers={**auth(), "last-event-id": str(after)})
            assert ids(again.text) == numbered[after + 1:]
            assert whole.text.endswith(again.text)  # exactly what was missed, and the end
        other_api = next(p for p in BODIES if p != path)
        assert (await client.get(f"{other_api}/streams/{stream_id}", headers=auth())).status_code == 404


async def test_a_responses_stream_resumes_by_its_sequence_number() -> None:
    async with gateway(FakeEngine()) as client:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True}
        whole = await client.post("/v1/responses", json=body, headers=auth())
        created = json.loads(events(whole.text)[0].split("data: ", 1)[1])
        response_id = created["response"]["id"]
        assert whole.headers["x-stream-id"] == response_id
        sequence = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in events(whole.text)]
        assert ids(whole.text) == sequence == list(range(len(sequence)))
        for after in (None, 0, 3, sequence[-1]):
            query = "" if after is None else f"&starting_after={after}"
            again = await client.get(f"/v1/responses/{response_id}?stream=true{query}", headers=auth())
            assert again.status_code == 200
            kept = [json.loads(e.split("data: ", 1)[1])["sequence_number"] for e in events(again.text)]
            assert kept == sequence[(-1 if after is None else after) + 1:]
        by_header = await client.get(f"/v1/responses/{response_id}?stream=true",
                                     headers={**auth(), "last-event-id": "3"})
        assert ids(by_header.text) == sequence[4:]
        beyond = await client.get(f"/v1/responses/{response_id}?stream=true&starting_after={sequence[-1] + 1}",
                                  headers=auth())
        assert beyond.status_code == 400
        assert beyond.json()["error"]["param"] == "starting_after"
        empty = await client.get(f"/v1/responses/{response_id}?stream=true&starting_after=", headers=auth())
        assert empty.status_code == 400
        bad = await client.get(f"/v1/responses/{response_id}?stream=true&starting_after=x", headers=auth())
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "starting_after"
        theirs = await client.get(f"/v1/responses/{response_id}?stream=true", headers=auth("sk-b"))
        unknown = await client.get("/v1/responses/resp_ffff?stream=true", headers=auth("sk-b"))
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.json()["error"]["message"].replace(response_id, "X") == \
            unknown.json()["error"]["message"].replace("resp_ffff", "X")


async def test_a_store_false_responses_stream_is_kept_only_for_a_reconnect_then_unknown() -> None:
    """Not stored: OpenAI answers an unknown response once it ends; its events are kept for a client that lost its
    connection (the grace), not for a retrieve long after (`streams.ttl_s`)."""
    async with gateway(FakeEngine(), grace_s=0.5, lease_s=0.3) as client:
        rings = client.app_state["gateway"].streams.log._rings  # type: ignore[attr-defined]
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True}
        kept = await client.post("/v1/responses", json=body, headers=auth())
        fleeting = await client.post("/v1/responses", json={**body, "store": False}, headers=auth())
        ttls = {key.rsplit(":", 1)[1]: ring.ttl_s for key, ring in rings.items()}
        assert ttls == {kept.headers["x-stream-id"]: 600, fleeting.headers["x-stream-id"]: 0.5}

        async def unknown() -> bool:
            again = await client.get(f"/v1/responses/{fleeting.headers['x-stream-id']}?stream=true", headers=auth())
            return again.status_code == 404

        await until_awaited(unknown, within_s=30, what="the store:false stream's events dropped after the grace")
        stored = await client.get(f"/v1/responses/{kept.headers['x-stream-id']}?stream=true", headers=auth())
        assert stored.status_code == 200
        assert stored.text == kept.text


def test_the_sdks_read_resumable_streams_with_their_ids() -> None:
    """Resumable by default: the openai and anthropic SDKs' stream parsers take the `id:` lines in their stride,
    and the openai SDK's own resume (`responses.retrieve(id, stream=True, starting_after=N)`) works."""
    with TestClient(app_with(FakeEngine(), api_keys=KEYS)) as client:
        sdk = sdk_for(client, "sk-a")
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=6, stream=True))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        streamed = list(sdk.responses.create(model=MODEL, input="hi", max_output_tokens=16, stream=True))
        assert [event.sequence_number for event in streamed] == list(range(len(streamed)))
        response_id = streamed[0].response.id  # type: ignore[union-attr]
        resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=2))
        assert [event.model_dump() for event in resumed] == [event.model_dump() for event in streamed[3:]]
        claude = anthropic.Anthropic(base_url=str(client.base_url), api_key="sk-a", http_client=client, max_retries=0)
        with claude.messages.stream(model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "hi"}]) as stream:
            text = "".join(stream.text_stream)
            assert stream.get_final_message().content[0].text == text  # type: ignore[union-attr]
        assert text


@pytest.mark.parametrize("value", ["x", "-1", " 1", "1.0", "\u0663", "1" * 19, ""])
async def test_a_garbage_last_event_id_is_a_400_naming_it(value: str) -> None:
    async with gateway(FakeEngine()) as client:
        whole = await client.post("/v1/chat/completions", json=CHAT, headers=auth())
        answer = await client.get(f"/v1/chat/completions/streams/{whole.headers['x-stream-id']}",
                                  headers={**auth(), "last-event-id": value.encode()})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "Last-Event-ID"
        anthropic = await client.post("/v1/messages", json=BODIES["/v1/messages"], headers=auth())
        answer = await client.get(f"/v1/messages/streams/{anthropic.headers['x-stream-id']}",
                                  headers={**auth(), "last-event-id": value.encode()})
        assert answer.status_code == 400
        assert answer.json()["type"] == "error"


@pytest.mark.parametrize("path", list(BODIES))
async def test_another_keys_stream_is_an_unknown_one(path: str, kind: str, redis_url: str | None) -> None:
    async with gateway(FakeEngine(), redis_url) as client:
        stream_id = (await client.post(path, json=BODIES[path], headers=auth())).headers["x-stream-id"]
        unknown_id = "strm_" + "0" * 32
        theirs = await client.get(f"{path}/streams/{stream_id}", headers=auth("sk-b"))
        unknown = await client.get(f"{path}/streams/{unknown_id}", headers=auth("sk-b"))
        assert theirs.status_code == unknown.status_code == 404
        assert theirs.text.replace(stream_id, "X") == unknown.text.replace(unknown_id, "X")
        for trick in (f"sk-a:{stream_id}", f" {stream_id}", stream_id.upper(), stream_id + "\u200b"):
            assert (await client.get(f"{path}/streams/{trick}", headers=auth("sk-b"))).status_code == 404
        assert (await client.get(f"{path}/streams/{stream_id}", headers=auth())).status_code == 200  # its own


async def test_another_keys_responses_stream_is_an_unknown_response(kind: str, redis_url: str | None) -> None:
    async with gateway(FakeEngine(), redis_url) as client:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True}
        for store in (True, False):
            response_id = (await client.post("/v1/responses", json={**body, "store": store},
                                             headers=auth())).headers["x-stream-id"]
            for after in ("", "&starting_after=2"):
                theirs = await client.get(f"/v1/responses/{response_id}?stream=true{after}", headers=auth("sk-b"))
                unknown = await client.get(f"/v1/responses/resp_{'0' * 32}?stream=true{after}", headers=auth("sk-b"))
                assert theirs.status_code == unknown.status_code == 404
                assert theirs.json()["error"]["message"].replace(response_id, "X") == \
                    unknown.json()["error"]["message"].replace(f"resp_{'0' * 32}", "X")
                mine = await client.get(f"/v1/responses/{response_id}?stream=true{after}", headers=auth())
                assert mine.status_code == 200


async def test_streams_off_have_no_ids_and_no_resume() -> None:
    engine = FakeEngine()
    app = create_app(fake_settings(streams={"resumable": False}), engine_starter=lambda es: engine)
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope: dict, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://gw") as client:
            whole = await client.post("/v1/chat/completions", json=CHAT)
            assert "x-stream-id" not in whole.headers
            assert ids(whole.text) == []
            assert (await client.get("/v1/chat/completions/streams/strm_1")).status_code == 404


async def drive_and_leave(app_client: httpx.AsyncClient, path: str, body: dict, leave_after: int) -> list[bytes]:
    """A POST whose client goes after `leave_after` body messages (hand-written ASGI, as a server drives it)."""
    transport = app_client._transport
    app = transport.app  # type: ignore[attr-defined]
    sent: list[dict] = []
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if len([m for m in sent if m["type"] == "http.response.body" and m.get("body")]) >= leave_after:
            gone.set()
            raise OSError("the client went")  # as the server's send does once the socket is gone

    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-a")]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    stream_id = dict(start["headers"])[b"x-stream-id"]
    return [stream_id, *(m["body"] for m in sent if m["type"] == "http.response.body" and m.get("body"))]


async def test_a_client_that_leaves_does_not_stop_the_generation_and_reconnects_for_the_rest() -> None:
    engine = FakeEngine(delay=0.001)
    async with gateway(engine, grace_s=60) as client:
        stream_id, *received = await drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 30}, 3)
        await until(lambda: engine.finished, what="the generation's end, with nobody reading")
        assert engine.aborted == []
        last = ids(b"".join(received[:-1]).decode())[-1]  # the last event it got whole (its send failed after)
        rest = await client.get(f"/v1/chat/completions/streams/{stream_id.decode()}",
                                headers={**auth(), "last-event-id": str(last)})
        whole = await client.get(f"/v1/chat/completions/streams/{stream_id.decode()}", headers=auth())
        assert whole.text.endswith(rest.text)
        assert rest.text.endswith("data: [DONE]\n\n")
        assert ids(rest.text) == list(range(last + 1, ids(whole.text)[-1] + 1))


async def test_after_the_grace_the_generation_stops_and_the_log_says_so() -> None:
    engine = FakeEngine(max_model_len=4096, delay=0.05)  # far longer than the grace: 200 tokens
    async with gateway(engine, grace_s=0.2) as client:
        stream_id, *_ = await drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 200}, 2)
        assert engine.aborted == [engine.requests[0].request_id]
        resumed = await client.get(f"/v1/chat/completions/streams/{stream_id.decode()}", headers=auth())
        last = events(resumed.text)[-2]
        assert "streams.grace_s" in last
        assert resumed.text.endswith("data: [DONE]\n\n")


async def test_a_departed_clients_generation_gives_way_to_a_waiter_for_its_model() -> None:
    """Grace is for a reconnect, not for a model others queue for: a waiter's arrival aborts the orphaned generation
    at once (its permit frees the place), and the waiter is served; the log ends saying the stream was stopped."""
    engine = FakeEngine(max_model_len=4096, delay=0.05)  # 200 tokens: far longer than the test
    async with gateway(engine, admission={"max_running": 1}, grace_s=60) as client:
        admission = client.app_state["gateway"].models.backends[MODEL].admission  # type: ignore[attr-defined]
        left = asyncio.create_task(drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 200}, 2))
        await until(lambda: admission.orphans, what="the departed client's generation, kept for a reconnect")
        assert engine.aborted == []
        waiter = await client.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers=auth())
        assert waiter.status_code == 200
        stream_id, *_ = await asyncio.wait_for(left, 30)
        assert engine.aborted == [engine.requests[0].request_id]
        resumed = await client.get(f"/v1/chat/completions/streams/{stream_id.decode()}", headers=auth())
        assert "streams.grace_s" in events(resumed.text)[-2]
        assert not admission.orphans


async def test_a_departed_clients_generation_with_nobody_waiting_keeps_its_grace_and_a_reconnect_gets_the_rest(
) -> None:
    engine = FakeEngine(delay=0.01)
    async with gateway(engine, admission={"max_running": 2}, grace_s=60) as client:
        admission = client.app_state["gateway"].models.backends[MODEL].admission  # type: ignore[attr-defined]
        left = asyncio.create_task(drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 30}, 2))
        await until(lambda: admission.orphans, what="the departed client's generation, kept for a reconnect")
        other = await client.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers=auth())
        assert other.status_code == 200  # admitted beside it: nobody waited
        stream_id, *received = await asyncio.wait_for(left, 30)
        assert engine.aborted == []
        last = ids(b"".join(received[:-1]).decode())[-1]
        rest = await client.get(f"/v1/chat/completions/streams/{stream_id.decode()}",
                                headers={**auth(), "last-event-id": str(last)})
        assert rest.text.endswith("data: [DONE]\n\n")
        assert '"finish_reason":"length"' in rest.text.replace(" ", "")


async def test_a_departed_clients_generation_ends_at_the_requests_deadline_within_the_grace() -> None:
    engine = FakeEngine(max_model_len=4096, delay=0.05)
    async with gateway(engine, admission={"deadline_s": 1.0}, grace_s=60) as client:
        await asyncio.wait_for(drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 200}, 2), 30)
        assert engine.aborted == [engine.requests[0].request_id]  # at its deadline, not after the grace


async def test_an_orphaned_generation_is_stopped_at_once_when_others_already_wait() -> None:
    admission = Admission("m", AdmissionSettings(max_running=1, adaptive=False))
    permit = await admission.acquire()
    queued = asyncio.ensure_future(admission.acquire())
    await until(lambda: admission.waiting, what="a waiter")
    stopped: list[int] = []
    permit.orphan(lambda: stopped.append(1))
    assert stopped == [1]
    assert not admission.orphans
    permit.release()
    (await queued).release()


# --- the logs themselves ----------------------------------------------------------------------------------------

@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@asynccontextmanager
async def log_of(kind: str, redis_url: str | None, **settings: Any) -> AsyncIterator[StreamStore]:
    config = StreamSettings(**{"lease_s": 0.3, "read_block_s": 0.05, **settings})
    pools = RedisPools()
    log = MemoryLog(config) if kind == "memory" else RedisLog(pools, redis_url or "", "t:streams:", 1.0, config)
    store = StreamStore(log, config)
    try:
        yield store
    finally:
        await store.aclose()
        await pools.aclose()


TAKEOVER = Takeover(Owner(key_id="k", tenant="a"), "/v1/chat/completions", b'{"model": "m"}')
DIED = b"data: {\"error\": \"died\"}\n\n"


async def played(store: StreamStore, after: int, owner: str = "a", path: str = "/v1/chat/completions") -> list[bytes]:
    replay = await store.of(owner).replay("strm_1", after, path, not_found, DIED, "Last-Event-ID")
    return [event async for event in replay]


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def redis_url(kind: str, request: pytest.FixtureRequest) -> str | None:
    return request.getfixturevalue("redis").url if kind == "redis" else None


async def test_a_log_replays_then_follows_live_then_ends(kind: str, redis_url: str | None) -> None:
    async with log_of(kind, redis_url) as store:
        writer = store.of("a").writer("strm_1", TAKEOVER)
        for n in range(3):
            writer.append(b"e%d" % n)

        async def opened() -> bool:
            return await store.log.takeover("a:strm_1") is not None

        await until_awaited(opened, within_s=30, what="the log opened")  # before: an unknown stream, a 404
        reading = asyncio.create_task(played(store, 0))
        await until(lambda: not writer._pending)
        writer.append(b"e3")
        writer.close(b"END")
        assert await asyncio.wait_for(reading, 30) == [b"e1", b"e2", b"e3", b"END"]
        assert await played(store, -1) == [b"e0", b"e1", b"e2", b"e3", b"END"]
        assert await played(store, 3) == [b"END"]  # exactly at its end
        for beyond in (4, 10**17):  # an event it never had: a 400, not a silent end
            with pytest.raises(InvalidRequest, match="ended before event"):
                await played(store, beyond)
        with pytest.raises(NotFound):
            await played(store, -1, owner="b")  # another owner's
        with pytest.raises(NotFound):
            await played(store, -1, path="/v1/messages")  # another API's


async def test_a_producer_that_dies_ends_the_replay_with_one_error_or_its_continuation(
    kind: str, redis_url: str | None,
) -> None:
    async with log_of(kind, redis_url) as store:
        writer = store.of("a").writer("strm_1", TAKEOVER)
        writer.append(b"e0")
        writer.append(b"e1")
        await until(lambda: not writer._pending)
        writer.task.cancel()  # dies: no end marker, its lease lapses
        assert await asyncio.wait_for(played(store, 0), 30) == [b"e1", DIED]

        async def continued(takeover: Takeover, produced: list[bytes]) -> AsyncGenerator[bytes, None]:
            assert takeover == TAKEOVER
            assert produced == [b"e0", b"e1"]
            yield b"e2 elsewhere"

        store.continuation = continued
        assert await asyncio.wait_for(played(store, -1), 30) == [b"e0", b"e1", b"e2 elsewhere"]


async def test_a_log_keeps_its_bound_and_says_what_it_lost(kind: str, redis_url: str | None) -> None:
    async with log_of(kind, redis_url, max_events=4) as store:
        writer = store.of("a").writer("strm_1", TAKEOVER)
        for n in range(300):  # Redis trims whole nodes (an approximate MAXLEN): enough to drop some
            writer.append(b"e%d" % n)
        writer.close(b"END")
        await asyncio.wait_for(writer.task, 30)
        with pytest.raises(Exception, match="no longer kept"):
            await played(store, -1)
        assert (await played(store, 298)) == [b"e299", b"END"]


async def test_a_log_keeps_at_most_max_bytes_of_events(kind: str, redis_url: str | None) -> None:
    async with log_of(kind, redis_url, max_bytes=100) as store:
        writer = store.of("a").writer("strm_1", TAKEOVER)
        for n in range(50):
            writer.append(b"event %02d:" % n + b"x" * 20)  # 30 bytes each: the last 3 fit
        writer.close(b"END")
        await asyncio.wait_for(writer.task, 30)
        with pytest.raises(InvalidRequest, match="before 47 are no longer kept"):
            await played(store, 10)
        assert await played(store, 46) == [b"event 47:" + b"x" * 20, b"event 48:" + b"x" * 20,
                                          b"event 49:" + b"x" * 20, b"END"]


async def test_the_memory_log_keeps_at_most_memory_bytes_in_all() -> None:
    async with log_of("memory", None, memory_bytes=2000) as store:
        log = cast(MemoryLog, store.log)
        for n in range(10):
            writer = store.of("a").writer(f"strm_{n}", TAKEOVER)
            writer.append(b"x" * 300)
            writer.close(b"END")
            await writer.task
            assert log.bytes <= 2000
        assert await log.takeover("a:strm_0") is None  # the oldest dropped first
        assert await log.takeover("a:strm_9") == TAKEOVER
        assert log.bytes == sum(ring.size for ring in log._rings.values())


async def test_a_stale_producers_late_events_are_refused_once_its_stream_is_taken_over(
    kind: str, redis_url: str | None,
) -> None:
    """A producer whose lease lapsed (a Redis outage, a long pause) while a reader took its stream over writes
    nothing more into it: each write checks the writer's token where it writes (fencing)."""
    async with log_of(kind, redis_url) as store:
        log = store.log
        kept = dataclasses.replace(TAKEOVER, ttl_s=30.0)  # kept as long under a taker (a store:false response's)
        await log.open("a:strm_1", kept, "producer")
        assert await log.takeover("a:strm_1") == kept
        assert await log.append("a:strm_1", "producer", [(0, b"e0")], None)
        assert not await log.claim("a:strm_1", "taker")  # its lease holds

        async def lapsed() -> bool:
            return not await log.alive("a:strm_1")

        await until_awaited(lapsed, within_s=30, what="the producer's lease lapsed")
        assert await log.claim("a:strm_1", "taker")
        assert not await log.claim("a:strm_1", "another")  # one taker
        assert not await log.append("a:strm_1", "producer", [(1, b"late")], None)  # fenced
        assert not await log.append("a:strm_1", "producer", [], b"LATE END")
        assert await log.append("a:strm_1", "taker", [(1, b"e1 taken over")], b"END")
        assert await played(store, -1) == [b"e0", b"e1 taken over", b"END"]


async def test_a_writer_that_is_fenced_out_stops_writing(kind: str, redis_url: str | None) -> None:
    async with log_of(kind, redis_url) as store:
        writer = store.of("a").writer("strm_1", TAKEOVER)
        writer.append(b"e0")
        await until(lambda: not writer._pending)
        # another writer's token where this one's lease was (as a taker's after a Redis outage)
        await store.log.open("a:strm_1", TAKEOVER, "taker")
        writer.append(b"e1 late")
        await asyncio.wait_for(writer.task, 30)  # it stopped: refused
        assert b"e1 late" not in b"".join(event for _, event in (await store.log.read("a:strm_1", -1, 0.0)).events)


async def test_the_memory_log_keeps_at_most_max_streams() -> None:
    async with log_of("memory", None, max_streams=2) as store:
        for n in range(3):
            writer = store.of("a").writer(f"strm_{n}", TAKEOVER)
            writer.close(b"END")
            await writer.task
        assert await store.log.takeover("a:strm_0") is None
        assert await store.log.takeover("a:strm_2") == TAKEOVER


async def test_a_background_response_streams_again_and_its_cancel_still_stops_it_at_once() -> None:
    engine = FakeEngine(max_model_len=4096)
    async with gateway(engine, grace_s=60) as client:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "background": True}
        started = (await client.post("/v1/responses", json=body, headers=auth())).json()

        async def completed() -> bool:
            found = (await client.get(f"/v1/responses/{started['id']}", headers=auth())).json()
            return bool(found["status"] == "incomplete")  # its max_output_tokens reached

        await until_awaited(completed, within_s=30, what="the background response's end")
        again = await client.get(f"/v1/responses/{started['id']}?stream=true", headers=auth())
        kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events(again.text)]
        assert kinds[0] == "response.created"
        assert kinds[-1] == "response.incomplete"
        engine.delay = 0.05
        running = (await client.post("/v1/responses", json={**body, "max_output_tokens": 1000},
                                     headers=auth())).json()
        cancelled = await client.post(f"/v1/responses/{running['id']}/cancel", headers=auth())
        assert cancelled.json()["status"] == "cancelled"
        assert engine.aborted == [engine.requests[-1].request_id]  # at once, not after the grace


async def test_a_stream_cancelled_by_a_shutdown_does_not_end_its_log_as_complete() -> None:
    """A cancel (a shutdown's, not its client's going) is no end: a resumer must not get `[DONE]` after a cut
    answer, but what was produced and then the producer's death (or its continuation), as when a replica dies."""
    engine = FakeEngine(max_model_len=4096, delay=0.05)
    async with gateway(engine, grace_s=60, lease_s=0.3, read_block_s=0.05) as client:
        # 40 tokens: cancelled after 3, the continuation (when it takes over) produces the rest at the engine's pace
        producing = asyncio.create_task(drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 40},
                                                        10**6))
        rings = client.app_state["gateway"].streams.log._rings  # type: ignore[attr-defined]
        await until(lambda: any(len(ring.events) >= 3 for ring in rings.values()), what="a few events logged")
        producing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await producing
        stream_id = next(iter(rings)).split(":", 1)[1]
        resumed = await client.get(f"/v1/chat/completions/streams/{stream_id}", headers=auth())
        last = events(resumed.text)[-2]  # before `[DONE]`: the death's error event, or the continuation's finish
        assert "producer stopped before the stream's end" in last or '"finish_reason":"length"' in last, last
        assert engine.aborted == [engine.requests[0].request_id]


async def test_a_key_reads_at_most_max_readers_resumed_streams_at_once() -> None:
    """Each resumed reader waits on the log (in Redis: a connection per `XREAD BLOCK`): a key's readers on one
    replica are bounded, the next one is a 429 before the first byte, and a reader that ends frees its place."""
    engine = FakeEngine(max_model_len=4096, delay=0.05)
    async with gateway(engine, grace_s=60, max_readers=2) as client:
        producing = asyncio.create_task(drive_and_leave(client, "/v1/chat/completions", {**CHAT, "max_tokens": 200},
                                                        10**6))
        rings = client.app_state["gateway"].streams.log._rings  # type: ignore[attr-defined]
        await until(lambda: bool(rings), what="the stream's log")
        path = f"/v1/chat/completions/streams/{next(iter(rings)).split(':', 1)[1]}"
        app, started = client._transport.app, []  # type: ignore[attr-defined]

        async def read() -> None:  # a reader that stays, until cancelled
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                     "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
                     "root_path": "", "headers": [(b"authorization", b"Bearer sk-a")], "client": ("127.0.0.1", 1),
                     "server": ("127.0.0.1", 80)}

            async def send(message: dict) -> None:
                if message["type"] == "http.response.start":
                    started.append(message["status"])

            await app(scope, asyncio.Event().wait, send)

        readers = [asyncio.create_task(read()) for _ in range(2)]
        await until(lambda: len(started) == 2, what="two readers reading")
        refused = await client.get(path, headers=auth())
        assert refused.status_code == 429
        assert "streams.max_readers" in refused.json()["error"]["message"]
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        assert not client.app_state["gateway"].streams.readers  # type: ignore[attr-defined]
        producing.cancel()
        await asyncio.gather(producing, return_exceptions=True)


async def test_a_resumed_reader_that_stops_reading_is_dropped_and_frees_its_place() -> None:
    """A reader whose sends wait (it reads nothing: uvicorn's send waits for room in the socket) would hold one of
    its key's `max_readers` and the events it was sent for ever: dropped after `stream_write_timeout_s`."""
    async with gateway(FakeEngine(), overrides={"stream_write_timeout_s": 0.3}) as client:
        stream_id = (await client.post("/v1/chat/completions", json=CHAT, headers=auth())).headers["x-stream-id"]
        state = client.app_state  # type: ignore[attr-defined]
        path = f"/v1/chat/completions/streams/{stream_id}"
        bodies = 0

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client neither sends nor leaves
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            nonlocal bodies
            if message["type"] == "http.response.body":
                bodies += 1
                if bodies > 1:
                    await asyncio.Event().wait()  # reads nothing more

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"authorization", b"Bearer sk-a")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80), "state": dict(state)}
        await asyncio.wait_for(client.asgi(scope, receive, send), 10)  # type: ignore[attr-defined]  # returns: dropped
        assert not state["gateway"].streams.readers


async def test_a_deleted_responses_events_are_gone_too(kind: str, redis_url: str | None) -> None:
    """DELETE of a response removes what it said: its stream is not played again by its id (an unknown response),
    and a store:false response's id answers GET, DELETE and input_items as an unknown one while its events are kept."""
    async with gateway(FakeEngine(), redis_url) as client:
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True}
        response_id = (await client.post("/v1/responses", json=body, headers=auth())).headers["x-stream-id"]
        assert (await client.delete(f"/v1/responses/{response_id}", headers=auth())).status_code == 200
        again = await client.get(f"/v1/responses/{response_id}?stream=true", headers=auth())
        assert again.status_code == 404
        fleeting = (await client.post("/v1/responses", json={**body, "store": False}, headers=auth())).headers
        fleeting_id = fleeting["x-stream-id"]
        assert (await client.get(f"/v1/responses/{fleeting_id}?stream=true", headers=auth())).status_code == 200
        for method, path in (("GET", ""), ("DELETE", ""), ("GET", "/input_items")):
            answer = await client.request(method, f"/v1/responses/{fleeting_id}{path}", headers=auth())
            assert answer.status_code == 404, (method, path)
