"""The gateway on the real engine, through the official openai SDK and raw HTTP as curl sends it."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.integration.conftest import MODEL

pytestmark = pytest.mark.integration
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_capital_of_france_at_temperature_zero(sdk: openai.OpenAI) -> None:
    """The golden answer that guards the default precision: the session gateway runs the default
    model with the default dtype (float32 on the CPU); bfloat16, faster there, turns this answer
    into noise (docs/operations.md: Notes on the CPU engine), so a default that drifts to it fails here."""
    result = sdk.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in result.choices[0].message.content
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens > 0
    assert result.usage.prompt_tokens > 10


def test_streamed_chat_yields_several_chunks(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
        extra_headers={"Cache-Control": "no-cache"},  # from the engine, not a cached replay
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "Paris" in "".join(c.choices[0].delta.content for c in content)
    # one chunk per engine step, each at least one token (the last, end of turn, has no text)
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= len(content)


def test_raw_http_stream_ends_with_done(base_url: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        every = [line for line in response.iter_lines() if line]
    lines = [line for line in every if not line.startswith("id: ")]  # a resumable stream's event ids (vLLM sends none)
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert len(lines) >= 3
    json.loads(lines[0][6:])


def test_completions_sync(sdk: openai.OpenAI) -> None:
    result = sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert result.choices[0].text
    assert result.usage.completion_tokens == 5 or result.choices[0].finish_reason == "stop"


def test_completions_stream_sync(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, stream=True))
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


async def test_async_chat_and_completions(async_sdk: openai.AsyncOpenAI) -> None:
    chat = await async_sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert chat.choices[0].message.content
    stream = await async_sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True)
    chunks = [c async for c in stream]
    assert chunks


async def test_32_concurrent_chats_all_complete(async_sdk: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> str:
        messages = [{"role": "user", "content": f"Count to {i + 3}."}]
        result = await async_sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
        return result.choices[0].message.content

    answers = await asyncio.gather(*(one(i) for i in range(32)))
    assert len(answers) == 32
    assert all(answers)


def test_n_and_seed_are_reproducible(sdk: openai.OpenAI) -> None:
    first = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, n=2, seed=42, temperature=1)
    second = sdk.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, n=2, seed=42, temperature=1)
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]


def test_stop_string_stops(sdk: openai.OpenAI) -> None:
    result = sdk.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30, stop=[" is"])
    assert result.choices[0].message.content == "The capital of France"
    assert result.choices[0].finish_reason == "stop"


def test_models_list(sdk: openai.OpenAI) -> None:
    assert [m.id for m in sdk.models.list().data] == [MODEL]


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b"not json", 400),
        (json.dumps({"model": MODEL, "messages": []}).encode(), 400),
        (json.dumps({"model": "nope", "messages": QUESTION}).encode(), 404),
        (json.dumps({"model": MODEL, "messages": QUESTION, "temperature": 9}).encode(), 400),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 3000}]}).encode(), 400),
    ],
)
@pytest.mark.gateway_only("vLLM's error objects differ (code is the status number)")
def test_bad_input_gets_openai_error_and_server_keeps_serving(base_url: str, body: bytes, status: int) -> None:
    headers = {"Content-Type": "application/json"}
    response = httpx.post(f"{base_url}/v1/chat/completions", content=body, headers=headers, timeout=60)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    ok = httpx.post(f"{base_url}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.gateway_only("vLLM's code is the status number, not context_length_exceeded")
def test_sdk_raises_typed_errors(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="missing", messages=QUESTION)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 3000}])
    assert info.value.code == "context_length_exceeded"


@pytest.mark.gateway_only("vLLM's unknown paths answer FastAPI's {\"detail\": ...}, not an OpenAI error")
def test_unknown_path_and_method(base_url: str) -> None:
    assert httpx.get(f"{base_url}/v2/anything").json()["error"]["code"] == "not_found"
    assert httpx.delete(f"{base_url}/v1/models").status_code == 405


@pytest.mark.gateway_only("vLLM's server has no body-size limit of ours to stay under")
async def test_a_huge_prompt_is_tokenized_off_the_loop_and_refused_while_a_stream_goes_on(base_url: str) -> None:
    """~270 KB of prompt (tokenized in the gateway's worker thread, with the real tokenizer): a
    clean 400, and a stream that runs meanwhile is not disturbed."""
    big = "The quick brown fox jumps over the lazy dog. " * 6000
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 16, "temperature": 0, "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def stream() -> list[str]:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers={"Cache-Control": "no-cache"}) as r:
                return [line async for line in r.aiter_lines() if line.startswith("data: ")]

        streaming = asyncio.create_task(stream())
        refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 5})
        counted = await client.post("/tokenize", json={"model": MODEL, "prompt": big})
        lines = await streaming
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    assert counted.status_code == 200
    assert counted.json()["count"] > 50_000
    assert lines[-1] == "data: [DONE]"
    assert all('"error"' not in line for line in lines)
