"""The same pipeline cases against both backends, with the same expectations: the engine's test
double (tests/fakes.py) and a scripted upstream (tests/scripted_upstream.py) that answers as an
OpenAI-compatible server would with the same script. Output guards on every field that carries
model text (content, a named tool call's arguments, structured output, logprobs), the output
bound, usage, errors before and after the first byte, and a client that leaves mid-stream; and the
embeddings, through the same `embed` of either backend."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog.testing
from prometheus_client import REGISTRY
from starlette.testclient import TestClient

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings
from tests.scripted_upstream import scripted
from tests.unit.test_disconnect import drive

GUARDS = """
default: out
profiles:
  out:
    output:
      deny: ["(?i)hydra"]
      pii: {email: redact}
      holdback_chars: 8
"""
TOOLS = [{"type": "function", "function": {"name": "mail", "parameters": {"type": "object"}}}]
NAMED = {"type": "function", "function": {"name": "mail"}}
EMAIL = ["Ask eve@", "evil.example", " now"]
ARGUMENTS = ['{"to": "eve@', "evil.example", '"}']


@dataclass
class Script:
    """What the backend answers with, whichever it is."""

    pieces: list[str] = field(default_factory=lambda: ["Hello", " there", " you"])
    dead: bool = False  # refuses before the first token
    fail_mid: bool = False  # fails after the first piece
    endless: bool = False  # generates until stopped
    reasoning: bool = False  # a remote upstream: the pieces are its reasoning, the answer a short "ok"
    unfinished: bool = False  # ends without a finish reason
    vectors: Any = None  # a remote upstream's embeddings answer in place of a good one (garbage)
    requests: int = 0
    sent: dict[str, Any] = field(default_factory=dict)  # the last request a remote upstream was sent
    stopped: threading.Event = field(default_factory=threading.Event)  # an endless generation was stopped


class Upstream:
    """An OpenAI-compatible server playing a Script: a chat completion, or its chunks."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def __call__(self, request: httpx.Request) -> httpx.Response:
        script, body = self.script, json.loads(request.content)
        script.requests, script.sent = script.requests + 1, body
        if script.dead:
            return httpx.Response(503, json={"error": {"message": "down", "type": "unavailable"}})
        if request.url.path.endswith("/embeddings"):
            return self._embeddings(body)
        named = body.get("tool_choice") is not None
        logprobs = bool(body.get("logprobs"))
        usage = {"prompt_tokens": 5, "completion_tokens": len(script.pieces), "total_tokens": 5 + len(script.pieces)}
        if "prompt" in body:
            return self._completion(body, usage)
        if not body.get("stream"):
            text = "".join(script.pieces)
            message: dict[str, Any] = {"role": "assistant", "content": None if named else text}
            if script.reasoning:
                message.update(content="ok", reasoning_content=text)
            if named:
                message["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"name": "mail", "arguments": text}}]
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": None if script.unfinished else "stop"}
            if logprobs:
                choice["logprobs"] = {"content": [_logprob(p) for p in script.pieces]}
            return httpx.Response(200, json={"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                                             "choices": [choice], "usage": usage})
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._chunks(named, logprobs, usage if include_usage else None))

    def _embeddings(self, body: dict[str, Any]) -> httpx.Response:
        script = self.script
        if script.endless:
            return httpx.Response(200, headers={"content-type": "application/json"}, content=self._never())
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [{"object": "embedding", "index": i, "embedding": [0.6, 0.8]} for i in range(len(inputs))]
        answer = {"object": "list", "data": data, "model": "up", "usage": {"prompt_tokens": 7, "total_tokens": 7}}
        return httpx.Response(200, json=answer if script.vectors is None else script.vectors)

    async def _never(self) -> AsyncIterator[bytes]:
        """An answer that never comes, until the gateway hangs up."""
        try:
            yield b"{"
            await asyncio.Event().wait()
        finally:
            self.script.stopped.set()

    def _completion(self, body: dict[str, Any], usage: dict[str, int]) -> httpx.Response:
        pieces = self.script.pieces
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(pieces), "finish_reason": "stop"}
            return httpx.Response(200, json={"id": "k", "object": "text_completion", "created": 1, "model": "m",
                                             "choices": [choice], "usage": usage})
        events = [_event({"id": "k", "object": "text_completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "text": piece, "finish_reason": "stop" if i == len(pieces) - 1 else None}]})
            for i, piece in enumerate(pieces)]
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=b"".join(events) + b"data: [DONE]\n\n")

    async def _chunks(self, named: bool, logprobs: bool, usage: dict[str, int] | None) -> AsyncIterator[bytes]:
        script = self.script
        try:
            for i, piece in enumerate(script.pieces if not script.endless else iter(lambda: "x", None)):
                if script.fail_mid and i == 1:
                    raise httpx.ReadError("connection reset by peer")
                delta: dict[str, Any] = {"reasoning_content": piece} if script.reasoning else {"content": piece}
                if named:
                    call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
                    if i == 0:
                        call.update(id="call_1", type="function", function={"name": "mail", "arguments": piece})
                    delta = {"tool_calls": [call]}
                last = not script.endless and not script.unfinished and i == len(script.pieces) - 1
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
                if logprobs:
                    choice["logprobs"] = {"content": [_logprob(piece)]}
                yield _event({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]})
                await asyncio.sleep(0.01 if script.endless else 0)
            if usage is not None:
                yield _event({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                              "usage": usage})
            yield b"data: [DONE]\n\n"
        finally:
            if script.endless:
                script.stopped.set()


async def aenumerate(items: AsyncIterator[Any]) -> AsyncIterator[tuple[int, Any]]:
    step = 0
    async for item in items:
        yield step, item
        step += 1


def _logprob(piece: str) -> dict[str, Any]:
    return {"token": piece, "logprob": -0.5, "bytes": list(piece.encode()), "top_logprobs": []}


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class Engine(FakeEngine):
    """The engine's test double playing a Script."""

    def __init__(self, script: Script) -> None:
        super().__init__(max_model_len=100_000)
        self.script = script

    async def generate(self, request: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        script = self.script
        script.requests += 1
        pieces = script.pieces[: request.sampling.max_tokens]  # an engine keeps to max_tokens
        self.dead, self.reply = script.dead, None if script.endless else pieces
        self.last_finish = "length" if len(pieces) < len(script.pieces) else "stop"
        if script.unfinished:
            self.last_finish = None  # type: ignore[assignment]
        self.delay = 0.01 if script.endless else 0.0
        try:
            async for step, output in aenumerate(super().generate(request)):
                if script.fail_mid and step == 1:
                    raise RuntimeError("the engine failed")
                yield output
        finally:
            if script.endless and self.aborted:
                script.stopped.set()


class Embedder(FakeEngine):
    """The engine's test double as an embedding model playing a Script."""

    def __init__(self, script: Script) -> None:
        super().__init__(task="embed")
        self.script = script

    async def embed(self, request: Any) -> Any:
        self.script.requests += 1
        self.dead = self.script.dead
        if self.script.endless:
            try:
                await asyncio.Event().wait()
            finally:
                self.script.stopped.set()
        return await super().embed(request)


@dataclass
class Side:
    model: str
    script: Script
    settings: dict[str, Any]
    engine: Engine


@pytest.fixture(params=["embedded", "remote"])
def side(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Side]:
    script = Script()
    engine = Engine(script) if "embed" not in request.fixturenames else Embedder(script)
    guards = tmp_path / "guards.yaml"
    guards.write_text(GUARDS)
    settings: dict[str, Any] = {"guards_file": guards, "max_output_tokens_per_request": 100}
    if request.param == "embedded":
        yield Side("fake-model", script, settings, engine)
        return
    with scripted(Upstream(script)) as base:
        models = tmp_path / "models.yaml"
        models.write_text(f"models: [{{name: far, kind: remote, url: '{base}/v1', upstream_model: up}}]")
        yield Side("far", script, {**settings, "models_file": models}, engine)


@pytest.fixture
def client(side: Side) -> Iterator[TestClient]:
    app = create_app(fake_settings(**side.settings), engine_starter=lambda es: side.engine)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def post(client: TestClient, side: Side, **body: Any) -> httpx.Response:
    body = {"model": side.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, **body}
    return client.post("/v1/chat/completions", json=body)


def chunks(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]


def said(answer: httpx.Response, stream: bool) -> tuple[str, str]:
    """(content, the tool call's arguments) of the first choice, joined across a stream's chunks."""
    parts = [c["choices"][0].get("delta" if stream else "message") or {} for c in
             (chunks(answer.text) if stream else [answer.json()]) if c.get("choices")]
    content = "".join(p.get("content") or "" for p in parts)
    arguments = "".join(call["function"].get("arguments") or "" for p in parts for call in p.get("tool_calls") or ())
    return content, arguments


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


GUARDED = [  # (the script's pieces, the request's fields, what the answer says: content, arguments)
    ("content", EMAIL, {}, ("Ask [EMAIL] now", "")),
    ("named tool", ARGUMENTS, {"tools": TOOLS, "tool_choice": NAMED}, ("", '{"to": "[EMAIL]"}')),
    ("structured", ARGUMENTS, {"response_format": {"type": "json_object"}}, ('{"to": "[EMAIL]"}', "")),
    ("logprobs", EMAIL, {"logprobs": True}, ("Ask [EMAIL] now", "")),
    ("named tool, logprobs", ARGUMENTS, {"tools": TOOLS, "tool_choice": NAMED, "logprobs": True}, ("", '{"to": "[EMAIL]"}')),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("pieces", "fields", "expected"), [case[1:] for case in GUARDED], ids=[c[0] for c in GUARDED])
def test_the_output_guard_reads_every_field(client: TestClient, side: Side, stream: bool, pieces: list[str],
                                            fields: dict[str, Any], expected: tuple[str, str]) -> None:
    side.script.pieces = pieces
    answer = post(client, side, stream=stream, **fields)
    assert answer.status_code == 200, answer.text
    assert "eve@" not in answer.text
    assert "evil.example" not in answer.text  # nor in a logprob's token
    assert said(answer, stream) == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_output_guard_reads_a_completions_text(client: TestClient, side: Side, stream: bool) -> None:
    side.script.pieces = EMAIL
    answer = client.post("/v1/completions", json={"model": side.model, "prompt": "hi", "max_tokens": 20, "stream": stream})
    assert answer.status_code == 200, answer.text
    assert "eve@" not in answer.text
    text = "".join(c["choices"][0]["text"] for c in chunks(answer.text) if c["choices"]) if stream else answer.json()["choices"][0]["text"]
    assert text == "Ask [EMAIL] now"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_output_guard_reads_a_remote_models_reasoning(client: TestClient, side: Side, stream: bool) -> None:
    """A remote upstream's reasoning (the engine makes none apart from its text) has a window of its own."""
    if side.model != "far":
        pytest.skip("the engine's reasoning is its text")
    side.script.pieces, side.script.reasoning = EMAIL, True
    answer = post(client, side, stream=stream)
    assert answer.status_code == 200, answer.text
    assert "eve@" not in answer.text
    parts = [c["choices"][0]["delta"] for c in chunks(answer.text) if c["choices"]] if stream else [answer.json()["choices"][0]["message"]]
    assert "".join(p.get("reasoning_content") or "" for p in parts) == "Ask [EMAIL] now"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_blocked_match_cuts_the_answer(client: TestClient, side: Side, stream: bool) -> None:
    side.script.pieces = ["Our plan is Hy", "dra and", " more"]
    answer = post(client, side, stream=stream)
    assert answer.status_code == 200
    assert "ydra" not in answer.text
    assert "content_filter" in answer.text
    assert said(answer, stream)[0].startswith("Our plan is")


def test_the_output_bound_holds(client: TestClient, side: Side) -> None:
    answer = post(client, side, max_tokens=60, n=2)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "max_tokens"
    assert side.script.requests == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_what_the_guard_holds_back_is_passed_on_when_a_backend_ends_without_finishing(
        client: TestClient, side: Side, stream: bool) -> None:
    side.script.pieces, side.script.unfinished = EMAIL, True
    answer = post(client, side, stream=stream)
    assert answer.status_code == 200
    assert said(answer, stream) == ("Ask [EMAIL] now", "")
    assert "eve@" not in answer.text


def test_a_cached_remote_answer_replayed_keeps_its_reasoning(side: Side) -> None:
    if side.model != "far":
        pytest.skip("the engine's reasoning is its text")
    side.script.reasoning = True
    with silent(side, cache={"backend": "memory"}) as client:
        assert post(client, side, temperature=0).headers["x-cache"] == "MISS"
        replayed = post(client, side, temperature=0, stream=True)
    assert replayed.headers["x-cache"] == "HIT"
    parts = [c["choices"][0]["delta"] for c in chunks(replayed.text) if c["choices"]]
    assert "".join(p.get("reasoning_content") or "" for p in parts) == "Hello there you"


def silent(side: Side, **settings: Any) -> TestClient:
    """A client of a gateway with these settings, for requests silent on max_tokens."""
    return TestClient(create_app(fake_settings(**{**side.settings, **settings}), engine_starter=lambda es: side.engine))


def test_a_request_silent_on_max_tokens_is_bounded_by_the_default_before_the_backend(side: Side) -> None:
    with silent(side, default_max_tokens=60) as client:
        answer = client.post("/v1/chat/completions", json={"model": side.model, "messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert answer.status_code == 400  # 2 x 60 past the 100 a request may generate
    assert answer.json()["error"]["param"] == "max_tokens"
    assert side.script.requests == 0


def test_a_request_silent_on_max_tokens_runs_with_the_default(side: Side) -> None:
    """The engine keeps to it; an upstream that goes past what it was sent is cut there."""
    with silent(side, default_max_tokens=2) as client:
        body = {"model": side.model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert said(answer, stream=True)[0] == "Hello there"
    assert [c["choices"][0].get("finish_reason") for c in chunks(answer.text) if c["choices"]][-1] == "length"
    sent = side.script.sent.get("max_tokens") if side.model == "far" else side.engine.requests[-1].sampling.max_tokens
    assert sent == 2


def test_a_remote_stream_without_a_budget_is_cut_at_the_gateways_bound(side: Side) -> None:
    """Nothing to forward (no default): the upstream is asked for its share of the bound, and cut past it
    (this one goes on regardless)."""
    if side.model != "far":
        pytest.skip("the engine's budget is what the context leaves, checked before it starts")
    side.script.endless = True
    with silent(side, max_output_tokens_per_request=4) as client:
        body = {"model": side.model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert side.script.sent["max_tokens"] == 4
    assert said(answer, stream=True)[0] == "xxxx"
    assert [c["choices"][0].get("finish_reason") for c in chunks(answer.text) if c["choices"]][-1] == "length"
    assert side.script.stopped.wait(5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_usage_is_the_backends_and_counted(client: TestClient, side: Side, stream: bool) -> None:
    before = metric("gateway_completion_tokens_total", model=side.model)
    answer = post(client, side, stream=stream, stream_options={"include_usage": True} if stream else None)
    assert answer.status_code == 200
    usage = chunks(answer.text)[-1]["usage"] if stream else answer.json()["usage"]
    assert usage["completion_tokens"] == 3
    assert metric("gateway_completion_tokens_total", model=side.model) == before + 3
    assert metric("gateway_requests_in_flight", model=side.model) == 0


def test_a_backend_down_before_the_first_byte_is_a_503(client: TestClient, side: Side) -> None:
    side.script.dead = True
    for stream in (False, True):
        answer = post(client, side, stream=stream)
        assert answer.status_code == 503
        assert "error" in answer.json()


def test_an_upstream_down_before_answering_counts_no_tokens(client: TestClient, side: Side) -> None:
    """Its prompt was only estimated, never read: the request is not charged for it."""
    if side.model != "far":
        pytest.skip("the engine read the prompt (its tokens count)")
    side.script.dead = True
    with structlog.testing.capture_logs() as logs:
        answer = post(client, side, messages=[{"role": "user", "content": "x" * 4000}])
    assert answer.status_code == 503
    line = next(log for log in logs if log["event"] == "request")
    assert line.get("prompt_tokens") is None
    assert line.get("completion_tokens") is None


def test_a_failure_mid_stream_ends_it_with_an_error_event(client: TestClient, side: Side) -> None:
    side.script.fail_mid = True
    side.script.pieces = ["A first piece longer than the holdback", " then more"]
    answer = post(client, side, stream=True)
    assert answer.status_code == 200
    assert "error" in chunks(answer.text)[-1]
    assert answer.text.endswith("data: [DONE]\n\n")
    assert metric("gateway_requests_in_flight", model=side.model) == 0


async def test_a_client_that_leaves_mid_stream_stops_the_generation(side: Side) -> None:
    side.script.endless = True
    # at once: no grace for a reconnect (a resumable stream's grace is test_resume's)
    app = create_app(fake_settings(**side.settings, streams={"grace_s": 0}), engine_starter=lambda es: side.engine)
    body = {"model": side.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 90, "stream": True}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        sent = await drive(with_state, body, disconnect_after_chunks=3)
        assert sent[0]["status"] == 200
        assert await asyncio.to_thread(side.script.stopped.wait, 5)  # the upstream's server runs in a thread
    assert metric("gateway_requests_in_flight", model=side.model) == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_access_line_and_the_keys_usage(client: TestClient, side: Side, stream: bool) -> None:
    side.script.pieces = EMAIL
    before = metric("gateway_key_completion_tokens_total", key="anonymous", team="")
    with structlog.testing.capture_logs() as logs:
        answer = post(client, side, stream=stream, stream_options={"include_usage": True} if stream else None)
    assert answer.status_code == 200
    line = next(log for log in logs if log["event"] == "request")
    assert line["model"] == side.model
    assert (line["prompt_tokens"], line["completion_tokens"]) == (5 if side.model == "far" else line["prompt_tokens"], 3)
    assert line["ttft_s"] is not None
    assert line["guards"] == ["output:pii.email:redact"]
    assert metric("gateway_key_completion_tokens_total", key="anonymous", team="") == before + 3


async def test_a_client_that_leaves_mid_stream_gives_back_its_permit_and_settles(side: Side) -> None:
    side.script.endless = True
    settings = {**side.settings, "rate_limit_tpm": 10_000, "streams": {"grace_s": 0}}  # no grace for a reconnect
    app = create_app(fake_settings(**settings), engine_starter=lambda es: side.engine)
    body = {"model": side.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 90, "stream": True}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        gateway = state["gateway"]
        before = metric("gateway_key_completion_tokens_total", key="anonymous", team="")
        with structlog.testing.capture_logs() as logs:
            sent = await drive(with_state, body, disconnect_after_chunks=3)
        assert sent[0]["status"] == 200
        assert await asyncio.to_thread(side.script.stopped.wait, 5)
        assert gateway.models.backends[side.model].admission.running == 0
        line = next(log for log in logs if log["event"] == "request")
        assert line["disconnected"] is True
        assert line["model"] == side.model
        # what was generated before the client left is its usage (the access line's, the key's budget)
        assert line["prompt_tokens"] > 0
        assert line["completion_tokens"] > 0
        assert metric("gateway_key_completion_tokens_total", key="anonymous", team="") == before + line["completion_tokens"]


def test_a_remote_whole_answer_times_no_output_tokens(client: TestClient, side: Side) -> None:
    """A whole answer arrives at one time: it has no time per output token to observe (a zero would
    drag the histogram down), though a stream of the same model has."""
    count = "gateway_time_per_output_token_seconds_count"
    before = metric(count, model=side.model)
    assert post(client, side).status_code == 200
    if side.model == "far":
        assert metric(count, model=side.model) == before
    assert post(client, side, stream=True).status_code == 200
    assert metric(count, model=side.model) > before


@pytest.fixture
def embed() -> None:
    """The side's engine is an embedding model."""


def embeddings(client: TestClient, side: Side, **body: Any) -> httpx.Response:
    return client.post("/v1/embeddings", json={"model": side.model, "input": ["one", "two words"], **body})


@pytest.mark.usefixtures("embed")
def test_embeddings_and_their_usage_are_counted(client: TestClient, side: Side) -> None:
    before = metric("gateway_prompt_tokens_total", model=side.model)
    with structlog.testing.capture_logs() as logs:
        answer = embeddings(client, side)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["model"] == side.model
    assert [item["index"] for item in body["data"]] == [0, 1]
    tokens = body["usage"]["prompt_tokens"]
    assert tokens == (7 if side.model == "far" else 3)  # the upstream's count; the engine's tokens
    assert metric("gateway_prompt_tokens_total", model=side.model) == before + tokens
    assert metric("gateway_requests_in_flight", model=side.model) == 0
    line = next(log for log in logs if log["event"] == "request")
    assert line["prompt_tokens"] == tokens


@pytest.mark.usefixtures("embed")
def test_embeddings_as_base64_from_either_backend(client: TestClient, side: Side) -> None:
    answer = embeddings(client, side, encoding_format="base64")
    assert answer.status_code == 200, answer.text
    assert all(isinstance(item["embedding"], str) for item in answer.json()["data"])


@pytest.mark.usefixtures("embed")
def test_an_embedding_backend_down_is_a_503(client: TestClient, side: Side) -> None:
    side.script.dead = True
    answer = embeddings(client, side)
    assert answer.status_code == 503
    assert answer.json()["error"]["type"]


GARBAGE = [  # a remote upstream's embeddings answer that is not OpenAI's
    ("not a list", {"data": "x"}),
    ("an index twice", {"data": [{"index": 0, "embedding": [1.0]}, {"index": 0, "embedding": [1.0]}]}),
    ("an index past the inputs", {"data": [{"index": 0, "embedding": [1.0]}, {"index": 2, "embedding": [1.0]}]}),
    ("a vector short of the inputs", {"data": [{"index": 0, "embedding": [1.0]}]}),
    ("a negative usage", {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1.0]}],
                          "usage": {"prompt_tokens": -5}}),
]


@pytest.mark.usefixtures("embed")
@pytest.mark.parametrize("garbage", [g for _, g in GARBAGE], ids=[name for name, _ in GARBAGE])
def test_an_upstreams_garbage_embeddings_are_a_502_in_openais_shape(client: TestClient, side: Side, garbage: Any) -> None:
    if side.model != "far":
        pytest.skip("the engine's vectors are typed already")
    side.script.vectors = garbage
    answer = embeddings(client, side)
    assert answer.status_code == 502
    assert set(answer.json()["error"]) >= {"message", "type", "param", "code"}


@pytest.mark.usefixtures("embed")
async def test_a_client_that_leaves_stops_its_embeddings(side: Side) -> None:
    side.script.endless = True
    app = create_app(fake_settings(**side.settings), engine_starter=lambda es: side.engine)
    body = {"model": side.model, "input": "hi"}
    async with app.router.lifespan_context(app) as state:
        async def with_state(scope: Any, receive: Any, send: Any) -> None:
            scope["state"] = dict(state)
            await app(scope, receive, send)

        await drive(with_state, body, disconnect_after_chunks=None, path="/v1/embeddings")
        assert await asyncio.to_thread(side.script.stopped.wait, 5)
        assert state["gateway"].models.backends[side.model].admission.running == 0
    assert metric("gateway_requests_in_flight", model=side.model) == 0


def test_a_remote_whole_answer_without_a_budget_asks_for_the_gateways_bound(side: Side) -> None:
    """Nothing to forward (no default): the upstream is asked for the bound (each choice's share), which it
    keeps to (a whole answer has no token count to cut it by before its usage)."""
    if side.model != "far":
        pytest.skip("the engine's budget is what the context leaves, checked before it starts")
    with silent(side, max_output_tokens_per_request=9) as client:
        body = {"model": side.model, "messages": [{"role": "user", "content": "hi"}]}
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert side.script.sent["max_tokens"] == 9


@pytest.mark.parametrize("stream", [False, True])
def test_a_keys_fair_share_counts_the_prompt_as_the_backend_counted_it(client: TestClient, side: Side, stream: bool) -> None:
    """A remote prompt is estimated (its characters) to be admitted; the key's counter (`tenancy.fairness`)
    takes the count the answer's usage gives once it is in: an estimate a prompt can fool (text that is
    more tokens than characters say, parts not read) does not stay the key's service."""
    from gateway.tenancy.fairness import VirtualTokenCounter
    from gateway.tenancy.keys import ANONYMOUS

    admission = client.app_state["gateway"].models.backends[side.model].admission
    vtc, weights = admission.fairness, admission.settings.fairness
    assert isinstance(vtc, VirtualTokenCounter)
    answer = post(client, side, messages=[{"role": "user", "content": "word " * 400}], stream=stream,
                  stream_options={"include_usage": True} if stream else None)
    assert answer.status_code == 200, answer.text
    usage = chunks(answer.text)[-1]["usage"] if stream else answer.json()["usage"]
    expected = weights.input_weight * usage["prompt_tokens"] + weights.output_weight * usage["completion_tokens"]
    assert vtc.counter(ANONYMOUS) == pytest.approx(expected)
