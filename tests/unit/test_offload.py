"""Large inputs are prepared off the event loop: the loop keeps serving while one is tokenized."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx

from gateway.app import create_app
from gateway.serving import offload
from tests.fakes import FakeEngine, FakeTokenizer, fake_settings

BIG = "word " * (offload.INLINE_MAX_BYTES // 4)  # a body well past the inline limit


class RecordingTokenizer(FakeTokenizer):
    """Notes the thread of each encode; with `gate` set, a large encode waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: list[str] = []
        self.gate: threading.Event | None = None
        self.started = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if self.gate is not None and len(text) > offload.INLINE_MAX_BYTES:
            self.started.set()
            assert self.gate.wait(30), "the test never let the tokenizer go on"
        return super().encode(text, add_special_tokens)


def engine_with(tokenizer: RecordingTokenizer) -> FakeEngine:
    engine = FakeEngine(max_model_len=100_000)
    engine._tokenizer = tokenizer
    return engine


async def with_client(engine: FakeEngine, work: Any) -> Any:
    app = create_app(fake_settings(), engine_starter=lambda es: engine)
    async with app.router.lifespan_context(app) as state:

        async def with_state(scope, receive, send):
            scope["state"] = dict(state)
            await app(scope, receive, send)

        transport = httpx.ASGITransport(app=with_state)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await work(client)


def chat(content: str) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 2}


async def test_small_bodies_inline_large_ones_in_the_worker() -> None:
    tokenizer = RecordingTokenizer()

    async def work(client: httpx.AsyncClient) -> None:
        assert (await client.post("/v1/chat/completions", json=chat("hi"))).status_code == 200
        assert (await client.post("/v1/chat/completions", json=chat(BIG))).status_code == 200
        assert (await client.post("/v1/completions", json={"model": "fake-model", "prompt": BIG, "max_tokens": 2})).status_code == 200
        tokens = await client.post("/tokenize", json={"model": "fake-model", "prompt": BIG})
        assert tokens.status_code == 200
        assert tokens.json()["count"] == BIG.count("word")

    await with_client(engine_with(tokenizer), work)
    assert tokenizer.threads[0] == threading.main_thread().name
    assert all(name.startswith("prepare") for name in tokenizer.threads[1:]), tokenizer.threads


async def test_the_loop_keeps_serving_while_a_large_prompt_is_tokenized() -> None:
    tokenizer = RecordingTokenizer()
    tokenizer.gate = threading.Event()

    async def work(client: httpx.AsyncClient) -> None:
        big = asyncio.create_task(client.post("/v1/chat/completions", json=chat(BIG)))
        assert await asyncio.to_thread(tokenizer.started.wait, 30)
        # the large prompt is held inside the tokenizer; other requests are still answered
        assert (await client.get("/health")).status_code == 200
        small = await client.post("/v1/chat/completions", json=chat("hi"))
        assert small.status_code == 200
        assert not big.done()
        tokenizer.gate.set()
        assert (await big).status_code == 200

    await with_client(engine_with(tokenizer), work)


async def test_refusals_from_the_worker_are_the_usual_errors() -> None:
    engine = FakeEngine(max_model_len=64)  # the large prompt does not fit

    async def work(client: httpx.AsyncClient) -> httpx.Response:
        return await client.post("/v1/chat/completions", json=chat(BIG))

    refused = await with_client(engine, work)
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"


async def test_a_turn_of_a_large_conversation_is_prepared_in_the_worker() -> None:
    """The body is small; the conversation it continues, read from the store, is not."""
    tokenizer = RecordingTokenizer()

    async def work(client: httpx.AsyncClient) -> None:
        made = await client.post("/v1/conversations", json={"items": [{"role": "user", "content": BIG}]})
        turn = {"model": "fake-model", "input": "hi", "conversation": made.json()["id"], "max_output_tokens": 16}
        assert (await client.post("/v1/responses", json=turn)).status_code == 200

    await with_client(engine_with(tokenizer), work)
    assert tokenizer.threads
    assert all(name.startswith("prepare") for name in tokenizer.threads), tokenizer.threads
