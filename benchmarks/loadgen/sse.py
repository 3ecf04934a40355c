"""Reading a streamed response: Server-Sent Events into event data, event data into the timing and
text of one answer (`StreamAccumulator`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Any

from benchmarks.loadgen.codec import loads


class SSEDecoder:
    """Turns lines of a `text/event-stream` into the data of each event (WHATWG rules, data only)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Feed one line without its newline; return the event's data when a blank line ends it."""
        line = line.removesuffix("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


async def sse_events(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    tail = decoder.flush()
    if tail is not None:
        yield tail


def _piece_of(choice: dict[str, Any]) -> str:
    """The text a streamed choice carries (completions: text; chat: delta content/reasoning/tools)."""
    text = choice.get("text")
    if text:
        return text
    delta = choice.get("delta")
    if not delta:
        return ""
    content = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if content:
        return content
    if delta.get("tool_calls"):
        return json.dumps(delta["tool_calls"])
    return ""


class StreamAccumulator:
    """Follows one streamed response: when text arrives, what it says, the usage at the end."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.pieces: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        self.finish_reason: str | None = None

    def feed(self, data: str, now: float) -> bool:
        """Take one event's data; return True at `[DONE]`."""
        if data.strip() == "[DONE]":
            self.done = True
            return True
        try:
            obj = loads(data)
        except ValueError:
            self.error = f"undecodable event: {data[:120]!r}"
            return False
        if not isinstance(obj, dict):
            return False
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        self._take_choices(obj.get("choices") or (), now)
        return False

    def _take_choices(self, choices: Iterable[dict[str, Any]], now: float) -> None:
        """Note the text the choices of one event carry, and when it came."""
        text = ""
        for choice in choices:
            piece = _piece_of(choice)
            if piece:
                text += piece
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if text:
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - self.last)  # type: ignore[operator]
            self.last = now
            self.chunks += 1
            self.pieces.append(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)
