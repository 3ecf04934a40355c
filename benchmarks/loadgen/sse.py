"""Reading a stream: Server-Sent Events into event data (`SSEDecoder`; `feed_raw`, the hot path,
splits raw chunks at blank lines without decoding), and event data into one answer's timing and
text (`StreamAccumulator`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from benchmarks.loadgen.codec import loads


class SSEDecoder:
    """Turns lines of a `text/event-stream` into the data of each event (WHATWG rules, data only)."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._pending = b""
        self._lines = False  # feed_raw: a CR was seen, so events are read line by line from then on

    def feed_raw(self, chunk: bytes) -> list[bytes | str]:
        """`feed_bytes` for the hot path: events of one `data: ` line each (what servers send)
        come back as their raw bytes, found by splitting at blank lines, with no decoding (orjson
        reads UTF-8 bytes as they are); any other event (comments, several data lines, other
        fields) goes through `feed` and comes back as str. CRLF line ends switch to `feed_bytes`."""
        if self._lines or b"\r" in chunk:
            self._lines = True
            return list(self.feed_bytes(chunk))
        parts = (self._pending + chunk).split(b"\n\n") if self._pending else chunk.split(b"\n\n")
        self._pending = parts.pop()
        events: list[bytes | str] = []
        for part in parts:
            if part.startswith(b"data: ") and b"\n" not in part:
                events.append(part[6:])
                continue
            for raw in part.split(b"\n"):
                self.feed(raw.decode("utf-8", "replace"))
            data = self.flush()
            if data is not None:
                events.append(data)
        return events

    def feed_bytes(self, chunk: bytes) -> list[str]:
        """Feed raw bytes of the body (cut anywhere); return the data of every event they complete.
        Lines end in LF or CRLF; a line is decoded only once whole, so UTF-8 cut across chunks is safe."""
        lines = (self._pending + chunk).split(b"\n") if self._pending else chunk.split(b"\n")
        self._pending = lines.pop()
        events = []
        for raw in lines:
            data = self.feed(raw.decode("utf-8", "replace"))
            if data is not None:
                events.append(data)
        return events

    def finish(self) -> list[str]:
        """The end of the body: the last line (when it had no newline) and the event it ends."""
        events = []
        if self._pending:  # one line (feed_bytes) or the lines of an event without its blank line (feed_raw)
            for raw in self._pending.split(b"\n"):
                data = self.feed(raw.decode("utf-8", "replace"))
                if data is not None:
                    events.append(data)
            self._pending = b""
        tail = self.flush()
        return events + ([tail] if tail is not None else [])

    def feed(self, line: str) -> str | None:
        """Feed one line without its newline; return the event's data when a blank line ends it."""
        if line.startswith("data: ") and not line.endswith("\r"):  # the common case, fast
            self._data.append(line[6:])
            return None
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
        self.done_at: float | None = None
        self.finish_reason: str | None = None

    def feed(self, data: str | bytes, now: float) -> bool:
        """Take one event's data (str, or bytes from `SSEDecoder.feed_raw`); return True at `[DONE]`."""
        if data == b"[DONE]":
            return self._done(now)
        try:
            obj = loads(data)
        except ValueError:  # not JSON: [DONE] with spaces around, or garbage
            if data.strip() in ("[DONE]", b"[DONE]"):
                return self._done(now)
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

    def _done(self, now: float) -> bool:
        self.done = True
        self.done_at = now
        return True

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
