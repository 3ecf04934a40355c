"""A stream whose client stops reading (its sends wait, as uvicorn's do when the socket is full)
is ended after `stream_write_timeout_s`, as if the client had left: its engine request aborted,
its admission slot given back. Driven by hand-written ASGI, as tests/unit/test_disconnect.py;
the same over a real socket in tests/unit/test_server.py."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.app import create_app
from gateway.pipeline.lifecycle import Lifecycle
from tests.fakes import FakeEngine, fake_settings

BODY = {"model": "fake-model", "prompt": "hi", "max_tokens": 40, "stream": True}


async def stalled_after(engine: FakeEngine, chunks: int, extensions: dict[str, Any] | None = None,
                        resumed: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """One streamed request whose client reads `chunks` body messages, then nothing: later sends
    wait until `resumed` is set (by the test's abort), as uvicorn's wait for room in the socket."""
    # a stalled client is dropped; the grace a resumable stream gives its client is test_resume's
    settings = fake_settings(stream_write_timeout_s=0.3, streams={"grace_s": 0})
    app = create_app(settings, engine_starter=lambda es: engine, lifecycle=Lifecycle())
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    read = False

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and len(sent) > chunks:
            await (resumed or asyncio.Event()).wait()  # the client reads nothing more
            gone.set()  # resumed: the connection was dropped
            return
        sent.append(message)

    async with app.router.lifespan_context(app) as state:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80), "state": dict(state), "extensions": extensions or {},
        }
        await asyncio.wait_for(app(scope, receive, send), 10)  # returns: the stream was ended
    return sent


async def test_a_stream_nobody_reads_is_cancelled_and_its_engine_request_aborted() -> None:
    engine = FakeEngine()
    engine.delay = 0.01
    sent = await stalled_after(engine, chunks=3)
    assert sent[0]["status"] == 200
    assert len(sent) == 4
    assert engine.aborted == [engine.requests[0].request_id]
    assert not engine.running


async def test_under_the_gateway_s_server_the_connection_is_dropped_and_the_watch_ends_it() -> None:
    engine = FakeEngine()
    engine.delay = 0.01
    resumed = asyncio.Event()
    dropped: list[bool] = []

    def abort() -> None:  # as gateway.server.http's: the transport aborted, uvicorn's waiting send returns
        dropped.append(True)
        resumed.set()

    sent = await stalled_after(engine, chunks=2, extensions={"gateway.abort": abort}, resumed=resumed)
    assert dropped == [True]
    assert len(sent) == 3
    assert engine.aborted == [engine.requests[0].request_id]
    assert not engine.running


async def test_a_slow_reader_within_the_timeout_is_not_cut() -> None:
    engine = FakeEngine()
    engine.delay = 0.001
    app = create_app(fake_settings(stream_write_timeout_s=0.3), engine_starter=lambda es: engine)
    chunks = 0

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal chunks
        if message["type"] == "http.response.body":
            chunks += 1
            await asyncio.sleep(0.05)  # slow, but reading

    async with app.router.lifespan_context(app) as state:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80), "state": dict(state),
        }
        body = json.dumps({**BODY, "max_tokens": 12}).encode()
        first = True

        async def receive_body() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await asyncio.wait_for(app(scope, receive_body, send), 10)
    assert chunks >= 13
    assert not engine.aborted
