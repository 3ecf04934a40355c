"""API keys: who is asking, into the request's context, or a refusal in the route's error shape. Without admin
keys the admin routes do not exist (404)."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, no_route
from gateway.pipeline.context import context_of
from gateway.tenancy.keys import Authenticator
from gateway.web.error_render import dialect_of, send_error


class AuthMiddleware:
    def __init__(self, app: ASGIApp, authenticator: Authenticator, open_paths: frozenset[str],
                 admin: Authenticator | None = None, admin_paths: frozenset[str] = frozenset(),
                 upload_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.upload_paths = upload_paths
        self.open = open_paths
        self.authenticator = authenticator
        self.admin = admin
        self.admin_paths = admin_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        peer = (scope.get("client") or ("unknown",))[0]
        authenticator = self.authenticator
        try:
            if scope["path"] in self.admin_paths:
                if self.admin is None:
                    raise no_route()
                authenticator = self.admin
            upload = scope["path"] in self.upload_paths
            identity = authenticator.identify(scope["method"], scope.get("headers", ()), peer, upload)
        except APIError as error:
            await send_error(send, error, dialect=dialect_of(scope))
            return
        context = context_of(scope)
        context.key_id, context.tenant = identity.key_id, identity.tenant
        context.record.api_key_id = identity.key_id
        await self.app(scope, receive, send)
