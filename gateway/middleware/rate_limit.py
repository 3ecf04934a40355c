"""Per API key (pure ASGI), after auth has named the key; the same routes as auth: the key's
policy (`gateway.tenancy.tenants`) into the scope for the steps after, its requests per minute
(`gateway.tenancy.quota`), and at the end its usage counted and its token charge settled. Tokens per
minute and budgets are taken later, by the dispatcher, once the prompt is known."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import RateLimited, dialect_of, send_error
from gateway.middleware.auth import ANONYMOUS
from gateway.telemetry.record import current_record
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants


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
        state = scope.setdefault("state", {})
        policy = state["key_policy"] = self.tenants.policy(state.get("api_key_id", ANONYMOUS))
        try:
            if policy.rpm is not None:  # no coroutine to make and await for a key without one
                await self.quota.take_request(policy)
        except RateLimited as error:
            await send_error(send, error, dialect=dialect_of(scope))
            return
        try:
            await self.app(scope, receive, send)  # send unwrapped: the access log records the status
        finally:
            self.quota.finish(policy, current_record().status or 500, state.get("charge"))
