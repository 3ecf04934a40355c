"""Lifecycle: readiness, the count of requests in progress, and the graceful drain on SIGTERM.

On SIGTERM the server does not stop listening at once: readiness turns 503 (so the load balancer
takes the pod out), new requests get 503, requests and streams in progress finish for up to
`drain_timeout_s`, and only then does uvicorn shut down and the lifespan stop the engines.
"""

from __future__ import annotations

import signal
import time
from types import FrameType

import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ServiceUnavailable, send_error

log = structlog.get_logger(__name__)

OPS_ROUTES = frozenset({"/health", "/ready", "/metrics"})


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # API requests in progress (ops routes not counted)

    def start_drain(self) -> None:
        self.draining = True


class LifecycleMiddleware:
    """Counts API requests in progress and refuses new ones while draining (pure ASGI)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_ROUTES:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            error = ServiceUnavailable("The server is shutting down; retry on another replica")
            await send_error(send, error, [(b"connection", b"close")])
            return
        self.lifecycle.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.active -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM meaning: drain first, then exit. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self._drain_requested = False
        self._deadline = 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_requested and not self.should_exit:
            self._captured_signals.append(sig)
            self._drain_requested = True  # acted on in on_tick, outside the signal handler
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and not self.lifecycle.draining:
            self.lifecycle.start_drain()
            self._deadline = time.monotonic() + self.drain_timeout_s
            log.info("draining", in_flight=self.lifecycle.active, timeout_s=self.drain_timeout_s)
        if self.lifecycle.draining and not self.should_exit:
            if self.lifecycle.active == 0 or time.monotonic() >= self._deadline:
                log.info("drained", left_in_flight=self.lifecycle.active)
                self.should_exit = True
        return await super().on_tick(counter)
