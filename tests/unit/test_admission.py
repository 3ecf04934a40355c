"""Admission control per model (backends.admission): bounds, waiting, refusals."""

from __future__ import annotations

import asyncio

import httpx

from tests.fakes import FakeEngine, app_with, chat_body


async def test_flood_holds_the_bound_and_admitted_requests_complete() -> None:
    engine = FakeEngine(delay=0.02)
    app = app_with(engine, admission={"max_running": 2, "max_waiting": 3, "wait_timeout_s": 30, "retry_after_s": 2})
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(engine.running))
            await asyncio.sleep(0.005)

    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            watcher = asyncio.create_task(watch())
            bodies = [chat_body(max_tokens=10, stream=i % 2 == 0) for i in range(12)]
            responses = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
            watcher.cancel()
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) == 5 and statuses.count(429) == 7
    assert peak == 2
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "2"
            assert response.json()["error"]["code"] == "model_overloaded"
        elif "text/event-stream" in response.headers["content-type"]:
            assert response.text.endswith("data: [DONE]\n\n")
        else:
            assert response.json()["usage"]["completion_tokens"] == 10
    assert len(engine.finished) == 5


async def test_waiting_past_the_timeout_is_refused_with_503_when_configured() -> None:
    engine = FakeEngine(delay=0.05)
    app = app_with(engine, admission={"max_running": 1, "max_waiting": 5, "wait_timeout_s": 0.1, "reject_status": 503})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            slow, late = await asyncio.gather(
                client.post("/v1/chat/completions", json=chat_body(max_tokens=10)),
                client.post("/v1/chat/completions", json=chat_body(max_tokens=10)),
            )
    assert slow.status_code == 200
    assert late.status_code == 503 and late.json()["error"]["code"] == "model_overloaded"
