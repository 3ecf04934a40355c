"""Embeddings: input(s) → token ids → the backend's `embed` (the engine: one request each, batched;
a remote upstream: the request forwarded) → CreateEmbeddingResponse, as floats or base64
(little-endian float32, as OpenAI sends them), one path for both backends.

`input` is a string, a list of strings, a list of token ids or a list of lists of them; each item is
one vector, answered at its index. `dimensions` asks a Matryoshka model for a shorter vector; other
models answer 400 unless it is their own size. Embeddings do not stream.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pydantic import BaseModel

from engine.types import EmbedRequest, Engine, Forward, Generator, ModelInfo, Task
from gateway.apis.embeddings.embeddings_wire import CreateEmbeddingResponse, Embedding, EmbeddingUsage
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.serving.generation import check_token_ids, new_id
from gateway.serving.meter import Meter, Readings
from gateway.serving.service import OnDone
from gateway.serving.structured import Constraint
from gateway.tenancy.priority import Scheduled


@dataclass(slots=True)
class PreparedEmbeddings:
    request: EmbeddingRequest
    engine: Generator
    embed: EmbedRequest  # the engine's token ids, or the request a remote upstream is forwarded
    model: str  # the name the answer carries: the model (version) that answers
    guard: RequestGuard = UNGUARDED
    constraint: Constraint | None = None  # vectors: nothing to constrain
    readings: Readings = field(default_factory=Readings)  # its tokens, for the pipeline

    def schedule(self, scheduled: Scheduled, readings: Readings) -> None:
        """Embeddings run in arrival order (only admission reads the class)."""
        self.readings = readings

    def token_budget(self) -> int:
        return sum(len(ids) for ids in self.embed.inputs)

    def output_tokens(self) -> int:
        return 0  # vectors, no generated tokens

    def sole(self) -> None:
        return None  # vectors: nothing to continue


def _token_ids(request: EmbeddingRequest, engine: Engine, guard: RequestGuard) -> list[list[int]]:
    """Each input's token ids, its text (token-id inputs decoded) through the input guards first (a blocked one
    raises ContentPolicyViolation)."""
    value = request.input
    texts = [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)]
    if isinstance(value, str) or len(texts) == len(value):
        return [engine.tokenizer.encode(text) for text in guard.check_input(texts, "input")]
    singles = [v for v in value if isinstance(v, int)]
    lists = [singles] if len(singles) == len(value) else [list(v) for v in value if isinstance(v, list)]
    for ids in lists:
        check_token_ids(ids, engine.info.extra.get("vocab_size"), "input")
    if not guard.active:
        return lists
    decoded = [engine.tokenizer.decode(ids) for ids in lists]
    checked = guard.check_input(decoded, "input")
    return [ids if text == seen else engine.tokenizer.encode(text) for ids, text, seen in zip(lists, checked, decoded, strict=True)]


def _dimensions(requested: int | None, info: ModelInfo) -> int | None:
    """The length asked of the engine; None: the model's own."""
    size = info.embedding_size
    if requested is None or requested == size:
        return None
    if not info.matryoshka:
        raise InvalidRequest(
            f"The model '{info.name}' makes {size}-dimension embeddings and cannot shorten them (it is not a "
            f"Matryoshka model): leave 'dimensions' out", "dimensions",
        )
    if size is not None and requested > size:
        raise InvalidRequest(f"'dimensions' must be at most {size} for the model '{info.name}'", "dimensions")
    return requested


def _encoded(vector: list[float] | str, encoding_format: str) -> list[float] | str:
    """A vector as asked; one a remote upstream sent as base64 (it was asked so) as it came."""
    if encoding_format == "base64" and not isinstance(vector, str):
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


class EmbeddingsService:
    """/v1/embeddings for the dispatcher (`serving.service.Service`); remote upstreams get it as is."""

    route = "/v1/embeddings"
    upstream_path: str | None = "/embeddings"
    answer_type = CreateEmbeddingResponse
    task: Task = "embed"

    def prepare(
        self, request: EmbeddingRequest, engine: Engine, default_max_tokens: int | None,
        guard: RequestGuard = UNGUARDED,
    ) -> PreparedEmbeddings:
        """Every refusal before the engine: input guards, vocabulary, context length, dimensions."""
        inputs = _token_ids(request, engine, guard)
        limit = engine.info.max_model_len
        for i, ids in enumerate(inputs):
            if len(ids) > limit:
                raise ContextLengthExceeded(
                    f"This model's maximum context length is {limit} tokens. However, input {i} has {len(ids)} "
                    "tokens. Please reduce the length of the input.", param="input",
                )
        embed = EmbedRequest(new_id("embd"), inputs, _dimensions(request.dimensions, engine.info))
        return PreparedEmbeddings(request, engine, embed, request.model, guard)

    @staticmethod
    def forwarded(request: EmbeddingRequest, forward: Forward, backend: Generator, guard: RequestGuard) -> PreparedEmbeddings:
        """A remote model's request (its input guarded already), forwarded as it is."""
        return PreparedEmbeddings(request, backend, EmbedRequest(new_id("embd"), [], forward=forward), request.model, guard)

    async def complete(
        self, prepared: PreparedEmbeddings, on_done: OnDone[CreateEmbeddingResponse] | None = None
    ) -> CreateEmbeddingResponse:
        """The backend's vectors, measured (in flight, time to the answer, its prompt tokens)."""
        await prepared.guard.moderate_input()
        meter = Meter(prepared.engine.info.name, prepared.readings)
        meter.begin()
        try:
            embedded = await prepared.engine.embed(prepared.embed)
            meter.token()
        finally:
            meter.end()
        meter.count(embedded.prompt_tokens, 0)
        prepared.readings.ended = True  # whole: the model's capacity learns from it
        encoding = prepared.request.encoding_format
        data = [Embedding(index=i, embedding=_encoded(vector, encoding)) for i, vector in enumerate(embedded.vectors)]
        tokens = embedded.prompt_tokens
        usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
        answer = CreateEmbeddingResponse(data=data, model=prepared.model, usage=usage)
        if on_done is not None:
            await on_done(answer)
        return answer

    def stream(
        self, prepared: PreparedEmbeddings, on_done: OnDone[CreateEmbeddingResponse] | None = None
    ) -> AsyncGenerator[bytes, None]:
        raise InvalidRequest("Embeddings do not stream")  # EmbeddingRequest.streams is always False

    def replay(self, answer: CreateEmbeddingResponse, request: EmbeddingRequest) -> AsyncGenerator[BaseModel, None]:
        raise InvalidRequest("Embeddings do not stream")

    def fresh(self, answer: CreateEmbeddingResponse) -> CreateEmbeddingResponse:
        return answer

    def renewed(self, raw: bytes) -> bytes | None:
        return None  # never cached (no temperature or seed); `fresh` would do


EMBEDDINGS = EmbeddingsService()
