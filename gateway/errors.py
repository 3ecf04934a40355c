"""Typed errors, each with its HTTP status and its OpenAI (or Anthropic) error object; `from_exception` maps every
other exception onto them, once. No web framework here: `gateway.web.error_render` renders them."""

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
    """At most `limit` characters, head and tail around an ellipsis: an error quotes what was sent, which may be
    megabytes."""
    if len(text) <= limit:
        return text
    half = (limit - 1) // 2
    return f"{text[:half]}\u2026{text[len(text) - half:]}"


class APIError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = None
    fallible: bool = False  # a model's failure before the first byte: its fallbacks may answer

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = bounded(message, MAX_MESSAGE)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else bounded(param, MAX_PARAM)
        self.code = code or self.code
        self.headers = headers or {}

    def body(self, dialect: Dialect = "openai") -> dict[str, Any]:
        if dialect == "anthropic":
            return {"type": "error", "error": {"type": self.anthropic_type(), "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

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
    code = "content_policy_violation"


class OverTokenLimit(InvalidRequest):
    """More tokens than a per-minute limit ever allows: waiting cannot help, so no 429 (which clients retry) and no
    Retry-After."""

    code = "tokens_over_limit"


class AuthenticationFailed(APIError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"  # OpenAI's own 401 type


class PermissionDenied(APIError):
    """The key may not reach what the request names (an MCP server outside its allow-list)."""

    status, type, code = 403, "invalid_request_error", "permission_denied"


class NotFound(APIError):
    status, type, code = 404, "invalid_request_error", "not_found"


def no_route(headers: dict[str, str] | None = None) -> NotFound:
    return NotFound("Not found: no route for this path", headers=headers)


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(APIError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class RequestTimeout(APIError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


class PayloadTooLarge(APIError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class UnsupportedMediaType(APIError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class HeadersTooLarge(APIError):
    status, type, code = 431, "invalid_request_error", "request_header_fields_too_large"


class RateLimited(APIError):
    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"


class ModelOverloaded(RateLimited):
    code = "model_overloaded"
    fallible = True


class QuotaExceeded(APIError):
    """The key's token budget is spent. Retry-After only when the next period can take the request."""

    status, type, code = 429, "insufficient_quota", "insufficient_quota"


class ClientDisconnected(APIError):
    """The client left before its answer was ready: logged as 499, no body."""

    status, type, code = 499, "client_disconnected", None

    def __init__(self, message: str = "The client closed the connection") -> None:
        super().__init__(message)


class InternalError(APIError):
    status, type, code = 500, "server_error", "internal_error"


class BadGateway(APIError):
    """A remote upstream answered with an error of its own: its text goes to the log, never to the client."""

    status, type, code = 502, "server_error", "bad_gateway"
    fallible = True


class ServiceUnavailable(APIError):
    status, type, code = 503, "server_error", "service_unavailable"


class BackendUnavailable(ServiceUnavailable):
    fallible = True


class ModelUnavailable(ServiceUnavailable):
    code = "model_overloaded"
    fallible = True


class StoreUnavailable(ServiceUnavailable): ...


# Every error the API answers with, as documented in docs/api.md's error table.
ERROR_CLASSES: tuple[type[APIError], ...] = (
    InvalidRequest, ContextLengthExceeded, ContentPolicyViolation, OverTokenLimit, AuthenticationFailed,
    PermissionDenied, NotFound, ModelNotFound, MethodNotAllowed, RequestTimeout, PayloadTooLarge, UnsupportedMediaType,
    RateLimited,
    ModelOverloaded, QuotaExceeded, InternalError, BadGateway, ServiceUnavailable, BackendUnavailable, ModelUnavailable,
    StoreUnavailable,
)


def error_table() -> list[tuple[int, str, str | None]]:
    return [(cls.status, cls.type, cls.code) for cls in ERROR_CLASSES]


_NO_BODY = object()  # a validation error of no request body (a query, a model built in the code)


def invalid_body(exc: ValidationError, body: bytes) -> InvalidRequest:
    try:
        data = json.loads(body)  # the error path only; the stdlib's parser takes what pydantic's did (NaN)
    except (ValueError, RecursionError):
        data = _NO_BODY
    return _validation_error(exc, data)


def _validation_error(exc: ValidationError, data: Any = _NO_BODY) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    # a union (e.g. `prompt`) reports one error per member: the deepest is the one that explains ("[[2**70]]": the token
    # id out of range, not "should be a valid string"), and at the same depth the member whose type matched ("[-1]": the
    # id below 0; five stop strings: too many, not "should be a valid string")
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
    """The field path of an error's location. Pydantic's location also names the union member it tried; with the body,
    the path is the parts found in it (and a missing field's name), without, the parts that look like fields."""
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
