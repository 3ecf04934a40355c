"""The request's journey driven without HTTP: a `RequestContext`, the app's state and a parsed
request in, the pipeline's `Whole` or `Stream` out (pipeline.dispatch). No Starlette object is made."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.apis.chat.chat_serving import CHAT
from gateway.errors import ModelNotFound
from gateway.pipeline.answer import Stream, Whole
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import dispatch
from gateway.pipeline.state import GatewayState
from gateway.protocol.openai import ChatCompletion, ChatCompletionRequest
from gateway.tenancy.tenants import KeyPolicy
from tests.fakes import HELLO, FakeEngine, app_with


@contextlib.asynccontextmanager
async def state_of(engine: FakeEngine, **settings: Any) -> AsyncIterator[GatewayState]:
    app = app_with(engine, **settings)
    async with app.router.lifespan_context(app) as state:
        yield state["gateway"]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "fake-model", "messages": HELLO, "max_tokens": 3, **fields})


async def test_a_whole_answer_without_http() -> None:
    engine, released = FakeEngine(), []
    context = RequestContext(release_body=lambda: released.append(True))
    async with state_of(engine) as state:
        answer = await dispatch(context, state, chat(), CHAT)
    assert isinstance(answer, Whole)
    assert isinstance(answer.body, ChatCompletion)
    assert answer.body.choices[0].message.content
    assert answer.body.usage.completion_tokens == 3
    assert len(engine.requests) == 1
    assert released == [True]
    assert context.record.response_headers["x-served-model"] == "fake-model"
    assert context.charge is not None  # the key's token charge, settled by whoever ends the request


async def test_a_stream_holds_its_admission_permit_until_closed() -> None:
    engine = FakeEngine()
    async with state_of(engine, admission={"max_running": 1, "max_waiting": 0}) as state:
        answer = await dispatch(RequestContext(), state, chat(stream=True), CHAT)
        assert isinstance(answer, Stream)
        assert answer.on_close is not None
        events = [event async for event in answer.events]
        admission = state.models.backends["fake-model"].admission
        assert events
        assert admission.admit_now(1) is None
        answer.on_close()
        permit = admission.admit_now(1)
        assert permit is not None
        permit.release()
    assert engine.finished == [engine.requests[0].request_id]


@pytest.mark.parametrize("models", [("other-model",), ()])
async def test_a_model_the_key_may_not_use_is_not_found(models: tuple[str, ...]) -> None:
    engine = FakeEngine()
    context = RequestContext(policy=KeyPolicy("k1", models=models))
    async with state_of(engine) as state:
        with pytest.raises(ModelNotFound):
            await dispatch(context, state, chat(), CHAT)
    assert engine.requests == []


async def test_the_cache_answers_a_tenant_again_but_not_another_tenant() -> None:
    engine = FakeEngine()
    async with state_of(engine, cache={"backend": "memory"}, api_keys=["sk-a", "sk-b"]) as state:
        def context(tenant: str) -> RequestContext:
            return RequestContext(key_id=tenant, tenant=tenant)

        first, again, other = context("a"), context("a"), context("b")
        for ctx in (first, again, other):
            answer = await dispatch(ctx, state, chat(temperature=0), CHAT)
            assert isinstance(answer, Whole)
    assert [c.record.response_headers["x-cache"] for c in (first, again, other)] == ["MISS", "HIT", "MISS"]
    assert len(engine.requests) == 2
