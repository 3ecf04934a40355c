"""Real MCP servers for tests, made with the `mcp` SDK's own server side (MCPServer, streamable HTTP) and served by
uvicorn on a free loopback port in a thread of the test process: a tool that answers, one that fails, one that is
slow (it waits until the server stops), one whose output is large; and what each request's headers were."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.types import ASGIApp, Receive, Scope, Send

from tests.served import running

LARGE_BYTES = 3 * 1024 * 1024  # the `large` tool's output: past the bound the tests set


class SeenHeaders:
    """The ASGI app in front of the MCP app: each request's headers kept, for tests that check what was sent."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            query = {":query": scope.get("query_string", b"").decode()}  # which URL of the server was asked
            self.headers.append({**query, **{k.decode(): v.decode() for k, v in scope["headers"]}})
        await self.app(scope, receive, send)


def tool_server(name: str = "tools", extra: tuple[str, ...] = ()) -> MCPServer:
    """`echo` (answers), `fail` (raises: an isError result), `slow` (never answers while the server runs), `large`
    (LARGE_BYTES of text), and one more echoing tool per name in `extra`."""
    server = MCPServer(name)
    stop = threading.Event()
    server.stop = stop  # type: ignore[attr-defined]

    @server.tool()
    def echo(text: str) -> str:
        """Answers with its text."""
        return text

    @server.tool()
    def fail() -> str:
        """Always fails."""
        raise ValueError("the tool broke")

    @server.tool()
    async def slow() -> str:
        """Answers when the server stops."""
        await anyio.to_thread.run_sync(stop.wait)  # slow on purpose: until the server stops
        return "late"

    @server.tool()
    def large() -> str:
        """A large output."""
        return "x" * LARGE_BYTES

    for tool in extra:
        server.add_tool(_echoing(tool), name=tool, description=f"The tool {tool}.")
    return server


def _echoing(tool: str) -> Any:
    def answer(text: str) -> str:
        return f"{tool}: {text}"

    return answer


@contextlib.contextmanager
def serving(server: MCPServer) -> Iterator[tuple[str, SeenHeaders]]:
    """`server` on a free port: its /mcp URL and the headers it saw."""
    app = server.streamable_http_app(
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    seen = SeenHeaders(app)
    config = uvicorn.Config(seen, log_level="warning", timeout_graceful_shutdown=1)
    with running(uvicorn.Server(config)) as port:
        try:
            yield f"http://127.0.0.1:{port}/mcp", seen
        finally:
            stop: Any = getattr(server, "stop", None)
            if stop is not None:
                stop.set()
