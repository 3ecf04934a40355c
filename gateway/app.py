"""The app factory: the route table's routes, the middleware stack, the one exception handler,
and the lifespan that starts the models (embedded engines, remote upstreams), the response
cache and the Responses API's store, and stops them after the drain.

Middleware, outermost first (`gateway/middleware/`): access log → lifecycle → auth → rate limits
→ request bodies, each given its paths by the route table (`gateway/api/routes.py`), then the
table's router (`TableRouter`) in place of Starlette's router and exception middleware. Errors the
handlers raise are answered by `error_response`; anything that escapes it, by the access log.
Paths are matched exactly: no slash redirects (a redirect would echo the client's Host header).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator, Iterator

import structlog
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp

from engine.errors import EngineError
from gateway.api.routes import TABLE
from gateway.api.state import GatewayState
from gateway.api.table import TableRouter
from gateway.backends import modelfile
from gateway.backends.startup import (
    EngineCheck,
    EngineStarter,
    build_registry,
    check_embedded,
    start_embedded,
    stop,
    warm_up,
)
from gateway.errors import APIError, dialect_of, from_exception, render
from gateway.middleware.access_log import AccessLogMiddleware
from gateway.middleware.auth import AttemptThrottle, AuthMiddleware, KeyRing
from gateway.middleware.body import BodyBudget, BodyMiddleware
from gateway.middleware.lifecycle import Lifecycle, LifecycleMiddleware
from gateway.middleware.rate_limit import RateLimitMiddleware
from gateway.serving.guards.pipeline import Guards
from gateway.settings import Settings
from gateway.stores.cache import ResponseCache, make_backend
from gateway.stores.responses import ResponseStore, make_store_backend
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants

log = structlog.get_logger(__name__)
# the errors `error_response` answers; unknown errors go up to the access log, which answers them
# within the request's log context (Starlette's own outermost handler would answer without
# X-Request-ID and raise on, resetting the connection)
HANDLED = (APIError, ValidationError, EngineError, HTTPException)


async def error_response(request: Request, exc: Exception) -> Response:
    """Every exception a handler raises, answered as its API error (`gateway.errors`)."""
    error = from_exception(exc)
    if error.status == 499:
        log.info("client_disconnected")
    elif error.status >= 500:
        # a traceback (without locals: gateway.telemetry.logs) for the server's own failures, not for refusals
        log.error("request_failed", status=error.status, error=error.message, exc_info=exc if error.status == 500 else None)
    status, headers, body = render(error, dialect_of(request.scope))
    response = Response(body, status_code=status)
    response.raw_headers = [*response.raw_headers, *headers]
    return response


@contextlib.contextmanager
def serving_heap(freeze: bool, young_threshold: int) -> Iterator[None]:
    """The garbage collector as the gateway serves, put back as it was when serving ends.

    - `freeze`: move what start-up built (modules, settings, models, tokenizers) out of the
      collector's sight, as vLLM's own server does after its start-up (`freeze_gc_heap`): its full
      passes then walk only what the requests allocate. On the echo engine, 64 requests in flight,
      this was +25-30% requests per second (the full passes over the start-up heap had stalled
      every request).
    - `young_threshold`: allocations between passes over the youngest objects (Python's default is
      700; 0 leaves it). Nearly everything a request allocates is freed by its reference count
      well before a pass, so the passes mostly walk the same objects in flight again; at 10,000 the
      gateway's CPU per request (benchmarks/app_cost.py, 64 in flight) was 3-7% lower.

    Refcounted objects are freed as before either way."""
    threshold = gc.get_threshold()
    if freeze:
        gc.collect()
        gc.freeze()
    if young_threshold:
        gc.set_threshold(young_threshold, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


class Gateway(Starlette):
    """Starlette's app with the route table's router innermost: Starlette's stack is its
    outermost error middleware, the app's middleware, its exception middleware and its router; here
    the last two are one `TableRouter` (the same answers, two layers and a regex scan fewer per
    request). Lifespan goes to Starlette's router, as before. Starlette's own exception handlers
    and body limit have no place in this stack: given, they are refused rather than ignored."""

    def build_middleware_stack(self) -> ASGIApp:
        if self.exception_handlers or getattr(self, "max_body_size", None) is not None:
            raise ValueError("errors are answered by error_response (HANDLED) and bodies bounded by our middleware")
        app: ASGIApp = TableRouter(self.router.routes, self.router, HANDLED, error_response)
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        return ServerErrorMiddleware(app, debug=self.debug)


def _middleware(settings: Settings, lifecycle: Lifecycle, quota: Quota, tenants: Tenants) -> list[Middleware]:
    keyless = TABLE.paths("open") if settings.auth_ops_routes else TABLE.paths("open", "ops")
    keys = KeyRing(settings.api_keys, settings.key_id_secret)
    throttle = AttemptThrottle(settings.auth_failures_per_minute)
    return [
        Middleware(AccessLogMiddleware, route_label=TABLE.label, log_content=settings.log_prompts,
                   dialect=TABLE.dialect),
        Middleware(LifecycleMiddleware, lifecycle=lifecycle, ops_paths=TABLE.paths("ops")),
        Middleware(AuthMiddleware, keys=keys, open_paths=keyless, throttle=throttle, tenants=tenants),
        Middleware(RateLimitMiddleware, quota=quota, tenants=tenants, open_paths=keyless),
        Middleware(BodyMiddleware, budget=BodyBudget(settings.max_body_bytes_in_flight), timeout_s=settings.body_timeout_s),
    ]


def tenants_of(settings: Settings) -> Tenants:
    """The keys file (none: only GATEWAY_API_KEYS), with the global limits for keys without their own."""
    return Tenants(settings.keys_file, settings.rate_limit_rpm, settings.rate_limit_tpm, settings.keys_reload_interval_s)


def create_app(
    settings: Settings,
    engine_starter: EngineStarter = start_embedded,
    lifecycle: Lifecycle | None = None,
    engine_check: EngineCheck | None = None,
    tenants: Tenants | None = None,
) -> Starlette:
    """Bad configuration (models file, guards, keys file, cache backend and, with `engine_check`,
    engine settings the model or platform cannot use) is refused here, before anything starts.
    `tenants`: the keys file, when the caller reloads it (the server, on SIGHUP); else read here."""
    models = modelfile.load(settings)
    guards = Guards.load(settings.guards_file, modelfile.guard_profiles(models))
    lifecycle = lifecycle or Lifecycle()
    tenants = tenants or tenants_of(settings)
    tenants.check(modelfile.public_names(models), frozenset(guards.profiles))
    guards.key_profile = tenants.guard_profile  # a key's profile in the keys file comes first
    quota = Quota(settings.limits)
    cache_backend = make_backend(settings.cache)
    if engine_check is not None:  # last: it imports vllm and reads the models
        check_embedded(models, settings, engine_check)
    store_backend = make_store_backend(settings.cache)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, GatewayState]]:
        registry = build_registry(models, settings, engine_starter)
        cache = ResponseCache(cache_backend)
        responses = ResponseStore(store_backend)
        try:
            if settings.warmup:
                for name, engine in registry.engines():
                    await warm_up(name, engine)
            state = GatewayState(settings, registry, lifecycle, quota, cache, guards, responses, tenants)
            log.info("ready", models=sorted(registry.backends), splits=sorted(registry.splits), aliases=sorted(registry.aliases))
            with serving_heap(settings.freeze_startup_heap, settings.gc_young_threshold):
                yield {"gateway": state}
        finally:
            lifecycle.start_drain()
            await responses.aclose()  # background responses stop before their engines do
            await stop(registry)
            if cache.backend is not None:
                await cache.backend.aclose()
            await guards.aclose()
            await quota.aclose()

    app = Gateway(routes=TABLE.routes(), middleware=_middleware(settings, lifecycle, quota, tenants), lifespan=lifespan)
    app.router.redirect_slashes = False
    return app
