"""What the pipeline answers with, for the api layer to encode: a `Whole` answer (a model, or JSON
already written) or a `Stream` of events (models, or JSON chunks the producer encoded itself), and
`primed`, which runs a stream up to its first event so that its refusals come before the response
starts."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from pydantic import BaseModel

Event = BaseModel | bytes


@dataclass(slots=True)
class Whole:
    body: BaseModel | bytes  # bytes: JSON already written (a cached answer, an upstream's body)
    status: int = 200
    media_type: str = "application/json"


@dataclass(slots=True)
class Stream:
    events: Events
    on_close: Callable[[], None] | None = None  # called once when the stream ends, however it ends
    # a resumable stream whose client left (generating for a reconnect only): given the stop that ends it at once
    on_left: Callable[[Callable[[], None]], None] | None = None
    deadline: float | None = None  # the request's (the event loop's clock): a departed client's grace ends by then


Answer = Whole | Stream


def json_bytes(model: BaseModel) -> bytes:
    """A model as the API writes it: JSON without its unset (None) fields."""
    return model.__pydantic_serializer__.to_json(model, exclude_none=True)


def whole_json(answer: Whole) -> bytes:
    """A whole answer's body as JSON bytes, exactly as the api layer sends it (a batch line's body)."""
    return json_bytes(answer.body) if isinstance(answer.body, BaseModel) else answer.body


async def _nothing() -> AsyncGenerator[Event, None]:
    return
    yield


class Primed:
    """A stream whose first event was already taken; closing it closes the stream underneath."""

    def __init__(self, first: Event | None, rest: AsyncGenerator[Event, None]) -> None:
        self._first = first
        self._rest = rest
        self._done = first is None

    def __aiter__(self) -> Primed:
        return self

    async def __anext__(self) -> Event:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self._done:
            raise StopAsyncIteration
        return await anext(self._rest)

    def split(self) -> tuple[Event | None, AsyncGenerator[Event, None]]:
        """The first event and the stream underneath, for a consumer that iterates the rest itself
        (no layer per event); closing still goes through this Primed."""
        first, self._first = self._first, None
        return first, (_nothing() if self._done else self._rest)

    async def aclose(self) -> None:
        self._done = True
        await self._rest.aclose()


Events = AsyncGenerator[Event, None] | Primed  # a stream of events, closed with aclose() however it ends


async def primed(events: AsyncGenerator[Event, None]) -> Primed:
    """Run a stream up to its first event, so that refusals raise before the response starts."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    return Primed(first, events)
