"""The HTTP edge: what nginx and Envoy refuse before a request reaches a route, so that a proxy in front and
the gateway cannot read one request two ways (the parser's own refusals are `server.http.HeaderTimeout`'s)."""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import HeadersTooLarge, InvalidRequest, NotFound, no_route
from gateway.web.error_render import dialect_of, send_error

# framing, routing and identity headers: with `_` for `-` they are refused (400), since some proxies map `_` to
# `-` and others drop them, and the two would disagree on the request's length or sender
SMUGGLED = frozenset(name.replace("-", "_").encode() for name in (
    "content-length", "transfer-encoding", "host", "connection", "upgrade", "te", "trailer", "expect",
    "authorization", "x-api-key", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "forwarded",
    "x-real-ip", "proxy-authorization", "content-encoding", "content-type",
))
# a separator: `/`, and what a proxy may read as one (`\\`, and both encoded: in a `{name:path}` tail
# an encoded slash is part of the value, but `org%2F..` is still a dot segment to a proxy that decodes it)
_SEPARATOR = rb"(?:/|\\|%2f|%5c)"
DOT_SEGMENT = re.compile(rb"(?:^|" + _SEPARATOR + rb")(?:\.|%2e){1,2}(?:" + _SEPARATOR + rb"|$)", re.IGNORECASE)
ENCODED_SEPARATOR = re.compile(rb"%(?:2f|5c)", re.IGNORECASE)


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, max_headers: int, max_header_bytes: int, free_tails: tuple[str, ...]) -> None:
        self.app = app
        self.max_headers, self.max_header_bytes = max_headers, max_header_bytes
        self.free_tails = tuple(tail.encode() for tail in free_tails)

    def _refusal(self, scope: Scope) -> InvalidRequest | NotFound | HeadersTooLarge | None:
        headers = scope.get("headers", ())
        if len(headers) > self.max_headers:
            return HeadersTooLarge(f"Too many request headers: {len(headers)}, at most {self.max_headers}")
        size = sum(len(name) + len(value) + 4 for name, value in headers)  # `name: value\r\n`
        if size > self.max_header_bytes:
            return HeadersTooLarge(f"Request headers too large: {size} bytes, at most {self.max_header_bytes}")
        for name, _ in headers:
            if b"_" in name and name.lower().replace(b"-", b"_") in SMUGGLED:  # `X-Forwarded_For` too
                return InvalidRequest(f"Header name '{name.decode('latin-1')}' is refused: write it with '-', not '_'")
        path = (scope.get("raw_path") or scope["path"].encode()).partition(b"?")[0]
        # an encoded slash is part of the value only in a route's last `{name:path}` parameter (`/v1/models/org%2Fm`);
        # elsewhere it, or a dot segment anywhere, is a 404, never the route it decodes to
        routed = next((tail for tail in self.free_tails if path.startswith(tail)), path)
        if ENCODED_SEPARATOR.search(routed) or DOT_SEGMENT.search(path):
            return no_route()
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (error := self._refusal(scope)):
            # and the connection closed: a proxy in front may have read this request another way
            await send_error(send, error, [(b"connection", b"close")], dialect=dialect_of(scope))
            return
        await self.app(scope, receive, send)
