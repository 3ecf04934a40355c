"""A client that goes away aborts its engine request at once, streaming or not.

The app is driven with hand-written ASGI receive/send, as a server would, so the disconnect
arrives exactly when the test says.
"""

from __future__ import annotations

import asyncio
import json

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings


async def drive(app, body: dict, disconnect_after_chunks: int | None, timeout: float = 5.0,
                path: str = "/v1/chat/completions") -> list[dict]:
    """Send one POST; disconnect once `disconnect_after_chunks` body messages arrived (None: at once)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        if disconnect_after_chunks is None:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        bodies = [m for m in sent if m["type"] == "http.response.body" and m.get("body")]
        if disconnect_after_chunks is not None and len(bodies) >= disconnect_after_chunks:
            gone.set()

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80), "state": {},
    }
    await asyncio.wait_for(app(scope, receive, send), timeout)
    return sent


async def run_with_app(engine: FakeEngine, coro_factory):
    app = create_app(fake_settings(), engine_starter=lambda es: engine)
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)
        return await coro_factory(with_state)


async def test_stream_disconnect_aborts_engine_request() -> None:
    engine = FakeEngine(max_model_len=10_000, delay=0.01)
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    sent = await run_with_app(engine, lambda app: drive(app, body, disconnect_after_chunks=3))
    assert sent[0]["status"] == 200
    assert engine.aborted == [engine.requests[0].request_id]
    assert engine.running == set() and engine.finished == []


async def test_non_stream_disconnect_aborts_engine_request() -> None:
    engine = FakeEngine(max_model_len=10_000, delay=0.01)
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    await run_with_app(engine, lambda app: drive(app, body, disconnect_after_chunks=None))
    assert engine.aborted == [engine.requests[0].request_id]
    assert engine.running == set() and engine.finished == []


async def test_finished_stream_is_not_aborted() -> None:
    engine = FakeEngine()
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    sent = await run_with_app(engine, lambda app: drive(app, body, disconnect_after_chunks=100))
    assert sent[-1]["body"] == b"data: [DONE]\n\n"
    assert engine.aborted == [] and engine.finished == [engine.requests[0].request_id]
