"""What the dispatcher needs of a service (chat, completions, messages, embeddings): typed, so that
a reader and the type checker can follow the strategy.

A service prepares a validated request for an engine (every refusal happens there, before the
first byte, the input guards' too; the request's guard goes along to check the output), or for a
remote upstream (`Forwards`), then
answers it whole (`complete`) or as a stream of events (`stream`: encoded JSON chunks or models),
and replays a cached answer (whole: under a new id, from its stored JSON when the service can,
`renewed`, else as a model, `fresh`; or as a stream, `replay`). Both `complete` and `stream` hand
the whole answer to `on_done` once it is known: the one cache hand-off, for streams and
non-streams alike (`complete` returns the very answer it handed over, unchanged).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel

from engine.types import Engine, Forward, GenerationRequest, Generator, ModelInfo, Task
from gateway.errors import InvalidRequest
from gateway.guards.guarding import RequestGuard
from gateway.protocol.openai import ModelRequest
from gateway.serving.meter import Readings
from gateway.serving.structured import Constraint
from gateway.tenancy.priority import Scheduled

RequestT = TypeVar("RequestT", bound=ModelRequest)
PreparedT = TypeVar("PreparedT", bound="Prepared")
PreparedT_co = TypeVar("PreparedT_co", bound="Prepared", covariant=True)
AnswerT = TypeVar("AnswerT", bound=BaseModel)
RequestT_contra = TypeVar("RequestT_contra", bound=ModelRequest, contravariant=True)

OnDone = Callable[[AnswerT], Awaitable[None]]


class Prepared(Protocol):
    """A request ready for the engine."""

    model: str  # the name the answer carries: the model (version) that answers
    constraint: Constraint | None  # what the output is constrained to (structured output), checked before the engine
    engine: Generator  # what runs it: the pipeline may wrap it (`serving.continuation.Failover`)

    def schedule(self, scheduled: Scheduled, readings: Readings) -> None:
        """Run at this priority (`tenancy.priority`: the engine's, and the tier the answer names),
        measured into `readings` (the pipeline reports them)."""
        ...

    def token_budget(self) -> int:
        """Prompt plus the most the answer may take, for tokens-per-minute limits."""
        ...

    def output_tokens(self) -> int:
        """The most the answer may take: max_tokens for every choice of every prompt."""
        ...

    def sole(self) -> GenerationRequest | None:
        """Its generation when it makes exactly one (what a stream may continue on another model)."""
        ...


class Service(Protocol[RequestT_contra, PreparedT, AnswerT]):
    route: str  # the route it serves (part of the cache key)
    answer_type: type[AnswerT]
    task: Task  # what the model must do: a generating model, or an embedding one

    @property
    def upstream_path(self) -> str | None:
        """The same route on a remote upstream (relative to its /v1); None: embedded models only."""
        ...

    def prepare(
        self, request: RequestT_contra, engine: Engine, default_max_tokens: int | None, guard: RequestGuard = ...
    ) -> PreparedT: ...

    async def complete(self, prepared: PreparedT, on_done: OnDone[AnswerT] | None = None) -> AnswerT: ...

    def stream(self, prepared: PreparedT, on_done: OnDone[AnswerT] | None = None) -> AsyncGenerator[BaseModel | bytes, None]:
        ...

    def replay(self, answer: AnswerT, request: RequestT_contra) -> AsyncGenerator[BaseModel, None]: ...

    def fresh(self, answer: AnswerT) -> AnswerT: ...

    def renewed(self, raw: bytes) -> bytes | None:
        """A cached answer's stored JSON as `fresh` would answer it (new id and time), written
        without the model; None when only the model can."""
        ...


@runtime_checkable
class Forwards(Protocol[RequestT_contra, PreparedT_co]):
    """A service that also serves remote models (chat, completions, embeddings): the request as a
    remote upstream is sent it, prepared for the same `complete` and `stream`."""

    def forwarded(self, request: RequestT_contra, forward: Forward, backend: Generator, guard: RequestGuard) -> PreparedT_co:
        ...


def check_task(info: ModelInfo, task: Task, route: str) -> None:
    """A generating route on an embedding model, or /v1/embeddings on a generating one: a 400."""
    if info.task == task:
        return
    if info.task == "embed":
        message = f"The model '{info.name}' is an embedding model: use it with /v1/embeddings, not {route}"
    else:
        message = f"The model '{info.name}' does not make embeddings: {route} needs an embedding model"
    raise InvalidRequest(message, "model")
