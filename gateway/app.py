"""The app factory: routes, the error mapping, middleware, and the lifespan that starts the models
(embedded engines, remote upstreams), the response cache, and stops them after the drain."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

import structlog
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.config import EngineSettings
from engine.errors import EngineError
from engine.types import Engine, GenerationRequest, SamplingOptions
from gateway import modelfile
from gateway.admission import Admission
from gateway.auth import AuthMiddleware, KeyRing, RateLimiter
from gateway.cache import ResponseCache, make_backend
from gateway.disconnect import ClientDisconnected
from gateway.errors import APIError, from_exception
from gateway.lifecycle import Lifecycle, LifecycleMiddleware
from gateway.logs import AccessLogMiddleware
from gateway.registry import Backend, ModelRegistry, Split
from gateway.routes import all_routes
from gateway.settings import Settings
from gateway.state import GatewayState
from gateway.upstream import Upstream

log = structlog.get_logger(__name__)

EngineStarter = Callable[[EngineSettings], Engine]


def start_embedded(settings: EngineSettings) -> Engine:
    from engine import start_engine

    return start_engine(settings)


async def error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ClientDisconnected):
        log.info("client_disconnected")
        return Response(status_code=499)
    error = from_exception(exc)
    if error.status >= 500:
        log.error("request_failed", status=error.status, error=error.message, cause=repr(exc))
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def build_registry(models: modelfile.ModelsFile, settings: Settings, start: EngineStarter) -> ModelRegistry:
    backends: dict[str, Backend] = {}
    splits: dict[str, Split] = {}
    aliases: dict[str, str] = {}
    created = int(time.time())
    for spec in models.models:
        aliases.update({alias: spec.name for alias in spec.aliases})
        if spec.kind == "split":
            splits[spec.name] = Split(spec.name, list(spec.versions.items()), spec.sticky, created)
            continue
        backend = Backend(spec.name, Admission(spec.name, spec.admission or settings.admission), tuple(spec.fallback), created=created)
        if spec.kind == "remote":
            assert spec.url is not None
            backend.upstream = Upstream(spec.name, spec.url, spec.upstream_model or spec.name, spec.api_key,
                                        spec.timeout_s, spec.connect_timeout_s)
        else:
            log.info("engine_starting", model=spec.name)
            backend.engine = start(spec.engine_settings(settings.engine))
        backends[spec.name] = backend
    return ModelRegistry(backends, splits, aliases)


async def warm_up(name: str, engine: Engine) -> None:
    """One tiny JSON-constrained generation: compiles the structured-output grammar machinery."""
    started = time.perf_counter()
    prompt = engine.tokenizer.encode("{", add_special_tokens=False)
    request = GenerationRequest(f"warmup-{name}", prompt, SamplingOptions(max_tokens=2, json_object=True))
    async for _ in engine.generate(request):
        pass
    log.info("warmed_up", model=name, seconds=round(time.perf_counter() - started, 1))


async def _stop(registry: ModelRegistry, cache: ResponseCache) -> None:
    for name, backend in registry.backends.items():
        if backend.engine is not None:
            log.info("engine_shutdown", model=name)
            await backend.engine.shutdown()
        if backend.upstream is not None:
            await backend.upstream.aclose()
    if cache.backend is not None:
        await cache.backend.aclose()


def create_app(
    settings: Settings, engine_starter: EngineStarter = start_embedded, lifecycle: Lifecycle | None = None
) -> Starlette:
    """Bad configuration (models file, cache backend) is refused here, before anything starts."""
    models = modelfile.load(settings)
    lifecycle = lifecycle or Lifecycle()
    limiter = RateLimiter(settings.rate_limit_rpm, settings.rate_limit_tpm)
    cache_backend = make_backend(settings.cache)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, GatewayState]]:
        registry = build_registry(models, settings, engine_starter)
        cache = ResponseCache(cache_backend)
        try:
            if settings.warmup:
                for name, engine in registry.engines():
                    await warm_up(name, engine)
            state = GatewayState(settings, registry, lifecycle, limiter, cache)
            log.info("ready", models=sorted(registry.backends), splits=sorted(registry.splits), aliases=sorted(registry.aliases))
            yield {"gateway": state}
        finally:
            lifecycle.start_drain()
            await _stop(registry, cache)

    return Starlette(
        routes=all_routes(),
        middleware=[
            Middleware(AccessLogMiddleware, log_content=settings.log_prompts),
            Middleware(LifecycleMiddleware, lifecycle=lifecycle),
            Middleware(AuthMiddleware, keys=KeyRing(settings.api_keys), limiter=limiter, protect_ops=settings.auth_ops_routes),
        ],
        exception_handlers={
            cls: error_response
            for cls in (APIError, ValidationError, EngineError, HTTPException, ClientDisconnected, Exception)
        },
        lifespan=lifespan,
    )
