"""One model's try at a request (`dispatch` tries the models in order). Per try: prepare (all
refusals, and the request's bounds: prompts, output tokens; for the engine a tokenized prompt, for
a remote upstream the request it is forwarded, its tokens estimated), the key's tokens per minute
and budgets (`tenancy.quota`), the response cache (scoped per tenant), admission (as many permits
as engine requests, by the key's priority class), then the generation: one path for both backends."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Callable
from typing import Generic

from pydantic import BaseModel

from engine.types import Engine, Forward
from gateway.backends.admission import Permit
from gateway.backends.registry import Backend
from gateway.backends.upstream import estimate, per_choice, with_defaults
from gateway.errors import InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.guards.inbound import guarded
from gateway.pipeline.answer import Answer, Event, Stream, Whole, primed
from gateway.pipeline.context import RequestContext
from gateway.pipeline.disconnect import unless_gone
from gateway.pipeline.state import GatewayState
from gateway.protocol.openai import ChatCompletionRequest
from gateway.serving import offload, structured
from gateway.serving.continuation import Failover, Onward, Prior
from gateway.serving.generation import check_schema_numbers
from gateway.serving.meter import Readings
from gateway.serving.service import AnswerT, Forwards, OnDone, PreparedT, RequestT, Service, check_task
from gateway.serving.structured import Constraint
from gateway.stores.cache import Hit, Storer
from gateway.telemetry.record import RequestRecord
from gateway.telemetry.tracing import stage
from gateway.tenancy import priority
from gateway.tenancy.fairness import Served
from gateway.tenancy.tenants import KeyPolicy

Shape = Callable[[Event], BaseModel]  # answers and chunks in another form (the native API's)
# uvloop's timers and clock count whole milliseconds: the deadline's timer may fire just before the deadline by
# the loop's clock, and that TimeoutError is still the deadline's (not a 500)
TIMER_GRAIN_S = 0.002


class Attempt(Generic[RequestT, PreparedT, AnswerT]):
    def __init__(
        self,
        context: RequestContext,
        state: GatewayState,
        body: RequestT,
        service: Service[RequestT, PreparedT, AnswerT],
        shape: Shape | None,
        policy: KeyPolicy,
    ) -> None:
        self.context, self.state, self.body, self.service = context, state, body, service
        self.shape, self.policy = shape, policy
        self.guard = UNGUARDED  # the guard of the model being tried (`on`)
        # the class admission orders by, the engine's priority (a batch line's: the batch lane, below every key's)
        self.scheduled = context.lane or priority.of(policy, body)
        keys_scope = (state.settings.api_keys or state.tenants.enabled) and not state.settings.cache.shared_across_keys
        self.cache_scope = context.tenant if keys_scope else ""
        # what the generation measures, handed down and reported here (`_report`), once
        self.readings = Readings(started=context.record.arrival, log_content=context.record.log_content)
        self._reported = False
        self._prompt_tokens = 0  # the try's prompt (estimated for a remote upstream): fair shares count it
        self.arrived = context.arrived()
        self.deadline = context.deadline  # the first byte's; per model, the model's default when the client set none
        # (none once the response has begun: `prepared`)

    async def on(self, backend: Backend, guard: RequestGuard, onward: Onward | None = None,
                 prior: Prior | None = None) -> Answer:
        """The one journey on either backend, under `guard` (the request's on this model): its
        preparation (every refusal, the tokens to charge), the output bound, the charge, the cache,
        admission, then the generation, the permit held until the answer has been passed on; a
        stream that fails past its first byte goes on where `onward` says (`serving.continuation`);
        `prior`: the answer's first part, produced elsewhere, which this generation continues."""
        prepared = await self.prepared(backend, guard)
        on_done, hit = await self._cached(backend)
        if hit is not None:
            return self._replay(hit)
        failover = None
        if (onward is not None or prior is not None) and self.body.streams and prepared.sole() is not None:
            prepared.engine = failover = Failover(prepared.engine, onward, prior)  # past its first byte, on down the chain
            on_done = failover.unless_switched(on_done)
        permit = await self.admit(backend)
        if failover is not None:
            failover.release = permit.release
        try:
            answer = await self._generate(prepared, permit, on_done)
        except BaseException:
            permit.release()
            self._report()
            raise
        if isinstance(answer, Whole):
            self._report()
        return answer

    async def prepared(self, backend: Backend, guard: RequestGuard) -> PreparedT:
        """The request prepared for `backend` under `guard`: every refusal, the output bound, the charge."""
        self.guard, engine = guard, backend.engine
        default = backend.admission.settings.deadline_s
        if self.context.record.status is not None:  # its response has begun (a stream's next model, a later turn)
            self.deadline = None  # the deadline is its first byte's, sent: the queue's own wait bounds the rest
        elif self.context.deadline is None:
            self.deadline = None if default is None else self.arrived + default
        return await (self._remote(backend) if engine is None else self._embedded(backend, engine))

    def _report(self) -> None:
        """The generation's readings into the request's record (the access line, metrics, the
        trace, the charge's settlement), once; a fallback's add to those of the model before it."""
        if self._reported:
            return
        self._reported = True
        readings, record = self.readings, self.context.record
        if readings.prompt_tokens is not None:
            record.prompt_tokens = (record.prompt_tokens or 0) + readings.prompt_tokens
            record.completion_tokens = (record.completion_tokens or 0) + (readings.completion_tokens or 0)
        if record.ttft_s is None:
            record.ttft_s = readings.ttft_s
        if readings.prompt is not None:  # kept only with prompt logging on
            record.prompt = readings.prompt
        if readings.output:
            record.output = (record.output or []) + readings.output

    def _check_output(self, tokens: int) -> None:
        most = self.state.settings.max_output_tokens_per_request
        if tokens > most:
            raise InvalidRequest(
                f"This request may generate {tokens} tokens (max_tokens for each choice of each prompt); "
                f"at most {most} are allowed: lower max_tokens, n or best_of",
                "max_tokens",
            )

    async def _charge(self, tokens: int, reconcile: bool = False) -> None:
        if self.context.charge is None:  # a fallback does not charge the same request twice
            # settled at the request's end (middleware.auth), or the stream's (_held)
            self.context.charge = await self.state.quota.charge(self.policy, tokens, reconcile)
            self.context.record.response_headers.update(self.context.charge.headers)

    def _held(self) -> Callable[[], None]:
        """A stream's charge settles when the stream ends (it knows its tokens then), not when the
        handler returns (a background response's stream outlives its request)."""
        charge = self.context.charge
        if charge is None:
            return lambda: None
        charge.held = True
        record = self.context.record
        return lambda: charge.settle(record.prompt_tokens or 0, record.completion_tokens or 0)

    async def admit(self, backend: Backend) -> Permit:
        """As many permits as the engine requests this one makes, in the key's priority class. A
        client that leaves while it waits for them leaves the queue (499): it would hold its place
        there for up to `wait_timeout_s`, then run. While its engine cannot serve: refused at once (503)."""
        admission, count, key = backend.admission, self.body.engine_requests(), self.context.tenant
        if not backend.healthy:
            raise admission.unhealthy(backend.name)
        readings, before = self.readings, self.readings.generated  # a fallback's output counts from here
        served = Served(self._prompt_tokens, lambda: readings.generated - before, self._counted_since())
        gap_s = self._gap_s(backend)
        permit = admission.admit_now(count, key, served, self.deadline, gap_s)  # room, nobody ahead: no wait to watch
        if permit is not None:
            return permit
        with stage(self.context.record.trace, "gateway.admission.wait", **{"gateway.admission.permits": count}):
            waited = admission.acquire(count, self.scheduled.klass, key, served, self.deadline, gap_s)
            return await unless_gone(self.context.client_gone, waited)

    def _gap_s(self, backend: Backend) -> float | None:
        """A stream's bound on the wait for each next token, for admission's measured limit (`backends.capacity`):
        the client's (`RequestContext.gap_s`), else the model's default deadline, else none (inf); a whole answer: None."""
        if not self.body.streams:
            return None
        gap_s = self.context.gap_s if self.context.gap_s is not None else backend.admission.settings.deadline_s
        return math.inf if gap_s is None else gap_s

    def _counted_since(self) -> Callable[[], tuple[int, int] | None]:
        """The (prompt, output) tokens the generation counts from now (a fallback's after the model's
        before it); None while it has counted none."""
        readings = self.readings
        before = readings.prompt_tokens, readings.completion_tokens

        def since() -> tuple[int, int] | None:
            prompt, output = readings.prompt_tokens, readings.completion_tokens
            if prompt is None or (prompt, output) == before:
                return None
            return prompt - (before[0] or 0), (output or 0) - (before[1] or 0)

        return since

    async def _embedded(self, backend: Backend, engine: Engine) -> PreparedT:
        check_task(engine.info, self.service.task, self.service.route)
        default_max_tokens, size = self.state.settings.default_max_tokens, self.context.body_bytes
        with stage(self.context.record.trace, "gateway.prepare"):  # template, tokens, input guards
            if offload.inline(size):  # nearly always: no coroutine to await
                prepared = self.service.prepare(self.body, engine, default_max_tokens, self.guard)
            else:
                prepared = await offload.by_size(
                    size, self.service.prepare, self.body, engine, default_max_tokens, self.guard
                )
        self.context.release_body()  # read and tokenized: its bytes leave the in-flight budget
        prepared.model = backend.name
        prepared.schedule(self.scheduled, self.readings)
        self._check_output(prepared.output_tokens())
        self._prompt_tokens = prepared.token_budget() - prepared.output_tokens()
        if prepared.constraint is not None:
            await self._constrained(backend, prepared.constraint, size)
        await self._charge(prepared.token_budget())
        return prepared

    async def _constrained(self, backend: Backend, constraint: Constraint, size: int) -> None:
        """A structured-output constraint within its bounds and compiled by the model's grammar
        compiler (`serving.structured`), before any quota, cache or engine: a client that leaves
        meanwhile stops its compile."""
        limits = self.state.settings.structured_output
        await offload.by_size(size, structured.check_constraint, constraint, limits)
        if backend.grammar is None:
            return
        with stage(self.context.record.trace, "gateway.structured.compile"):
            compiled = structured.compile_constraint(backend.grammar, constraint, limits)
            await unless_gone(self.context.client_gone, compiled)

    def _on_close(self, permit: Permit) -> Callable[[], None]:
        settle = self._held()

        def close() -> None:
            permit.release(self._paced())
            self._report()
            settle()

        return close

    def _paced(self) -> int | None:
        """The output tokens the model's measured capacity learns the engine's pace from: none from an
        answer cut short (a client gone after its first tokens held its permit for the queue and the
        prefill; a flood of them would shrink every key's limit)."""
        return self.readings.completion_tokens if self.readings.ended else None

    async def _cached(self, backend: Backend) -> tuple[OnDone[AnswerT] | None, Hit[AnswerT] | None]:
        """(where to store the answer, or the answer found) in the response cache, scoped per tenant
        (a guarded answer under a key of its own), under what answers now (`Backend.identity`)."""
        record, cache = self.context.record, self.state.cache
        model = backend.name + self.guard.cache_tag
        key = cache.key_for(self.service.route, model, self.body, self.cache_scope, backend.identity)
        fresh, unstored = self.context.no_cache, self.context.no_store  # the request's Cache-Control
        if key is None or (fresh and unstored):
            record.response_headers["x-cache"] = "MISS"
            return None, None
        hit = None
        if not fresh:
            with stage(record.trace, "gateway.cache.lookup") as span:
                hit = await cache.get(key, backend.name, self.service.answer_type)
                if span is not None:
                    span.set_attribute("gateway.cache.hit", hit is not None)
        record.cache = "hit" if hit is not None else "miss"
        record.response_headers["x-cache"] = record.cache.upper()
        return (cache.storer(key) if hit is None and not unstored else None), hit

    async def _generate(self, prepared: PreparedT, permit: Permit, on_done: OnDone[AnswerT] | None) -> Answer:
        """The generation, up to its first byte by the deadline: past it, it is aborted (cancelled, as
        for a client gone) and refused."""
        gone, deadline = self.context.client_gone, self.deadline
        try:
            if self.body.streams:
                events = await unless_gone(gone, primed(self._shaped(self.service.stream(prepared, on_done))), deadline)
                permit.started()  # its first token (or its end): the limit may grow long before the stream ends
                return Stream(events, on_close=self._on_close(permit), on_left=permit.orphan, deadline=deadline)
            answer = await unless_gone(gone, self.service.complete(prepared, on_done), deadline)
        except TimeoutError:
            if deadline is None or asyncio.get_running_loop().time() < deadline - TIMER_GRAIN_S:
                raise  # not the deadline's
            raise permit.refuse("deadline_passed", "the request's deadline passed before its answer began") from None
        permit.release(self._paced())
        if self.shape is None and isinstance(on_done, Storer) and (written := on_done.written(answer)) is not None:
            return Whole(written)  # stored as the api layer writes it
        return Whole(self.shape(answer) if self.shape else answer)

    def _replay(self, hit: Hit[AnswerT]) -> Answer:
        if self.context.record.trace is not None:
            _traced_hit(self.context.record, hit.answer())
        if self.body.streams:
            return Stream(self._shaped(self.service.replay(hit.answer(), self.body)))
        if self.shape is None and (renewed := self.service.renewed(hit.raw)) is not None:
            return Whole(renewed)  # as the api layer writes it, unparsed
        answer = self.service.fresh(hit.answer())
        return Whole(self.shape(answer) if self.shape else answer)

    def _shaped(self, events: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
        """The events in the native API's shape; as they are (no layer per event) for the others."""
        return events if self.shape is None else _reshaped(events, self.shape)

    async def _remote(self, backend: Backend) -> PreparedT:
        """The request forwarded as the input guards let it through, with the model's defaults and
        the priority's fields; its tokens estimated for the charge and the output bound."""
        service, path = self.service, self.service.upstream_path
        if self.shape is not None:
            raise InvalidRequest("The native API serves embedded models only", "model")
        if not path or not isinstance(service, Forwards):
            raise InvalidRequest(f"{service.route} serves embedded models only; '{backend.name}' is remote", "model")
        with stage(self.context.record.trace, "gateway.prepare"):
            body = await offload.by_size(self.context.body_bytes, guarded, self.body, self.guard)
        self.context.release_body()
        payload = body.model_dump(mode="json", by_alias=True, exclude_unset=True)
        for key in ("messages", "tools", "tool_choice", "response_format"):  # free-form JSON: what orjson can write
            check_schema_numbers(payload.get(key), key)
        chat, most = isinstance(self.body, ChatCompletionRequest), self.state.settings.max_output_tokens_per_request
        # silent on max_tokens with no default: asked for its share of the bound, which a whole answer is held to too
        payload = with_defaults(payload, backend.defaults, chat, self.state.settings.default_max_tokens or per_choice(payload, most))
        payload = self.scheduled.forwarded(payload)
        if payload.get("stream"):  # its usage, to settle the charge with: the client gets it only if it asked
            payload["stream_options"] = {**(payload.get("stream_options") or {}), "include_usage": True}
        prompt, output = estimate(payload)
        self._check_output(output)
        self._prompt_tokens = prompt
        await self._charge(prompt + output, reconcile=True)
        forward = Forward(path, payload, prompt, per_choice(payload, most))
        prepared: PreparedT = service.forwarded(body, forward, backend.generator, self.guard)
        prepared.model = backend.name
        prepared.schedule(self.scheduled, self.readings)
        return prepared


def _traced_hit(record: RequestRecord, answer: BaseModel) -> None:
    """A cached answer's usage and finish reasons, for its trace (the access line counts no tokens
    for a hit: none were generated)."""
    assert record.trace is not None
    choices = getattr(answer, "choices", None) or ()
    record.trace.finished(getattr(choice, "finish_reason", None) for choice in choices)
    usage = getattr(answer, "usage", None)
    if usage is not None and record.trace.server.is_recording():
        record.trace.server.set_attributes({
            "gen_ai.usage.input_tokens": getattr(usage, "prompt_tokens", 0) or getattr(usage, "input_tokens", 0),
            "gen_ai.usage.output_tokens": getattr(usage, "completion_tokens", 0) or getattr(usage, "output_tokens", 0),
        })


async def _reshaped(events: AsyncGenerator[Event, None], shape: Shape) -> AsyncGenerator[Event, None]:
    try:
        async for event in events:
            yield shape(event)
    finally:
        await events.aclose()
