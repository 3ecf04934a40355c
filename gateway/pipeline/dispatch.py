"""From a validated request to an answer: pick the models it reaches (`access_of`, then
`ModelRegistry.reach`: alias, version, A/B split arm, fallback hops, only those the key may use),
then try them in order (`attempt.Attempt`: one model's try). Only
*fallible* errors (`gateway.errors`: the model overloaded, its engine dead, its upstream down),
which happen before the first byte, move on to the next model; the last one is the answer when no
model is left. The request's `Charge` settles when its answer ends.
"""

from __future__ import annotations

from gateway.backends.registry import Access
from gateway.errors import APIError, BackendUnavailable, InvalidRequest, from_exception
from gateway.guards.guarding import RequestGuard
from gateway.pipeline.answer import Answer
from gateway.pipeline.attempt import Attempt, Shape
from gateway.pipeline.context import RequestContext
from gateway.pipeline.state import GatewayState
from gateway.serving.service import AnswerT, PreparedT, RequestT, Service
from gateway.telemetry import metrics
from gateway.tenancy.keys import ANONYMOUS
from gateway.tenancy.tenants import KeyPolicy


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
        if before is not None:
            guard.actions[:0], guard.matches[:0] = before.actions, before.matches
        record.guards, record.guard_matches = guard.actions, guard.matches
    return guard


async def dispatch(
    context: RequestContext,
    state: GatewayState,
    body: RequestT,
    service: Service[RequestT, PreparedT, AnswerT],
    shape: Shape | None = None,
) -> Answer:
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
    for backend in chain:
        if failure is not None:
            metrics.labelled(metrics.FALLBACKS, chain[0].name, backend.name).inc()
        guard = guard_on(context, state, body.model, backend.name, guard)
        try:
            answer = await attempt.on(backend, guard)
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
