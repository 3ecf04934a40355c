"""From a validated request to an answer: pick the model (alias, A/B split), then try it and its
fallbacks in order. Per attempt: prepare (all refusals), tokens-per-minute, the response cache,
admission, then the engine or the remote upstream. Only failures that happen before the first
byte and are the model's (dead, overloaded, upstream down) move on to the next model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from engine.errors import EngineUnavailable
from gateway import chat, completions, metrics, offload
from gateway.admission import Overloaded, Permit
from gateway.auth import ANONYMOUS
from gateway.disconnect import unless_disconnected
from gateway.errors import InvalidRequest, ServiceUnavailable
from gateway.logs import current_record
from gateway.protocol import ChatCompletion, Completion
from gateway.registry import Backend
from gateway.sse import EventStreamResponse, primed
from gateway.state import GatewayState
from gateway.upstream import UpstreamFailed

FALLIBLE = (Overloaded, EngineUnavailable, UpstreamFailed)


@dataclass(frozen=True, slots=True)
class Service:
    """What differs between chat and completions, for the dispatcher."""

    route: str
    upstream_path: str
    module: ModuleType  # gateway.chat or gateway.completions: prepare, complete, stream, replay, fresh
    answer_type: type[BaseModel]


CHAT = Service("/v1/chat/completions", "/chat/completions", chat, ChatCompletion)
COMPLETIONS = Service("/v1/completions", "/completions", completions, Completion)


def _sticky_key(request: Request, body: Any) -> str | None:
    key_id = getattr(request.state, "api_key_id", ANONYMOUS)
    return body.user or (key_id if key_id != ANONYMOUS else None)


Shape = Callable[[BaseModel | bytes], BaseModel]


async def dispatch(
    request: Request, state: GatewayState, body: Any, service: Service, shape: Shape | None = None
) -> Response:
    """`shape` turns answers and chunks into another form (the native API's)."""
    record = current_record()
    version, chain = state.models.resolve(body.model, _sticky_key(request, body))
    record.model, record.version = body.model, version
    record.response_headers["x-model-version"] = version
    attempt = _Attempt(request, state, body, service, shape)
    failure: BaseException | None = None
    for backend in chain:
        if failure is not None:
            metrics.FALLBACKS.labels(chain[0].name, backend.name).inc()
        try:
            response = await attempt.on(backend)
        except FALLIBLE as exc:
            failure = exc
            continue
        record.version = backend.name
        record.response_headers["x-served-model"] = backend.name
        return response
    raise _final_error(failure)


def _final_error(failure: BaseException | None) -> BaseException:
    if isinstance(failure, Overloaded):
        return failure.error
    if isinstance(failure, UpstreamFailed):
        return ServiceUnavailable(str(failure))
    return failure or ServiceUnavailable("No model could answer")


class _Attempt:
    def __init__(self, request: Request, state: GatewayState, body: Any, service: Service, shape: Shape | None) -> None:
        self.request, self.state, self.body, self.service = request, state, body, service
        self.shape = shape
        self.key_id = getattr(request.state, "api_key_id", ANONYMOUS)
        self.charged = False
        self.no_cache = "no-cache" in request.headers.get("cache-control", "").lower()

    async def on(self, backend: Backend) -> Response:
        if backend.upstream is not None:
            return await self._remote(backend)
        return await self._embedded(backend)

    def _charge(self, tokens: int) -> None:
        if not self.charged:  # a fallback does not charge the same request twice
            self.state.limiter.take_tokens(self.key_id, tokens)
            self.charged = True

    async def _embedded(self, backend: Backend) -> Response:
        module, record = self.service.module, current_record()
        assert backend.engine is not None
        settings = self.state.settings
        prepared = await offload.by_size(
            self.request.state.body_bytes, module.prepare, self.body, backend.engine, settings.default_max_tokens
        )
        prepared.model = backend.name
        self._charge(prepared.token_budget())
        cache = self.state.cache
        key = cache.key_for(self.service.route, backend.name, self.body, self.no_cache)
        if key is not None:
            hit = await cache.get(key, backend.name, self.service.answer_type)
            record.cache = "hit" if hit is not None else "miss"
            record.response_headers["x-cache"] = record.cache.upper()
            if hit is not None:
                return self._replay(hit)
            prepared.on_done = lambda answer: cache.put(key, answer)
        else:
            record.response_headers["x-cache"] = "MISS"
        permit = await backend.admission.acquire()
        try:
            return await self._generate(prepared, permit)
        except BaseException:
            permit.release()
            raise

    async def _generate(self, prepared: Any, permit: Permit) -> Response:
        module, receive = self.service.module, self.request.receive
        if self.body.stream:
            events = await unless_disconnected(receive, primed(self._shaped(module.stream(prepared))))
            return EventStreamResponse(events, on_close=permit.release)
        answer = await unless_disconnected(receive, module.complete(prepared))
        permit.release()
        if prepared.on_done is not None:
            await prepared.on_done(answer)
        return json_response(self.shape(answer) if self.shape else answer)

    def _replay(self, hit: BaseModel) -> Response:
        module = self.service.module
        if self.body.stream:
            return EventStreamResponse(self._shaped(module.replay(hit, self.body)))
        answer = module.fresh(hit)
        return json_response(self.shape(answer) if self.shape else answer)

    async def _shaped(self, events: AsyncIterator[BaseModel | bytes]) -> AsyncIterator[BaseModel | bytes]:
        if self.shape is None:
            async for event in events:
                yield event
            return
        try:
            async for event in events:
                yield self.shape(event)
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    async def _remote(self, backend: Backend) -> Response:
        assert backend.upstream is not None
        if self.shape is not None:
            raise InvalidRequest("The native API serves embedded models only", "model")
        permit = await backend.admission.acquire()
        payload = self.body.model_dump(mode="json", by_alias=True, exclude_unset=True)
        try:
            return await backend.upstream.forward(self.service.upstream_path, payload, self.body.stream, permit.release)
        except BaseException:
            permit.release()
            raise


def json_response(model: BaseModel, status: int = 200) -> Response:
    body = model.__pydantic_serializer__.to_json(model, exclude_none=True)
    return Response(body, status_code=status, media_type="application/json")

