"""`POST /mcp`: the gateway as one MCP server (streamable HTTP, the `mcp` SDK's server side) in front of the servers
file's servers (`mcp_serving`). Stateless and answered as JSON: each POST stands alone (no session kept between
requests, so any worker or replica answers it), and its handlers run within the request's own task, under the key the
auth layer identified and the request's log context and trace."""

from __future__ import annotations

from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.apis.mcp import mcp_serving
from gateway.errors import RateLimited, UnsupportedMediaType
from gateway.pipeline.context import context_of
from gateway.web.requests import state_of

RATE_LIMITED = -32000  # JSON-RPC's range for an implementation's own server errors; MCP names none for a limit


async def _list_tools(ctx: ServerRequestContext[Any], params: PaginatedRequestParams | None) -> ListToolsResult:
    request = _request(ctx)
    try:
        tools = await mcp_serving.list_tools(context_of(request.scope), state_of(request))
    except RateLimited as refused:  # a JSON-RPC error: the exchange's HTTP status is the transport's
        raise MCPError(code=RATE_LIMITED, message=refused.message) from None
    return ListToolsResult(tools=[Tool(name=t.name, description=t.description, input_schema=t.input_schema)
                                  for t in tools])


async def _call_tool(ctx: ServerRequestContext[Any], params: CallToolRequestParams) -> CallToolResult:
    request = _request(ctx)
    called = await mcp_serving.call_tool(context_of(request.scope), state_of(request), params.name,
                                         params.arguments or {})
    return CallToolResult(content=[TextContent(text=called.text)], is_error=called.is_error)


def _request(ctx: ServerRequestContext[Any]) -> Request:
    request = ctx.request
    assert isinstance(request, Request), "the streamable HTTP transport attaches the HTTP request"
    return request


def _no_schema(name: str) -> None:
    """No tool's schema for the SDK's check of a call's `Mcp-Param-*` headers: without this it would list every server's
    tools once per call to find one; the gateway routes by the tool's name alone and never forwards those headers."""
    return


SERVER: Server[Any] = Server("llm-gateway", on_list_tools=_list_tools, on_call_tool=_call_tool,
                             get_tool_input_schema=_no_schema)


class McpExchange(Response):
    """The SDK's transport answering one POST, in the route's place: a stateless session manager of its own, whose
    task group lives within this request (its context: the key, the log context, the trace)."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        manager = StreamableHTTPSessionManager(SERVER, json_response=True, stateless=True)
        async with manager.run():
            await manager.handle_request(scope, receive, send)


async def exchange(request: Request) -> Response:
    """The SDK answers what it refuses as JSON-RPC errors; a body that is not JSON it would answer in plain text, so
    that refusal is the gateway's own (415, in OpenAI's shape, as the other routes')."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise UnsupportedMediaType("Send MCP messages as JSON, with 'Content-Type: application/json'.")
    return McpExchange()
