"""Request bodies (pure ASGI, the innermost layer): slow, abandoned and too many bodies.

- A body must arrive within `body_timeout_s` of the request's start: 408 (and the connection
  closed) otherwise, so a client trickling bytes cannot hold a request open for ever.
- A client that leaves in the middle of its body is a 499 (client gone), not a server error.
- `BodyBudget`: the bytes of the bodies being read and prepared (parsed, tokenized), all requests
  together, are bounded; a body that does not fit is refused with 503 and `Retry-After` before it
  is read (its declared Content-Length counts from the start). A request's bytes count from its
  first read until its input is prepared (the context's `release_body`, called by the pipeline) or its
  response starts, whichever comes first.
- An upload (the route table's `upload` routes: a multipart form streamed to disk, `api.multipart`)
  holds one chunk in memory at a time: its bytes are not counted in the budget, and it has its own
  deadline (`files.upload_timeout_s`), long enough for hundreds of megabytes.
- A compressed body (`Content-Encoding` other than identity) is a 415 before it is read: the
  gateway reads JSON as sent, and gzip bytes would only fail as invalid JSON.

It wraps `receive`: handlers read bodies as usual, and these errors come out of their reads.
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import dialect_of, send_error
from gateway.errors import ClientDisconnected, RequestTimeout, ServiceUnavailable, UnsupportedMediaType
from gateway.pipeline.context import context_of
from gateway.telemetry import metrics
from gateway.telemetry.record import current_record


class BodyBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, amount: int) -> bool:
        if self.used + amount > self.limit:
            return False
        self.used += amount
        return True

    def give_back(self, amount: int) -> None:
        self.used -= amount


def _declared(scope: Scope) -> tuple[int, bytes | None]:
    """The body's declared length (its first Content-Length; 0 when none or not digits) and its
    Content-Encoding (None: none)."""
    length: int | None = None
    encoding = None
    for key, value in scope.get("headers", ()):
        if key == b"content-length" and length is None:
            length = int(value) if value.isdigit() and len(value) < 19 else 0
        elif key == b"content-encoding":
            encoding = value
    return length or 0, encoding


class _Reading:
    """One request's body: its deadline and the bytes it holds of the budget."""

    def __init__(self, receive: Receive, budget: BodyBudget | None, deadline: float, declared: int) -> None:
        """`budget`: None for an upload, whose bytes go to disk (nothing is held of a budget)."""
        self._receive = receive
        self.budget = budget
        self.deadline = deadline
        self.declared = declared
        self.read = 0
        self.held = 0
        self.complete = False
        self.released = budget is None

    async def receive(self) -> Message:
        if self.complete:
            return await self._receive()  # after the body: disconnect watching, untouched
        self._hold(max(self.declared, self.read))
        cut = asyncio.timeout_at(self.deadline)  # a cancellation of the request's own stays one
        try:
            async with cut:
                message = await self._receive()
        except TimeoutError:
            if not cut.expired():
                raise
            self.release()
            raise RequestTimeout(
                "The request body was not received in time", headers={"Connection": "close"}
            ) from None
        if message["type"] == "http.disconnect":
            self.complete = True
            self.release()
            current_record().disconnected = True
            raise ClientDisconnected("The client left while sending its request body")
        self.read += len(message.get("body", b""))
        self._hold(max(self.declared, self.read))
        self.complete = not message.get("more_body", False)
        return message

    def _hold(self, needed: int) -> None:
        if self.released or needed <= self.held:
            return
        assert self.budget is not None
        if not self.budget.take(needed - self.held):
            self.release()
            metrics.labelled(metrics.REJECTED, "", "body_bytes_in_flight").inc()
            raise ServiceUnavailable(
                "The server is reading too many request bodies at once; please retry",
                headers={"Retry-After": "1"},
            )
        self.held = needed

    def release(self) -> None:
        if not self.released:
            self.released = True
            assert self.budget is not None
            self.budget.give_back(self.held)
            self.held = 0


class BodyMiddleware:
    def __init__(self, app: ASGIApp, budget: BodyBudget, timeout_s: float,
                 upload_paths: frozenset[str] = frozenset(), upload_timeout_s: float = 600) -> None:
        self.app = app
        self.budget = budget
        self.timeout_s = timeout_s
        self.upload_paths = upload_paths
        self.upload_timeout_s = upload_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, encoding = _declared(scope)
        if encoding is not None and encoding.strip().lower() not in (b"", b"identity"):
            named = encoding.decode("latin-1")[:40]
            error = UnsupportedMediaType(f"Content-Encoding '{named}' is not supported: send the body uncompressed.")
            await send_error(send, error, dialect=dialect_of(scope))  # before a byte of it is read
            return
        upload = scope["method"] == "POST" and scope["path"] in self.upload_paths
        deadline = asyncio.get_running_loop().time() + (self.upload_timeout_s if upload else self.timeout_s)
        reading = _Reading(receive, None if upload else self.budget, deadline, length)
        context_of(scope).release_body = reading.release  # the pipeline calls it once the input is prepared

        async def send_releasing(message: Message) -> None:
            if message["type"] == "http.response.start":
                reading.release()
            await send(message)

        try:
            await self.app(scope, reading.receive, send_releasing)
        finally:
            reading.release()

