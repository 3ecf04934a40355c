"""A remote upstream's tool calls through the output guard: a call's name is checked whole (a blocked
word cuts the choice, personal data is redacted), and two pieces of one call in one delta both pass."""

from __future__ import annotations

import re
from typing import Any

from engine.types import GenerationOutput
from gateway.backends import upstream
from gateway.guards import pii
from gateway.guards.config import OutputChecks
from gateway.guards.patterns import Detector, Match, Scanner, regex_spans
from gateway.guards.stream import CONTENT_FILTER, OutputGuard


class _Notes:
    def __init__(self) -> None:
        self.guards: list[str] = []

    def note_match(self, stage: str, match: Match, text: str) -> None:
        self.guards.append(match.detector.guard)

    async def moderate(self, stage: str, text: str, action: str) -> str | None:
        return None


def _guard() -> OutputGuard:
    deny = Detector("deny", "block", "DENY", regex_spans(re.compile(r"(?i)hydra")))
    email = Detector("pii.email", "redact", "EMAIL", regex_spans(pii.EMAIL))
    return OutputGuard(_Notes(), Scanner([deny, email]), OutputChecks(holdback_chars=8, window_chars=64), None, 1, apart=True)


async def _run(chunks: list[dict[str, Any]], whole: bool = False) -> list[GenerationOutput]:
    guard = _guard()
    return [await guard.apply(upstream._output(chunk, whole=whole)) for chunk in chunks]


def _call(index: int, arguments: str, name: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        function["name"] = name
    return {"index": index, "function": function}


def _stream(*calls: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"choices": [{"index": 0, "delta": {"tool_calls": list(calls)}}]},
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]


def _names(outputs: list[GenerationOutput]) -> list[str]:
    return [call.name for output in outputs for delta in output.choices for call in delta.tool_calls if call.name]


def _arguments(outputs: list[GenerationOutput]) -> str:
    return "".join(call.arguments for output in outputs for delta in output.choices for call in delta.tool_calls)


def _finish(outputs: list[GenerationOutput]) -> list[str]:
    return [delta.finish_reason for output in outputs for delta in output.choices if delta.finish_reason]


async def test_a_blocked_word_in_a_streamed_calls_name_cuts_the_choice() -> None:
    outputs = await _run(_stream(_call(0, "", "send_HYDRA")))
    assert _names(outputs) == []
    assert _finish(outputs) == [CONTENT_FILTER]


async def test_personal_data_in_a_streamed_calls_name_is_redacted() -> None:
    outputs = await _run(_stream(_call(0, "{}", "eve@evil.example")))
    assert _names(outputs) == ["[EMAIL]"]
    assert _finish(outputs) == ["tool_calls"]


async def test_a_blocked_word_in_a_whole_answers_call_name_cuts_the_choice() -> None:
    answer = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "HYDRA", "arguments": "{}"}}]}}]}
    outputs = await _run([answer], whole=True)
    assert _names(outputs) == []
    assert _finish(outputs) == [CONTENT_FILTER]


async def test_two_pieces_of_one_call_in_one_delta_are_read_as_one() -> None:
    outputs = await _run(_stream(_call(0, '{"to": "eve@', "send"), _call(0, 'evil.example"}')))
    assert _names(outputs) == ["send"]
    assert _arguments(outputs) == '{"to": "[EMAIL]"}'


async def test_two_pieces_of_one_call_spelling_a_blocked_word_cut_the_choice() -> None:
    outputs = await _run(_stream(_call(0, '{"a": "hy', "f"), _call(0, 'dra"}')))
    assert _finish(outputs) == [CONTENT_FILTER]
    assert "dra" not in _arguments(outputs)


def _ids(outputs: list[GenerationOutput]) -> list[str]:
    return [call.id for output in outputs for delta in output.choices for call in delta.tool_calls if call.id]


async def test_a_name_in_pieces_is_checked_whole_and_goes_out_with_its_id() -> None:
    """An upstream may stream a call's name in pieces (a client joins them): each was checked alone,
    so an e-mail split over two pieces went out as they came, and a blocked word spelled by two passed."""
    first = {**_call(0, "", "to_eve@"), "id": "call_1"}
    outputs = await _run([{"choices": [{"index": 0, "delta": {"tool_calls": [first]}}]},
                          *_stream(_call(0, "{}", "evil.example"))])
    assert _names(outputs) == ["[EMAIL]"]
    assert _ids(outputs) == ["call_1"]  # the call's first piece out names it
    assert _arguments(outputs) == "{}"
    outputs = await _run([{"choices": [{"index": 0, "delta": {"tool_calls": [_call(0, "", "send_HY")]}}]},
                          *_stream(_call(0, "{}", "DRA"))])
    assert _names(outputs) == []
    assert _finish(outputs) == [CONTENT_FILTER]


async def test_a_name_held_goes_out_when_a_later_call_begins_or_the_choice_ends() -> None:
    outputs = await _run(_stream(_call(0, "", "first"), _call(1, "", "second")))
    assert _names(outputs) == ["first", "second"]
    assert _finish(outputs) == ["tool_calls"]
