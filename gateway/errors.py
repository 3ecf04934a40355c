"""Typed errors: each one's HTTP status and its OpenAI (or Anthropic) error object.

    APIError(status, type, code)                         body: {"error": {message, type, param, code}}
    ├── InvalidRequest          400 invalid_request_error
    │   ├── ContextLengthExceeded  400 invalid_request_error / context_length_exceeded
    │   └── ContentPolicyViolation 400 invalid_request_error / content_policy_violation
    │   └── OverTokenLimit      400 invalid_request_error / tokens_over_limit  (can never fit a limit)
    ├── AuthenticationFailed    401 invalid_request_error / invalid_api_key
    ├── NotFound                404 invalid_request_error / not_found
    │   └── ModelNotFound       404 invalid_request_error / model_not_found
    ├── MethodNotAllowed        405 invalid_request_error / method_not_allowed
    ├── RequestTimeout          408 invalid_request_error / request_timeout
    ├── PayloadTooLarge         413 invalid_request_error / request_too_large
    ├── UnsupportedMediaType    415 invalid_request_error / unsupported_media_type
    ├── RateLimited             429 rate_limit_error / rate_limit_exceeded
    │   └── ModelOverloaded     429 rate_limit_error / model_overloaded      (fallible)
    ├── QuotaExceeded           429 insufficient_quota / insufficient_quota  (a key's token budget)
    ├── ClientDisconnected      499 (no body: the client is gone)
    ├── InternalError           500 server_error / internal_error
    ├── BadGateway              502 server_error / bad_gateway           (fallible)
    └── ServiceUnavailable      503 server_error / service_unavailable
        ├── BackendUnavailable  503 server_error / service_unavailable   (fallible)
        ├── ModelUnavailable    503 server_error / model_overloaded      (fallible)
        └── StoreUnavailable    503 server_error / service_unavailable   (the batch lane's store)

A *fallible* error is a model's failure before the first byte (overloaded, its engine dead, its
upstream down): the dispatcher tries the model's fallbacks before answering with it.

`from_exception` maps every other exception onto this tree, once: the engine's errors and pydantic's
validation errors; anything unknown is a 500. This module knows no web framework: `gateway.api.errors`
adds the HTTP server's own exceptions and renders an error as an HTTP answer.

The body speaks the route's *dialect* (the route table says which): OpenAI's object, or on
Anthropic's routes `{"type": "error", "error": {"type", "message"}}` with the same status and
Anthropic's type for it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ValidationError

from engine.errors import EngineError, EngineInvalidRequest, EngineUnavailable, PromptTooLong

Dialect = Literal["openai", "anthropic"]
# Anthropic's error type by status (its API reference); other 4xx are invalid_request_error there
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   413: "request_too_large", 429: "rate_limit_error"}


MAX_MESSAGE, MAX_PARAM = 1000, 200  # characters of an error's message and param (see `bounded`)


def bounded(text: str, limit: int) -> str:
    """At most `limit` characters: a longer text keeps its head and tail around an ellipsis. An error
    quotes what was sent (a model's name, an unknown key, an id in the path), which may be megabytes:
    the answer, a batch's result line and the log then hold a part of it, enough to recognize it."""
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return f"{text[:half]}\u2026{text[len(text) - half:]}"


class APIError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    fallible: bool = False  # a model's failure before the first byte: its fallbacks may answer

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = bounded(message, MAX_MESSAGE)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else bounded(param, MAX_PARAM)
        self.code = code or self.code
        self.headers = headers or {}

    def body(self, dialect: Dialect = "openai") -> dict[str, Any]:
        if dialect == "anthropic":
            return {"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}}
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }

    def anthropic_type(self) -> str:
        if self.code == "model_overloaded":
            return "overloaded_error"
        if self.status >= 500:
            return "api_error"
        return ANTHROPIC_TYPES.get(self.status, "invalid_request_error")


class InvalidRequest(APIError):
    status, type = 400, "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ContentPolicyViolation(InvalidRequest):
    """A guard refused the prompt (`gateway.serving.guards`)."""

    code = "content_policy_violation"


class OverTokenLimit(InvalidRequest):
    """The request asks for more tokens than a per-minute limit ever allows: waiting cannot help,
    so it is no 429 (which clients retry) and has no Retry-After."""

    code = "tokens_over_limit"


class AuthenticationFailed(APIError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"  # OpenAI's own 401 type


class NotFound(APIError):
    status, type, code = 404, "invalid_request_error", "not_found"


def no_route(headers: dict[str, str] | None = None) -> NotFound:
    """A path no route answers (or one the edge never lets reach a route)."""
    return NotFound("Not found: no route for this path", headers=headers)


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(APIError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTimeout(APIError):
    """The client sent its body too slowly (`body_timeout_s`)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(APIError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class UnsupportedMediaType(APIError):
    """A POST whose body is not declared JSON (without API keys: what a web page could send cross-site)."""

    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class HeadersTooLarge(APIError):
    """More request headers, or bytes of them, than the edge takes (RFC 6585)."""

    status, type, code = 431, "invalid_request_error", "request_header_fields_too_large"


class RateLimited(APIError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class ModelOverloaded(RateLimited):
    """The model's admission bounds are full (or the wait timed out)."""

    code = "model_overloaded"
    fallible = True


class QuotaExceeded(APIError):
    """The key's token budget (per day or month, `gateway.tenancy.tenants`) is spent: OpenAI's answer when
    an account's quota is. Retry-After only when the budget's next period can take the request."""

    status, type, code = 429, "insufficient_quota", "insufficient_quota"


class ClientDisconnected(APIError):
    """The client closed the connection before its answer was ready: logged as 499, no body."""

    status, type, code = 499, "client_disconnected", None

    def __init__(self, message: str = "The client closed the connection") -> None:
        super().__init__(message)


class InternalError(APIError):
    status, type, code = 500, "server_error", "internal_error"


class BadGateway(APIError):
    """A remote model's upstream answered with an error of its own (refused our key, failed):
    the upstream's text goes to the log, never to the client."""

    status, type, code = 502, "server_error", "bad_gateway"
    fallible = True


class ServiceUnavailable(APIError):
    status, type, code = 503, "server_error", "service_unavailable"


class BackendUnavailable(ServiceUnavailable):
    """A model's engine is dead or its remote upstream failed, before the first byte."""

    fallible = True


class ModelUnavailable(ServiceUnavailable):
    """Overloaded, when the model is configured to refuse with 503."""

    code = "model_overloaded"
    fallible = True


class StoreUnavailable(ServiceUnavailable):
    """The batch lane's store (files, batches: `stores.blobs`) cannot be reached right now: its
    backend is down or failing; the client may try again later."""


# Every error the API answers with, as documented in docs/api.md's error table.
ERROR_CLASSES: tuple[type[APIError], ...] = (
    InvalidRequest, ContextLengthExceeded, ContentPolicyViolation, OverTokenLimit, AuthenticationFailed, NotFound,
    ModelNotFound, MethodNotAllowed, RequestTimeout, PayloadTooLarge, UnsupportedMediaType, RateLimited,
    ModelOverloaded, QuotaExceeded, InternalError, BadGateway, ServiceUnavailable, BackendUnavailable, ModelUnavailable,
    StoreUnavailable,
)


def error_table() -> list[tuple[int, str, str | None]]:
    return [(cls.status, cls.type, cls.code) for cls in ERROR_CLASSES]


_NO_BODY = object()  # a validation error of no request body (a query, a model built in the code)


def invalid_body(exc: ValidationError, body: bytes) -> InvalidRequest:
    """A request body's validation error, its param the field's path in the body as sent."""
    try:
        data = json.loads(body)  # the error path only; the stdlib's parser takes what pydantic's did (NaN)
    except (ValueError, RecursionError):
        data = _NO_BODY
    return _validation_error(exc, data)


def _validation_error(exc: ValidationError, data: Any = _NO_BODY) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    # a union (e.g. `prompt`) reports one error per member: the deepest is the one that explains
    # ("[[2**70]]": the token id out of range, not "should be a valid string"), and at the same depth
    # the member whose type matched ("[-1]": the id below 0; five stop strings: too many, not "should
    # be a valid string")
    first = max(
        (e for e in errors if e["loc"][:1] == errors[0]["loc"][:1]),
        key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")),
    )
    path = _field_path(first["loc"], data, first["type"] == "missing")
    param = ".".join(path) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif first["type"] == "missing":
        message = f"Missing required parameter: '{param}'"
    elif param:
        message = f"Invalid value for '{param}': {message}"
    return InvalidRequest(message, param=param)


def _field_path(loc: tuple[int | str, ...], data: Any, missing: bool) -> list[str]:
    """The field path of an error's location. Pydantic's location also names the union member it
    tried ("str", "list[...]", a model's class name, a tagged union's tag): with the body, the path
    is the parts found in it (and a missing field's name); without, the parts that look like fields."""
    if data is _NO_BODY:
        location = [str(part) for part in loc if not str(part).startswith(("function-", "json-"))]
        return [part for part in location if not any(c in part for c in "[]") and part not in ("str", "int", "float", "bool")]
    path, node = [], data
    for i, part in enumerate(loc):
        if isinstance(node, dict) and isinstance(part, str) and part in node:  # noqa: SIM114 - two narrowings of node
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            continue  # not in the body: a union member's label ("messages.0.content.0.TextPart.type")
        path.append(str(part))
    return path


def from_exception(exc: BaseException) -> APIError:
    """Map any exception to the API error the client sees; unknown ones are 500s."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError):
        return _validation_error(exc)
    if isinstance(exc, PromptTooLong):
        return ContextLengthExceeded(exc.message, param="messages")
    if isinstance(exc, EngineInvalidRequest):
        return InvalidRequest(exc.message, param=exc.param)
    if isinstance(exc, EngineUnavailable):
        return BackendUnavailable(exc.message)
    if isinstance(exc, EngineError):
        return InternalError(exc.message)
    return InternalError("The server had an error while processing your request.")
