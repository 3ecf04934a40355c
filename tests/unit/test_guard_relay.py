"""A remote model's answers pass the output guards as an embedded model's do (#25 item 4): whole
answers, relayed streams (a match split across the upstream's chunks), cached replays, chat and
completions, every field that carries text (content, tool-call arguments, logprobs and their
alternatives), n > 1. The upstream is a real gateway (unguarded) on the fake engine behind a real
uvicorn server on loopback; the front gateway is guarded and has it as a remote model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from starlette.testclient import TestClient

from gateway.guards.relay import RelayGuard
from gateway.protocol.openai import ChatCompletion
from gateway.serving.remote import RemoteAnswer
from tests.fakes import FakeEngine
from tests.served import gateway
from tests.unit.test_guard_evasion import (  # noqa: F401  # its fixture: guard actions counted apart
    CHUNKINGS,
    LOOKUP,
    _own_guard_counter,
    guarded_client,
    sampled_tokens,
    shown,
)


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine()
    with gateway(engine) as base:
        yield base, engine


@pytest.fixture
def engine(upstream: tuple[str, FakeEngine]) -> Iterator[FakeEngine]:
    """The upstream's engine, its script cleared after each test."""
    yield upstream[1]
    upstream[1].reply, upstream[1].alternatives = None, {}


def front(tmp_path: Path, base: str, **settings: object) -> TestClient:
    models = tmp_path / "models.yaml"
    models.write_text(f"models: [{{name: far, kind: remote, url: '{base}/v1', upstream_model: fake-model}}]")
    return guarded_client(tmp_path, FakeEngine(), models_file=models, **settings)


@pytest.fixture
def client(tmp_path: Path, upstream: tuple[str, FakeEngine]) -> Iterator[TestClient]:
    with front(tmp_path, upstream[0], cache={"backend": "memory"}) as test_client:
        yield test_client


def text_of(body: str) -> str:
    """The first choice's text (content, or a completion's text), joined across a stream's chunks."""
    events = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")] or [json.loads(body)]
    pieces = []
    for event in events:
        for choice in event["choices"]:
            if choice["index"] == 0:
                part = choice.get("delta") or choice.get("message") or {}
                pieces.append(part.get("content") or choice.get("text") or "")
    return "".join(pieces)


def arguments_of(body: str) -> str:
    """The first tool call's arguments, joined across a stream's chunks."""
    events = [json.loads(line[6:]) for line in body.split("\n") if line.startswith("data: {")] or [json.loads(body)]
    pieces = []
    for event in events:
        for choice in event["choices"]:
            for call in (choice.get("delta") or choice.get("message") or {}).get("tool_calls") or ():
                pieces.append(call["function"].get("arguments", ""))
    return "".join(pieces)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2, "max_tokens": 40}
COMPLETION = {"prompt": "hi", "logprobs": 2, "max_tokens": 40}
ROUTES = [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]


@pytest.mark.parametrize("pieces", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_denied_word_leaves_a_remote_model_by_no_field(client: TestClient, engine: FakeEngine, pieces: list[str],
                                                         route: str, body: dict, stream: bool) -> None:
    engine.reply = pieces
    answer = client.post(route, json={"model": "far", **body, "stream": stream})
    assert answer.status_code == 200, answer.text
    seen = shown(answer.text)
    assert "hydra" not in seen
    assert "hydra" not in sampled_tokens(answer.text)
    assert "content_filter" in seen
    assert text_of(answer.text).startswith("We call it ")  # what came before the match is passed on
    if stream:
        assert answer.text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("pieces", [["The plan is conf", "iden", "tial, ok"], ["The plan is ", *"cоnfidеntial", ", ok"],
                                    ["The plan is c\u200bonfi", "\u00addential, ok"]])
@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_redacted_word_leaves_a_remote_model_by_no_field(client: TestClient, engine: FakeEngine, pieces: list[str],
                                                           route: str, body: dict, stream: bool) -> None:
    engine.reply = pieces
    answer = client.post(route, json={"model": "far", **body, "stream": stream})
    seen = shown(answer.text)
    assert "confidential" not in seen
    assert "[secret]" in seen
    assert text_of(answer.text) == "The plan is [SECRET], ok"
    assert "confidential" not in sampled_tokens(answer.text)
    assert "[secret]" in sampled_tokens(answer.text)
    assert "content_filter" not in seen


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_logprob_alternatives_of_a_remote_model_that_would_complete_a_match_are_left_out(
        client: TestClient, engine: FakeEngine, route: str, body: dict, stream: bool) -> None:
    engine.reply = ["We call it Project", " Hyacinth", " and that is all"]
    engine.alternatives = {1: [" Hydra", " Hyena"]}
    answer = client.post(route, json={"model": "far", **body, "top_logprobs": 3, "stream": stream}
                         if route == "/v1/chat/completions" else {"model": "far", **body, "logprobs": 3, "stream": stream})
    assert answer.status_code == 200
    assert "hydra" not in shown(answer.text)
    assert "hyena" in shown(answer.text)  # the others are kept
    assert sampled_tokens(answer.text) == "we call it project hyacinth and that is all"


@pytest.mark.parametrize("stream", [False, True])
def test_a_remote_models_tool_call_arguments_are_guarded(client: TestClient, engine: FakeEngine, stream: bool) -> None:
    engine.reply = ['{"q": "Pro', 'ject\u200b Hy', 'dra"}']
    body = {"model": "far", "messages": [{"role": "user", "content": "hi"}], "tools": [LOOKUP],
            "tool_choice": {"type": "function", "function": {"name": "lookup"}}, "stream": stream}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    seen = shown(answer.text)
    assert "hydra" not in seen
    assert "content_filter" in seen
    assert arguments_of(answer.text).startswith('{"q": "')  # the arguments up to the match
    engine.reply = ['{"q": "the conf', 'idential', ' plan"}']
    answer = client.post("/v1/chat/completions", json=body)
    assert "confidential" not in shown(answer.text)
    assert json.loads(arguments_of(answer.text)) == {"q": "the [SECRET] plan"}


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["chat", "completions"])
def test_every_choice_of_a_remote_answer_is_guarded(client: TestClient, engine: FakeEngine, route: str, body: dict) -> None:
    engine.reply = CHUNKINGS["zero-width, split"]
    for stream in (False, True):
        answer = client.post(route, json={"model": "far", **body, "n": 3, "stream": stream})
        seen = shown(answer.text)
        assert "hydra" not in seen
        assert seen.count("content_filter") == 3


@pytest.mark.parametrize(("route", "body"), ROUTES, ids=["chat", "completions"])
def test_cached_replays_of_remote_answers_hold_no_denied_word(client: TestClient, engine: FakeEngine, route: str,
                                                              body: dict) -> None:
    engine.reply = CHUNKINGS["homoglyphs, one per token"]
    asked = len(engine.requests)
    for stream in (True, False, True):  # a guarded stream joined for the cache, then replayed whole and streamed
        answer = client.post(route, json={"model": "far", **body, "temperature": 0, "stream": stream})
        assert answer.status_code == 200
        assert "hydra" not in shown(answer.text)
        assert "hydra" not in sampled_tokens(answer.text)
    assert answer.headers["x-cache"] == "HIT"
    assert len(engine.requests) == asked + 1
    body = {**body, "max_tokens": 39}  # whole first, then replayed streamed
    for stream in (False, True):
        answer = client.post(route, json={"model": "far", **body, "temperature": 0, "stream": stream})
        assert "hydra" not in shown(answer.text)
    assert answer.headers["x-cache"] == "HIT"


def test_placeholders_a_remote_model_repeats_are_restored_across_chunks(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ["I will write to [EM", "AIL_1] today"]
    body = {"model": "far", "messages": [{"role": "user", "content": "mail bob@corp.example"}]}
    for stream in (False, True):
        answer = client.post("/v1/chat/completions", json={**body, "stream": stream})
        assert text_of(answer.text) == "I will write to bob@corp.example today"
    assert "bob@corp.example" not in engine.requests[-1].prompt_text  # the upstream saw the placeholder


def test_an_unguarded_remote_answer_passes_through_as_the_upstream_wrote_it(tmp_path: Path, upstream, engine) -> None:
    engine.reply = ["We call it Project Hydra", " and it is confidential."]
    models = tmp_path / "models.yaml"
    models.write_text(f"models: [{{name: far, kind: remote, url: '{upstream[0]}/v1', upstream_model: fake-model}}]")
    from tests.fakes import app_with

    with TestClient(app_with(FakeEngine(), models_file=models)) as client:
        for stream in (False, True):
            answer = client.post("/v1/chat/completions", json={"model": "far", "stream": stream,
                                                               "messages": [{"role": "user", "content": "hi"}]})
            assert "project hydra" in shown(answer.text)


async def test_an_event_whose_data_is_no_json_object_is_not_passed_on() -> None:
    """What cannot be checked is not relayed: not even the event's other lines, as an event of its own."""
    watch = RemoteAnswer("far", ChatCompletion, 1)
    try:
        for event in (b"data: 5", b"event: x\ndata: [1, 2]", b"data: not json"):
            assert await watch.guarded(event, cast(RelayGuard, object())) is None, event
    finally:
        watch.end()
