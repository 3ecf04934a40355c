"""What a route table is: endpoints (method, path, handler, access class, OpenAPI description,
error dialect) and what the layers ask of them (Starlette routes, paths by access class, route
labels, the dialect of a path's errors and streams), and `TableRouter`, the innermost ASGI layer
that answers a request with its route's handler.
`gateway.api.routes` holds the one table."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Route, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import Dialect

Access = Literal["api", "ops", "open"]
Handler = Callable[[Request], Awaitable[Response]]
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]
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

    @property
    def template(self) -> str:
        """The path as OpenAPI writes it: /v1/models/{model} where the route says {model:path}."""
        return compile_path(self.path)[1]


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
        """Starlette's routes: one per path, with all its methods."""
        by_path: dict[str, list[Endpoint]] = {}
        for endpoint in self.endpoints:
            by_path.setdefault(endpoint.path, []).append(endpoint)
        routes = []
        for path, endpoints in by_path.items():
            if len({e.handler for e in endpoints}) != 1:
                raise ValueError(f"{path}: one handler per path (it may dispatch on the method)")
            routes.append(Route(path, endpoints[0].handler, methods=[e.method for e in endpoints]))
        return routes

    def paths(self, *access: Access) -> frozenset[str]:
        return frozenset(e.path for e in self.endpoints if e.access in access)

    def label(self, path: str) -> str:
        """The route label of a request path (metrics, access log): bounded, whatever clients send
        (a concrete /v1/responses/resp_1 is labelled with its template, /v1/responses/{response_id})."""
        if path in self._paths:
            return path
        return next((template for regex, template in self._templates if regex.match(path)), UNMATCHED)

    def dialect(self, path: str) -> Dialect:
        """The error dialect of a request path: its route's, or that of the route it is under
        (/v1/messages/batches: Anthropic's); OpenAI's for other paths outside the table."""
        found = self._dialects.get(path)
        if found is not None:
            return found
        return next((dialect for prefix, dialect in self._dialect_prefixes if path.startswith(prefix)), "openai")


def route_path(scope: Scope) -> str:
    """The path routes match: the request's path without the app's root path (as Starlette's router)."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    return path[len(root_path):] if path[len(root_path)] == "/" else path


class TableRouter:
    """The innermost ASGI layer: the route for a request, its handler called, and the errors of the
    `handled` kinds answered by `on_error`, in place of Starlette's router and exception middleware
    with the same answers (tests/unit/test_routes.py runs the same requests through both):

    - an exact path is one dict lookup; only paths with parameters are matched by their regex, in
      the routes' order (Starlette's router tries every route's regex, in order);
    - a known path with another method is a 405 with `Allow` (HEAD where GET is: Starlette's
      `Route`), an unknown path a 404: both as Starlette's `HTTPException`, answered by `on_error`;
    - one exception catch per request where Starlette had two (its exception middleware and the
      route's), the same rule: an error of a handled kind after the response started becomes a
      RuntimeError raised on; any other error is raised on as it is;
    - the scope gets what Starlette's router puts there (`router`, `route`, `endpoint`, `path_params`).

    Other scope types (lifespan) go to `fallback`, Starlette's router."""

    def __init__(
        self, routes: Iterable[BaseRoute], fallback: ASGIApp, handled: tuple[type[Exception], ...], on_error: ErrorHandler
    ) -> None:
        routes = list(routes)
        if not all(isinstance(route, Route) and inspect.iscoroutinefunction(route.endpoint) for route in routes):
            raise ValueError("plain routes with async handlers only (Starlette would run others in a thread)")
        self.fallback = fallback
        self.handled = handled
        self.on_error = on_error
        self._exact = {route.path: route for route in routes if isinstance(route, Route) and not route.param_convertors}
        self._templated = [route for route in routes if isinstance(route, Route) and route.param_convertors]
        for path in self._exact:  # an exact path first is what Starlette's order gives only then
            if any(route.path_regex.match(path) for route in self._templated):
                raise ValueError(f"{path} is matched by a path with parameters too")

    def _route(self, scope: Scope) -> Route:
        """The request's route, its matches put in the scope; Starlette's 404 or 405 else."""
        route = self._exact.get(route_path(scope))
        if route is not None:
            scope["route"], scope["endpoint"] = route, route.endpoint
            scope["path_params"] = dict(scope.get("path_params", {}))
        else:
            route = self._match(scope)
        methods = route.methods
        if methods and scope["method"] not in methods:
            raise HTTPException(status_code=405, headers={"Allow": ", ".join(methods)})
        return route

    def _match(self, scope: Scope) -> Route:
        partial: tuple[Route, Scope] | None = None
        for route in self._templated:
            match, child_scope = route.matches(scope)
            if match is Match.FULL or (match is Match.PARTIAL and partial is None):
                partial = route, child_scope
                if match is Match.FULL:
                    break
        if partial is None:
            raise HTTPException(status_code=404)
        route, child_scope = partial
        scope["route"] = route
        scope.update(child_scope)
        return route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.fallback(scope, receive, send)
            return
        if "router" not in scope:
            scope["router"] = self.fallback
        request = Request(scope, receive, send)
        started = False

        async def sender(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            response = await self._route(scope).endpoint(request)
            await response(scope, receive, sender)
        except self.handled as exc:
            if started:
                raise RuntimeError("Caught handled exception, but response already started.") from exc
            response = await self.on_error(request, exc)
            await response(scope, receive, sender)
            exc.__traceback__ = None  # as Starlette: a reused exception would gather tracebacks
