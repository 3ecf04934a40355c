"""Bad input gets an OpenAI error object with the right status, and the server keeps serving."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from tests import sse

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


@pytest.mark.parametrize(
    ("route", "extra", "param", "says"),
    [
        ("/v1/completions", {"prompt": [-1]}, "prompt.0", "greater than or equal to 0"),
        ("/v1/completions", {"prompt": [2**64]}, "prompt.0", "less than or equal to"),
        ("/v1/completions", {"prompt": []}, "prompt", "at least 1 item"),
        ("/v1/chat/completions", {"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 items"),
    ],
)
def test_a_union_field_error_names_the_member_that_matched(
    client: TestClient, route: str, extra: dict, param: str, says: str
) -> None:
    """Of a union's errors at the same depth, the one of the member whose type matched: the
    constraint broken, not "Input should be a valid string" of the string member."""
    error = assert_error(client.post(route, json={"model": MODEL, **extra}), 400, param=param)
    assert says in error["message"], error["message"]


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
         "messages.0.content.0.type"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages.0.content"),
        ("/v1/responses", {"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages.0.content.0.text"),
        ("/v1/messages", {"max_tokens": 4, "messages": HELLO, "system": [{"type": "text", "text": 5}]}, "system.0.text"),
    ],
)
def test_a_param_is_the_field_s_path_in_the_body(client: TestClient, route: str, extra: dict, param: str) -> None:
    """Pydantic's error location also names the union member it tried (a model's class name:
    "messages.0.content.0.TextPart.type"; a tag: "input.0.message.role"): the param is the path
    in the body as sent."""
    response = client.post(route, json={"model": MODEL, **extra})
    assert response.status_code == 400
    error = response.json()["error"]
    assert f"'{param}'" in error["message"], error["message"]
    if route != "/v1/messages":  # Anthropic's error object has no param
        assert error["param"] == param


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
    events = sse.blocks(response.text)
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2]
    assert '"server_error"' in events[-2]
    assert client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1}).status_code == 200


def test_engine_failure_before_stream_is_a_real_status(client: TestClient, engine) -> None:
    engine.fail_after = 0
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "stream": True})
    assert_error(response, 500)


def test_dead_engine_is_503(client: TestClient, engine) -> None:
    engine.dead = True
    assert_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO}), 503)


BIG = 2**64


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/chat/completions", {"seed": BIG}, "seed"),
        ("/v1/chat/completions", {"seed": -(2**63) - 1}, "seed"),
        ("/v1/chat/completions", {"top_k": BIG, "temperature": 0}, "top_k"),
        ("/v1/chat/completions", {"min_tokens": BIG, "temperature": 0}, "min_tokens"),
        ("/v1/chat/completions", {"truncate_prompt_tokens": BIG, "temperature": 0}, "truncate_prompt_tokens"),
        ("/v1/chat/completions", {"stop_token_ids": [BIG], "temperature": 0}, "stop_token_ids.0"),
        ("/v1/chat/completions", {"max_tokens": BIG}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": BIG}, "max_completion_tokens"),
        ("/v1/chat/completions", {"logit_bias": {"²": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"-5": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": [[BIG]]}, "prompt.0.0"),
        ("/v1/completions", {"prompt": [-1]}, "prompt.0"),
        ("/v1/completions", {"prompt": "a", "seed": BIG}, "seed"),
        ("/v1/completions", {"prompt": "a", "max_tokens": BIG}, "max_tokens"),
        ("/generate", {"prompt": "a", "seed": BIG}, "seed"),
        ("/detokenize", {"tokens": [BIG]}, "tokens.0"),
    ],
)
def test_integers_are_bounded_as_vllm_bounds_them(client: TestClient, route: str, extra: dict, param: str) -> None:
    """Past int64 (or a token id that is not one), a 400 naming the field, never a 500."""
    body = {"model": MODEL, **({"messages": HELLO} if route == "/v1/chat/completions" else {}), **extra}
    assert_error(client.post(route, json=body), 400, param=param)


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("/v1/chat/completions", {"logit_bias": {"100": 5}}, "logit_bias"),
        ("/v1/chat/completions", {"stop_token_ids": [1, 100]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [1, 100]}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [2, 100]]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"99999999999": 1}}, "logit_bias"),
        ("/generate", {"prompt": [100]}, "prompt"),
        ("/detokenize", {"tokens": [100]}, "tokens"),
    ],
)
def test_token_ids_are_checked_against_the_vocabulary(route: str, extra: dict, param: str) -> None:
    from tests.fakes import FakeEngine, app_with

    engine = FakeEngine(vocab_size=100)
    with TestClient(app_with(engine)) as client:
        body = {"model": MODEL, **({"messages": HELLO} if route == "/v1/chat/completions" else {}), **extra}
        error = assert_error(client.post(route, json=body), 400, param=param)
        assert "vocabulary" in error["message"]
        assert engine.requests == []
        ok = {**body, **{k: v for k, v in {"logit_bias": {"99": 5}, "stop_token_ids": [99]}.items() if k in extra}}
        if route == "/v1/chat/completions":
            assert client.post(route, json=ok).status_code == 200


def test_min_tokens_past_max_tokens_is_400(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 3, "min_tokens": 4})
    assert_error(response, 400, param="min_tokens")


def test_an_unexpected_error_is_a_500_with_request_id_in_the_api_shape(client: TestClient, engine) -> None:
    engine.fail_after = 0  # a RuntimeError: no layer knows it
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO}, headers={"X-Request-ID": "req-500"})
    assert_error(response, 500, code="internal_error")
    assert response.headers["x-request-id"] == "req-500"
    metrics = client.get("/metrics").text
    assert 'route="/v1/chat/completions",status="500"' in metrics


def test_a_slash_redirect_never_echoes_the_host(client: TestClient) -> None:
    for path in ("/health/", "/v1/models/", "/v1/chat/completions/"):
        response = client.get(path, headers={"Host": "evil.example"}, follow_redirects=False)
        assert_error(response, 404, code="not_found")
        assert "location" not in response.headers


def test_an_unexpected_error_on_the_messages_route_is_a_500_in_anthropics_shape(client: TestClient, engine) -> None:
    engine.fail_after = 0  # a RuntimeError: no layer knows it, the access log answers it
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    response = client.post("/v1/messages", json=body, headers={"X-Request-ID": "req-500-messages"})
    assert response.status_code == 500
    payload = response.json()
    assert payload["type"] == "error", payload
    assert payload["error"]["type"] == "api_error", payload
    assert response.headers["x-request-id"] == "req-500-messages"
