"""Lifecycle (pure ASGI): the count of API requests in progress, and refusing new ones while the
server drains. `gateway.server.http` starts the drain on SIGTERM and waits for the count to reach 0.
Work that outlives its request (a background response) holds the count too (`Lifecycle.hold`), so
that a drain lets it finish as well, within the same timeout.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import ServiceUnavailable, dialect_of, send_error


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # API requests in progress (ops routes not counted), and held work

    def start_drain(self) -> None:
        self.draining = True

    def hold(self) -> Callable[[], None]:
        """Count work in progress until the returned call (the first call; later ones change nothing)."""
        self.active += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.active -= 1

        return release


class LifecycleMiddleware:
    """`ops_paths` (from the route table) are neither counted nor refused: probes keep answering."""

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
