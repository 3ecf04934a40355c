"""Reading a stream: Server-Sent Events into event data (`SSEDecoder`), and event data into one
answer's timing and text (`StreamAccumulator`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import orjson


class SSEDecoder:
    """Splits a `text/event-stream` body (bytes, cut anywhere) into the data of each event (WHATWG
    rules, data fields only; LF or CRLF line ends). The hot path: an event of one `data: ` line, what
    servers send, comes back as its raw bytes, never decoded (orjson reads UTF-8 bytes as they are);
    any other event comes back as str."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes | str]:
        """The data of every event that `chunk` completes."""
        buffer = self._pending + chunk
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")  # a CR cut from its LF stays for the next chunk
        parts = buffer.split(b"\n\n")
        self._pending = parts.pop()
        events = [part[6:] if part.startswith(b"data: ") and b"\n" not in part else _data(part) for part in parts]
        return [e for e in events if e is not None]

    def finish(self) -> list[bytes | str]:
        """The end of the body: the event it ends, if any."""
        data, self._pending = _data(self._pending.rstrip(b"\r\n")), b""
        return [] if data is None else [data]


def _data(event: bytes) -> str | None:
    """The data of one event's lines (None for an event without data: a comment, a keep-alive)."""
    values = []
    for line in event.decode("utf-8", "replace").split("\n"):
        name, _, value = line.partition(":")
        if name == "data":
            values.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(values) if values else None


def _piece_of(choice: dict[str, Any]) -> str:
    """The text a streamed choice carries (completions: text; chat: delta content/reasoning/tools)."""
    delta = choice.get("delta") or {}
    text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    return text or (json.dumps(delta["tool_calls"]) if delta.get("tool_calls") else "")


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
        """Take one event's data (str, or bytes from `SSEDecoder.feed`); return True at `[DONE]`."""
        if data == b"[DONE]":
            return self._done(now)
        try:
            obj = orjson.loads(data)
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
        self.done, self.done_at = True, now
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
