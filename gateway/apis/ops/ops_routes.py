"""Operations routes: liveness, readiness, the Prometheus exposition and the router's page."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.telemetry import metrics, router
from gateway.web.requests import state_of


async def prometheus(request: Request) -> Response:
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


async def router_metrics(request: Request) -> Response:
    backends = state_of(request).models.backends.values()
    # each engine once (an adapter's is its base's), each admission queue once (an adapter may share its base's)
    loads = [backend.engine.load() for backend in backends if backend.engine is not None and backend.base is None]
    waiting = sum(admission.waiting for admission in {id(b.admission): b.admission for b in backends}.values())
    return Response(router.page(loads, waiting), media_type=router.CONTENT_TYPE)


async def _failure(check: Awaitable[None]) -> str | None:
    """What is wrong with a model by its health check (None: healthy), waiting 5 s at most."""
    try:
        async with asyncio.timeout(5):  # not wait_for: on Python 3.11 it can swallow the caller's cancel
            await check
    except Exception as exc:  # any failure of a health check
        return str(exc)
    return None


async def health(request: Request) -> Response:
    """Liveness: 200 while every embedded engine is alive. A dead engine never comes back in this process, so 503 lets
    the orchestrator restart us; remote upstreams are not checked (restarting cures nothing there)."""
    dead = {}
    for name, engine in state_of(request).models.engines():
        if (failure := await _failure(engine.check_health())) is not None:
            dead[name] = f"dead: {failure}"
    if dead:
        return JSONResponse({"status": "dead", "models": dead}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    state = state_of(request)
    models = {}
    for name, backend in state.models.backends.items():
        failure = await _failure(backend.generator.check_health())
        models[name] = "ready" if failure is None else f"unavailable: {failure}"
    ok = all(status == "ready" for status in models.values()) and not state.lifecycle.draining
    status = "ready" if ok else ("draining" if state.lifecycle.draining else "unavailable")
    return JSONResponse({"status": status, "models": models}, status_code=200 if ok else 503)
