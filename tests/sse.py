"""Server-Sent Events as the tests read them: one parser for every test, so that a stream's `id:` lines (a
resumable stream numbers its events, on by default) sit apart from what each event says."""

from __future__ import annotations

import json
from typing import Any


def _split(text: str | bytes) -> list[list[str]]:
    """The events of a body: each its lines (a comment's, `: ...`, dropped)."""
    body = text.decode() if isinstance(text, bytes) else text
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if lines:
            events.append(lines)
    return events


def blocks(text: str | bytes) -> list[str]:
    """Each event as it was framed, but for its `id:` line."""
    return ["\n".join(line for line in lines if not line.startswith("id:")) for lines in _split(text)]


def data(text: str | bytes) -> list[str]:
    """Each event's data (`[DONE]` too)."""
    return ["\n".join(line[5:].removeprefix(" ") for line in lines if line.startswith("data:"))
            for lines in _split(text) if any(line.startswith("data:") for line in lines)]


def chunks(text: str | bytes) -> list[Any]:
    """Each event's data, read as JSON (`[DONE]` left out)."""
    return [json.loads(payload) for payload in data(text) if payload != "[DONE]"]


def named(text: str | bytes) -> list[tuple[str, Any]]:
    """(event name, data read as JSON) of each event of a named-event stream (Responses', Messages')."""
    found = []
    for lines in _split(text):
        fields = dict(line.split(": ", 1) for line in lines if not line.startswith("id:"))
        found.append((fields["event"], json.loads(fields["data"])))
    return found


def ids(text: str | bytes) -> list[int]:
    """The `id:` of each event that has one (a resumable stream's numbers)."""
    return [int(line[3:]) for lines in _split(text) for line in lines if line.startswith("id:")]
