"""From a validated request to an answer: pick the model (alias, A/B split; one the key may use),
then try it and its fallbacks in order. Per attempt: prepare (all refusals, and the request's
bounds: prompts, output tokens), the key's tokens per minute and budgets (`gateway.tenancy.quota`; a remote
model's tokens estimated), the response cache (scoped per tenant), admission (as many permits as
engine requests, by the key's priority class), then the engine or the remote upstream (its answer
read on the way: `serving.remote`). Only *fallible* errors (`gateway.errors`: the model overloaded,
its engine dead, its upstream down), which happen before the first byte, move on to the next
model; the last one is the answer when no model is left. The request's `Charge` settles when its
answer ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.disconnect import unless_disconnected
from gateway.api.requests import body_size, json_response
from gateway.api.sse import EventStreamResponse, primed, relayed_event_stream
from gateway.api.state import GatewayState
from gateway.backends.admission import Permit
from gateway.backends.registry import Backend
from gateway.backends.upstream import with_defaults
from gateway.errors import APIError, BackendUnavailable, InvalidRequest, ModelNotFound, from_exception
from gateway.middleware.auth import ANONYMOUS
from gateway.middleware.body import body_prepared
from gateway.protocol.openai import ChatCompletionRequest
from gateway.serving import offload, remote
from gateway.serving.guards.pipeline import RequestGuard
from gateway.serving.guards.requests import guarded
from gateway.serving.service import AnswerT, OnDone, PreparedT, RequestT, Service, check_task
from gateway.stores.cache import Hit, Storer
from gateway.telemetry import metrics
from gateway.telemetry.record import current_record
from gateway.tenancy.quota import Charge
from gateway.tenancy.tenants import KeyPolicy

Shape = Callable[[BaseModel | bytes], BaseModel]  # answers and chunks in another form (the native API's)


class JSONBytes(Response):
    """A 200 of JSON already written: what `Response(body, media_type="application/json")` makes
    (the same headers in the same order: content-length, content-type), without its rendering
    and header-building layers."""

    media_type = "application/json"

    def __init__(self, body: bytes) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [(b"content-length", b"%d" % len(body)), (b"content-type", b"application/json")]


class _Caller:
    """Who asks, as the middleware put it in the request's scope (`scope["state"]`, which
    `request.state` wraps): the tenant, the API key and its policy, read once."""

    __slots__ = ("tenant", "key_id", "policy")

    def __init__(self, request: Request, state: GatewayState) -> None:
        found = request.scope.get("state") or {}
        self.tenant = str(found.get("tenant", ANONYMOUS))
        self.key_id: str | None = found.get("api_key_id")
        policy = found.get("key_policy")  # the rate-limit middleware's
        if not isinstance(policy, KeyPolicy):
            policy = state.tenants.policy(found.get("api_key_id", ANONYMOUS))
        self.policy: KeyPolicy = policy

    def sticky_key(self, body: RequestT) -> str | None:
        return body.user or (self.tenant if self.tenant != ANONYMOUS else None)


def _check_prompts(state: GatewayState, body: RequestT) -> None:
    most = state.settings.max_prompts_per_request
    if body.prompt_count() > most:
        raise InvalidRequest(
            f"This request has {body.prompt_count()} prompts; at most {most} are allowed", body.prompts_param
        )


async def dispatch(
    request: Request,
    state: GatewayState,
    body: RequestT,
    service: Service[RequestT, PreparedT, AnswerT],
    shape: Shape | None = None,
) -> Response:
    record = current_record()
    _check_prompts(state, body)
    caller = _Caller(request, state)
    version, chain = state.models.resolve(body.model, caller.sticky_key(body))
    record.model, record.version = body.model, version
    if not caller.policy.allows(body.model, version):  # the keys file's `models`
        raise ModelNotFound(f"The model '{body.model}' does not exist or you do not have access to it.", "model")
    record.response_headers["x-model-version"] = version
    guard = state.guards.for_request(caller.key_id, body.model, version)
    attempt = _Attempt(request, state, body, service, guard, shape, caller)
    failure: APIError | None = None
    for backend in chain:
        if failure is not None:
            metrics.labelled(metrics.FALLBACKS, chain[0].name, backend.name).inc()
        try:
            response = await attempt.on(backend)
        except Exception as exc:
            error = from_exception(exc)
            if not error.fallible:
                raise  # the original, for the exception handler's log
            failure = error
            continue
        record.version = backend.name
        record.response_headers["x-served-model"] = backend.name
        return response
    raise failure or BackendUnavailable("No model could answer")


class _Attempt(Generic[RequestT, PreparedT, AnswerT]):
    def __init__(
        self,
        request: Request,
        state: GatewayState,
        body: RequestT,
        service: Service[RequestT, PreparedT, AnswerT],
        guard: RequestGuard,
        shape: Shape | None,
        caller: _Caller,
    ) -> None:
        self.request, self.state, self.body, self.service = request, state, body, service
        self.guard, self.shape = guard, shape
        self.policy = caller.policy
        self.charge: Charge | None = None
        keys_scope = (state.settings.api_keys or state.tenants.enabled) and not state.settings.cache.shared_across_keys
        self.cache_scope = caller.tenant if keys_scope else ""
        control = request.headers.getlist("cache-control")  # the first, as get(); no KeyError when absent
        self.no_cache = bool(control) and "no-cache" in control[0].lower()

    def on(self, backend: Backend) -> Awaitable[Response]:
        # the coroutine itself (no layer of its own to await)
        return self._remote(backend) if backend.upstream is not None else self._embedded(backend)

    def _check_output(self, tokens: int) -> None:
        most = self.state.settings.max_output_tokens_per_request
        if tokens > most:
            raise InvalidRequest(
                f"This request may generate {tokens} tokens (max_tokens for each choice of each prompt); "
                f"at most {most} are allowed: lower max_tokens, n or best_of",
                "max_tokens",
            )

    async def _charge(self, tokens: int, reconcile: bool = False) -> None:
        if self.charge is None:  # a fallback does not charge the same request twice
            self.charge = await self.state.quota.charge(self.policy, tokens, reconcile)
            self.request.state.charge = self.charge  # settled at the request's end (middleware.rate_limit)

    def _held(self) -> Callable[[], None]:
        """A stream's charge settles when the stream ends (it knows its tokens then), not when the
        handler returns (a background response's stream outlives its request)."""
        charge = self.charge
        if charge is None:
            return lambda: None
        charge.held = True
        return charge.settle

    async def _admit(self, backend: Backend) -> Permit:
        """As many permits as the engine requests this one makes, in the key's priority class. A
        client that leaves while it waits for them leaves the queue (499): it would hold its place
        there for up to `wait_timeout_s`, then run."""
        admission, count = backend.admission, self.body.engine_requests()
        permit = admission.admit_now(count)  # room, nobody ahead: no wait to watch (nearly always)
        if permit is not None:
            return permit
        return await unless_disconnected(self.request.receive, admission.acquire(count, self.policy.priority))

    async def _embedded(self, backend: Backend) -> Response:
        engine = backend.engine
        assert engine is not None
        check_task(engine.info, self.service.task, self.service.route)
        default_max_tokens, size = self.state.settings.default_max_tokens, body_size(self.request)
        if offload.inline(size):  # nearly always: no coroutine to await
            prepared = self.service.prepare(self.body, engine, default_max_tokens, self.guard)
        else:
            prepared = await offload.by_size(size, self.service.prepare, self.body, engine, default_max_tokens, self.guard)
        body_prepared(self.request.scope)  # read and tokenized: its bytes leave the in-flight budget
        prepared.model = backend.name
        self._check_output(prepared.output_tokens())
        await self._charge(prepared.token_budget())
        on_done, hit = await self._cached(backend)
        if hit is not None:
            return self._replay(hit)
        permit = await self._admit(backend)
        try:
            return await self._generate(prepared, permit, on_done)
        except BaseException:
            permit.release()
            raise

    def _on_close(self, permit: Permit) -> Callable[[], None]:
        settle = self._held()

        def close() -> None:
            permit.release()
            settle()

        return close

    async def _cached(self, backend: Backend) -> tuple[OnDone[AnswerT] | None, Hit[AnswerT] | None]:
        """(where to store the answer, or the answer found) in the response cache, scoped per tenant."""
        record, cache = current_record(), self.state.cache
        model = backend.name + self.guard.cache_tag
        key = cache.key_for(self.service.route, model, self.body, self.no_cache, self.cache_scope)
        if key is None:
            record.response_headers["x-cache"] = "MISS"
            return None, None
        hit = await cache.get(key, backend.name, self.service.answer_type)
        record.cache = "hit" if hit is not None else "miss"
        record.response_headers["x-cache"] = record.cache.upper()
        return (cache.storer(key) if hit is None else None), hit

    async def _generate(self, prepared: PreparedT, permit: Permit, on_done: OnDone[AnswerT] | None) -> Response:
        receive = self.request.receive
        if self.body.streams:
            events = await unless_disconnected(receive, primed(self._shaped(self.service.stream(prepared, on_done))))
            return EventStreamResponse(events, on_close=self._on_close(permit))
        answer = await unless_disconnected(receive, self.service.complete(prepared, on_done))
        permit.release()
        if self.shape is None and isinstance(on_done, Storer) and (written := on_done.written(answer)) is not None:
            return JSONBytes(written)  # stored as json_response writes it
        return json_response(self.shape(answer) if self.shape else answer)

    def _replay(self, hit: Hit[AnswerT]) -> Response:
        if self.body.streams:
            return EventStreamResponse(self._shaped(self.service.replay(hit.answer(), self.body)))
        if self.shape is None and (renewed := self.service.renewed(hit.raw)) is not None:
            return JSONBytes(renewed)  # as json_response writes it, unparsed
        answer = self.service.fresh(hit.answer())
        return json_response(self.shape(answer) if self.shape else answer)

    def _shaped(self, events: AsyncIterator[BaseModel | bytes]) -> AsyncIterator[BaseModel | bytes]:
        """The events in the native API's shape; as they are (no layer per event) for the others."""
        return events if self.shape is None else _reshaped(events, self.shape)

    async def _remote(self, backend: Backend) -> Response:
        assert backend.upstream is not None
        if self.shape is not None:
            raise InvalidRequest("The native API serves embedded models only", "model")
        if not self.service.upstream_path:
            route = self.service.route
            raise InvalidRequest(f"{route} serves embedded models only; '{backend.name}' is remote", "model")
        # input checks only: the answer passes through unread by the guards (redacted values stay placeholders)
        body = await offload.by_size(body_size(self.request), guarded, self.body, self.guard)
        body_prepared(self.request.scope)
        await self.guard.moderate_input()
        payload = body.model_dump(mode="json", by_alias=True, exclude_unset=True)
        payload = with_defaults(payload, backend.defaults, output_budget=isinstance(self.body, ChatCompletionRequest))
        prompt, output = remote.estimate(payload)
        await self._charge(prompt + output, reconcile=True)
        on_done, hit = await self._cached(backend)
        if hit is not None:
            return self._replay(hit)
        permit = await self._admit(backend)
        watch = remote.RemoteAnswer(backend.name, self.service.answer_type, prompt, on_done)
        try:
            path, streams = self.service.upstream_path, self.body.streams
            answer = await backend.upstream.forward(path, payload, streams, permit.release)
            if answer.events is None:
                await watch.whole(answer.status, answer.body)
                return Response(answer.body, status_code=answer.status, media_type=answer.media_type)
            watch.on_end = self._held()
            # up to its first event, so that an upstream failing before it can still fall back
            events = await unless_disconnected(self.request.receive, primed(watch.events(answer.events)))
            return relayed_event_stream(events, on_close=permit.release)
        except BaseException:
            permit.release()
            watch.end()
            raise


async def _reshaped(events: AsyncIterator[BaseModel | bytes], shape: Shape) -> AsyncIterator[BaseModel | bytes]:
    try:
        async for event in events:
            yield shape(event)
    finally:
        await events.aclose()  # type: ignore[attr-defined]
