from __future__ import annotations

import json

import openai
from starlette.testclient import TestClient

from tests.fakes import FakeEngine
from tests.unit.test_chat import sse_events

MODEL = "fake-model"


def test_tokenize_prompt_and_messages(client: TestClient, engine: FakeEngine) -> None:
    response = client.post("/tokenize", json={"prompt": "one two three", "return_token_strs": True})
    body = response.json()
    assert body["count"] == 3
    assert body["tokens"] == engine.tokenizer.encode("one two three")
    assert body["token_strs"] == ["one", "two", "three"]
    assert body["max_model_len"] == 64
    chat = client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(engine.tokenizer.encode("<user> hi <assistant>"))


def test_detokenize_round_trip(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"prompt": "red green"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "red green"}


def test_tokenize_refuses_both_or_neither(client: TestClient) -> None:
    assert client.post("/tokenize", json={}).status_code == 400
    both = {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
    assert client.post("/tokenize", json=both).status_code == 400
    assert client.post("/tokenize", json={"model": "nope", "prompt": "a"}).status_code == 404


def test_generate_native(client: TestClient, engine: FakeEngine) -> None:
    response = client.post("/generate", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200
    body = response.json()
    assert body["output"] == "the quick brown"
    assert body["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    assert engine.requests[0].sampling.temperature == 0


def test_stream_generate_native(client: TestClient) -> None:
    events = sse_events(client.post("/stream-generate", json={"prompt": "hello", "max_tokens": 3}).text)
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["output"] for e in events[:-1]) == "the quick brown"


def test_native_bad_input(client: TestClient) -> None:
    assert client.post("/generate", json={"max_tokens": 3}).json()["error"]["param"] == "prompt"
    assert client.post("/generate", json={"prompt": "a", "temperature": 3}).status_code == 400


def test_best_of_returns_the_most_likely(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    result = sdk.completions.create(model=MODEL, prompt="a", max_tokens=2, n=1, best_of=3)
    assert engine.requests[0].sampling.n == 3
    assert [c.index for c in result.choices] == [0]
    assert result.choices[0].logprobs is None
    assert result.usage.completion_tokens == 6  # every candidate's tokens count, as at OpenAI


def test_best_of_rules(client: TestClient) -> None:
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "n": 2, "best_of": 1}).status_code == 400
    body = {"model": MODEL, "prompt": "a", "best_of": 2, "stream": True}
    assert client.post("/v1/completions", json=body).json()["error"]["param"] == "best_of"


def test_truncate_prompt_tokens_keeps_the_end(client: TestClient, engine: FakeEngine) -> None:
    long = " ".join(f"w{i}" for i in range(100))
    body = {"model": MODEL, "prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 10}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.requests[0].prompt_token_ids == engine.tokenizer.encode(long)[-10:]


def test_openapi_describes_routes_from_the_models(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("ChatCompletionRequest")
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"messages", "temperature", "logprobs", "tools", "response_format"} <= set(props)
    assert "/tokenize" in doc["paths"]
    assert "/generate" in doc["paths"]


def test_chat_native_messages_in_text_out(client: TestClient, engine: FakeEngine) -> None:
    body = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
            "max_tokens": 3, "temperature": 0}
    response = client.post("/chat", json=body)
    assert response.status_code == 200
    assert response.headers["x-model-version"] == MODEL
    assert response.json() == {"output": "the quick brown", "finish_reason": "length",
                               "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}}
    assert engine.tokenizer.decode(engine.requests[0].prompt_token_ids) == "<system> be brief <user> hello <assistant>"


def test_chat_native_streams_as_stream_generate_does(client: TestClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "stream": True}
    response = client.post("/chat", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["output"] for c in chunks) == "the quick brown"
    assert chunks[-1]["finish_reason"] == "length"
    assert set(chunks[0]) <= {"output", "finish_reason", "usage"}


def test_chat_native_cached_answer_streams_too(engine: FakeEngine) -> None:
    from tests.fakes import app_with

    with TestClient(app_with(engine, cache={"backend": "memory"})) as client:
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "temperature": 0}
        first = client.post("/chat", json=body)
        again = client.post("/chat", json={**body, "stream": True})
    assert again.headers["x-cache"] == "HIT"
    assert len(engine.requests) == 1
    events = sse_events(again.text)
    assert "".join(json.loads(e)["output"] for e in events[:-1]) == first.json()["output"]


def test_chat_native_bad_input(client: TestClient) -> None:
    assert client.post("/chat", json={"max_tokens": 3}).json()["error"]["param"] == "messages"
    assert client.post("/chat", json={"messages": [], "max_tokens": 3}).status_code == 400
    unknown = client.post("/chat", json={"messages": [{"role": "user", "content": "a"}], "tools": []})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "tools"
    assert client.post("/chat", json={"model": "nope", "messages": [{"role": "user", "content": "a"}]}).status_code == 404
