"""Bad input gets an OpenAI error object with the right status, and the server keeps serving."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

MODEL = "fake-model"
HELLO = [{"role": "user", "content": "hi"}]


def assert_error(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def test_unknown_path_is_404(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, code="not_found")


def test_wrong_method_is_405_with_allow(client: TestClient) -> None:
    response = client.get("/v1/chat/completions")
    assert_error(response, 405, code="method_not_allowed")
    assert "POST" in response.headers["allow"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO}, "model"),
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0"),
        ({"model": MODEL, "messages": HELLO, "temperature": 2.5}, "temperature"),
        ({"model": MODEL, "messages": HELLO, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": HELLO, "top_p": 0}, "top_p"),
        ({"model": MODEL, "messages": HELLO, "top_p": 1.5}, "top_p"),
        ({"model": MODEL, "messages": HELLO, "n": 0}, "n"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": MODEL, "messages": HELLO, "presence_penalty": 3}, "presence_penalty"),
        ({"model": MODEL, "messages": HELLO, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"model": MODEL, "messages": HELLO, "stream_options": {"include_usage": True}}, None),
        ({"model": MODEL, "messages": HELLO, "bogus": 1}, "bogus"),
        ({"model": MODEL, "messages": HELLO, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ],
)
def test_invalid_chat_requests_are_400(client: TestClient, body: dict, param: str | None) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param=param)
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [{"model": MODEL}, {"model": MODEL, "prompt": []}, {"model": MODEL, "prompt": 5}, {"model": MODEL, "prompt": "a", "logprobs": 21}],
)
def test_invalid_completion_requests_are_400(client: TestClient, body: dict) -> None:
    assert_error(client.post("/v1/completions", json=body), 400)


def test_unknown_model_is_404(client: TestClient) -> None:
    error = assert_error(client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": HELLO}), 404, "model")
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_body_that_is_not_a_json_object_is_400(client: TestClient, raw: bytes) -> None:
    assert_error(client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}), 400)


def test_body_over_the_limit_is_413(client: TestClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20_000}]}
    assert_error(client.post("/v1/chat/completions", json=body), 413, code="request_too_large")


def test_engine_failure_mid_stream_is_one_error_event_then_done(client: TestClient, engine) -> None:
    engine.fail_after = 2
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 5, "stream": True})
    assert response.status_code == 200
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2] and '"server_error"' in events[-2]
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1}).status_code == 200


def test_engine_failure_before_stream_is_a_real_status(client: TestClient, engine) -> None:
    engine.fail_after = 0
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "stream": True})
    assert_error(response, 500)


def test_dead_engine_is_503(client: TestClient, engine) -> None:
    engine.dead = True
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO}), 503)
