"""Server-Sent Events on the wire, both ways: framing our events in the route's dialect (`FRAMINGS`, and
`NAMED` for the Responses API's typed events), and reading an upstream's (`split`, `payloads`).

OpenAI's events are `data: <json>`, the stream ending in `data: [DONE]`; Anthropic's and the Responses API's are
named by their `type` (`event: <type>`: Anthropic's SDK skips unnamed events), with no end marker. An error
after the stream has started is one more event with the dialect's error object (`error_frame`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import orjson
from pydantic import BaseModel

from gateway.errors import Dialect

DONE = b"data: [DONE]\n\n"
EVENT_BYTES = 4 << 20  # one event of an upstream's stream: one chunk of an answer, far smaller


@dataclass(frozen=True, slots=True)
class Framing:
    dialect: Dialect
    named: bool  # an `event: <type>` line before each data line
    end: bytes  # what closes the stream


FRAMINGS: dict[Dialect, Framing] = {
    "openai": Framing("openai", named=False, end=DONE),
    "anthropic": Framing("anthropic", named=True, end=b""),
}
NAMED = Framing("openai", named=True, end=b"")  # the Responses API's typed events


def encode(event: BaseModel | bytes, named: bool = False) -> bytes:
    """One event; bytes are JSON the producer encoded itself (the per-token chunks, ChunkEncoder)."""
    if isinstance(event, bytes):
        return b"data: " + event + b"\n\n"
    data = b"data: " + event.__pydantic_serializer__.to_json(event, exclude_none=True) + b"\n\n"
    if named:
        return b"event: " + str(getattr(event, "type", "message")).encode() + b"\n" + data
    return data


def error_frame(body: dict[str, Any], framing: Framing) -> bytes:
    """An error event after the stream started; `body` is the dialect's error object."""
    if framing.named:  # Anthropic's body is already {"type": "error", "error": {...}}
        return b"event: error\ndata: " + orjson.dumps({"type": "error", **body}) + b"\n\n"
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def split(chunks: AsyncIterable[bytes]) -> AsyncGenerator[bytes, None]:
    """A byte stream's events as they complete, each one block of lines without the blank line
    that ends it (an event cut short by the stream's end is passed on; empty ones are not; one
    that grows past `EVENT_BYTES` is a ValueError: held whole, it is not read without bound)."""
    pending = b""
    async for chunk in chunks:
        pending = (pending + chunk).replace(b"\r\n", b"\n")
        *complete, pending = pending.split(b"\n\n")
        if len(pending) > EVENT_BYTES:
            raise ValueError(f"an event past {EVENT_BYTES} bytes")
        for event in complete:
            if event.strip():
                yield event
    if pending.strip():
        yield pending


DONE_MARK: Final = "DONE"
UNREADABLE: Final = "UNREADABLE"
Payload = dict[str, Any] | str  # a JSON object, DONE_MARK or UNREADABLE


def payloads(event: bytes) -> Iterator[Payload]:
    """An event's data lines, read (data that is JSON but not an object is skipped)."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield DONE_MARK
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            yield UNREADABLE
            continue
        if isinstance(chunk, dict):
            yield chunk
