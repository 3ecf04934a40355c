"""From a validated request to an answer: pick the models it reaches (`access_of`, then
`ModelRegistry.reach`: alias, version, A/B split arm, fallback hops, only those the key may use),
then try them in order (`attempt.Attempt`: one model's try). Only
*fallible* errors (`gateway.errors`: the model overloaded, its engine dead, its upstream down),
which happen before the first byte, move on to the next model; the last one is the answer when no
model is left. A stream whose backend fails past its first byte goes on down the same chain
(`onward`: the answer so far continued by the next model that can, `serving.continuation`). The
request's `Charge` settles when its answer ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import structlog

from gateway.backends.registry import Access, Backend
from gateway.errors import APIError, BackendUnavailable, ClientDisconnected, InvalidRequest, from_exception
from gateway.guards.guarding import RequestGuard
from gateway.pipeline.answer import Answer
from gateway.pipeline.attempt import Attempt, Shape
from gateway.pipeline.context import RequestContext
from gateway.pipeline.state import GatewayState
from gateway.serving.continuation import Onward, Part, Prior
from gateway.serving.service import AnswerT, PreparedT, RequestT, Service
from gateway.telemetry import metrics
from gateway.tenancy.keys import ANONYMOUS
from gateway.tenancy.tenants import KeyPolicy

log = structlog.get_logger(__name__)


def policy_of(context: RequestContext, state: GatewayState) -> KeyPolicy:
    """The key's policy, as the rate limits read it (or read now, for a route they did not see)."""
    if context.policy is None:
        context.policy = state.tenants.policy(context.key_id)
    return context.policy


def access_of(context: RequestContext, state: GatewayState) -> Access:
    """The models the request's key may reach (the keys file's `models`; None: every model)."""
    return state.models.access(policy_of(context, state).models)


def _check_prompts(state: GatewayState, body: RequestT) -> None:
    most = state.settings.max_prompts_per_request
    if body.prompt_count() > most:
        raise InvalidRequest(
            f"This request has {body.prompt_count()} prompts; at most {most} are allowed", body.prompts_param
        )


def guard_on(context: RequestContext, state: GatewayState, asked: str, answering: str,
             before: RequestGuard | None) -> RequestGuard:
    """The request's guard on the model about to answer (`Guards.profile_for`: the key's profile, else
    the name asked for's, else the answering model's, so a fallback hop brings its own, else the
    default); the hop before's guard when the profile is the same, so what it noted is noted once."""
    record = context.record
    guard = state.guards.for_request(context.key_id, asked, answering, log_content=record.log_content)
    if before is not None and guard.profile is before.profile:
        return before
    if guard.active:  # its notes are the access line's (the same lists, filled as the request goes)
        if before is not None:  # the hop before's lists: a stream's output guard goes on past a switch
            guard.actions, guard.matches = before.actions, before.matches
        elif record.guards is not None and record.guard_matches is not None:  # an earlier model turn's (mcp)
            guard.actions, guard.matches = record.guards, record.guard_matches
        record.guards, record.guard_matches = guard.actions, guard.matches
    return guard


def onward(attempt: Attempt[RequestT, PreparedT, AnswerT], failed: str, rest: Sequence[Backend],
           guard: RequestGuard, origin: RequestT | None = None) -> Onward:
    """Where a stream goes when `failed` fails past its first byte: the next model of `rest` (the
    models after it that the key may reach, as `dispatch` resolved them) that takes the request
    continued after the text so far, prepared and admitted as any try (its guard `guard_on`'s, the
    charge the request's one); None when no model is left, or the answer cannot be continued.
    A model whose own guard profile checks output is passed over: the answer's output guard is the
    one it began under, which would let that model's text out unchecked. Each switch is named
    (`_switched`) once the model switched to answers."""
    context, state, hops, began = attempt.context, attempt.state, list(rest), guard.profile
    body = origin or attempt.body  # the text so far is the whole answer's: continued from the request as asked

    async def following(text: str, tokens: int) -> Part | None:
        nonlocal guard
        continued = body.continued(text, tokens)
        while continued is not None and hops:
            backend = hops.pop(0)
            guarded = guard_on(context, state, body.model, backend.name, guard)
            if guarded.profile is not began and guarded.checks_output:
                log.info("failover_skipped", model=backend.name, error="output_guard")
                continue
            fresh, guard = guarded is not guard, guarded
            hop = Attempt(context, state, continued[0], attempt.service, attempt.shape, attempt.policy)
            hop.readings = attempt.readings  # the one generation's: its fair share counts the tokens it makes
            try:
                prepared = await hop.prepared(backend, guard)
                generation = prepared.sole()
                if generation is None:
                    continue
                if fresh:  # its profile's moderation, which a stream's start runs (the first model's, the first's)
                    await guard.moderate_input()
                permit = await hop.admit(backend)
            except Exception as exc:  # this model cannot continue it (remote for an embedded-only API, busy)
                error = from_exception(exc)
                if isinstance(error, ClientDisconnected) or not (error.fallible or error.status < 500):
                    raise
                log.info("failover_skipped", model=backend.name, error=type(exc).__name__)
                continue
            generation = replace(generation, priority=hop.scheduled.priority)
            stop, include_stop = _stops(body)
            return Part(prepared.engine, generation, permit.release, continued[1], switched(backend.name),
                        stop=stop, include_stop=include_stop)
        return None

    def switched(following: str) -> Callable[[], None]:
        def started() -> None:  # named once it answers: a model that refuses to continue is no switch
            nonlocal failed
            _switched(context, failed, following)
            failed = following

        return started

    return following


def _stops(body: RequestT) -> tuple[tuple[str, ...], bool]:
    """The request's stop strings and include_stop_str_in_output: one begun before a seam may end after it."""
    stop = getattr(body, "stop", None)
    return (stop,) if isinstance(stop, str) else tuple(stop or ()), getattr(body, "include_stop_str_in_output", False)


def _switched(context: RequestContext, failed: str, following: str) -> None:
    """A stream's switch of model, named in its access line, a metric and its trace."""
    record = context.record
    record.failover = [*(record.failover or []), f"{failed}>{following}"]
    metrics.labelled(metrics.STREAM_FAILOVERS, failed, following).inc()
    if record.trace is not None:
        record.trace.server.add_event("gateway.failover", {"gateway.failover.from": failed, "gateway.failover.to": following})


async def dispatch(
    context: RequestContext,
    state: GatewayState,
    body: RequestT,
    service: Service[RequestT, PreparedT, AnswerT],
    shape: Shape | None = None,
    prior: Prior | None = None,
    origin: RequestT | None = None,
) -> Answer:
    """`prior`: the answer's first part, produced elsewhere, which this one continues (`resume`); `origin`: then the
    request as asked (`body` is it continued), from which a failover past the seam continues the whole text."""
    record = context.record
    _check_prompts(state, body)
    policy = policy_of(context, state)
    sticky = body.user or (context.tenant if context.tenant != ANONYMOUS else None)
    reach = state.models.reach(body.model, state.models.access(policy.models), sticky)
    version, chain = reach.version, reach.chain
    record.model, record.version = body.model, version
    if record.trace is not None:
        record.trace.request(service.route, body.model, body)
    record.response_headers["x-model-version"] = version
    attempt = Attempt(context, state, body, service, shape, policy)
    failure: APIError | None = None
    guard: RequestGuard | None = None
    for at, backend in enumerate(chain):
        if failure is not None:
            metrics.labelled(metrics.FALLBACKS, chain[0].name, backend.name).inc()
        guard = guard_on(context, state, body.model, backend.name, guard)
        rest = chain[at + 1 :]
        try:
            answer = await attempt.on(backend, guard, onward(attempt, backend.name, rest, guard, origin) if rest else None,
                                      prior)
        except Exception as exc:
            error = from_exception(exc)
            if not error.fallible:
                raise  # the original, for the exception handler's log
            failure = error
            continue
        record.version = backend.name
        record.response_headers["x-served-model"] = backend.name
        return answer
    raise failure or BackendUnavailable("No model could answer")


async def resume(context: RequestContext, state: GatewayState, body: RequestT,
                 service: Service[RequestT, PreparedT, AnswerT], text: str, tokens: int,
                 shape: Shape | None = None) -> Answer:
    """An answer whose generation was lost with the process that ran it, answered on from `text`
    (its first `tokens`) on any replica: the request continued (`ModelRequest.continued`) on the one
    journey (`dispatch`: the key's reach, guards, charge, admission, fallbacks), seamed to `text` as a
    failover's next part is (`serving.continuation.joined`: the whitespace held back not sent twice, a
    stop string spanning the seam, what is left of the answer's bound). The answer holds the
    continuation's events only (the caller splices them after those already sent, under their ids)."""
    continued = body.continued(text, tokens)
    if continued is None:
        raise BackendUnavailable("This answer cannot be continued on another model (tool calls, structured output, n > 1)")
    stop, include_stop = _stops(body)
    most = getattr(body, "max_completion_tokens", None) or getattr(body, "max_tokens", None)
    prior = Prior(text, tokens, most, continued[1], stop, include_stop)
    return await dispatch(context, state, continued[0], service, shape, prior, origin=body)
