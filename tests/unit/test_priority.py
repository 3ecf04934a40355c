"""Priority (#28 item 2): a request's place from its key's class and, where the key allows it, from
the request (`tenancy.priority`); admission's order by class and its bound per key (`key_share`);
the engine's priority and scheduling policy; `service_tier` in the answers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import EngineSettings
from gateway.app import create_app
from gateway.backends.admission import Admission
from gateway.settings import AdmissionSettings, Priority
from gateway.tenancy.priority import Scheduled, scheduled
from tests.fakes import FakeEngine, HeldEngine, chat_body, fake_settings
from tests.unit.test_tenants import bearer, keys_file
from tests.waits import until

KEYS = """\
keys:
  web: {key: sk-web, priority: high}
  batch: {key: sk-batch, priority: low}
  chooser: {key: sk-chooser, request_priority: true}
  plain: {key: sk-plain}
"""


@pytest.mark.parametrize(
    ("key_class", "may_raise", "tier", "wanted", "expected"),
    [
        ("normal", False, None, None, Scheduled("normal", 0)),
        ("high", False, None, None, Scheduled("high", -1)),
        ("low", False, "auto", None, Scheduled("low", 1)),
        ("normal", False, "flex", None, Scheduled("low", 1)),  # lowering: always allowed
        ("normal", False, None, 5, Scheduled("low", 5)),
        ("high", False, "default", None, Scheduled("normal", 0)),
        ("normal", False, "priority", None, Scheduled("normal", 0)),  # raising: needs request_priority
        ("low", False, None, -3, Scheduled("low", 1)),
        ("normal", True, "priority", None, Scheduled("high", -1)),
        ("low", True, None, -3, Scheduled("high", -3)),
        ("normal", True, "flex", -2, Scheduled("high", -2)),  # the integer over the tier
    ],
)
def test_a_requests_place(key_class: Priority, may_raise: bool, tier: str | None, wanted: int | None,
                          expected: Scheduled) -> None:
    assert scheduled(key_class, may_raise, tier, wanted) == expected


def _app(tmp_path: Path, fake: FakeEngine, started: list[EngineSettings], keys: str | None = KEYS,
         **settings: Any) -> Any:
    if keys is not None:
        settings["keys_file"] = keys_file(tmp_path, keys)

    def start(engine_settings: EngineSettings) -> FakeEngine:
        started.append(engine_settings)
        return fake

    return create_app(fake_settings(**settings), engine_starter=start)


async def _client(app: Any, state: Any) -> httpx.AsyncClient:
    async def with_state(scope: Any, receive: Any, send: Any) -> None:
        scope["state"] = dict(state)
        await app(scope, receive, send)

    return httpx.AsyncClient(transport=httpx.ASGITransport(app=with_state), base_url="http://test")


@pytest.mark.parametrize(
    ("key", "fields", "priority", "tier"),
    [
        ("sk-plain", {}, 0, "default"),
        ("sk-web", {}, -1, "priority"),
        ("sk-batch", {}, 1, "flex"),
        ("sk-batch", {"service_tier": "priority"}, 1, "flex"),  # a low key cannot raise itself
        ("sk-plain", {"service_tier": "priority", "priority": -9}, 0, "default"),
        ("sk-plain", {"service_tier": "flex"}, 1, "flex"),
        ("sk-chooser", {"service_tier": "priority"}, -1, "priority"),
        ("sk-chooser", {"priority": -7}, -7, "priority"),
        ("sk-chooser", {"priority": 3}, 3, "flex"),
    ],
)
async def test_the_priority_reaches_the_engine_and_the_answer_names_its_tier(
    tmp_path: Path, key: str, fields: dict[str, Any], priority: int, tier: str
) -> None:
    engine, started = FakeEngine(), []
    app = _app(tmp_path, engine, started)
    async with app.router.lifespan_context(app) as state, await _client(app, state) as client:
        whole = await client.post("/v1/chat/completions", json=chat_body(**fields), headers=bearer(key))
        assert whole.status_code == 200, whole.text
        assert whole.json()["service_tier"] == tier
        assert engine.requests[-1].priority == priority
        streamed = await client.post("/v1/chat/completions", json=chat_body(stream=True, **fields),
                                     headers=bearer(key))
        chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert chunks
        assert all(chunk["service_tier"] == tier for chunk in chunks)
        assert engine.requests[-1].priority == priority
        completion = {"model": "fake-model", "prompt": "hi", "max_tokens": 2, **fields}
        assert (await client.post("/v1/completions", json=completion, headers=bearer(key))).status_code == 200
        assert engine.requests[-1].priority == priority
        response = await client.post(
            "/v1/responses", json={"model": "fake-model", "input": "hi", "max_output_tokens": 16, **fields},
            headers=bearer(key),
        )
        assert response.status_code == 200, response.text
        assert response.json()["service_tier"] == tier
        assert engine.requests[-1].priority == priority
    assert started[0].scheduling_policy == "priority"  # the keys have classes: auto is priority


@pytest.mark.parametrize(
    ("keys", "setting", "batches", "policy"),
    [
        (None, "auto", False, "fcfs"),
        ("keys:\n  a: {key: sk-a}\n", "auto", False, "fcfs"),
        ("keys:\n  a: {key: sk-a, request_priority: true}\n", "auto", False, "priority"),
        ("keys:\n  a: {key: sk-a, priority: low}\n", "fcfs", True, "fcfs"),
        (None, "priority", False, "priority"),
        (None, "auto", True, "priority"),  # batch lines run below every key's class
    ],
)
async def test_engines_schedule_by_priority_when_keys_have_classes_or_batches_run(
    tmp_path: Path, keys: str | None, setting: str, batches: bool, policy: str
) -> None:
    started: list[EngineSettings] = []
    app = _app(tmp_path, FakeEngine(), started, keys=keys, engine={"scheduling_policy": setting},
               batches={"enabled": batches, "dir": tmp_path / "batches"})
    async with app.router.lifespan_context(app):
        pass
    assert [s.scheduling_policy for s in started] == [policy]


async def test_waiting_requests_are_admitted_high_first_then_normal_then_low() -> None:
    admission = Admission("m", AdmissionSettings(max_running=1, max_waiting=10))
    holder = admission.admit_now(1, "k")
    assert holder is not None
    order: list[str] = []

    async def wait(klass: Priority, name: str) -> None:
        permit = await admission.acquire(1, klass, name)
        order.append(name)
        await asyncio.sleep(0)
        permit.release()

    tasks = []
    for klass, name in [("low", "low-1"), ("normal", "normal-1"), ("low", "low-2"), ("high", "high-1"),
                        ("normal", "normal-2")]:
        tasks.append(asyncio.create_task(wait(klass, name)))  # type: ignore[arg-type]
        await asyncio.sleep(0)
    assert admission.waiting == 5
    holder.release()
    await asyncio.gather(*tasks)
    assert order == ["high-1", "normal-1", "normal-2", "low-1", "low-2"]
    assert admission.running == 0


@pytest.mark.parametrize(("key_share", "order", "b_started_at"),
                         [(0.5, "fcfs", 2), (None, "fcfs", 6), (None, "vtc", 2), (0.5, "vtc", 2)])
async def test_one_key_cannot_hold_the_model_while_another_waits(
    tmp_path: Path, key_share: float | None, order: str, b_started_at: int
) -> None:
    """max_running 2: key A floods with 6 requests (2 run, 4 wait); key B's one request, sent last,
    starts as soon as a slot frees, ahead of A's waiting ones: with fair shares counted in tokens (the
    default), B has been served least; with key_share 0.5, A holds one slot while B waits; in arrival
    order without either, after all of A's."""
    keys = "keys:\n  a: {key: sk-a}\n  b: {key: sk-b}\n"
    engine, started = HeldEngine(), []
    admission = {"max_running": 2, "max_waiting": 10, "wait_timeout_s": 30, "key_share": key_share,
                 "fairness": {"order": order}}
    app = _app(tmp_path, engine, started, keys=keys, admission=admission)
    async with app.router.lifespan_context(app) as state:
        admission = state["gateway"].models.backends["fake-model"].admission
        async with await _client(app, state) as client:
            def post(key: str, max_tokens: int) -> asyncio.Task[httpx.Response]:
                body = chat_body(max_tokens=max_tokens)
                return asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=bearer(key)))

            flood = [post("sk-a", 5) for _ in range(6)]
            await until(lambda: len(engine.held) == 2 and admission.waiting == 4, what="A's 2 running, 4 waiting")
            b = post("sk-b", 7)
            await until(lambda: admission.waiting == 5, what="B waiting")
            engine.go.set()
            responses = await asyncio.gather(*flood, b)
    assert [r.status_code for r in responses] == [200] * 7
    assert [r.sampling.max_tokens for r in engine.requests].index(7) == b_started_at


async def test_through_the_app_queued_classes_reach_the_engine_high_then_normal_then_low(tmp_path: Path) -> None:
    """What the priority drill (tests/drills/test_priority.py) shows on the real engine, in order and
    without timing: behind a request holding the only slot, lows, a normal and a high queue in that
    order (each seen waiting before the next is sent); once the slot frees, the engine gets the high
    first, then the normal, then the lows in arrival order."""
    engine, started = HeldEngine(), []
    app = _app(tmp_path, engine, started, admission={"max_running": 1, "max_waiting": 10, "wait_timeout_s": 600})
    async with app.router.lifespan_context(app) as state, await _client(app, state) as client:
        admission = state["gateway"].models.backends["fake-model"].admission
        sent = []
        for number, key in enumerate(["sk-plain", "sk-batch", "sk-batch", "sk-plain", "sk-web"]):
            body = chat_body(messages=[{"role": "user", "content": f"request {number}"}])
            sent.append(asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=bearer(key))))
            await until(lambda n=number: len(engine.held) + admission.waiting == n + 1, what=f"request {number} queued")
        engine.go.set()
        answers = await asyncio.gather(*sent)
    assert [answer.status_code for answer in answers] == [200] * 5
    order = [engine.tokenizer.decode(request.prompt_token_ids).split()[2] for request in engine.requests]
    assert order == ["0", "4", "3", "1", "2"]
    assert [request.priority for request in engine.requests] == [0, -1, 0, 1, 1]
