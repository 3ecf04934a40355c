"""Admission control per model (backends.admission): bounds, waiting, refusals."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.testclient import TestClient

from tests.fakes import FakeEngine, HeldEngine, app_with, chat_body
from tests.waits import until


async def test_flood_holds_the_bound_and_admitted_requests_complete() -> None:
    engine = HeldEngine()  # the admitted hold their slots until all twelve have been seen
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
            posts = [asyncio.create_task(client.post("/v1/chat/completions", json=b)) for b in bodies]
            await until(lambda: sum(post.done() for post in posts) == 7, what="7 refused")
            engine.go.set()
            responses = await asyncio.gather(*posts)
            watcher.cancel()
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) == 5
    assert statuses.count(429) == 7
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
    engine = HeldEngine()
    app = app_with(engine, admission={"max_running": 1, "max_waiting": 5, "wait_timeout_s": 0.1, "reject_status": 503})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            slow = asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(max_tokens=10)))
            await until(lambda: engine.held, what="the first running")
            late = await client.post("/v1/chat/completions", json=chat_body(max_tokens=10))  # waits 0.1 s, refused
            engine.go.set()
            slow = await slow
    assert slow.status_code == 200
    assert late.status_code == 503
    assert late.json()["error"]["code"] == "model_overloaded"


async def serve(app, requests):
    """Run `requests(client)` against the app with its lifespan state."""
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            return await requests(client)


async def test_a_request_takes_a_permit_per_engine_request() -> None:
    """4 prompts x n=2 is 8 engine requests: with 8 running, a single request beside it waits."""
    engine = HeldEngine()
    app = app_with(engine, admission={"max_running": 8, "max_waiting": 0})
    fanned = {"model": "fake-model", "prompt": ["a", "b", "c", "d"], "n": 2, "max_tokens": 10}

    async def both(client: httpx.AsyncClient) -> list[httpx.Response]:
        big = asyncio.create_task(client.post("/v1/completions", json=fanned))
        await until(lambda: engine.held, what="the big request running")
        single = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        engine.go.set()
        return [await big, single]

    big, single = await serve(app, both)
    assert big.status_code == 200
    assert len(big.json()["choices"]) == 8
    assert single.status_code == 429
    assert single.json()["error"]["code"] == "model_overloaded"


async def test_too_many_engine_requests_for_the_model_ever_is_400() -> None:
    engine = FakeEngine()
    app = app_with(engine, admission={"max_running": 4})

    async def one(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/completions", json={"model": "fake-model", "prompt": ["a", "b", "c"], "n": 2})

    refused = await serve(app, one)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "n"
    assert "6 engine requests" in refused.json()["error"]["message"]
    assert engine.requests == []


async def test_a_large_request_at_the_head_of_the_queue_is_not_overtaken() -> None:
    from gateway.backends.admission import Admission
    from gateway.settings import AdmissionSettings

    admission = Admission("m", AdmissionSettings(max_running=4, max_waiting=10, wait_timeout_s=5))
    first = await admission.acquire(3)
    big = asyncio.create_task(admission.acquire(4))
    await asyncio.sleep(0)
    small = asyncio.create_task(admission.acquire(1))
    await asyncio.sleep(0)
    assert not big.done()
    assert not small.done()
    assert admission.waiting == 5
    first.release()
    permit = await big
    assert admission.running == 4
    assert not small.done()
    permit.release()
    (await small).release()
    assert admission.running == 0
    assert admission.waiting == 0


async def test_a_waiter_that_leaves_gives_its_place_and_permits_back() -> None:
    from gateway.backends.admission import Admission
    from gateway.settings import AdmissionSettings

    admission = Admission("m", AdmissionSettings(max_running=2, max_waiting=10, wait_timeout_s=5))
    held = await admission.acquire(2)
    blocked = asyncio.create_task(admission.acquire(2))
    behind = asyncio.create_task(admission.acquire(1))
    await asyncio.sleep(0)
    blocked.cancel()  # the client left
    await asyncio.gather(blocked, return_exceptions=True)
    assert admission.waiting == 1
    held.release()
    (await behind).release()
    assert admission.running == 0
    assert admission.waiting == 0


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/completions", {"prompt": ["x"] * 6, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": [[1]] * 6, "max_tokens": 1}, "prompt"),
        ("/v1/completions", {"prompt": "a", "n": 3, "best_of": 4, "max_tokens": 30}, "max_tokens"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 51}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5, "max_tokens": 21}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "max_tokens"),  # n x the room left
    ],
)
def test_prompts_and_output_tokens_per_request_are_bounded(route: str, body: dict, param: str) -> None:
    engine = FakeEngine(max_model_len=1000)
    settings = {"max_prompts_per_request": 5, "max_output_tokens_per_request": 100}
    with TestClient(app_with(engine, **settings)) as client:
        refused = client.post(route, json={"model": "fake-model", **body})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param, refused.text
        assert engine.requests == []
        assert client.post("/v1/completions", json={"model": "fake-model", "prompt": ["a"] * 5, "max_tokens": 20}).status_code == 200


async def test_admit_now_takes_what_acquire_takes_at_once_and_nothing_else() -> None:
    from gateway.backends.admission import Admission
    from gateway.settings import AdmissionSettings

    admission = Admission("m", AdmissionSettings(max_running=3, max_waiting=4, wait_timeout_s=5))
    first = admission.admit_now(2)
    assert first is not None
    assert first.count == 2
    assert admission.running == 2
    assert admission.admit_now(2) is None
    assert admission.running == 2
    assert admission.admit_now(4) is None  # never admissible: acquire says so (a 400)
    waiter = asyncio.create_task(admission.acquire(2))
    await asyncio.sleep(0)
    assert admission.waiting == 2
    first.release()
    await asyncio.sleep(0)
    second = await waiter
    assert admission.running == 2
    assert admission.admit_now(1) is not None
    assert admission.running == 3
    second.release()
    # someone waiting: nobody overtakes, even with room for the smaller request
    blocker = admission.admit_now(1)
    assert blocker is not None
    assert admission.running == 2
    waiter = asyncio.create_task(admission.acquire(3))
    await asyncio.sleep(0)
    assert admission.admit_now(1) is None
    assert admission.running == 2
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


@pytest.mark.parametrize("stream", [False, True])
async def test_a_full_queue_refuses_at_once_with_429_and_retry_after_before_the_first_byte(stream: bool) -> None:
    """What the flood drill (tests/drills/test_flood.py) shows on the real engine, without timing:
    with the engine's slots and the queue full, one more request is refused at once (long before
    `wait_timeout_s`), with 429 and Retry-After and the API's error, not a stream; those admitted complete."""
    engine = HeldEngine()
    app = app_with(engine, admission={"max_running": 2, "max_waiting": 2, "wait_timeout_s": 600, "retry_after_s": 7})
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        admission = state["gateway"].models.backends["fake-model"].admission
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test") as client:
            admitted = [asyncio.create_task(client.post("/v1/chat/completions", json=chat_body(stream=stream)))
                        for _ in range(4)]
            await until(lambda: len(engine.held) == 2 and admission.waiting == 2, what="2 running, 2 waiting")
            refused = await asyncio.wait_for(client.post("/v1/chat/completions", json=chat_body(stream=stream)), 60)
            assert not engine.go.is_set()  # answered while the others were still held: it did not wait
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "7"
            assert refused.headers["content-type"].startswith("application/json")
            assert refused.json()["error"]["code"] == "model_overloaded"
            assert len(engine.held) == 2
            engine.go.set()
            answers = await asyncio.gather(*admitted)
    assert [answer.status_code for answer in answers] == [200] * 4
    assert len(engine.finished) == 4
