"""Remote models under the same policies as embedded ones (the one path of pipeline.attempt): charged
(estimated before, settled to the upstream's usage after), cached (whole and streamed answers),
measured (time to first token, in flight, tokens). The upstream is a real gateway on the fake
engine behind a real uvicorn server on loopback; the front gateway has only remote models, as in
the documented front-gateway set-up."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from gateway.backends.upstream import estimate
from tests.fakes import FakeEngine, app_with, chat_body
from tests.scripted_upstream import scripted
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
def test_streams_are_counted_from_the_upstreams_usage(tmp_path: Path, upstream, include_usage) -> None:
    """The upstream is asked for its usage whatever the client asked; the client gets it only if it asked."""
    base, _ = upstream
    before = [metric(f"gateway_key_{kind}_tokens_total", key="team-b", team="b") for kind in ("prompt", "completion")]
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    with front(tmp_path, base) as client:
        answer = post(client, stream=True, max_tokens=4, **options)
        assert answer.status_code == 200
        assert answer.text.endswith("data: [DONE]\n\n")
    assert ('"usage":{' in answer.text) is include_usage
    after = [metric(f"gateway_key_{kind}_tokens_total", key="team-b", team="b") for kind in ("prompt", "completion")]
    assert [a - b for a, b in zip(after, before, strict=True)] == [UPSTREAM_PROMPT, 4]


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
    assert metric("gateway_prompt_tokens_total", model="far") == prompt + 2 * UPSTREAM_PROMPT  # a stream asks for usage too


def test_in_flight_while_a_remote_stream_is_passed_on(tmp_path: Path) -> None:
    seen: dict[str, float] = {}

    async def chunks() -> AsyncIterator[bytes]:
        yield b'data: {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
        seen["in flight"] = metric("gateway_requests_in_flight", model="far")
        seen["ttft"] = metric("gateway_time_to_first_token_seconds_count", model="far")  # no content yet
        yield b'data: {"id": "c", "created": 1, "model": "m", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n'
        yield b'\ndata: [DONE]\n\n'

    before = metric("gateway_time_to_first_token_seconds_count", model="far")
    events = httpx.Response(200, content=chunks(), headers={"content-type": "text/event-stream"})
    with scripted(lambda request: events) as base, front(tmp_path, base) as client:
        answer = post(client, stream=True)
    assert '"content":"Hi"' in answer.text
    assert seen == {"in flight": 1, "ttft": before}
    assert metric("gateway_requests_in_flight", model="far") == 0
    assert metric("gateway_time_to_first_token_seconds_count", model="far") == before + 1


CHAT_CHUNKS = [
    {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}}]},
    {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": '}}]}, "logprobs": {"content": [
            {"token": "a", "logprob": -0.1, "top_logprobs": []}]}}]},
    {"id": "c1", "created": 5, "model": "up", "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '"Paris"}'}}]}, "finish_reason": "tool_calls"}]},
]
COMPLETION_CHUNKS = [
    {"id": "k", "created": 1, "model": "up", "choices": [{"index": 0, "text": "Hello", "logprobs": {
        "tokens": ["Hello"], "token_logprobs": [-0.5], "top_logprobs": [None], "text_offset": [0]}}]},
    {"id": "k", "created": 1, "model": "up", "choices": [{"index": 0, "text": " you", "finish_reason": "stop",
        "logprobs": {"tokens": [" you"], "token_logprobs": [-0.2], "top_logprobs": [None], "text_offset": [5]}}]},
    {"id": "k", "created": 1, "model": "up", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2,
                                                                      "total_tokens": 6}},
]


def _stream(chunks: list[dict[str, Any]]) -> httpx.Response:
    events = b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks) + b"data: [DONE]\n\n"
    return httpx.Response(200, content=events, headers={"content-type": "text/event-stream"})


def test_streams_join_into_whole_answers(tmp_path: Path) -> None:
    """An upstream's stream read into typed outputs and answered as the gateway's own chunks; the
    whole answer it joins into is cached: tool calls and logprobs (chat), logprobs (completions)."""
    chunks = [CHAT_CHUNKS]
    with scripted(lambda request: _stream(chunks[0])) as base, front(tmp_path, base, cache={"backend": "memory"}) as client:
        fields = {"temperature": 0, "logprobs": True}
        streamed = post(client, stream=True, **fields)
        assert streamed.headers["x-cache"] == "MISS"
        assert '"arguments":"{\\"city\\": "' in streamed.text
        hit = post(client, **fields).json()
        call = hit["choices"][0]["message"]["tool_calls"][0]
        assert call == {"type": "function", "id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        assert hit["choices"][0]["message"].get("content") is None
        assert hit["choices"][0]["finish_reason"] == "tool_calls"
        assert len(hit["choices"][0]["logprobs"]["content"]) == 1
        assert hit["usage"]["completion_tokens"] == 3  # one a chunk, without the upstream's usage
        assert hit["usage"]["prompt_tokens"] == ESTIMATED_PROMPT

        chunks[0] = COMPLETION_CHUNKS
        body = {"model": "far", "prompt": "hi", "temperature": 0, "logprobs": 1}
        key = {"Authorization": "Bearer sk-b"}
        assert client.post("/v1/completions", json={**body, "stream": True}, headers=key).status_code == 200
        whole = client.post("/v1/completions", json=body, headers=key)
        assert whole.headers["x-cache"] == "HIT"
        choice = whole.json()["choices"][0]
        assert choice["text"] == "Hello you"
        assert choice["logprobs"]["text_offset"] == [0, 5]
        assert whole.json()["usage"]["prompt_tokens"] == 4

        chunks[0] = CHAT_CHUNKS[:2]  # no finish_reason: not cached
        assert post(client, stream=True, temperature=0, max_tokens=7).status_code == 200
        assert post(client, temperature=0, max_tokens=7).headers["x-cache"] == "MISS"


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
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}
    bare = estimate({"messages": [{"role": "user", "content": "abcd"}]})[0]
    assert estimate({"messages": [{"role": "user", "content": "abcd"}], "tools": tools})[0] > bare + 10
    assert estimate({"messages": [{"role": "user", "content": "abcd"},
                                  {"role": "user", "content": [image]}]})[0] == bare + 85  # not its URL's length
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"a": {}}}}}
    assert estimate({"messages": [{"role": "user", "content": "abcd"}], "response_format": schema})[0] > bare + 10
