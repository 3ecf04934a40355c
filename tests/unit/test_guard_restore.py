"""Restore survives any stream: with `restore: true` the caller's redacted values come back in the
answer however the backend splits it into events (one character each, a placeholder over any
number of them, placeholders repeated and out of order, a placeholder longer than any fixed bound),
the same as from the whole answer, in every field a model writes (its text, reasoning, a tool call's
arguments), whole and streamed, embedded and remote. And the output checks' redactions come out
the same for any split (when the holdback covers the match, as the guards' docs say).

A property test (hypothesis) feeds any split of an answer to one request's output guard; the
table below drives whole requests through the app, on the engine's double and on a scripted
upstream over real HTTP answering one character per event."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from engine.types import ChoiceDelta, GenerationOutput, ToolCallDelta
from gateway.app import create_app
from gateway.guards.config import Profile
from gateway.guards.guarding import CompiledProfile, RequestGuard
from tests.fakes import FakeEngine, fake_settings
from tests.scripted_upstream import scripted
from tests.unit.test_guard_every_field import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Side, Upstream

LONG = "customer.account.reference.number"  # a deny rule's name: its placeholder is 39 characters
PROMPT = "Write to a@b.com and c@d.org about project zeus"
PLACEHOLDERS = {"[EMAIL_1]": "a@b.com", "[EMAIL_2]": "c@d.org", "[CUSTOMER_ACCOUNT_REFERENCE_NUMBER_1]": "project zeus"}


def profile(holdback: int = 16, window: int = 256, output: bool = True) -> Profile:
    checks: dict[str, Any] = {"holdback_chars": holdback, "window_chars": window}
    if output:  # the model's own email and a word redacted on the way out
        checks.update(pii={"email": "redact"}, deny=[{"pattern": "(?i)hydra", "action": "redact", "name": "secret"}])
    return Profile.model_validate({"output": checks, "input": {
        "pii": {"email": "redact"}, "restore": True, "deny": [{"pattern": "(?i)project zeus", "action": "redact", "name": LONG}]}})


def restored(text: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    return text


# --- any split, one request's output guard ------------------------------------------------------

def _delta(field: str, piece: str, first: bool, last: bool) -> ChoiceDelta:
    finish = "stop" if last else None
    if field == "reasoning":
        return ChoiceDelta(0, "", [1], finish, reasoning=piece)
    if field == "arguments":
        return ChoiceDelta(0, "", [1], finish, tool_calls=(ToolCallDelta(0, piece, "mail" if first else None),))
    return ChoiceDelta(0, piece, [1], finish)


def guarded(pieces: list[str], field: str, checks: Profile) -> str:
    """What the client is shown of `field` when the backend answers in `pieces`."""
    guard = RequestGuard(CompiledProfile.of("keep", checks))
    assert guard.check_input([PROMPT], "messages") == ["Write to [EMAIL_1] and [EMAIL_2] about [CUSTOMER_ACCOUNT_REFERENCE_NUMBER_1]"]
    output = guard.output(1, apart=field != "text")
    assert output is not None
    shown: list[str] = []

    async def feed() -> None:
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            passed = await output.apply(GenerationOutput(0, [_delta(field, piece, i == 0, last)], finished=last))
            for delta in passed.choices:
                shown.append(delta.text + delta.reasoning + "".join(call.arguments for call in delta.tool_calls))

    asyncio.run(feed())
    return "".join(shown)


WORDS = st.sampled_from([*PLACEHOLDERS, "[EMAIL_3]", "[EMAIL_", "[CUSTOMER_ACCOUNT", "[", "]", "[[", " ", "x", "EMAIL",
                         "_1", "hydra", "q@w.io", "\u200b", "zeus", "a" * 40])


# examples a property: each runs the guard three times over (whole, split, a character an event), some 30 ms an example
# here; new ones are drawn on every run
EXAMPLES = 200


def split(text: str, cuts: list[int]) -> list[str]:
    at = sorted({cut for cut in cuts if cut < len(text)} | {0})
    return [text[a:b] for a, b in zip(at, [*at[1:], len(text)], strict=True)] or [""]


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(WORDS, max_size=16).map("".join), st.lists(st.integers(0, 400), max_size=30),
       st.sampled_from(["text", "reasoning", "arguments"]), st.sampled_from([0, 1, 8]), st.sampled_from([0, 4, 256]))
def test_any_split_restores_as_the_whole_answer_does(text: str, cuts: list[int], field: str, holdback: int, window: int) -> None:
    checks = profile(holdback, window, output=False)
    whole = guarded([text], field, checks)
    assert whole == restored(text)
    assert guarded(split(text, cuts), field, checks) == whole
    assert guarded(list(text) or [""], field, checks) == whole  # one character per event


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(WORDS.filter(lambda word: not word.startswith("a")), max_size=16).map(" ".join),
       st.lists(st.integers(0, 400), max_size=30), st.sampled_from(["text", "reasoning", "arguments"]))
def test_any_split_is_redacted_and_restored_as_the_whole_answer_is(text: str, cuts: list[int], field: str) -> None:
    """With output checks too: the model's own email and denied word redacted, the caller's restored,
    the same for any split (the holdback longer than any match here)."""
    checks = profile(holdback=40)
    whole = guarded([text], field, checks)
    assert "q@w.io" not in whole
    assert "hydra" not in whole
    assert guarded(split(text, cuts), field, checks) == whole
    assert guarded(list(text) or [""], field, checks) == whole


# --- the app, embedded and remote, one character per event ------------------------------------

ANSWER = "Sent [EMAIL_2] then [EMAIL_1], re [CUSTOMER_ACCOUNT_REFERENCE_NUMBER_1]; again [EMAIL_2]."
ARGUMENTS = '{"to": "[EMAIL_2]", "cc": "[EMAIL_1]", "re": "[CUSTOMER_ACCOUNT_REFERENCE_NUMBER_1]", "bcc": "[EMAIL_2]"}'
SCHEMA = {"type": "object"}
ASKED = [{"role": "user", "content": PROMPT}]
CASES = {  # route, the request's fields, the field the model writes (remote: the upstream's; None: embedded only), its text
    "chat content": (CHAT, {"messages": ASKED}, "content", ANSWER),
    "chat reasoning": (CHAT, {"messages": ASKED}, "reasoning_content", ANSWER),
    "chat named tool call": (CHAT, {"messages": ASKED, "tools": [{"type": "function", "function": {"name": "mail", "parameters": SCHEMA}}],
                                    "tool_choice": {"type": "function", "function": {"name": "mail"}}}, "tool_calls", ARGUMENTS),
    "completions": (COMPLETIONS, {"prompt": PROMPT}, "text", ANSWER),
    "responses": (RESPONSES, {"input": PROMPT}, None, ANSWER),
    "messages named tool use": (MESSAGES, {"messages": ASKED, "tools": [{"name": "mail", "input_schema": SCHEMA}],
                                           "tool_choice": {"type": "tool", "name": "mail"}}, None, ARGUMENTS),
}
GUARDS = f"""
default: keep
profiles:
  keep:
    input:
      pii: {{email: redact}}
      deny: [{{pattern: "(?i)project zeus", action: redact, name: {LONG}}}, {{pattern: '(?i)code\\s+"\\w+"', action: redact, name: code}}]
    output: {{pii: {{email: redact}}, holdback_chars: 16}}
"""


@pytest.fixture(params=["embedded", "remote"])
def side(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Side]:
    guards = tmp_path / "guards.yaml"
    guards.write_text(GUARDS)
    engine, upstream = FakeEngine(max_model_len=1000), Upstream()
    if request.param == "embedded":
        yield Side("fake-model", engine, upstream, {"guards_file": guards})
        return
    with scripted(upstream) as base:
        models = tmp_path / "models.yaml"
        models.write_text(f"models: [{{name: far, kind: remote, url: '{base}/v1', upstream_model: up}}]")
        yield Side("far", engine, upstream, {"guards_file": guards, "models_file": models})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_the_callers_values_come_back_from_one_character_events(side: Side, case: str, stream: bool) -> None:
    route, fields, upstream_field, text = CASES[case]
    if side.model == "far" and upstream_field is None:
        pytest.skip(f"{route} serves embedded models only")
    if side.model != "far" and upstream_field == "reasoning_content":
        pytest.skip("the engine's reasoning is its text")
    side.upstream.kind, side.upstream.pieces = upstream_field or "content", list(text)
    side.engine.reply = list(text)
    budget = {"max_output_tokens": 500} if route == RESPONSES else {"max_tokens": 500}
    with side.client() as client:
        answer = client.post(route, json={"model": side.model, **budget, **fields, "stream": stream})
    assert answer.status_code == 200, answer.text
    for placeholder, value in PLACEHOLDERS.items():
        assert placeholder[:-3] not in answer.text  # no placeholder, nor a piece of one, is left
        assert json.dumps(value)[1:-1] in answer.text  # whole, in one event of a stream


QUOTED = 'code\t"zeus"'  # a value with a tab and quotes, which JSON writes escaped
JSON_CASES = {  # route, the request's fields, the upstream's field (None: embedded only), how to read the value back
    "chat named tool call": (CHAT, {"tools": [{"type": "function", "function": {"name": "mail", "parameters": SCHEMA}}],
                                    "tool_choice": {"type": "function", "function": {"name": "mail"}}}, "tool_calls"),
    "chat structured output": (CHAT, {"response_format": {"type": "json_object"}}, "content"),
    "messages named tool use": (MESSAGES, {"tools": [{"name": "mail", "input_schema": SCHEMA}],
                                           "tool_choice": {"type": "tool", "name": "mail"}}, None),
}


def _arguments(route: str, answer: dict[str, Any]) -> str:
    if route == MESSAGES:
        return json.dumps(next(block["input"] for block in answer["content"] if block["type"] == "tool_use"))
    message = answer["choices"][0]["message"]
    return message["tool_calls"][0]["function"]["arguments"] if message.get("tool_calls") else message["content"]


@pytest.mark.parametrize("case", list(JSON_CASES), ids=list(JSON_CASES))
def test_a_value_restored_into_json_is_written_as_a_json_string(side: Side, case: str) -> None:
    """A tool call's arguments and structured output are JSON: the caller's value goes back in as a
    JSON string holds it (its tab and quotes escaped), so that the arguments still parse and hold it,
    split one character per event or not; in prose it comes back as it was."""
    route, fields, upstream_field = JSON_CASES[case]
    if side.model == "far" and upstream_field is None:
        pytest.skip(f"{route} serves embedded models only")
    text = '{"to": "[CODE_1]", "cc": "[EMAIL_1]"}'
    side.upstream.kind, side.upstream.pieces = upstream_field or "content", list(text)
    side.engine.reply = list(text)
    asked = [{"role": "user", "content": f"Send {QUOTED} to a@b.com"}]
    with side.client() as client:
        answer = client.post(route, json={"model": side.model, "max_tokens": 500, "messages": asked, **fields})
        assert answer.status_code == 200, answer.text
        assert json.loads(_arguments(route, answer.json())) == {"to": QUOTED, "cc": "a@b.com"}
        side.upstream.kind, side.upstream.pieces = "content", list("Use [CODE_1].")
        side.engine.reply = list("Use [CODE_1].")
        prose = client.post(CHAT, json={"model": side.model, "max_tokens": 500, "messages": asked})
    assert prose.json()["choices"][0]["message"]["content"] == f"Use {QUOTED}."


AUTO = {  # route, its tools on `auto` (the engine's calls are parsed from its text, after a `<tool_call>` tag)
    CHAT: {"messages": [{"role": "user", "content": f"Send {QUOTED} to a@b.com"}],
           "tools": [{"type": "function", "function": {"name": "mail", "parameters": SCHEMA}}]},
    RESPONSES: {"input": f"Send {QUOTED} to a@b.com", "tools": [{"type": "function", "name": "mail", "parameters": SCHEMA}]},
    MESSAGES: {"messages": [{"role": "user", "content": f"Send {QUOTED} to a@b.com"}],
               "tools": [{"name": "mail", "input_schema": SCHEMA}]},
}


def _auto_call(route: str, answer: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the text before the call, the call's arguments) of a whole answer."""
    if route == MESSAGES:
        blocks = answer["content"]
        text = "".join(block["text"] for block in blocks if block["type"] == "text")
        return text, next(block["input"] for block in blocks if block["type"] == "tool_use")
    if route == RESPONSES:
        items = answer["output"]
        text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
        return text, json.loads(next(item["arguments"] for item in items if item["type"] == "function_call"))
    message = answer["choices"][0]["message"]
    return message["content"] or "", json.loads(message["tool_calls"][0]["function"]["arguments"])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("route", list(AUTO))
def test_a_value_restored_into_a_call_parsed_from_the_text_is_a_json_string(tmp_path: Path, route: str, stream: bool) -> None:
    """Tools on `auto`, the engine's calls parsed from its text: the value goes back as prose before
    the `<tool_call>` tag and as a JSON string after it (raw, its quotes and tab broke the call's
    JSON: the call was lost, its text answered as content), one character per event or not."""
    guards = tmp_path / "guards.yaml"
    guards.write_text(GUARDS)
    engine = FakeEngine(max_model_len=1000)
    engine.reply = list('Mailing [CODE_1]. <tool_call>{"name": "mail", "arguments": {"to": "[CODE_1]", "cc": "[EMAIL_1]"}}</tool_call>')
    app = create_app(fake_settings(guards_file=guards), engine_starter=lambda es: engine)
    with TestClient(app) as client:
        budget = {"max_output_tokens": 500} if route == RESPONSES else {"max_tokens": 500}
        answer = client.post(route, json={"model": "fake-model", **budget, **AUTO[route]})
        assert answer.status_code == 200, answer.text
        text, arguments = _auto_call(route, answer.json())
        assert arguments == {"to": QUOTED, "cc": "a@b.com"}
        assert text == f"Mailing {QUOTED}."
        if stream:
            streamed = client.post(route, json={"model": "fake-model", **budget, **AUTO[route], "stream": True})
            assert streamed.status_code == 200
            assert json.dumps(json.dumps(QUOTED)[1:-1])[1:-1] in streamed.text  # the arguments' JSON, in an event's JSON
            assert "[CODE_1]" not in streamed.text
            assert "[EMAIL_1]" not in streamed.text
