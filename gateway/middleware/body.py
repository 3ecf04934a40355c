"""Request bodies: a deadline for each (408), a client gone mid-body (499), no compressed bodies (415), and a
budget of the bytes all bodies hold until their input is prepared (503). It wraps `receive`, so these errors come
out of the handlers' reads."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ClientDisconnected, RequestTimeout, ServiceUnavailable, UnsupportedMediaType
from gateway.pipeline.context import context_of
from gateway.telemetry import metrics
from gateway.telemetry.record import current_record
from gateway.web.error_render import dialect_of, send_error


@dataclass(slots=True)
class BodyBudget:
    """The bytes of the bodies being read and prepared, all requests together; a request's declared Content-Length
    counts from the start, so a body that cannot fit is refused before it is read."""

    limit: int
    used: int = 0


def _declared(scope: Scope) -> tuple[int, bytes | None]:
    """The first Content-Length (0 when none or not digits) and the Content-Encoding."""
    length: int | None = None
    encoding = None
    for key, value in scope.get("headers", ()):
        if key == b"content-length" and length is None:
            length = int(value) if value.isdigit() and len(value) < 19 else 0
        elif key == b"content-encoding":
            encoding = value
    return length or 0, encoding


class _Reading:
    """One request's body: its deadline and the bytes it holds of the budget (None for an upload: its bytes go to
    disk a chunk at a time)."""

    def __init__(self, receive: Receive, budget: BodyBudget | None, deadline: float, declared: int) -> None:
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
        if self.budget.used + needed - self.held > self.budget.limit:
            self.release()
            metrics.labelled(metrics.REJECTED, "", "body_bytes_in_flight").inc()
            raise ServiceUnavailable(
                "The server is reading too many request bodies at once; please retry",
                headers={"Retry-After": "1"},
            )
        self.budget.used += needed - self.held
        self.held = needed

    def release(self) -> None:
        if not self.released:
            self.released = True
            assert self.budget is not None
            self.budget.used -= self.held
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
            await send_error(send, error, dialect=dialect_of(scope))  # gzip bytes would only fail as invalid JSON
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

