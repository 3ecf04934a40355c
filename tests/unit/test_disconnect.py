"""A client that goes away aborts its engine request at once, streaming or not.

The app is driven with hand-written ASGI receive/send, as a server would, so the disconnect
arrives exactly when the test says.
"""

from __future__ import annotations

import asyncio
import contextvars
import json

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings


async def drive(app, body: dict, disconnect_after_chunks: int | None, within_s: float = 60.0,
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
            await asyncio.sleep(0.05)  # the behaviour: the client leaves a moment after sending
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
    await asyncio.wait_for(app(scope, receive, send), within_s)
    return sent


async def run_with_app(engine: FakeEngine, coro_factory):
    # no grace for a reconnect (streams.grace_s, tested in test_resume.py): a client's going ends its work at once
    app = create_app(fake_settings(streams={"grace_s": 0}), engine_starter=lambda es: engine)
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
    assert engine.running == set()
    assert engine.finished == []


async def test_non_stream_disconnect_aborts_engine_request() -> None:
    engine = FakeEngine(max_model_len=10_000, delay=0.01)
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}
    await run_with_app(engine, lambda app: drive(app, body, disconnect_after_chunks=None))
    assert engine.aborted == [engine.requests[0].request_id]
    assert engine.running == set()
    assert engine.finished == []


async def test_finished_stream_is_not_aborted() -> None:
    engine = FakeEngine()
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    sent = await run_with_app(engine, lambda app: drive(app, body, disconnect_after_chunks=100))
    assert sent[-1]["body"] == b"data: [DONE]\n\n"
    assert engine.aborted == []
    assert engine.finished == [engine.requests[0].request_id]


# --- the watch itself (pipeline.disconnect) ---------------------------------------------------------

import pytest

from gateway.errors import ClientDisconnected
from gateway.pipeline.disconnect import WATCH_AFTER_S, unless_gone
from gateway.web.requests import gone_of


def gone_receive(after_s: float = 0.0):
    async def receive() -> dict:
        await asyncio.sleep(after_s)
        return {"type": "http.disconnect"}

    return receive


def staying_receive():
    async def receive() -> dict:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


async def test_a_client_gone_at_once_is_noticed_after_the_grace_and_the_work_is_cancelled() -> None:
    cancelled = asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "done"

    with pytest.raises(ClientDisconnected):
        async with asyncio.timeout(2):  # in this task (wait_for would run it in another)
            await unless_gone(gone_of(gone_receive()), work())
    assert cancelled.is_set()
    assert asyncio.current_task().cancelling() == 0  # the watch's own cancellation was taken back


async def test_quick_work_starts_no_watcher_and_returns_its_value() -> None:
    calls = 0

    async def receive() -> dict:
        nonlocal calls
        calls += 1
        return {"type": "http.disconnect"}

    async def work() -> str:
        return "answer"

    assert await unless_gone(gone_of(receive), work()) == "answer"
    await asyncio.sleep(WATCH_AFTER_S * 3)  # the behaviour: the watch's start passes, and starts nothing
    assert calls == 0  # the answer came before the watch began: receive was never called


async def test_a_cancellation_from_elsewhere_stays_a_cancellation() -> None:
    started = asyncio.Event()

    async def work() -> None:
        started.set()
        await asyncio.sleep(10)

    task = asyncio.ensure_future(unless_gone(gone_of(staying_receive()), work()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_work_that_swallows_the_cancellation_leaves_no_stray_cancel_behind() -> None:
    async def work() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "finished anyway"
        return "slept"

    async with asyncio.timeout(2):
        assert await unless_gone(gone_of(gone_receive()), work()) == "finished anyway"
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # and the task goes on: no cancellation waiting for its next await


async def test_each_watcher_runs_in_its_own_request_context_and_never_a_stopped_watchs() -> None:
    """Each watch's watcher starts at its time in the context of the request that made it, and a
    watch whose work ended first starts none."""
    from gateway.pipeline.disconnect import Watch

    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    seen: list[str] = []
    all_seen = asyncio.Event()

    async def receive() -> dict:
        seen.append(who.get())
        if len(seen) == 2:
            all_seen.set()
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def request(name: str, until: asyncio.Event | None) -> bool:
        who.set(name)
        async with Watch(gone_of(receive), after_s=0.01 if until else 3600) as watch:
            if until is not None:
                await until.wait()
        return watch.watcher is not None

    quick = asyncio.create_task(request("quick", None))  # over before its watch would start
    slow = [asyncio.create_task(request(f"slow{i}", all_seen)) for i in range(2)]
    assert await quick is False
    async with asyncio.timeout(10):
        assert await asyncio.gather(*slow) == [True, True]
    assert sorted(seen) == ["slow0", "slow1"]


async def test_an_expired_watch_ends_its_work_as_a_disconnect() -> None:
    """`expire()` (a stalled stream without the server's abort) ends the work as a disconnect;
    after the block it changes nothing."""
    from gateway.pipeline.disconnect import Watch

    watch = Watch(gone_of(staying_receive()), after_s=3600)

    async def stalled() -> None:
        async with asyncio.timeout(10), watch:
            asyncio.get_running_loop().call_soon(watch.expire)
            await asyncio.Event().wait()

    with pytest.raises(ClientDisconnected):
        await stalled()
    watch.expire()
    assert asyncio.current_task().cancelling() == 0


async def test_a_client_that_leaves_while_queued_for_admission_leaves_the_queue() -> None:
    """Queued behind a running request (max_running 1), a client that leaves is a 499 at once: it
    does not hold its place in the queue until admitted (up to wait_timeout_s), nor then run."""
    engine = FakeEngine(max_model_len=10_000, delay=0.01)
    app = create_app(fake_settings(admission={"max_running": 1, "wait_timeout_s": 30}, streams={"grace_s": 0}),
                     engine_starter=lambda es: engine)
    body = {"model": engine.info.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000, "stream": True}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        running = asyncio.create_task(drive(with_state, body, disconnect_after_chunks=50, within_s=60))
        async with asyncio.timeout(10):
            while not engine.requests:  # noqa: ASYNC110 - polls the fake engine's state; no event to wait on
                await asyncio.sleep(0.01)
        queued = await drive(with_state, {**body, "stream": False}, disconnect_after_chunks=None)
        assert queued[0]["status"] == 499
        admission = state["gateway"].models.backends[engine.info.name].admission
        assert admission.waiting == 0
        assert len(engine.requests) == 1
        await running
    assert engine.aborted == [engine.requests[0].request_id]
