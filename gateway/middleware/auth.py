"""API keys and their limits (pure ASGI): who is asking, into the request's context, or a refusal in the route's error
shape (without admin keys the admin routes do not exist: 404). On the API routes then the key's policy
(`tenancy.tenants`) and its requests per minute (`tenancy.quota`), and at the end its usage counted and its token
charge settled. Tokens per minute and budgets are taken later, by the pipeline, once the prompt is known."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError, no_route
from gateway.pipeline.context import context_of
from gateway.tenancy.keys import Authenticator
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants
from gateway.web.error_render import dialect_of, send_error


class AuthMiddleware:
    def __init__(self, app: ASGIApp, authenticator: Authenticator, quota: Quota, tenants: Tenants,
                 open_paths: frozenset[str], admin: Authenticator | None = None,
                 admin_paths: frozenset[str] = frozenset(), upload_paths: frozenset[str] = frozenset(),
                 per_call_paths: frozenset[str] = frozenset()) -> None:
        """`per_call_paths`: routes that take the key's requests per minute themselves, per call they make."""
        self.app = app
        self.authenticator, self.quota, self.tenants = authenticator, quota, tenants
        self.open, self.admin, self.admin_paths, self.upload_paths = open_paths, admin, admin_paths, upload_paths
        self.per_call = per_call_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        context = context_of(scope)
        admin = path in self.admin_paths
        try:
            authenticator = self.admin if admin else self.authenticator
            if authenticator is None:
                raise no_route()
            peer = (scope.get("client") or ("unknown",))[0]
            upload = path in self.upload_paths
            identity = authenticator.identify(scope["method"], scope.get("headers", ()), peer, upload)
            context.key_id, context.tenant = identity.key_id, identity.tenant
            context.record.api_key_id = identity.key_id
            if admin:  # no limits on the admin API
                policy = None
            else:
                policy = context.policy = self.tenants.policy(context.key_id)
                if policy.rpm is not None and path not in self.per_call:  # no coroutine for a key without one
                    context.record.response_headers.update(await self.quota.take_request(policy))
        except APIError as error:
            await send_error(send, error, dialect=dialect_of(scope))
            return
        try:
            await self.app(scope, receive, send)  # send unwrapped: the access log records the status
        finally:
            if policy is not None:
                record = context.record
                usage = (record.prompt_tokens or 0, record.completion_tokens or 0)
                self.quota.finish(policy, record.status or 500, context.charge, usage)
