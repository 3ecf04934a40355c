"""Remote models under the same policies as embedded ones (serving.remote, pipeline.attempt): charged
(estimated before, settled to the upstream's usage after), cached (whole and streamed answers),
measured (time to first token, in flight, tokens). The upstream is a real gateway on the fake
engine behind a real uvicorn server on loopback; the front gateway has only remote models, as in
the documented front-gateway set-up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from gateway.protocol import sse_wire
from gateway.protocol.openai import ChatCompletion, Completion
from gateway.serving.remote import RemoteAnswer, estimate
from tests.fakes import FakeEngine, app_with, chat_body
from tests.served import gateway

# on the upstream's fake engine, chat_body's prompt is 3 tokens; the front estimates "hi" as 1
UPSTREAM_PROMPT, ESTIMATED_PROMPT = 3, 1


@pytest.fixture
def upstream() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    with gateway(engine) as base:
        yield base, engine


def front(tmp_path: Path, upstream_url: str, **settings: object) -> TestClient:
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - {{name: far, kind: remote, url: '{upstream_url}/v1', upstream_model: fake-model}}\n")
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  team-a: {key: sk-a, team: a, tpm: 1000, budget: {day: 12}}\n  team-b: {key: sk-b, team: b}\n")
    return TestClient(app_with(models_file=models, keys_file=keys, **settings))


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def post(client: TestClient, key: str = "sk-b", **body: object) -> httpx.Response:
    return client.post("/v1/chat/completions", json=chat_body("far", **body), headers={"Authorization": f"Bearer {key}"})


def test_remote_requests_are_estimated_then_settled_to_the_upstreams_usage(tmp_path: Path, upstream) -> None:
    base, _ = upstream
    with front(tmp_path, base) as client:
        first = post(client, "sk-a")
        assert first.status_code == 200
        # charged up front: the estimate (1 + max_tokens 3), not yet the upstream's 3 + 3
        assert first.headers["x-ratelimit-remaining-tokens"] == str(1000 - ESTIMATED_PROMPT - 3)
        # the budget of 12 a day holds two requests of 6 (as the upstream counted them), not three of 4
        assert post(client, "sk-a").status_code == 200
        refused = post(client, "sk-a")
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "insufficient_quota"


@pytest.mark.parametrize("include_usage", [True, False])
def test_streams_are_counted_from_the_usage_chunk_or_their_chunks(tmp_path: Path, upstream, include_usage) -> None:
    base, _ = upstream
    before = [metric(f"gateway_key_{kind}_tokens_total", key="team-b", team="b") for kind in ("prompt", "completion")]
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    with front(tmp_path, base) as client:
        answer = post(client, stream=True, max_tokens=4, **options)
        assert answer.status_code == 200
        assert answer.text.endswith("data: [DONE]\n\n")
    after = [metric(f"gateway_key_{kind}_tokens_total", key="team-b", team="b") for kind in ("prompt", "completion")]
    prompt = UPSTREAM_PROMPT if include_usage else ESTIMATED_PROMPT  # without usage: the estimate
    assert [a - b for a, b in zip(after, before, strict=True)] == [prompt, 4]


def test_deterministic_remote_answers_are_cached_whole_and_streamed(tmp_path: Path, upstream) -> None:
    base, engine = upstream
    with front(tmp_path, base, cache={"backend": "memory"}) as client:
        whole = post(client, temperature=0)
        again = post(client, temperature=0)
        assert (whole.headers["x-cache"], again.headers["x-cache"]) == ("MISS", "HIT")
        assert again.json()["choices"] == whole.json()["choices"]
        assert again.json()["usage"] == whole.json()["usage"]
        replayed = post(client, temperature=0, stream=True)
        assert replayed.headers["x-cache"] == "HIT"
        assert '"content":"the quick brown"' in replayed.text
        assert len(engine.requests) == 1
        # a stream first: joined into the whole answer, then served whole
        streamed = post(client, temperature=0, max_tokens=5, stream=True, stream_options={"include_usage": True})
        assert streamed.headers["x-cache"] == "MISS"
        hit = post(client, temperature=0, max_tokens=5)
        assert hit.headers["x-cache"] == "HIT"
        assert hit.json()["choices"][0]["message"]["content"] == "the quick brown fox jumps"
        assert hit.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        assert hit.json()["choices"][0]["finish_reason"] == "length"
        assert post(client, temperature=1).headers["x-cache"] == "MISS"  # not deterministic: not cached
        assert len(engine.requests) == 3


def test_remote_models_are_measured(tmp_path: Path, upstream) -> None:
    base, _ = upstream
    ttft = metric("gateway_time_to_first_token_seconds_count", model="far")
    prompt = metric("gateway_prompt_tokens_total", model="far")
    with front(tmp_path, base) as client:
        assert post(client).status_code == 200
        assert post(client, stream=True).status_code == 200
        assert metric("gateway_requests_in_flight", model="far") == 0  # up while answering, down after
    assert metric("gateway_time_to_first_token_seconds_count", model="far") == ttft + 2
    assert metric("gateway_prompt_tokens_total", model="far") == prompt + UPSTREAM_PROMPT + ESTIMATED_PROMPT


async def test_in_flight_while_a_remote_stream_is_passed_on() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'data: {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
        assert metric("gateway_requests_in_flight", model="watched") == 1
        assert metric("gateway_time_to_first_token_seconds_count", model="watched") == before  # no content yet
        yield b'data: {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n'
        yield b'\ndata: [DONE]\n\n'

    before = metric("gateway_time_to_first_token_seconds_count", model="watched")
    watch = RemoteAnswer("watched", ChatCompletion, 1)
    passed = [event async for event in watch.events(sse_wire.split(chunks()))]
    assert passed[-1] == b"data: [DONE]"
    assert len(passed) == 3
    assert metric("gateway_requests_in_flight", model="watched") == 0
    assert metric("gateway_time_to_first_token_seconds_count", model="watched") == before + 1


async def test_streams_join_into_whole_answers() -> None:
    """Tool calls and logprobs (chat), logprobs (completions); the events of a stream already cut
    into events (the form a relayed stream takes) read the same as raw chunks."""
    stored: list[object] = []

    async def store(answer: object) -> None:
        stored.append(answer)

    chat = [
        {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}}]},
        {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '{"city": '}}]}, "logprobs": {"content": [
                {"token": "a", "logprob": -0.1, "top_logprobs": []}]}}]},
        {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": '"Paris"}'}}]}, "finish_reason": "tool_calls"}]},
    ]
    await _drain(RemoteAnswer("m", ChatCompletion, 2, on_done=store), chat)
    answer = stored.pop()
    assert isinstance(answer, ChatCompletion)
    call = answer.choices[0].message.tool_calls[0]  # type: ignore[index]
    assert call == {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert answer.choices[0].message.content is None
    assert answer.choices[0].finish_reason == "tool_calls"
    assert answer.choices[0].logprobs is not None
    assert len(answer.choices[0].logprobs.content or []) == 1
    assert answer.usage.completion_tokens == 3
    assert answer.usage.prompt_tokens == 2

    completion = [
        {"id": "k", "created": 1, "model": "up", "choices": [{"index": 0, "text": "Hello", "logprobs": {
            "tokens": ["Hello"], "token_logprobs": [-0.5], "top_logprobs": [None], "text_offset": [0]}}]},
        {"id": "k", "created": 1, "model": "up", "choices": [{"index": 0, "text": " you", "finish_reason": "stop",
            "logprobs": {"tokens": [" you"], "token_logprobs": [-0.2], "top_logprobs": [None], "text_offset": [5]}}]},
        {"id": "k", "created": 1, "model": "up", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                                          "total_tokens": 6}},
    ]
    await _drain(RemoteAnswer("m", Completion, 9, on_done=store), completion)
    whole = stored.pop()
    assert isinstance(whole, Completion)
    assert whole.choices[0].text == "Hello you"
    assert whole.choices[0].logprobs is not None
    assert whole.choices[0].logprobs.text_offset == [0, 5]
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == 4

    cut_short = chat[:2]  # no finish_reason, no [DONE]: not cached
    await _drain(RemoteAnswer("m", ChatCompletion, 2, on_done=store), cut_short)
    assert stored == []


async def _drain(watch: RemoteAnswer, chunks: list[dict]) -> None:
    async def events() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield b"data: " + orjson.dumps(chunk)
        if chunks and any(c.get("finish_reason") for chunk in chunks for c in chunk["choices"]):
            yield b"data: [DONE]"

    async for _ in watch.events(events()):
        await asyncio.sleep(0)


def test_estimates() -> None:
    chat = {"messages": [{"role": "user", "content": "x" * 40}, {"role": "user", "content": [{"type": "text", "text": "abcd"}]},
                         {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "12345678"}}]}],
            "max_completion_tokens": 7, "n": 2}
    assert estimate(chat) == (10 + 1 + 2, 14)
    assert estimate({"messages": [{"role": "user", "content": "hi"}]}) == (1, 0)  # no budget asked: counted after
    assert estimate({"prompt": "abcdefgh"}) == (2, 16)  # completions' default max_tokens
    assert estimate({"prompt": ["abcd", "abcd"], "max_tokens": 3, "best_of": 2}) == (2, 12)
    assert estimate({"prompt": [[1, 2, 3], [4]], "max_tokens": 1}) == (4, 2)
    assert estimate({"input": ["abcd", "abcdefgh"]}) == (3, 0)  # embeddings
