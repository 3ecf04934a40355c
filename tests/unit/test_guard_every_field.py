"""The output guard on every field that carries model text, table-driven: each way a model produces
text (content, reasoning, tool-call arguments from auto parsing, a named or required tool choice and
structured output, logprobs with their alternatives) on each API (chat, completions, Responses,
Messages; the native API's text), on either backend (embedded: the engine's double; remote: a scripted upstream over real
HTTP), whole and streamed, however the answer leaves (directly, a cached replay, a stored response,
a batch's output line). One profile redacts emails on the way out; the model's email must leave by
no field. The remote side is skipped where an API serves embedded models only (Responses, Messages)
and for reasoning on the engine (its reasoning is its text)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from tests.fakes import FakeEngine, fake_settings
from tests.scripted_upstream import scripted
from tests.unit.test_batches import jsonl, lines_of, submit, wait
from tests.unit.test_responses import sdk_for
from tests.waits import until_sync

GUARDS = """
default: out
profiles:
  out:
    output: {pii: {email: redact}, holdback_chars: 16}
"""
LEAKS = ("eve@", "evil.example")  # any piece of the model's email, in any field
TEXT = ["Ask eve@", "evil.example", " now"]
ARGUMENTS = ['{"to": "eve@', 'evil.example', '"}']
TAGGED = ['<tool_call>{"name": "mail", "arguments": {"to": "eve@', 'evil.example"}}</tool_call>']
CALLS = ['[{"name": "mail", "parameters": {"to": "eve@', 'evil.example"}}]']
ALTERNATIVE = "eve@evil.example"  # what a logprob's alternatives offer in the email's place
SCHEMA = {"type": "object", "properties": {"to": {"type": "string"}}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "mail", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "mail", "parameters": SCHEMA}]
MESSAGES_TOOLS = [{"name": "mail", "input_schema": SCHEMA}]
HI = [{"role": "user", "content": "write to eve"}]
CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"


@dataclass(frozen=True)
class Way:
    """One way a model produces text on one route: what the engine writes, and what a remote upstream
    answers (the field it fills and its pieces; None: the route serves embedded models only)."""

    route: str
    body: dict[str, Any]
    engine: list[str] | None
    upstream: tuple[str, list[str]] | None
    alternatives: bool = False  # the logprobs' alternatives offer the email


WAYS = {
    "chat content": Way(CHAT, {"messages": HI}, TEXT, ("content", TEXT)),
    "chat reasoning": Way(CHAT, {"messages": HI}, None, ("reasoning_content", TEXT)),
    "chat auto tool call": Way(CHAT, {"messages": HI, "tools": CHAT_TOOLS}, TAGGED, ("tool_calls", ARGUMENTS)),
    "chat named tool call": Way(CHAT, {"messages": HI, "tools": CHAT_TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "mail"}}}, ARGUMENTS, ("tool_calls", ARGUMENTS)),
    "chat required tool call": Way(CHAT, {"messages": HI, "tools": CHAT_TOOLS, "tool_choice": "required"}, CALLS,
                                   ("tool_calls", ARGUMENTS)),
    "chat json object": Way(CHAT, {"messages": HI, "response_format": {"type": "json_object"}}, ARGUMENTS,
                            ("content", ARGUMENTS)),
    "chat json schema": Way(CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "mail", "schema": SCHEMA}}}, ARGUMENTS, ("content", ARGUMENTS)),
    "chat logprobs": Way(CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 3}, TEXT, ("content", TEXT), True),
    "chat named tool call, logprobs": Way(CHAT, {"messages": HI, "tools": CHAT_TOOLS, "logprobs": True, "top_logprobs": 3,
                                                 "tool_choice": {"type": "function", "function": {"name": "mail"}}},
                                          ARGUMENTS, ("tool_calls", ARGUMENTS), True),
    "completions text": Way(COMPLETIONS, {"prompt": "write to eve"}, TEXT, ("text", TEXT)),
    "completions logprobs": Way(COMPLETIONS, {"prompt": "write to eve", "logprobs": 3}, TEXT, ("text", TEXT), True),
    "responses text": Way(RESPONSES, {"input": "write to eve"}, TEXT, None),
    "responses auto function call": Way(RESPONSES, {"input": "write to eve", "tools": RESPONSES_TOOLS}, TAGGED, None),
    "responses named function call": Way(RESPONSES, {"input": "write to eve", "tools": RESPONSES_TOOLS, "tool_choice": {
        "type": "function", "name": "mail"}}, ARGUMENTS, None),
    "responses required function call": Way(RESPONSES, {"input": "write to eve", "tools": RESPONSES_TOOLS,
                                                        "tool_choice": "required"}, CALLS, None),
    "responses json schema": Way(RESPONSES, {"input": "write to eve", "text": {"format": {
        "type": "json_schema", "name": "mail", "schema": SCHEMA}}}, ARGUMENTS, None),
    "messages text": Way(MESSAGES, {"messages": HI}, TEXT, None),
    "messages auto tool use": Way(MESSAGES, {"messages": HI, "tools": MESSAGES_TOOLS}, TAGGED, None),
    "messages named tool use": Way(MESSAGES, {"messages": HI, "tools": MESSAGES_TOOLS, "tool_choice": {
        "type": "tool", "name": "mail"}}, ARGUMENTS, None),
    "messages any tool use": Way(MESSAGES, {"messages": HI, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "any"}},
                                 CALLS, None),
}


@dataclass
class Upstream:
    """An OpenAI-compatible server answering every request with `pieces` in the field `kind` (a chat message's
    content, reasoning or one tool call's arguments; a completion's text), logprobs when asked."""

    kind: str = "content"
    pieces: list[str] = field(default_factory=list)
    alternatives: bool = False

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        usage = {"prompt_tokens": 5, "completion_tokens": len(self.pieces), "total_tokens": 5 + len(self.pieces)}
        if not body.get("stream"):
            choice = self._choice(0, "".join(self.pieces), "stop", whole=True, logprobs=body.get("logprobs"))
            choice["logprobs"] = self._logprobs(self.pieces) if body.get("logprobs") else None
            kind = "text_completion" if self.kind == "text" else "chat.completion"
            return httpx.Response(200, json={"id": "u", "object": kind, "created": 1, "model": "up", "choices": [choice],
                                             "usage": usage})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._events(bool(body.get("logprobs")), usage))

    def _choice(self, step: int, piece: str, finish: str | None, whole: bool, logprobs: Any) -> dict[str, Any]:
        if self.kind == "text":
            return {"index": 0, "text": piece, "finish_reason": finish}
        if self.kind == "tool_calls":
            call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
            if step == 0:
                call.update(id="call_1", type="function", function={"name": "mail", "arguments": piece})
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            message = {"role": "assistant", self.kind: piece}
        return {"index": 0, "message" if whole else "delta": message, "finish_reason": finish}

    def _logprobs(self, pieces: list[str]) -> dict[str, Any]:
        offered = [ALTERNATIVE] if self.alternatives else []
        if self.kind == "text":
            return {"tokens": pieces, "token_logprobs": [-0.5] * len(pieces), "text_offset": [0] * len(pieces),
                    "top_logprobs": [{piece: -0.5, **dict.fromkeys(offered, -2.0)} for piece in pieces]}
        return {"content": [{"token": piece, "logprob": -0.5, "bytes": list(piece.encode()), "top_logprobs": [
            {"token": other, "logprob": -2.0, "bytes": list(other.encode())} for other in [piece, *offered]]}
            for piece in pieces]}

    async def _events(self, logprobs: bool, usage: dict[str, int]) -> AsyncIterator[bytes]:
        kind = "text_completion" if self.kind == "text" else "chat.completion.chunk"
        for step, piece in enumerate(self.pieces):
            choice = self._choice(step, piece, "stop" if step == len(self.pieces) - 1 else None, False, logprobs)
            if logprobs:
                choice["logprobs"] = self._logprobs([piece])
            yield _event({"id": "u", "object": kind, "created": 1, "model": "up", "choices": [choice]})
        yield _event({"id": "u", "object": kind, "created": 1, "model": "up", "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@dataclass
class Side:
    """A gateway on one backend: its model's name, the engine's double, the upstream's script."""

    model: str
    engine: FakeEngine
    upstream: Upstream
    settings: dict[str, Any]

    def play(self, way: Way) -> None:
        if self.model == "far":
            if way.upstream is None:
                pytest.skip(f"{way.route} serves embedded models only")
            self.upstream.kind, self.upstream.pieces = way.upstream
            self.upstream.alternatives = way.alternatives
            return
        if way.engine is None:
            pytest.skip("the engine's reasoning is its text")
        self.engine.reply = way.engine
        self.engine.alternatives = {0: [ALTERNATIVE]} if way.alternatives else {}

    def client(self, **settings: Any) -> TestClient:
        app = create_app(fake_settings(**{**self.settings, **settings}), engine_starter=lambda es: self.engine)
        return TestClient(app)

    def body(self, way: Way, stream: bool, **extra: Any) -> dict[str, Any]:
        budget = {"max_tokens": 40} if way.route in (CHAT, COMPLETIONS, MESSAGES) else {"max_output_tokens": 40}
        return {"model": self.model, **budget, **way.body, "stream": stream, **extra}


@pytest.fixture(params=["embedded", "remote"])
def side(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Side]:
    guards = tmp_path / "guards.yaml"
    guards.write_text(GUARDS)
    settings: dict[str, Any] = {"guards_file": guards, "files": {"dir": tmp_path / "files"},
                                "batches": {"dir": tmp_path / "batches", "poll_s": 0.05, "retry_s": 0.1}}
    engine, upstream = FakeEngine(max_model_len=1000), Upstream()
    if request.param == "embedded":
        yield Side("fake-model", engine, upstream, settings)
        return
    with scripted(upstream) as base:
        models = tmp_path / "models.yaml"
        models.write_text(f"models: [{{name: far, kind: remote, url: '{base}/v1', upstream_model: up}}]")
        yield Side("far", engine, upstream, {**settings, "models_file": models})


def assert_guarded(text: str) -> None:
    """No piece of the model's email in the answer, in any field, and the placeholder in its place."""
    for leak in LEAKS:
        assert leak not in text, text
    assert "[EMAIL]" in text, text


def answered(client: TestClient, route: str, body: dict[str, Any]) -> httpx.Response:
    answer = client.post(route, json=body)
    assert answer.status_code == 200, answer.text
    return answer


ways = pytest.mark.parametrize("way", list(WAYS.values()), ids=list(WAYS))
streams = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])


@ways
@streams
def test_every_field_is_guarded(side: Side, way: Way, stream: bool) -> None:
    side.play(way)
    with side.client() as client:
        assert_guarded(answered(client, way.route, side.body(way, stream)).text)


@ways
@streams
def test_a_cached_replay_is_the_guarded_answer(side: Side, way: Way, stream: bool) -> None:
    """Stored as it was guarded, replayed whole or as a stream (the same request, the other form too)."""
    side.play(way)
    with side.client(cache={"backend": "memory"}) as client:
        first = answered(client, way.route, side.body(way, stream, temperature=0))
        assert first.headers["x-cache"] == "MISS"
        for again in (stream, not stream):
            replayed = answered(client, way.route, side.body(way, again, temperature=0))
            if again == stream:
                assert replayed.headers["x-cache"] == "HIT"
            assert_guarded(replayed.text)


@pytest.mark.parametrize("way", [w for w in WAYS.values() if w.route == RESPONSES],
                         ids=[name for name, w in WAYS.items() if w.route == RESPONSES])
@pytest.mark.parametrize("run", ["whole", "stream", "background"])
def test_a_stored_response_is_the_guarded_answer(side: Side, way: Way, run: str) -> None:
    side.play(way)
    with side.client() as client:
        answer = answered(client, RESPONSES, side.body(way, run == "stream", store=True, background=run == "background"))
        ids = [json.loads(line[6:]).get("response", {}).get("id") for line in answer.text.splitlines()
               if line.startswith("data: {")] if run == "stream" else [answer.json()["id"]]
        path = f"{RESPONSES}/{next(i for i in ids if i)}"
        until_sync(lambda: client.get(path).json()["status"] not in ("queued", "in_progress"), what="the response done")
        stored = client.get(path)
    assert stored.status_code == 200
    assert_guarded(stored.text)


BATCHED = [name for name, w in WAYS.items() if w.route != MESSAGES]  # Messages have their own batches (below)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, RESPONSES])
def test_a_batchs_output_lines_are_guarded(side: Side, route: str) -> None:
    """Every way of the route, one line each, answered in the batch lane (whole answers)."""
    names = [n for n in BATCHED if WAYS[n].route == route and (WAYS[n].upstream if side.model == "far" else WAYS[n].engine)]
    if not names:
        pytest.skip(f"{route} serves embedded models only")
    with side.client() as client:
        sdk = sdk_for(client)
        for name in names:
            way = WAYS[name]
            side.play(way)
            line = {"custom_id": name, "method": "POST", "url": route, "body": side.body(way, False)}
            done = wait(sdk, submit(sdk, jsonl(line), route).id)
            [result] = lines_of(sdk, done.output_file_id) + lines_of(sdk, done.error_file_id)
            assert result["response"]["status_code"] == 200, (name, result)
            assert_guarded(json.dumps(result))


@pytest.mark.parametrize("name", [n for n, w in WAYS.items() if w.route == MESSAGES])
def test_a_message_batchs_results_are_guarded(side: Side, name: str) -> None:
    way = WAYS[name]
    if side.model == "far":
        pytest.skip(f"{MESSAGES} serves embedded models only")
    side.play(way)
    with side.client() as client:
        made = answered(client, "/v1/messages/batches", {"requests": [{"custom_id": "m", "params": side.body(way, False)}]})
        batch_id = made.json()["id"]
        until_sync(lambda: client.get(f"/v1/messages/batches/{batch_id}").json()["processing_status"] == "ended",
                   what="the message batch ended")
        results = client.get(f"/v1/messages/batches/{batch_id}/results")
    assert results.status_code == 200
    assert '"succeeded"' in results.text, results.text
    assert_guarded(results.text)


NATIVE = [  # the native API's routes (embedded models only): a completion's text, or a chat's
    ("/generate", {"prompt": "write to eve"}),
    ("/stream-generate", {"prompt": "write to eve"}),
    ("/chat", {"messages": HI}),
    ("/chat", {"messages": HI, "stream": True}),
]


@pytest.mark.parametrize(("route", "body"), NATIVE, ids=[f"{r}{' stream' if b.get('stream') else ''}" for r, b in NATIVE])
def test_the_native_apis_text_is_guarded(side: Side, route: str, body: dict[str, Any]) -> None:
    if side.model == "far":
        pytest.skip("the native API serves embedded models only")
    side.play(WAYS["chat content"])
    with side.client() as client:
        assert_guarded(answered(client, route, {"model": side.model, "max_tokens": 40, **body}).text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("down", ["embedded", "remote"])
def test_a_fallback_answers_under_its_own_profile(tmp_path: Path, down: str, stream: bool) -> None:
    """The model asked for has no profile and is down; the fallback that answers has one: its answer
    is guarded as when it is asked for itself (the profile of the model that answers)."""
    engine, upstream = FakeEngine(max_model_len=1000), Upstream("content", TEXT)
    engine.reply, engine.dead = TEXT, down == "embedded"
    guards = "guards: {output: {pii: {email: redact}}}"
    with scripted(lambda request: httpx.Response(503) if down == "remote" else upstream(request)) as base:
        remote = f"name: far, kind: remote, url: '{base}/v1', upstream_model: up"
        embedded = "name: fake-model"
        if down == "embedded":  # the engine down, its fallback remote and guarded
            listed = f"{{{embedded}, fallback: [far]}}, {{{remote}, {guards}}}"
        else:  # the upstream down, its fallback the engine, guarded
            listed = f"{{{embedded}, {guards}}}, {{{remote}, fallback: [fake-model]}}"
        models = tmp_path / "models.yaml"
        models.write_text(f"models: [{listed}]")
        app = create_app(fake_settings(models_file=models), engine_starter=lambda es: engine)
        with TestClient(app) as client:
            asked = "fake-model" if down == "embedded" else "far"
            answer = answered(client, CHAT, {"model": asked, "max_tokens": 40, "messages": HI, "stream": stream})
    assert answer.headers["x-served-model"] == ("far" if down == "embedded" else "fake-model")
    assert_guarded(answer.text)


@pytest.mark.parametrize("asked", ["far", "far@1.0.0", "far@2.0.0"])
def test_a_version_answers_under_its_own_profile(tmp_path: Path, asked: str) -> None:
    """Two versions of one model, the older one guarded: whichever name reaches it (its id, or the
    family's name while it is the latest), the version that answers brings its own profile, and the
    other's does not follow the family's name (the profile was the last declared version's, by name)."""
    upstream = Upstream("content", TEXT)
    with scripted(upstream) as base:
        remote = f"kind: remote, url: '{base}/v1', upstream_model: up"
        models = tmp_path / "models.yaml"
        models.write_text(f"models: [{{name: far, version: 2.0.0, {remote}}}, "
                          f"{{name: far, version: 1.0.0, {remote}, guards: {{output: {{pii: {{email: redact}}}}}}}}]")
        app = create_app(fake_settings(models_file=models), engine_starter=lambda es: FakeEngine())
        with TestClient(app) as client:
            answer = answered(client, CHAT, {"model": asked, "max_tokens": 40, "messages": HI})
    if answer.headers["x-served-model"] == "far@1.0.0":
        assert_guarded(answer.text)
    else:
        assert "eve@evil.example" in answer.text  # version 2.0.0 has no profile
