"""What a route table is: endpoints and what the layers ask of them (Starlette's routes, paths by access class, route
labels, a path's error dialect)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, compile_path
from starlette.types import Receive, Scope, Send

from gateway.errors import Dialect

Access = Literal["api", "ops", "open", "admin"]
Handler = Callable[[Request], Awaitable[Response]]
UNMATCHED = "unmatched"


@dataclass(frozen=True, slots=True)
class Endpoint:
    method: str
    path: str
    handler: Handler
    access: Access
    summary: str
    request: type[BaseModel] | None = None  # the JSON body (OpenAPI)
    response: type[BaseModel] | None = None  # the JSON answer (OpenAPI)
    streams: bool = False  # answers with Server-Sent Events when the body says `stream: true`
    dialect: Dialect = "openai"  # whose API it is: the shape of its errors and its SSE framing
    upload: bool = False  # its POST body is a multipart/form-data upload, streamed to disk (not JSON)
    per_call: bool = False  # the key's requests per minute count what the route calls (/mcp: tool calls), not requests

    @property
    def template(self) -> str:
        """The path as OpenAPI writes it: /v1/models/{model} where the route says {model:path}."""
        return compile_path(self.path)[1]


class Handled:
    """A path's handlers, one per method (HEAD answered by GET's), as the ASGI app Starlette's `Route` takes for a class
    endpoint: a function endpoint would get Starlette's own exception wrapper as well, a second layer around every
    message a stream sends."""

    __slots__ = ("handlers",)

    def __init__(self, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers.get(scope["method"]) or self.handlers["GET"]  # Starlette lets HEAD in only where GET is
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)


class RouteTable:
    def __init__(self, endpoints: Iterable[Endpoint]) -> None:
        self.endpoints = tuple(endpoints)
        self._paths = frozenset(e.path for e in self.endpoints)
        self._dialects = {e.path: e.dialect for e in self.endpoints}
        # paths under another API's route (/v1/messages/...): that API's errors, also for a 404
        self._dialect_prefixes = tuple((e.path + "/", e.dialect) for e in self.endpoints if e.dialect != "openai")
        # paths with parameters (/v1/responses/{response_id}), matched as Starlette's router does
        self._templates = [(compile_path(path)[0], path) for path in sorted(self._paths) if "{" in path]

    def routes(self) -> list[Route]:
        by_path: dict[str, dict[str, Handler]] = {}
        for endpoint in self.endpoints:
            handlers = by_path.setdefault(endpoint.path, {})
            if endpoint.method in handlers:
                raise ValueError(f"{endpoint.method} {endpoint.path}: one handler per method of a path")
            handlers[endpoint.method] = endpoint.handler
        return [Route(path, Handled(handlers), methods=list(handlers)) for path, handlers in by_path.items()]

    def free_tails(self) -> tuple[str, ...]:
        """Prefixes of the routes whose last parameter takes the rest of the path: there an encoded slash belongs to
        the value (`org%2Fmodel`, as the SDKs send it)."""
        return tuple(e.path.partition("{")[0] for e in self.endpoints if e.path.endswith(":path}"))

    def upload_paths(self) -> frozenset[str]:
        """The paths whose POST body is an upload streamed to disk: a form, its own deadline, outside the in-memory
        body budget."""
        return frozenset(e.path for e in self.endpoints if e.upload)

    def per_call_paths(self) -> frozenset[str]:
        """The paths whose route takes the key's requests per minute itself, per call it makes (/mcp: per tool call;
        an MCP session's other requests are free)."""
        return frozenset(e.path for e in self.endpoints if e.per_call)

    def paths(self, *access: Access) -> frozenset[str]:
        return frozenset(e.path for e in self.endpoints if e.access in access)

    def label(self, path: str) -> str:
        if path in self._paths:
            return path
        return next((template for regex, template in self._templates if regex.match(path)), UNMATCHED)

    def dialect(self, path: str) -> Dialect:
        found = self._dialects.get(path)
        if found is not None:
            return found
        return next((dialect for prefix, dialect in self._dialect_prefixes if path.startswith(prefix)), "openai")
