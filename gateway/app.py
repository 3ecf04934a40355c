"""The app factory: routes, the error mapping, middleware, and the engines' lifespan."""

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

from engine.errors import EngineError
from engine.types import Engine, GenerationRequest, SamplingOptions
from gateway.disconnect import ClientDisconnected
from gateway.errors import APIError, from_exception
from gateway.generation import ModelRegistry
from gateway.logs import AccessLogMiddleware
from gateway.routes import all_routes
from gateway.settings import Settings
from gateway.state import GatewayState

log = structlog.get_logger(__name__)

EngineFactory = Callable[[Settings], dict[str, Engine]]


def embedded_engines(settings: Settings) -> dict[str, Engine]:
    from engine import start_engine

    engine = start_engine(settings.engine)
    return {engine.info.name: engine}


async def error_response(request: Request, exc: Exception) -> Response:
    if isinstance(exc, ClientDisconnected):
        log.info("client_disconnected")
        return Response(status_code=499)
    error = from_exception(exc)
    if error.status >= 500:
        log.error("request_failed", status=error.status, error=error.message, cause=repr(exc))
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def warm_up(name: str, engine: Engine) -> None:
    """One tiny JSON-constrained generation: compiles the structured-output grammar machinery."""
    started = time.perf_counter()
    prompt = engine.tokenizer.encode("{", add_special_tokens=False)
    request = GenerationRequest(f"warmup-{name}", prompt, SamplingOptions(max_tokens=2, json_object=True))
    async for _ in engine.generate(request):
        pass
    log.info("warmed_up", model=name, seconds=round(time.perf_counter() - started, 1))


def create_app(settings: Settings, engine_factory: EngineFactory = embedded_engines) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, GatewayState]]:
        engines = engine_factory(settings)
        if settings.warmup:
            for name, engine in engines.items():
                await warm_up(name, engine)
        state = GatewayState(settings=settings, models=ModelRegistry(engines))
        log.info("ready", models=sorted(engines))
        try:
            yield {"gateway": state}
        finally:
            state.draining = True
            for name, engine in engines.items():
                log.info("engine_shutdown", model=name)
                await engine.shutdown()

    return Starlette(
        routes=all_routes(),
        middleware=[Middleware(AccessLogMiddleware, log_content=settings.log_prompts)],
        exception_handlers={
            cls: error_response
            for cls in (APIError, ValidationError, EngineError, HTTPException, ClientDisconnected, Exception)
        },
        lifespan=lifespan,
    )
