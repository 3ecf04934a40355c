"""A resumable stream whose producer died, taken over by the replica a reader resumes on (`apis.takeover`, plugged
into `StreamStore.continuation`): the reader gets the events produced before the death, then the rest of the answer
continued there, under the first stream's ids, together exactly the uninterrupted answer; only the key that asked
can set it off; of two readers only one continues it (the other follows the log). In-process ring and a real
redis-server shared by two app instances."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.errors import EngineUnavailable
from engine.types import GenerationOutput, GenerationRequest
from gateway.apis.chat.chat_serving import CHAT as CHAT_SERVICE
from gateway.app import create_app
from gateway.pipeline.answer import Stream
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import resume
from gateway.protocol.batch_objects import Owner
from gateway.protocol.openai import ChatCompletionRequest
from gateway.stores.streams import Takeover, Writer
from tests.fakes import fake_settings
from tests.redis_server import RedisServer
from tests.sse import named
from tests.unit.test_failover import WHOLE, Continuing, _offset, whole
from tests.waits import until

KEYS = ["sk-a", "sk-b"]
BEFORE = 3  # outputs the producer sends before it dies
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True,
        "temperature": 0}
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": "fake-model", "prompt": "hi ", "max_tokens": 6, "stream": True, "temperature": 0},
    "/v1/messages": {"model": "fake-model", "max_tokens": 6, "stream": True, "temperature": 0,
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": "fake-model", "input": "hi", "max_output_tokens": 16, "stream": True, "temperature": 0},
}


class Stalling(Continuing):
    """Continues a partial answer as the fake model at temperature 0 does; a fresh request stalls after BEFORE
    outputs (its replica is about to die)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        fresh = _offset(request.prompt_text or "") == 0
        count = 0
        async for output in super().generate(request):
            if fresh and count == BEFORE:
                await asyncio.Event().wait()  # until cancelled
            count += 1
            yield output

    def continued(self) -> int:
        return sum(1 for request in self.requests if _offset(request.prompt_text or "") > 0)


def auth(key: str = "sk-a") -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def answer_text(text: str) -> str:
    """The answer's text, in any of the three APIs' events."""
    found = []
    for event in chunks(text):
        choice = (event.get("choices") or [{}])[0]
        found.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        if event.get("type") == "content_block_delta":
            found.append(event["delta"].get("text") or "")
    return "".join(found)


def ids(text: str) -> list[int]:
    return [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]


@asynccontextmanager
async def replica(engine: Stalling, redis_url: str | None) -> AsyncIterator[tuple[httpx.AsyncClient, Any, Any]]:
    cache = {"backend": "redis", "redis_url": redis_url} if redis_url else {}
    settings = fake_settings(api_keys=KEYS, cache=cache, streams={"resumable": True, "lease_s": 0.3,
                                                                  "read_block_s": 0.05})
    app = create_app(settings, engine_starter=lambda es: engine)
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope: dict, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, with_state, state["gateway"]


def post_scope(path: str) -> dict[str, Any]:
    """An ASGI scope of sk-a's JSON POST to `path` (a call driven by hand: its sends seen as they happen)."""
    headers = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk-a")]
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


async def produce_and_die(app: Any, state_of: Any, path: str = "/v1/chat/completions") -> str:
    """A chat stream on `app` whose replica dies after BEFORE outputs, written to its log: its stream id."""
    sent: list[dict] = []

    async def receive() -> dict:
        if not sent:
            return {"type": "http.request", "body": json.dumps(BODIES[path]).encode(), "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    producing = asyncio.create_task(app(post_scope(path), receive, send))
    await until(lambda: len([m for m in sent if b"quick" in m.get("body", b"")]), what="the first part", within_s=20)
    await until(lambda: any(b"brown" in m.get("body", b"") for m in sent), what="the first part", within_s=20)
    task = next(iter(state_of().streams.writers))
    writer: Writer = task.get_coro().cr_frame.f_locals["self"]  # type: ignore[union-attr]
    await until(lambda: not writer._pending, what="the events written", within_s=20)
    task.cancel()  # the replica dies: its log stops, its lease lapses
    await asyncio.gather(task, return_exceptions=True)
    producing.cancel()
    await asyncio.gather(producing, return_exceptions=True)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return dict(start["headers"])[b"x-stream-id"].decode()


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "redis"])
def redis_url(request: pytest.FixtureRequest) -> str | None:
    return request.getfixturevalue("redis").url if request.param == "redis" else None


@asynccontextmanager
async def two_replicas(redis_url: str | None) -> AsyncIterator[tuple[Stalling, Any, httpx.AsyncClient]]:
    """The producing replica's app and state, and the reading one's client (the same app without Redis: one process
    holds the ring)."""
    engine = Stalling("fake-model")
    async with AsyncExitStack() as stack:
        first, first_app, first_state = await stack.enter_async_context(replica(engine, redis_url))
        second = first
        if redis_url:
            second, _, _ = await stack.enter_async_context(replica(engine, redis_url))
        yield engine, (first_app, lambda: first_state), second


async def test_a_dead_replicas_stream_goes_on_where_it_is_resumed(redis_url: str | None) -> None:
    async with two_replicas(redis_url) as (engine, (app, state_of), reader):
        stream_id = await produce_and_die(app, state_of)
        path = f"/v1/chat/completions/streams/{stream_id}"
        rest = await reader.get(path, headers={**auth(), "last-event-id": "1"})
        assert rest.status_code == 200
        whole = await reader.get(path, headers=auth())  # the log holds the continuation too
        assert answer_text(whole.text) == WHOLE
        assert whole.text.endswith(rest.text)
        assert ids(whole.text) == list(range(len(ids(whole.text))))
        assert ids(rest.text)[0] == 2
        assert whole.text.endswith("data: [DONE]\n\n")
        assert whole.text.count("[DONE]") == 1
        parts = [c for c in chunks(whole.text) if c.get("choices")]
        assert {c["id"] for c in parts} == {parts[0]["id"]}  # one stream's id
        assert len({c["created"] for c in parts}) == 1
        assert sum(1 for c in parts if c["choices"][0]["delta"].get("role")) == 1
        assert [c["choices"][0]["finish_reason"] for c in parts if c["choices"][0].get("finish_reason")] == ["length"]
        assert engine.continued() == 1


async def test_another_key_cannot_set_off_or_read_a_takeover(redis_url: str | None) -> None:
    async with two_replicas(redis_url) as (engine, (app, state_of), reader):
        stream_id = await produce_and_die(app, state_of)
        theirs = await reader.get(f"/v1/chat/completions/streams/{stream_id}", headers=auth("sk-b"))
        assert theirs.status_code == 404
        assert engine.continued() == 0


async def test_of_two_readers_one_takes_over(redis_url: str | None) -> None:
    async with two_replicas(redis_url) as (engine, (app, state_of), reader):
        stream_id = await produce_and_die(app, state_of)
        path = f"/v1/chat/completions/streams/{stream_id}"
        one, two = await asyncio.gather(reader.get(path, headers=auth()), reader.get(path, headers=auth()))
        assert one.text == two.text
        assert answer_text(one.text) == WHOLE
        assert engine.continued() == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
async def test_completions_and_messages_streams_go_on_too(path: str) -> None:
    async with two_replicas(None) as (engine, (app, state_of), reader):
        stream_id = await produce_and_die(app, state_of, path)
        whole = await reader.get(f"{path}/streams/{stream_id}", headers=auth())
        assert answer_text(whole.text) == WHOLE
        assert ids(whole.text) == list(range(len(ids(whole.text))))
        assert engine.continued() == 1
        assert '"error"' not in whole.text
        if path == "/v1/messages":
            types = [c["type"] for c in chunks(whole.text)]
            assert types.count("message_start") == types.count("content_block_start") == 1
            assert types.count("message_stop") == types.count("content_block_stop") == 1
            assert types[-1] == "message_stop"
        else:
            assert len({c["id"] for c in chunks(whole.text)}) == 1
            assert whole.text.endswith("data: [DONE]\n\n")


async def test_a_responses_stream_goes_on_with_its_sequence_numbers_and_one_end(redis_url: str | None) -> None:
    async with two_replicas(redis_url) as (engine, (app, state_of), reader):
        response_id = await produce_and_die(app, state_of, "/v1/responses")
        path = f"/v1/responses/{response_id}?stream=true"
        theirs = await reader.get(path, headers=auth("sk-b"))
        assert theirs.status_code == 404  # another key's: unknown, and nothing set off
        assert engine.continued() == 0
        rest = await reader.get(path + "&starting_after=4", headers=auth())
        assert rest.status_code == 200
        again = await reader.get(path, headers=auth())  # the log holds the continuation too
        assert again.text.endswith(rest.text)
        events = named(again.text)
        numbers = [data["sequence_number"] for _, data in events]
        assert numbers == ids(again.text) == list(range(len(events)))
        assert named(rest.text)[0][1]["sequence_number"] == 5
        types = [kind for kind, _ in events]
        # one end, as the uninterrupted answer's: the fake model writes on to max_output_tokens
        for once in ("response.created", "response.output_item.added", "response.output_text.done",
                     "response.output_item.done", "response.incomplete"):
            assert types.count(once) == 1, once
        assert types[-1] == "response.incomplete"
        assert "response.completed" not in types
        assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
        text = "".join(data["delta"] for kind, data in events if kind == "response.output_text.delta")
        assert text == whole(16)
        assert len({data["item_id"] for kind, data in events if "item_id" in data}) == 1
        completed = events[-1][1]["response"]
        assert completed["id"] == response_id
        assert completed["created_at"] == events[0][1]["response"]["created_at"]
        assert completed["output"][0]["content"][0]["text"] == text
        stored = await reader.get(f"/v1/responses/{response_id}", headers=auth())
        assert stored.json()["status"] == "incomplete"
        assert stored.json()["output"][0]["content"][0]["text"] == text
        assert engine.continued() == 1


class DiesContinuing(Continuing):
    """Continues a partial answer, and dies after two outputs (the taker's engine core too)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        count = 0
        async for output in super().generate(request):
            if count == 2:
                raise EngineUnavailable("the engine core died")
            count += 1
            yield output


async def test_a_resumed_answer_fails_over_from_the_whole_text(tmp_path: Path) -> None:
    """`dispatch.resume` on a model that dies past its first byte: the fallback continues the whole answer so far
    (the request as asked, not the continued one again)."""
    (tmp_path / "models.yaml").write_text("models:\n  - {name: dies, fallback: [rescue]}\n  - {name: rescue}\n")
    engines = {"dies": DiesContinuing("dies"), "rescue": Continuing("rescue")}
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml"),
                     engine_starter=lambda es: engines[es.served_model_name])
    body = ChatCompletionRequest.model_validate({**CHAT, "model": "dies"})
    async with app.router.lifespan_context(app) as state:
        answer = await resume(RequestContext(), state["gateway"], body, CHAT_SERVICE, "the", 1)
        assert isinstance(answer, Stream)
        events = [json.loads(event) async for event in answer.events]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert "the" + text == WHOLE
    assert engines["rescue"].requests[-1].prompt_text.endswith("<assistant> the quick brown")


class SlowTaker(Stalling):
    """As Stalling; the first continuation also stalls after one output (its taker's client is about to leave)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        first_taker = _offset(request.prompt_text or "") > 0 and self.continued() == 0
        count = 0
        async for output in super().generate(request):
            if first_taker and count == 2:
                await asyncio.Event().wait()  # until cancelled
            count += 1
            yield output


async def test_a_taker_whose_client_leaves_leaves_the_stream_to_the_next_reader() -> None:
    engine = SlowTaker("fake-model")
    async with replica(engine, None) as (client, app, state):
        stream_id = await produce_and_die(app, lambda: state)
        sent: list[dict] = []

        async def receive() -> dict:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        path = f"/v1/chat/completions/streams/{stream_id}"
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"authorization", b"Bearer sk-a")], "client": ("127.0.0.1", 1),
                 "server": ("127.0.0.1", 80)}
        reading = asyncio.create_task(app(scope, receive, send))
        await until(lambda: any(b"fox" in m.get("body", b"") for m in sent), what="the first taker's first event",
                    within_s=20)
        reading.cancel()  # its client left mid-way
        await asyncio.gather(reading, return_exceptions=True)
        whole = await client.get(path, headers=auth())  # once the first taker's lease lapsed: taken over again
        assert answer_text(whole.text) == WHOLE
        assert ids(whole.text) == list(range(len(ids(whole.text))))
        assert whole.text.count("[DONE]") == 1
        assert engine.continued() == 2


async def _stream_with_log(redis: RedisServer, append: Any) -> tuple[list[tuple[str, int]], str]:
    """A chat stream on a replica whose Redis log's `append` is `append(original, order, key, token, events, *rest)`:
    the order in which its events were logged and sent (`("logged" | "sent", number)`), and the body sent."""
    order: list[tuple[str, int]] = []
    async with replica(Stalling("fake-model"), redis.url) as (_, app, state):
        log_ = state.streams.log
        original = log_.append

        async def appending(key: str, token: str, events: list[tuple[int, bytes]], *rest: Any) -> bool:
            return bool(await append(original, order, key, token, events, *rest))

        log_.append = appending
        sent: list[bytes] = []

        async def receive() -> dict:
            if not sent:
                body = json.dumps({**CHAT, "max_tokens": 3}).encode()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            body = message.get("body", b"")
            sent.append(body)
            order.extend(("sent", number) for number in ids(body.decode()))

        await asyncio.wait_for(app(post_scope("/v1/chat/completions"), receive, send), 30)
    return order, b"".join(sent).decode()


async def test_a_client_gets_an_event_only_once_the_shared_log_has_it(redis: RedisServer) -> None:
    """A replica that dies right after a send: its client's last event is in the log, so the taker goes on from the
    text the client had (a log a step behind numbered the taker's events one off, and the client got one twice)."""

    async def lagging(original: Any, order: list[tuple[str, int]], key: str, token: str,
                      events: list[tuple[int, bytes]], *rest: Any) -> bool:
        for _ in range(3):
            await asyncio.sleep(0)  # the behaviour: a log a few loop turns behind its producer
        written = await original(key, token, events, *rest)
        order.extend(("logged", number) for number, _ in events)
        return bool(written)

    order, body = await _stream_with_log(redis, lagging)
    sent = [number for what, number in order if what == "sent"]
    assert sent == list(range(len(sent)))
    assert len(sent) >= 3
    for number in sent:
        assert order.index(("logged", number)) < order.index(("sent", number))
    assert body.endswith("data: [DONE]\n\n")


async def test_a_failing_log_does_not_hold_a_stream_back(redis: RedisServer) -> None:
    async def failing(original: Any, order: list[tuple[str, int]], *args: Any) -> bool:
        raise ConnectionError("redis is gone")

    order, body = await _stream_with_log(redis, failing)
    assert [what for what, _ in order] == ["sent"] * len(order)
    assert len(order) >= 3
    assert answer_text(body)
    assert body.endswith("data: [DONE]\n\n")


async def test_a_writer_stopped_before_it_ran_holds_no_event_back(redis: RedisServer) -> None:
    """A writer task cancelled before its first step (a shutdown's: `StreamStore.aclose` cancelled, its gather
    cancels the writers) runs none of its body: its waiters are released all the same (`Writer._stopped`)."""
    async with replica(Stalling("fake-model"), redis.url) as (_, _, state):
        writer = state.streams.of("t").writer("strm_x", Takeover(Owner(key_id="k", tenant="t"), "/v1/chat/completions"))
        writer.task.cancel()
        writer.append(b"data: {}\n\n")
        await asyncio.wait_for(writer.logged(0), 5)
        assert writer.task.cancelled()
