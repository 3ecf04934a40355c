"""What the dispatcher needs of a service (chat, completions): typed, so that a reader and the
type checker can follow the strategy.

A service prepares a validated request for an engine (every refusal happens there, before the
first byte), then answers it whole (`complete`) or as a stream of encoded chunks (`stream`), and
replays a cached answer. Both `complete` and `stream` hand the whole answer to `on_done` once it
is known: the one cache hand-off, for streams and non-streams alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from pydantic import BaseModel

from engine.types import Engine
from gateway.protocol.openai import SamplingFields

RequestT = TypeVar("RequestT", bound=SamplingFields)
PreparedT = TypeVar("PreparedT", bound="Prepared")
AnswerT = TypeVar("AnswerT", bound=BaseModel)
RequestT_contra = TypeVar("RequestT_contra", bound=SamplingFields, contravariant=True)

OnDone = Callable[[AnswerT], Awaitable[None]]


class Prepared(Protocol):
    """A request ready for the engine."""

    model: str  # the name the answer carries: the model (version) that answers

    def token_budget(self) -> int:
        """Prompt plus the most the answer may take, for tokens-per-minute limits."""
        ...

    def output_tokens(self) -> int:
        """The most the answer may take: max_tokens for every choice of every prompt."""
        ...


class Service(Protocol[RequestT_contra, PreparedT, AnswerT]):
    route: str  # the OpenAI route it serves (part of the cache key)
    upstream_path: str  # the same route on a remote upstream (relative to its /v1)
    answer_type: type[AnswerT]

    def prepare(self, request: RequestT_contra, engine: Engine, default_max_tokens: int | None) -> PreparedT: ...

    async def complete(self, prepared: PreparedT, on_done: OnDone[AnswerT] | None = None) -> AnswerT: ...

    def stream(self, prepared: PreparedT, on_done: OnDone[AnswerT] | None = None) -> AsyncIterator[bytes]: ...

    def replay(self, answer: AnswerT, request: RequestT_contra) -> AsyncIterator[BaseModel]: ...

    def fresh(self, answer: AnswerT) -> AnswerT: ...
