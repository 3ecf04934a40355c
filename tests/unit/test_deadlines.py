"""Deadlines: the client's timeout headers (web.requests.timeout_of), admission refusing what cannot
start in time (backends.admission), and the engine request aborted when the deadline passes before
the answer's first byte (pipeline.attempt). No timing is asserted: waits are for conditions."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import REGISTRY

from engine.types import GenerationOutput, GenerationRequest, Task
from gateway.backends.admission import Admission
from gateway.backends.capacity import Capacity
from gateway.errors import ModelOverloaded
from gateway.settings import AdmissionSettings
from gateway.web.requests import GAP_HEADERS, MOST_TIMEOUT_S, timeout_of
from tests.fakes import FakeEngine, HeldAfter, app_with, chat_body
from tests.unit.test_admission import serve
from tests.waits import until


@pytest.mark.parametrize(("headers", "seconds"), [
    ([], None),
    ([(b"x-stainless-read-timeout", b"600.0")], 600.0),  # the Python SDKs: the read timeout, str(float)
    ([(b"x-stainless-timeout", b"60")], 60.0),  # the JavaScript SDKs: whole seconds
    ([(b"request-timeout", b"12.5")], 12.5),
    ([(b"x-request-timeout", b" 3 ")], 3.0),
    ([(b"x-stainless-read-timeout", b"600.0"), (b"x-request-timeout", b"20")], 20.0),  # the shortest: it gives up first
    ([(b"x-stainless-timeout", b"0")], None),  # a JavaScript timeout under a second, truncated
    ([(b"request-timeout", b"-5")], None),
    ([(b"request-timeout", b"nan")], None),
    ([(b"request-timeout", b"inf")], None),
    ([(b"request-timeout", b"-inf")], None),
    ([(b"request-timeout", b"1e400")], None),
    ([(b"request-timeout", str(MOST_TIMEOUT_S + 1).encode())], None),
    ([(b"request-timeout", str(MOST_TIMEOUT_S).encode())], float(MOST_TIMEOUT_S)),
    ([(b"request-timeout", b"30s")], None),
    ([(b"request-timeout", b"")], None),
    ([(b"request-timeout", b"\xd9\xa1")], None),  # a digit of another script
    ([(b"request-timeout", b"0x10")], None),
    ([(b"request-timeout", b"garbage"), (b"x-request-timeout", b"7")], 7.0),  # a bad one is ignored, not the rest
    ([(b"timeout", b"5")], None),  # not a timeout header
])
def test_the_clients_timeout_is_read_from_its_headers(headers: list[tuple[bytes, bytes]], seconds: float | None) -> None:
    assert timeout_of(headers) == seconds


@pytest.mark.parametrize(("header", "bounds_the_gap"), [
    (b"x-stainless-read-timeout", True),  # the Python SDKs' httpx read timeout: each read, the first and every next
    (b"request-timeout", True),  # a whole timeout bounds every gap in it too
    (b"x-request-timeout", True),
    (b"x-stainless-timeout", False),  # the JavaScript SDKs': until the response's headers, then no more
])
def test_which_timeouts_bound_a_stream_s_wait_for_its_next_chunk(header: bytes, bounds_the_gap: bool) -> None:
    """Every timeout header bounds the first byte; only some the gaps of a stream after it (the measured limit's
    pace for streams, `backends.capacity`)."""
    assert timeout_of([(header, b"30")]) == 30.0
    assert timeout_of([(header, b"30")], GAP_HEADERS) == (30.0 if bounds_the_gap else None)
    assert timeout_of([(header, b"30"), (b"x-stainless-timeout", b"5")], GAP_HEADERS) == (30.0 if bounds_the_gap else None)


@pytest.mark.parametrize(("stream", "headers", "settings", "gap_s"), [
    (False, {"x-stainless-read-timeout": "30.0"}, {}, None),  # a whole answer: its first byte is its end, the engine's pace
    (True, {"x-stainless-read-timeout": "30.0"}, {}, 30.0),
    (True, {"x-stainless-read-timeout": "30.0", "request-timeout": "20"}, {}, 20.0),  # the shortest
    (True, {"x-stainless-timeout": "20"}, {}, 600.0),  # no bound on its gaps: the model's default deadline
    (True, {}, {}, 600.0),
    (True, {}, {"admission": {"deadline_s": None}}, math.inf),  # no bound at all
])
async def test_a_stream_brings_its_clients_bound_on_the_gaps_to_the_measured_limit(
    monkeypatch: pytest.MonkeyPatch, stream: bool, headers: dict[str, str], settings: dict[str, object], gap_s: float | None,
) -> None:
    learnt: list[float | None] = []
    finished = Capacity.finished

    def spy(self: Capacity, held_s: float, tokens: int | None, running: int, gap_s: float | None = None) -> bool:
        learnt.append(gap_s)
        return finished(self, held_s, tokens, running, gap_s)

    monkeypatch.setattr(Capacity, "finished", spy)

    async def ask(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/chat/completions", json=chat_body(max_tokens=3, stream=stream), headers=headers)

    assert (await serve(app_with(FakeEngine(), **settings), ask)).status_code == 200
    assert learnt == [gap_s]


def refused(model: str, reason: str) -> float:
    return REGISTRY.get_sample_value("gateway_rejected_total", {"model": model, "reason": reason}) or 0.0


def admission(model: str, **settings: object) -> Admission:
    return Admission(model, AdmissionSettings.model_validate({"adaptive": False, **settings}))


async def test_work_whose_deadline_passed_is_never_started() -> None:
    model = admission("deadline-passed", max_running=4)
    before = refused("deadline-passed", "deadline_passed")
    now = asyncio.get_running_loop().time()
    with pytest.raises(ModelOverloaded) as caught:
        model.admit_now(1, "k", deadline=now - 1)
    assert caught.value.headers["Retry-After"] == "1"  # nothing measured: the setting
    with pytest.raises(ModelOverloaded):
        await model.acquire(1, "normal", "k", deadline=now - 1)
    assert model.running == 0
    assert refused("deadline-passed", "deadline_passed") == before + 2


async def test_a_request_whose_expected_wait_passes_its_deadline_is_refused_at_once() -> None:
    model = admission("expected-wait", max_running=1, max_waiting=10, wait_timeout_s=30)
    held = model.admit_now(1, "a")
    assert held is not None
    model.capacity.finished(10.0, 5, 1)  # measured: one at a time, 10 s each
    before = refused("expected-wait", "expected_wait")
    now = asyncio.get_running_loop().time()
    with pytest.raises(ModelOverloaded) as caught:
        await model.acquire(1, "normal", "b", deadline=now + 5)  # a 10 s wait for a 5 s deadline
    assert caught.value.headers["Retry-After"] == "10"  # the measured time to drain what is ahead, itself included
    assert refused("expected-wait", "expected_wait") == before + 1
    assert model.waiting == 0
    waiter = asyncio.create_task(model.acquire(1, "normal", "c", deadline=now + 60))  # 10 s of 60: it waits
    await until(lambda: model.waiting == 1, what="the waiter queued")
    held.release(5)
    permit = await waiter
    assert permit.count == 1
    assert model.running == 1


async def test_the_wait_bound_refuses_at_once_too() -> None:
    model = admission("expected-wait-bound", max_running=1, max_waiting=10, wait_timeout_s=5)
    assert model.admit_now(1, "a") is not None
    model.capacity.finished(10.0, 5, 1)
    with pytest.raises(ModelOverloaded):
        await model.acquire(1, "normal", "b")  # no deadline: the wait allowed, 5 s, is shorter than 10 s


async def test_a_higher_class_is_not_refused_for_the_queue_of_a_lower_one() -> None:
    model = admission("expected-wait-class", max_running=1, max_waiting=100, wait_timeout_s=30,
                      queue_share={"low": 1.0})
    assert model.admit_now(1, "a") is not None
    model.capacity.finished(1.0, 5, 1)  # one every second
    now = asyncio.get_running_loop().time()
    lows = [asyncio.create_task(model.acquire(1, "low", f"low{i}", deadline=now + 60)) for i in range(20)]
    await until(lambda: model.waiting == 20, what="the low queue")
    high = asyncio.create_task(model.acquire(1, "high", "h", deadline=now + 5))  # 20 low ahead: 21 s; only itself: 1 s
    await until(lambda: model.waiting == 21, what="the high request queued")
    assert not high.done()
    with pytest.raises(ModelOverloaded):
        await model.acquire(1, "low", "late", deadline=now + 5)  # behind the 20 low
    for task in [high, *lows]:
        task.cancel()
    await asyncio.gather(high, *lows, return_exceptions=True)
    assert model.waiting == 0


async def test_a_waiter_leaves_the_queue_when_its_deadline_passes() -> None:
    model = admission("deadline-waiter", max_running=1, max_waiting=10, wait_timeout_s=30)
    held = model.admit_now(1, "a")
    assert held is not None
    before = refused("deadline-waiter", "deadline_passed")
    with pytest.raises(ModelOverloaded):
        await model.acquire(1, "normal", "b", deadline=asyncio.get_running_loop().time() + 0.05)  # nothing measured: it waits
    assert model.waiting == 0
    assert refused("deadline-waiter", "deadline_passed") == before + 1
    held.release()
    assert model.running == 0


async def test_a_full_queue_is_counted_as_such() -> None:
    model = admission("queue-full", max_running=1, max_waiting=0)
    assert model.admit_now(1, "a") is not None
    before = refused("queue-full", "queue_full")
    with pytest.raises(ModelOverloaded):
        await model.acquire(1, "normal", "b")
    assert refused("queue-full", "queue_full") == before + 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_engine_request_is_aborted_when_the_deadline_passes_before_its_first_byte(stream: bool) -> None:
    engine = HeldAfter(0)  # holds every generation until it is cancelled, noting the abort
    app = app_with(engine)
    headers = {"x-stainless-read-timeout": "0.2"}

    async def ask(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/chat/completions", json=chat_body(max_tokens=10, stream=stream), headers=headers)

    before = refused("fake-model", "deadline_passed")
    answer = await serve(app, ask)
    assert answer.status_code == 429
    assert answer.json()["error"]["code"] == "model_overloaded"
    assert int(answer.headers["retry-after"]) >= 1
    assert len(engine.aborted) == 1
    assert refused("fake-model", "deadline_passed") == before + 1


@pytest.mark.parametrize("value", [b"nan", b"-1", b"0", b"1e999", b"garbage", "\u0661".encode()])
async def test_a_hostile_timeout_header_is_ignored(value: bytes) -> None:
    async def ask(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/chat/completions", json=chat_body(max_tokens=3),
                                 headers={"request-timeout": value, "x-stainless-timeout": value})

    answer = await serve(app_with(FakeEngine()), ask)
    assert answer.status_code == 200
    assert answer.json()["usage"]["completion_tokens"] == 3


def test_retry_after_is_whole_seconds() -> None:
    capacity = admission("retry-seconds", max_running=3).capacity
    capacity.finished(1.3, 4, 3)
    assert capacity.retry_after(2, least=0) == math.ceil(2 * 1.3 / 3)


async def test_waiters_met_before_anything_was_measured_are_refused_once_it_is() -> None:
    model = admission("late-waiters", max_running=1, max_waiting=10, wait_timeout_s=100)
    held = model.admit_now(1, "a")
    assert held is not None
    now = asyncio.get_running_loop().time()
    near = asyncio.create_task(model.acquire(1, "normal", "b", deadline=now + 60))
    far = asyncio.create_task(model.acquire(1, "normal", "c", deadline=now + 60))
    await until(lambda: model.waiting == 2, what="both queued, nothing measured")
    before = refused("late-waiters", "expected_wait")
    model.capacity.clock = lambda: held.taken + 40  # its answer took 40 s: the second in the queue waits 80 s
    held.release(4)
    permit = await near  # admitted: its slot came free
    with pytest.raises(ModelOverloaded) as caught:
        await far
    assert int(caught.value.headers["Retry-After"]) >= 40  # measured: at one every 40 s
    assert refused("late-waiters", "expected_wait") == before + 1
    assert model.waiting == 0
    permit.release()
    assert model.running == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_request_for_a_model_whose_engine_is_dead_is_refused_at_once_with_retry_after(stream: bool) -> None:
    """The engine's own state (`Backend.healthy`), read per request without a health call: 503 in the
    API's shape before the first byte, never a generation started; served again once it can."""
    engine = FakeEngine()
    engine.dead = True

    async def ask(client: httpx.AsyncClient) -> list[httpx.Response]:
        refused_now = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
        engine.dead = False
        return [refused_now, await client.post("/v1/chat/completions", json=chat_body(stream=stream))]

    before = refused("fake-model", "engine_unhealthy")
    answer, again = await serve(app_with(engine), ask)
    assert answer.status_code == 503
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json()["error"]["type"] == "server_error"
    assert "engine is not running" in answer.json()["error"]["message"]
    assert answer.headers["retry-after"] == "1"  # the setting: nothing measures when it comes back
    assert refused("fake-model", "engine_unhealthy") == before + 1
    assert again.status_code == 200
    assert len(engine.requests) == 1  # the second one's only


async def test_the_deadline_counts_from_the_requests_arrival_not_from_when_a_busy_loop_got_to_it() -> None:
    """A burst of arrivals keeps the loop from a request's handler for seconds; its client's timeout runs from
    when it sent the request, so its deadline (and the default one) does too."""
    from gateway.pipeline.context import RequestContext
    from gateway.telemetry.record import RequestRecord

    late = RequestContext(record=RequestRecord(arrival=time.perf_counter() - 10))
    assert late.arrived() <= asyncio.get_running_loop().time() - 10
    unseen = RequestContext()  # no arrival noted (a batch line): now
    assert unseen.arrived() == pytest.approx(asyncio.get_running_loop().time(), abs=60)


DEAD_ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "generate"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "generate"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16}, "generate"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, "generate"),
    ("/v1/embeddings", {"input": "hi"}, "embed"),
    ("/generate", {"prompt": "hi", "max_tokens": 2}, "generate"),
    ("/chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "generate"),
]


@pytest.mark.parametrize(("path", "body", "task"), DEAD_ROUTES, ids=[route[0] for route in DEAD_ROUTES])
async def test_every_route_refuses_a_dead_engines_request_at_once_with_retry_after(
        path: str, body: dict[str, object], task: Task) -> None:
    engine = FakeEngine(task=task)
    engine.dead = True

    async def ask(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(path, json={"model": "fake-model", **body})

    answer = await serve(app_with(engine, admission={"retry_after_s": 0}), ask)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"  # never 0 ("retry now"), whatever the setting
    assert not engine.requests
    assert not engine.embedded


async def test_a_cached_answer_is_still_served_while_the_engine_is_dead() -> None:
    engine = FakeEngine()
    body = chat_body(temperature=0, max_tokens=3)

    async def ask(client: httpx.AsyncClient) -> list[httpx.Response]:
        first = await client.post("/v1/chat/completions", json=body)
        engine.dead = True
        return [first, await client.post("/v1/chat/completions", json=body)]

    first, again = await serve(app_with(engine, cache={"backend": "memory"}), ask)
    assert (first.status_code, again.status_code) == (200, 200)
    assert again.headers["x-cache"] == "HIT"
    assert again.json()["choices"] == first.json()["choices"]


class PastTheDeadlineAfterItsFirstToken(FakeEngine):
    """Its first output at once, the rest only once the request's deadline (`TIMEOUT_S` from now) has passed."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        loop, first = asyncio.get_running_loop(), True
        passed = loop.time() + TIMEOUT_S + 0.05
        async for output in super().generate(request):
            yield output
            if first:
                first = False
                await until(lambda: loop.time() > passed, what="the deadline passed")


TIMEOUT_S = 0.2


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
async def test_a_stream_whose_deadline_passes_after_its_first_byte_is_not_cut(path: str) -> None:
    """The deadline bounds the wait for the first byte (docs/tenants-and-guards.md): a client reading a
    stream has its answer begun, and its SDK's read timeout runs per read, not for the whole stream."""
    engine = PastTheDeadlineAfterItsFirstToken()
    body = {"model": "fake-model", "max_tokens": 6, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/responses":
        body = {"model": "fake-model", "max_output_tokens": 16, "stream": True, "input": "hi"}

    async def ask(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(path, json=body, headers={"request-timeout": str(TIMEOUT_S)})

    before = refused("fake-model", "deadline_passed")
    answer = await serve(app_with(engine), ask)
    assert answer.status_code == 200
    assert engine.aborted == []
    assert "brown" in answer.text  # its tokens past the deadline came too (the first is "the")
    assert refused("fake-model", "deadline_passed") == before
