"""API requests counted while in progress, and refused while the server drains."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ServiceUnavailable
from gateway.pipeline.lifecycle import Lifecycle
from gateway.web.error_render import dialect_of, send_error


class LifecycleMiddleware:
    """`ops_paths` are neither counted nor refused: probes keep answering during a drain."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, ops_paths: frozenset[str]) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.ops_paths = ops_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.ops_paths:
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            error = ServiceUnavailable("The server is shutting down; retry on another replica")
            await send_error(send, error, [(b"connection", b"close")], dialect_of(scope))
            return
        self.lifecycle.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.active -= 1
