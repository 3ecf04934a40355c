"""Requests per minute per API key (pure ASGI), after auth has named the key; the same routes as
auth. Tokens per minute are taken later, by the dispatcher, once the prompt is known."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import RateLimited, dialect_of, send_error
from gateway.limits import RateLimiter
from gateway.middleware.auth import ANONYMOUS


class RateLimitMiddleware:
    def __init__(self, app: ASGIApp, limiter: RateLimiter, open_paths: frozenset[str]) -> None:
        self.app = app
        self.limiter = limiter
        self.open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        try:
            self.limiter.take_request(scope.get("state", {}).get("api_key_id", ANONYMOUS))
        except RateLimited as error:
            await send_error(send, error, dialect=dialect_of(scope))
            return
        await self.app(scope, receive, send)
