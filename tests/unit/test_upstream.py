"""Remote models (backends.upstream) against a scripted upstream (a real server on loopback that
answers with httpx.Response objects: tests/scripted_upstream.py): its failures
become the gateway's own errors with fallbacks, its words stay in the log, its encodings are
undone, and a stream it breaks ends with one error event."""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import structlog.testing
from starlette.testclient import TestClient

from gateway.app import create_app
from tests import sse
from tests.fakes import FakeEngine, chat_body, fake_settings
from tests.scripted_upstream import Script, scripted

MODELS = """
models:
  - name: local
  - name: remote
    kind: remote
    url: http://upstream.test/v1
    fallback: [local]
  - name: lonely
    kind: remote
    url: http://upstream.test/v1
"""
SECRET_TEXT = "Incorrect API key provided: sk-up****"
EVENT = b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"}}]}'


class Broken(httpx.AsyncByteStream):
    """Some bytes, then the connection fails."""

    def __init__(self, before: bytes) -> None:
        self.before = before

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.before:
            yield self.before
        raise httpx.ReadError("connection reset by peer")


@pytest.fixture
def upstream(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[TestClient, list[Script]]]:
    """The gateway with `local` (fake engine) and two remotes; set script[0] to answer as the upstream.
    Indirectly parametrized: the gateway's `log_prompts` (default off)."""
    script: list[Script] = [lambda request: httpx.Response(200, json={})]
    with scripted(lambda request: script[0](request)) as base:
        models = tmp_path / "models.yaml"
        models.write_text(MODELS.replace("http://upstream.test", base))
        settings = fake_settings(models_file=models, log_prompts=getattr(request, "param", False))
        app = create_app(settings, engine_starter=lambda es: FakeEngine(es.served_model_name))
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, script


def test_an_upstream_that_refuses_our_key_is_a_502_and_falls_back(upstream) -> None:
    client, script = upstream
    script[0] = lambda request: httpx.Response(401, json={"error": {"message": SECRET_TEXT}})
    with structlog.testing.capture_logs() as logs:
        alone = client.post("/v1/chat/completions", json=chat_body("lonely"))
        rescued = client.post("/v1/chat/completions", json=chat_body("remote"))
    assert alone.status_code == 502
    assert alone.json()["error"]["code"] == "bad_gateway"
    assert SECRET_TEXT not in alone.text
    assert "sk-up" not in alone.text
    assert rescued.status_code == 200
    assert rescued.headers["x-served-model"] == "local"
    failed = [str(entry.get("why")) for entry in logs if entry["event"] == "upstream_failed"]
    assert set(failed) == {"answered 401: (its text is logged with log_prompts)"}  # what it said may echo the request


@pytest.mark.parametrize("upstream", [True], indirect=True)
def test_an_upstreams_error_text_is_logged_only_with_log_prompts(upstream) -> None:
    client, script = upstream
    script[0] = lambda request: httpx.Response(401, json={"error": {"message": SECRET_TEXT}})
    with structlog.testing.capture_logs() as logs:
        assert client.post("/v1/chat/completions", json=chat_body("lonely")).status_code == 502
    assert any(SECRET_TEXT in str(entry.get("why")) for entry in logs if entry["event"] == "upstream_failed")


def test_an_upstreams_error_type_and_code_are_logged_not_its_message(upstream) -> None:
    client, script = upstream
    script[0] = lambda request: httpx.Response(
        500, json={"error": {"message": SECRET_TEXT, "type": "server_error", "code": "engine_dead"}})
    with structlog.testing.capture_logs() as logs:
        assert client.post("/v1/chat/completions", json=chat_body("lonely")).status_code == 502
    failed = [str(entry.get("why")) for entry in logs if entry["event"] == "upstream_failed"]
    assert failed == ["answered 500: type server_error, code engine_dead"]
    assert SECRET_TEXT not in str(logs)


@pytest.mark.parametrize(("status", "expected"), [(500, 502), (403, 502), (404, 502), (503, 503), (429, 503), (504, 503)])
def test_upstream_failures_map_to_our_errors(upstream, status: int, expected: int) -> None:
    client, script = upstream
    script[0] = lambda request: httpx.Response(status, text=f"upstream says {SECRET_TEXT}")
    answer = client.post("/v1/chat/completions", json=chat_body("lonely"))
    assert answer.status_code == expected
    assert SECRET_TEXT not in answer.text
    assert answer.json()["error"]["type"] == "server_error"
    assert client.post("/v1/chat/completions", json=chat_body("remote")).headers["x-served-model"] == "local"


def test_the_clients_own_mistake_is_passed_on(upstream) -> None:
    client, script = upstream
    error = {"error": {"message": "max_tokens is too large", "type": "BadRequestError", "param": "max_tokens", "code": 400}}
    script[0] = lambda request: httpx.Response(400, json=error)
    answer = client.post("/v1/chat/completions", json=chat_body("remote"))
    assert answer.status_code == 400
    assert answer.json() == error


def test_ready_shows_no_upstream_text(upstream) -> None:
    """Nor does its log, as a failed request's (`upstream_failed`): what a refusal of our key says may spell it."""
    client, script = upstream
    script[0] = lambda request: httpx.Response(401, json={"error": {"message": SECRET_TEXT, "type": "auth"}})
    with structlog.testing.capture_logs() as logs:
        ready = client.get("/ready")
    assert ready.status_code == 503
    assert ready.json()["models"]["lonely"] == "unavailable: upstream answered 401"
    assert SECRET_TEXT not in ready.text
    unhealthy = [str(entry["why"]) for entry in logs if entry["event"] == "upstream_unhealthy"]
    assert set(unhealthy) == {"answered 401: type auth"}


def test_a_compressed_stream_reaches_the_client_decoded(upstream) -> None:
    client, script = upstream
    events = EVENT + b"\n\n" + EVENT + b"\r\n\r\n" + b"data: [DONE]\n\n"
    script[0] = lambda request: httpx.Response(
        200, content=gzip.compress(events), headers={"content-type": "text/event-stream", "content-encoding": "gzip"}
    )
    answer = client.post("/v1/chat/completions", json=chat_body("remote", stream=True))
    assert answer.status_code == 200
    assert "content-encoding" not in answer.headers
    chunks = sse.chunks(answer.text)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "HiHi"
    assert answer.text.endswith("data: [DONE]\n\n")


def test_a_compressed_answer_reaches_the_client_decoded(upstream) -> None:
    client, script = upstream
    body = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}]}
    script[0] = lambda request: httpx.Response(
        200, content=gzip.compress(json.dumps(body).encode()),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    answer = client.post("/v1/chat/completions", json=chat_body("remote"))
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "Hi"
    assert answer.json()["model"] == "remote"  # the answer is the gateway's, in the name of the model asked
    assert "content-encoding" not in answer.headers


def test_an_upstream_that_breaks_mid_stream_ends_it_with_one_error_event(upstream) -> None:
    client, script = upstream
    # the second event is cut in the middle: it is not passed on
    script[0] = lambda request: httpx.Response(
        200, stream=Broken(EVENT + b"\n\n" + EVENT[:20]), headers={"content-type": "text/event-stream"}
    )
    answer = client.post("/v1/chat/completions", json=chat_body("lonely", stream=True))
    assert answer.status_code == 200
    events = sse.blocks(answer.text)
    assert json.loads(events[0][len("data: "):])["choices"][0]["delta"]["content"] == "Hi"
    assert events[-1] == "data: [DONE]"
    assert len(events) == 3
    error = json.loads(events[1][len("data: "):])["error"]
    assert error["code"] == "service_unavailable"
    assert "reset" not in error["message"]


def test_an_upstream_that_breaks_before_its_first_event_falls_back(upstream) -> None:
    client, script = upstream
    script[0] = lambda request: httpx.Response(200, stream=Broken(b""), headers={"content-type": "text/event-stream"})
    answer = client.post("/v1/chat/completions", json=chat_body("remote", stream=True))
    assert answer.status_code == 200
    assert answer.headers["x-served-model"] == "local"
    assert answer.text.endswith("data: [DONE]\n\n")
    assert '"error"' not in answer.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_an_answer_that_cannot_be_read_is_not_passed_on(upstream, stream: bool) -> None:
    """What is not JSON cannot be checked nor rendered: a whole one is a 502 (its fallbacks may
    answer), a stream's event ends the stream with an error."""
    client, script = upstream
    content = EVENT + b"\n\ndata: {not json\n\n" if stream else b"<html>busy</html>"
    script[0] = lambda request: httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})
    answer = client.post("/v1/chat/completions", json=chat_body("lonely", stream=stream))
    if not stream:
        assert answer.status_code == 502
        assert client.post("/v1/chat/completions", json=chat_body("remote")).headers["x-served-model"] == "local"
        return
    events = sse.blocks(answer.text)
    assert json.loads(events[1][len("data: "):])["error"]["code"] == "service_unavailable"
    assert "not json" not in answer.text


def _answer(index: int, usage: dict[str, int] | None = None, **choice: object) -> dict[str, object]:
    choice = {"index": index, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop", **choice}
    return {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice],
            "usage": usage or {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


UNTAKEN = [  # (what the upstream answered a request for one choice with logprobs)
    ("negative index", _answer(-1)),
    ("index past n", _answer(1)),
    ("negative prompt", _answer(0, {"prompt_tokens": -3, "completion_tokens": 1})),
    ("negative completion", _answer(0, {"prompt_tokens": 1, "completion_tokens": -1})),
    ("no choices", {**_answer(0), "choices": []}),
    ("a choice twice", {**_answer(0), "choices": _answer(0)["choices"] * 2}),  # type: ignore[operator]
    ("not an object", [_answer(0)]),
    ("a logprob not a number", _answer(0, logprobs={"content": [{"token": "Hi", "logprob": None, "top_logprobs": []}]})),
]


@pytest.mark.parametrize("body", [body for _, body in UNTAKEN], ids=[name for name, _ in UNTAKEN])
def test_an_answer_the_gateway_cannot_take_is_a_502(upstream, body: object) -> None:
    """A choice outside the n asked for (or missing, or twice), a negative count, a logprob that is
    no number: not an IndexError, a wrong slot, a charge refunded, an empty 200, or a 400 that blames
    the client for the upstream's answer."""
    client, script = upstream
    script[0] = lambda request: httpx.Response(200, json=body)
    answer = client.post("/v1/chat/completions", json=chat_body("lonely", logprobs=True))
    assert answer.status_code == 502
    assert answer.json()["error"]["code"] == "bad_gateway"
    assert client.post("/v1/chat/completions", json=chat_body("remote")).headers["x-served-model"] == "local"


def test_a_streamed_logprob_that_is_not_a_number_is_the_upstreams_failure(upstream) -> None:
    """Not a 400 that blames the client: before the first byte a 503 (its fallbacks may answer), as
    an event that cannot be read."""
    client, script = upstream
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"content": "Hi"}, "logprobs": {"content": [{"token": "Hi", "logprob": "x"}]}}]}
    content = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
    script[0] = lambda request: httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})
    answer = client.post("/v1/chat/completions", json=chat_body("lonely", stream=True, logprobs=True))
    assert answer.status_code == 503
    assert answer.json()["error"]["code"] == "service_unavailable"


def test_a_refusal_is_passed_on_only_so_far(upstream) -> None:
    """An upstream's 400 body is read with a bound: a huge one is not held whole in memory."""
    client, script = upstream
    script[0] = lambda request: httpx.Response(400, text="x" * (1 << 20))
    answer = client.post("/v1/chat/completions", json=chat_body("remote"))
    assert answer.status_code == 400
    assert 0 < len(answer.json()["error"]["message"]) <= 64 * 1024


BEYOND_64_BITS = [  # a free-form field of a chat request (JSON's numbers have no bound) with an integer orjson cannot write
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"maxLength": 2**70}}}]}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"maximum": 2**70}}}}),
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "f"}, "x": -(2**70)}}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u", "w": 2**70}}]}]}),
]


@pytest.mark.parametrize(("param", "fields"), BEYOND_64_BITS, ids=[param for param, _ in BEYOND_64_BITS])
def test_an_integer_beyond_64_bits_is_refused_before_the_upstream(upstream, param: str, fields: dict[str, object]) -> None:
    """Not a 500 from the JSON writer: a 400 naming the field, and the upstream never asked."""
    client, script = upstream
    asked: list[object] = []
    script[0] = lambda request: asked.append(request) or httpx.Response(200, json=_answer(0))
    body = json.dumps(chat_body("lonely", **fields))  # the stdlib writes any integer
    answer = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert asked == []


class Endless(httpx.AsyncByteStream):
    """One event that never ends (no blank line), `most` bytes of it, then nothing more."""

    def __init__(self, most: int) -> None:
        self.most, self.sent_all = most, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"data: " + b"x" * 65530
        for _ in range(self.most // 65536):
            yield b"x" * 65536
            await asyncio.sleep(0)  # a server that hears its client hang up (writes to a closed socket are dropped)
        self.sent_all = True
        await asyncio.Event().wait()  # until the gateway hangs up (at its read timeout, if nothing else)


def test_an_event_past_its_bound_ends_the_upstreams_request(tmp_path: Path) -> None:
    """An upstream's event is held whole until it ends: one that does not is not read without
    bound (memory, and a re-scan of all of it at each piece); the gateway hangs up and answers 503."""
    endless = Endless(64 << 20)
    with scripted(lambda request: httpx.Response(200, stream=endless, headers={"content-type": "text/event-stream"})) as base:
        models = tmp_path / "models.yaml"
        models.write_text(f"models: [{{name: far, kind: remote, url: '{base}/v1', timeout_s: 2}}]")
        app = create_app(fake_settings(models_file=models), engine_starter=lambda es: FakeEngine(es.served_model_name))
        with TestClient(app, raise_server_exceptions=False) as client:
            answer = client.post("/v1/chat/completions", json=chat_body("far", stream=True))
    assert answer.status_code == 503
    assert not endless.sent_all


@pytest.mark.parametrize("content", [json.dumps(_answer(0)).encode(), b"", b": keep-alive\n\ndata: [DONE]\n\n"],
                         ids=["a whole answer", "nothing", "no chunk"])
def test_a_stream_without_a_chunk_is_a_502_and_falls_back(upstream, content: bytes) -> None:
    """An upstream that answers a stream with no chunk at all (one that ignored `stream`, or said
    nothing) did not answer: not an empty 200 stream."""
    client, script = upstream
    script[0] = lambda request: httpx.Response(200, content=content, headers={"content-type": "application/json"})
    alone = client.post("/v1/chat/completions", json=chat_body("lonely", stream=True))
    assert alone.status_code == 502
    assert alone.json()["error"]["code"] == "bad_gateway"
    rescued = client.post("/v1/chat/completions", json=chat_body("remote", stream=True))
    assert rescued.headers["x-served-model"] == "local"
