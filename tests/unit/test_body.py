"""Request bodies (middleware.body): slow bodies time out, abandoned uploads are 499s, and the
bytes being read and prepared at once are bounded. Driven with hand-written ASGI receive/send,
so the body arrives exactly as the test says."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable

import structlog.testing

from gateway.telemetry import metrics
from tests.fakes import FakeEngine, app_with, chat_body

Receive = Callable[[], Awaitable[dict]]


def scope_for(length: int | None, path: str = "/v1/chat/completions") -> dict:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }


def trickle(body: bytes, then: str = "hang", first: int = 10, waiting: asyncio.Event | None = None) -> Receive:
    """The first `first` bytes of `body`, then: hang for ever (`waiting` set then), or disconnect."""
    messages = [{"type": "http.request", "body": body[:first], "more_body": True}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        if then == "disconnect":
            return {"type": "http.disconnect"}
        if waiting is not None:
            waiting.set()
        await asyncio.Event().wait()
        return {}

    return receive


def whole(body: bytes) -> Receive:
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {}

    return receive


class Served:
    """The app with its lifespan state, called as a server would."""

    def __init__(self, app) -> None:
        self.app = app

    async def __aenter__(self) -> Served:
        self._lifespan = self.app.router.lifespan_context(self.app)
        self.state = await self._lifespan.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._lifespan.__aexit__(*exc)

    async def call(self, scope: dict, receive: Receive) -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        await self.app({**scope, "state": dict(self.state)}, receive, send)
        return sent


def status_and_headers(sent: list[dict]) -> tuple[int, dict[str, str]]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


BODY = json.dumps(chat_body()).encode()


async def test_a_body_that_does_not_arrive_in_time_is_408_and_closes() -> None:
    engine = FakeEngine()
    async with Served(app_with(engine, body_timeout_s=0.2)) as served:
        sent = await asyncio.wait_for(served.call(scope_for(len(BODY)), trickle(BODY)), 10)
    status, headers = status_and_headers(sent)
    assert status == 408
    assert headers["connection"] == "close"
    assert "x-request-id" in headers
    assert json.loads(sent[-1]["body"])["error"]["code"] == "request_timeout"
    assert engine.requests == []


async def test_an_abandoned_upload_is_a_499_not_a_server_error() -> None:
    engine = FakeEngine()
    before = metrics.REQUESTS.labels("", "/v1/chat/completions", "500")._value.get()
    async with Served(app_with(engine)) as served:
        with structlog.testing.capture_logs() as logs:
            sent = await served.call(scope_for(len(BODY)), trickle(BODY, then="disconnect"))
    assert status_and_headers(sent)[0] == 499
    line = next(entry for entry in logs if entry["event"] == "request")
    assert line["status"] == 499
    assert line["disconnected"] is True
    assert not [entry for entry in logs if entry["log_level"] == "error"]
    assert metrics.REQUESTS.labels("", "/v1/chat/completions", "500")._value.get() == before
    assert engine.requests == []


async def test_bytes_being_read_at_once_are_bounded() -> None:
    """A slow 8 kB upload holds 8 kB of the 10 kB budget: a 5 kB body beside it is refused with
    503 and Retry-After before it is read; once the slow one is gone, the budget is whole again."""
    engine = FakeEngine()
    settings = {"max_body_bytes": 10_000, "max_body_bytes_in_flight": 10_000, "body_timeout_s": 1.0}
    big = json.dumps(chat_body(messages=[{"role": "user", "content": "x " * 4000}])).encode()
    medium = json.dumps(chat_body(messages=[{"role": "user", "content": "y " * 2500}])).encode()
    async with Served(app_with(engine, **settings)) as served:
        waiting = asyncio.Event()
        slow = asyncio.create_task(served.call(scope_for(len(big)), trickle(big, waiting=waiting)))
        await asyncio.wait_for(waiting.wait(), 10)  # its first chunk read, its declared bytes held
        refused = await served.call(scope_for(len(medium)), whole(medium))
        undeclared = await served.call(scope_for(None), whole(medium))  # chunked: counted as it arrives
        assert status_and_headers(await slow)[0] == 408
        full = json.dumps(chat_body(messages=[{"role": "user", "content": "z " * 4900}])).encode()
        after = await served.call(scope_for(len(full)), whole(full))
    for sent in (refused, undeclared):
        status, headers = status_and_headers(sent)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert json.loads(sent[-1]["body"])["error"]["code"] == "service_unavailable"
    assert status_and_headers(after)[0] == 400  # read whole (the context is too small), not refused
    assert 'reason="body_bytes_in_flight"' in metrics.exposition()[0].decode()


def _read(messages: list[dict], limit: int, length: int | None = None, starlette: bool = False) -> bytes:
    """`requests.read_body` (or Starlette's `request.body()`) on these receive messages."""
    from starlette.requests import Request

    from gateway.web.requests import read_body

    pending = list(messages)

    async def receive() -> dict:
        return pending.pop(0)

    request = Request(scope_for(length), receive)
    return asyncio.run(request.body() if starlette else read_body(request, limit))


def test_the_body_is_read_as_starlette_reads_it_within_its_limit() -> None:
    import pytest
    from starlette.requests import ClientDisconnect

    from gateway.errors import PayloadTooLarge

    parts = [{"type": "http.request", "body": b'{"a":', "more_body": True},
             {"type": "http.request", "body": b"", "more_body": True},
             {"type": "other"},  # neither: skipped, as Starlette skips it
             {"type": "http.request", "body": b" 1}"}]
    assert _read(parts, limit=8) == _read(parts, 8, starlette=True) == b'{"a": 1}'
    assert _read([{"type": "http.request"}], limit=0) == b""
    with pytest.raises(PayloadTooLarge, match="limit of 7 bytes"):
        _read(parts, limit=7)
    with pytest.raises(PayloadTooLarge, match="of 9 bytes exceeds"):
        _read([], limit=8, length=9)  # refused on its declared length, before a read
    with pytest.raises(ClientDisconnect):
        _read([parts[0], {"type": "http.disconnect"}], limit=8)


def _reading(receive: Receive, deadline: float) -> object:
    from gateway.middleware.body import BodyBudget, _Reading

    return _Reading(receive, BodyBudget(10**9), deadline, 0)


def _later(seconds: float) -> Receive:
    """A first chunk at once, the rest `seconds` later."""
    messages = [{"type": "http.request", "body": b"}", "more_body": False}, {"type": "http.request", "body": b"{", "more_body": True}]

    async def receive() -> dict:
        if len(messages) == 1:
            await asyncio.sleep(seconds)
        return messages.pop()

    return receive


async def _timed(read: Awaitable[dict], since: float) -> tuple[str, float]:
    """What the read gave (its type, or 408) and when, since `since` on the loop's clock."""
    from gateway.errors import RequestTimeout

    try:
        outcome = (await asyncio.wait_for(read, 60))["type"]
    except RequestTimeout as error:  # a helper that returns what a read gave, a timeout included
        assert error.status == 408  # noqa: PT017
        assert error.headers == {"Connection": "close"}  # noqa: PT017
        outcome = "408"
    return outcome, asyncio.get_running_loop().time() - since


async def test_reads_are_cut_at_their_own_deadlines() -> None:
    """Deadlines in any order: each read is cut at its own (never before it: the lower bounds hold
    on any machine), a read that gets its message in time keeps it, and none stays waiting."""

    now = asyncio.get_running_loop().time()
    reads = [
        _reading(trickle(b"x" * 20), now + 0.1),  # a first chunk at once, then nothing
        _reading(_later(0.15), now + 60),  # (its message comes long before)
        _reading(trickle(b"x" * 20), now + 0.25),
    ]
    firsts = await asyncio.gather(*(_timed(r.receive(), now) for r in reads))  # type: ignore[attr-defined]
    assert [outcome for outcome, _ in firsts] == ["http.request"] * 3
    results = await asyncio.gather(*(_timed(r.receive(), now) for r in reads))  # type: ignore[attr-defined]
    (cut_1, at_1), (read_2, at_2), (cut_3, at_3) = results
    assert (cut_1, read_2, cut_3) == ("408", "http.request", "408")
    resolution = time.get_clock_info("monotonic").resolution  # asyncio fires a timer up to that early
    assert at_1 >= 0.1 - resolution
    assert at_2 >= 0.15 - resolution
    assert at_3 >= 0.25 - resolution


async def test_a_cancelled_read_is_a_cancellation_not_a_timeout() -> None:
    waiting = asyncio.Event()
    reading = _reading(trickle(b"", first=0, waiting=waiting), asyncio.get_running_loop().time() + 5)
    await reading.receive()  # type: ignore[attr-defined]
    task = asyncio.ensure_future(reading.receive())  # type: ignore[attr-defined]
    await asyncio.wait_for(waiting.wait(), 10)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:
        raise AssertionError("not cancelled")


async def test_a_message_there_at_once_is_read_past_the_deadline() -> None:
    """As asyncio.timeout_at: a read that does not wait is not cut, even past its deadline."""

    reading = _reading(whole(b"{}"), asyncio.get_running_loop().time() - 1)
    assert (await reading.receive())["body"] == b"{}"  # type: ignore[attr-defined]


async def test_a_cut_the_receive_swallows_is_taken_back_as_timeout_at_does() -> None:
    """A receive that keeps its message through the cancellation: the message is read, and the
    task's cancellation count is back where it was (asyncio.timeout_at uncancels too)."""

    async def stubborn() -> dict:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(5)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def read(receive: Receive) -> tuple[dict, int]:
        loop = asyncio.get_running_loop()
        reading = _reading(receive, loop.time() + 0.05)
        message = await reading.receive()  # type: ignore[attr-defined]
        return message, asyncio.current_task().cancelling()  # type: ignore[union-attr]

    async def with_timeout_at() -> tuple[dict, int]:
        async with asyncio.timeout(0.05):
            message = await stubborn()
        return message, asyncio.current_task().cancelling()  # type: ignore[union-attr]

    ours = await asyncio.ensure_future(read(stubborn))
    theirs = await asyncio.ensure_future(with_timeout_at())
    assert ours == theirs == ({"type": "http.request", "body": b"{}", "more_body": False}, 0)
