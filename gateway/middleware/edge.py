"""The HTTP edge (pure ASGI, just inside the access log): what nginx and Envoy refuse before a
request reaches a route, so that no proxy in front of the gateway and the gateway itself can
read one request two ways.

- A header name that is a framing or identity header with `_` for any `-` (`Transfer_Encoding`,
  `Content_Length`, `X_Forwarded_For`, `X-Forwarded_For`, ...): 400. Some proxies map `_` to `-`
  (or drop such headers, as nginx does by default), so the two would disagree on the request's length or sender.
- More headers than `max_request_headers`, or more bytes of them than `max_request_header_bytes`:
  431 (RFC 6585). (Past 64 KiB the server closes the connection before a request exists:
  `server.http.HeaderTimeout`.)
- A path whose raw form holds an encoded slash or backslash (`%2F`, `%5C`) or a dot segment
  (`.`, `..`, also percent-encoded, also between backslashes or encoded slashes): 404, as for any
  unknown path, never the route it decodes to.
  Only in the value of a route's last `{name:path}` parameter (a model id, `/v1/models/org%2Fm`,
  as the SDKs encode it) is an encoded slash part of that value.

What the parser itself refuses (a Content-Length with Transfer-Encoding, two Content-Lengths,
obs-folded lines, bad chunk sizes) is a 400 from `server.http.HeaderTimeout.send_400_response`.
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.api.errors import dialect_of, send_error
from gateway.errors import HeadersTooLarge, InvalidRequest, NotFound, no_route

# framing, routing and identity headers: with `_` for `-` they are refused, not read or ignored
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


def refusal(
    scope: Scope, max_headers: int, max_header_bytes: int, free_tails: tuple[bytes, ...] = ()
) -> InvalidRequest | NotFound | HeadersTooLarge | None:
    """Why the edge refuses this request, or None."""
    headers = scope.get("headers", ())
    if len(headers) > max_headers:
        return HeadersTooLarge(f"Too many request headers: {len(headers)}, at most {max_headers}")
    size = sum(len(name) + len(value) + 4 for name, value in headers)  # `name: value\r\n`
    if size > max_header_bytes:
        return HeadersTooLarge(f"Request headers too large: {size} bytes, at most {max_header_bytes}")
    for name, _ in headers:
        if b"_" in name and name.lower().replace(b"-", b"_") in SMUGGLED:  # `X-Forwarded_For` too
            return InvalidRequest(f"Header name '{name.decode('latin-1')}' is refused: write it with '-', not '_'")
    raw = scope.get("raw_path") or scope["path"].encode()
    path = raw.partition(b"?")[0]
    routed = next((tail for tail in free_tails if path.startswith(tail)), path)  # the part that picks the route
    if ENCODED_SEPARATOR.search(routed) or DOT_SEGMENT.search(path):
        return no_route()
    return None


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, max_headers: int, max_header_bytes: int, free_tails: tuple[str, ...]) -> None:
        self.app = app
        self.max_headers, self.max_header_bytes = max_headers, max_header_bytes
        self.free_tails = tuple(tail.encode() for tail in free_tails)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            error := refusal(scope, self.max_headers, self.max_header_bytes, self.free_tails)
        ):
            # and the connection closed: a proxy in front may have read this request another way
            await send_error(send, error, [(b"connection", b"close")], dialect=dialect_of(scope))
            return
        await self.app(scope, receive, send)
