"""Per API key (pure ASGI), after auth has named the key; the same routes as auth: the key's
policy (`tenancy.tenants`) into the request's context for the steps after, its requests per
minute (`tenancy.quota`), and at the end its usage counted and its token charge settled. Tokens
per minute and budgets are taken later, by the pipeline, once the prompt is known."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import RateLimited
from gateway.pipeline.context import context_of
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants
from gateway.web.error_render import dialect_of, send_error


class RateLimitMiddleware:
    def __init__(self, app: ASGIApp, quota: Quota, tenants: Tenants, open_paths: frozenset[str]) -> None:
        self.app = app
        self.quota = quota
        self.tenants = tenants
        self.open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        context = context_of(scope)
        policy = context.policy = self.tenants.policy(context.key_id)
        try:
            if policy.rpm is not None:  # no coroutine to make and await for a key without one
                context.record.response_headers.update(await self.quota.take_request(policy))
        except RateLimited as error:
            await send_error(send, error, dialect=dialect_of(scope))
            return
        try:
            await self.app(scope, receive, send)  # send unwrapped: the access log records the status
        finally:
            record = context.record
            usage = (record.prompt_tokens or 0, record.completion_tokens or 0)
            self.quota.finish(policy, record.status or 500, context.charge, usage)
