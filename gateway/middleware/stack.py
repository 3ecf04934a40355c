"""The middleware stack, outermost first: access log, HTTP edge, traces, lifecycle, auth and limits, bodies."""

from __future__ import annotations

from starlette.middleware import Middleware

from gateway.middleware.access_log import AccessLogMiddleware
from gateway.middleware.auth import AuthMiddleware
from gateway.middleware.body import BodyBudget, BodyMiddleware
from gateway.middleware.drain import LifecycleMiddleware
from gateway.middleware.edge import EdgeMiddleware
from gateway.middleware.trace_context import TracingMiddleware
from gateway.pipeline.lifecycle import Lifecycle
from gateway.settings import Settings
from gateway.telemetry.tracing import Tracing
from gateway.tenancy.keys import Authenticator, KeyRing
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants
from gateway.web.table import RouteTable


def stack(
    settings: Settings, lifecycle: Lifecycle, quota: Quota, tenants: Tenants, table: RouteTable,
    tracing: Tracing | None, authenticator: Authenticator,
) -> list[Middleware]:
    """`tracing` None: no tracing layer at all, so nothing to pay per request."""
    keyless = table.paths("open") if settings.auth_ops_routes else table.paths("open", "ops")
    throttle = authenticator.throttle  # unknown admin keys count against the same addresses
    admin = Authenticator(KeyRing(settings.admin_keys, settings.key_id_secret), throttle, None, authenticator.proxies) \
        if settings.admin_keys else None
    traced = [] if tracing is None else [
        Middleware(TracingMiddleware, tracing=tracing, route_label=table.label, log_content=settings.log_prompts)
    ]
    return [
        Middleware(AccessLogMiddleware, route_label=table.label, log_content=settings.log_prompts,
                   dialect=table.dialect),
        Middleware(EdgeMiddleware, max_headers=settings.max_request_headers,
                   max_header_bytes=settings.max_request_header_bytes, free_tails=table.free_tails()),
        *traced,
        Middleware(LifecycleMiddleware, lifecycle=lifecycle, ops_paths=table.paths("ops")),
        Middleware(AuthMiddleware, authenticator=authenticator, quota=quota, tenants=tenants, open_paths=keyless,
                   admin=admin, admin_paths=table.paths("admin"), upload_paths=table.upload_paths(),
                   per_call_paths=table.per_call_paths()),
        Middleware(BodyMiddleware, budget=BodyBudget(settings.max_body_bytes_in_flight), timeout_s=settings.body_timeout_s,
                   upload_paths=table.upload_paths(), upload_timeout_s=settings.files.upload_timeout_s),
    ]
