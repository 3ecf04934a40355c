"""The output guard on a named tool call's arguments (Responses and chat, whole and streamed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.fakes import FakeEngine
from tests.unit.test_guards import MODEL, guarded_app

TOOLS = [{"type": "function", "name": "mail", "parameters": {"type": "object", "properties": {"to": {"type": "string"}}}}]
REPLY = ['{"to": "eve@', 'evil.example', '"}']


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_calls_arguments_are_guarded_in_responses(tmp_path: Path, stream: bool) -> None:
    engine = FakeEngine()
    engine.reply = REPLY
    body = {"model": MODEL, "input": "write to eve", "tools": TOOLS, "stream": stream, "store": False,
            "tool_choice": {"type": "function", "name": "mail"}}
    with TestClient(guarded_app(tmp_path, engine)) as client:
        answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 200
    if stream:
        events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
        done = next(e for e in events if e.get("type") == "response.completed")["response"]
        streamed = "".join(e["delta"] for e in events if e.get("type") == "response.function_call_arguments.delta")
        assert "eve@" not in streamed
    else:
        done = answer.json()
    arguments = done["output"][0]["arguments"]
    assert "eve@" not in arguments
    assert json.loads(arguments)["to"] == "[EMAIL]"


CHAT_TOOLS = [{"type": "function", "function": {"name": "mail", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_calls_arguments_are_guarded_in_chat(tmp_path: Path, stream: bool) -> None:
    engine = FakeEngine()
    engine.reply = REPLY
    body = {"model": MODEL, "messages": [{"role": "user", "content": "write to eve"}], "tools": CHAT_TOOLS,
            "stream": stream, "tool_choice": {"type": "function", "function": {"name": "mail"}}}
    with TestClient(guarded_app(tmp_path, engine)) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200
    assert "eve@" not in answer.text
    assert "[EMAIL]" in answer.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_calls_input_is_guarded_in_messages(tmp_path: Path, stream: bool) -> None:
    engine = FakeEngine()
    engine.reply = REPLY
    body = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "write to eve"}], "stream": stream,
            "tools": [{"name": "mail", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "mail"}}
    with TestClient(guarded_app(tmp_path, engine)) as client:
        answer = client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    assert "eve@" not in answer.text
    assert "[EMAIL]" in answer.text
