"""Request helpers for the handlers: the lifespan state, the request's context, the bounded body read and parsing into
a protocol model."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar, cast

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import Receive

from engine.types import Engine
from gateway.backends.registry import Access
from gateway.errors import InvalidRequest, PayloadTooLarge, invalid_body
from gateway.pipeline.context import Gone, RequestContext, context_of
from gateway.pipeline.dispatch import access_of
from gateway.pipeline.state import GatewayState
from gateway.stores.streams import TAKEOVER_REQUEST_BYTES

M = TypeVar("M", bound=BaseModel)
# A client's timeout in seconds: its own, or the one the openai and anthropic SDKs send (Python: the read timeout, as
# "600.0"; JavaScript: the timeout until the response's headers, as "600"); each bounds the wait for the first byte,
# and the shortest wins: the client gives up at the first
TIMEOUT_HEADERS = (b"request-timeout", b"x-request-timeout", b"x-stainless-read-timeout", b"x-stainless-timeout")
# ... and those that bound a stream's wait for each next chunk too: a read timeout runs per read (httpx), a whole
# timeout over every gap; the JavaScript SDKs' stops once the headers are in
GAP_HEADERS = (b"request-timeout", b"x-request-timeout", b"x-stainless-read-timeout")
MOST_TIMEOUT_S = 7 * 24 * 3600  # beyond: not a timeout anyone waits for; ignored, as garbage is


def state_of(request: Request) -> GatewayState:
    """The lifespan's state straight from the scope, without a State object and its `__getattr__` per call."""
    try:
        return cast(GatewayState, request.scope["state"]["gateway"])
    except KeyError:
        return cast(GatewayState, request.state.gateway)  # none: request.state's AttributeError


def access(request: Request) -> Access:
    return access_of(context_of(request.scope), state_of(request))


def gone_of(receive: Receive) -> Gone:
    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return gone


def context(request: Request) -> RequestContext:
    found = context_of(request.scope)
    found.client_gone = gone_of(request.receive)
    # Cache-Control's directive names (RFC 9111 5.2.1): `no-cache` skips a stored answer, `no-store` keeps this one out
    directives: set[str] = set()
    for key, value in request.scope["headers"]:
        if key == b"cache-control":
            directives.update(part.partition(b"=")[0].strip().lower().decode("latin-1") for part in value.split(b","))
    found.no_cache, found.no_store = "no-cache" in directives, "no-store" in directives
    if (seconds := timeout_of(request.scope["headers"])) is not None:
        found.deadline = found.arrived() + seconds
    found.gap_s = timeout_of(request.scope["headers"], GAP_HEADERS)
    return found


def timeout_of(headers: Iterable[tuple[bytes, bytes]], names: tuple[bytes, ...] = TIMEOUT_HEADERS) -> float | None:
    """The client's timeout by its headers (`names`), in seconds; a value that is not a number of seconds
    above 0 and at most `MOST_TIMEOUT_S` (negative, NaN, infinite, not a number) is ignored: the default applies."""
    found: float | None = None
    for key, value in headers:
        if key in names:
            try:
                seconds = float(value)
            except ValueError:
                continue
            if 0 < seconds <= MOST_TIMEOUT_S:  # NaN is neither
                found = seconds if found is None else min(found, seconds)
    return found


def engine_for(request: Request, name: str | None) -> Engine:
    return state_of(request).models.engine(name, access(request))


def default_model(request: Request) -> str:
    """The native routes' model when a request names none."""
    return state_of(request).models.default_name(access(request))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (413 past it: a declared length before reading, else once past it)."""
    declared = request.headers.get("content-length")
    if declared and declared.isascii() and declared.isdigit() and int(declared) > limit:  # isdigit alone takes '²'
        raise PayloadTooLarge(f"Request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # a client gone midway: ClientDisconnect
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"Request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, model: type[M]) -> M:
    body = await read_body(request, state_of(request).settings.max_body_bytes)
    found = context_of(request.scope)
    found.body_bytes = len(body)  # large bodies are prepared off the event loop (offload)
    found.request_body = body if len(body) <= TAKEOVER_REQUEST_BYTES else b""  # kept for a stream's takeover
    if not body.strip():
        raise InvalidRequest("The request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        kind = exc.errors()[0]["type"]
        if kind == "json_invalid":
            raise InvalidRequest("We could not parse the JSON body of your request: it is not valid JSON") from exc
        if kind == "model_type":
            raise InvalidRequest("The request body must be a JSON object") from exc
        raise invalid_body(exc, body) from exc


def body_size(request: Request) -> int:
    return context_of(request.scope).body_bytes
