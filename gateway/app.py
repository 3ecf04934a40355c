"""The app factory: routes, the error mapping, middleware, and the engines' lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import structlog
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.errors import EngineError
from engine.types import Engine
from gateway.disconnect import ClientDisconnected
from gateway.errors import APIError, from_exception
from gateway.generation import ModelRegistry
from gateway.logs import AccessLogMiddleware
from gateway.routes import routes
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


def create_app(settings: Settings, engine_factory: EngineFactory = embedded_engines) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, GatewayState]]:
        engines = engine_factory(settings)
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
        routes=routes,
        middleware=[Middleware(AccessLogMiddleware)],
        exception_handlers={
            cls: error_response
            for cls in (APIError, ValidationError, EngineError, HTTPException, ClientDisconnected, Exception)
        },
        lifespan=lifespan,
    )
