"""The only module that talks to an MCP server (streamable HTTP, the official `mcp` SDK's client): its tools listed, one
called. Each operation opens a session of its own for one `Target` (one key's view of one server: no session is shared
between keys), bounded in time and size, and closes it. The connection goes to the address `access.reach` checked,
follows no redirect, and reads no proxy from the environment. Nothing here logs or returns a header.

    McpUnavailable   list_tools: the server failed, timed out or answered something unreadable
    ToolOutcome      call_tool: the output, or an error (the server's failure, a tool's `isError`, a timeout)
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx2
import structlog
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult, ContentBlock, Implementation, TextContent, Tool

from gateway.mcp.access import Target

log = structlog.get_logger(__name__)
MAX_PAGES = 20  # of a tool listing: a server that pages for ever is a failing one
# the tools of one server the model may be offered (or /mcp may list): each is described in every prompt, so a server
# listing more, or a listing (names, descriptions, schemas) larger than its output bound, is a failing one
MAX_TOOLS = 256
CLIENT_INFO = Implementation(name="llm-gateway", version="1")


@dataclass(frozen=True)
class McpTool:
    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None  # the server's hints (readOnlyHint, destructiveHint, ...)


@dataclass(frozen=True)
class ToolOutcome:
    """Exactly one of `output` and `error` is set."""

    output: str | None
    error: str | None


class McpUnavailable(Exception):
    """The server could not be reached, failed or timed out; the message names the server's label only, so it is safe
    to show the client."""


class TooLarge(Exception):
    """An answer of the server's beyond four times the output bound, or a tool listing beyond its bounds."""


async def list_tools(target: Target, *, timeout_s: float) -> list[McpTool]:
    """The server's tools (every page); McpUnavailable when it fails or takes longer than `timeout_s` (or its own)."""
    try:
        with anyio.fail_after(min(timeout_s, target.timeout_s)):
            async with _session(target) as client:
                tools: list[McpTool] = []
                cursor = None
                for _ in range(MAX_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    tools.extend(_tool(target, listed) for listed in page.tools)
                    _check_listing(target, tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        return tools
                raise TooLarge(f"it listed more than {MAX_PAGES} pages of tools")
    except Exception as exc:
        raise McpUnavailable(_failure(target, "list its tools", exc)) from None


def _tool(target: Target, tool: Tool) -> McpTool:
    hints = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations is not None else None
    description = tool.description and _scrubbed(target, tool.description)
    return McpTool(tool.name, description, dict(tool.input_schema), hints)


def _check_listing(target: Target, tools: list[McpTool]) -> None:
    if len(tools) > MAX_TOOLS:
        raise TooLarge(f"it listed more than {MAX_TOOLS} tools")
    size = sum(len(tool.name) + len(tool.description or "") + len(json.dumps(tool.input_schema)) for tool in tools)
    if size > target.max_output_bytes:
        raise TooLarge("its tool listing was too large")


async def call_tool(target: Target, name: str, arguments: dict[str, Any], *, timeout_s: float) -> ToolOutcome:
    """The tool's output (cut at the target's bound, and said so), or an error; never raises for the server."""
    try:
        with anyio.fail_after(min(timeout_s, target.timeout_s)):
            async with _session(target) as client:
                result = await client.call_tool(name, arguments)
    except Exception as exc:
        return ToolOutcome(None, _failure(target, f"call the tool '{name}'", exc))
    text = _bounded(_scrubbed(target, _text(result)), target.max_output_bytes)
    return ToolOutcome(None, text or "The tool failed.") if result.is_error else ToolOutcome(text, None)


def _failure(target: Target, what: str, exc: BaseException) -> str:
    """A failure's message for the client and the log: the server's label and the kind of failure, never a header
    (nor the URL, which the client may not have named)."""
    reason = _scrubbed(target, _reason(exc))
    parts = urlsplit(target.label)  # a client's URL: its origin only (a path or query may hold a token)
    server = f"{parts.scheme}://{parts.netloc}" if parts.netloc else target.label
    log.warning("mcp_failed", server=server, operation=what, reason=reason)
    return f"{target} failed to {what}: {reason}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):  # the SDK's task groups wrap what failed
        return _reason(exc.exceptions[0])
    if isinstance(exc, TimeoutError):
        return "it did not answer in time"
    if isinstance(exc, TooLarge):
        return str(exc) or "its answer was too large"
    if isinstance(exc, MCPError):
        return f"it answered with an error: {exc.error.message[:500]}"  # scrubbed by `_failure`
    if isinstance(exc, httpx2.HTTPStatusError):
        return f"it answered HTTP {exc.response.status_code}"
    if isinstance(exc, httpx2.TransportError | OSError):
        return "it could not be reached"
    return f"it answered something the gateway could not read ({type(exc).__name__})"


def _scrubbed(target: Target, text: str) -> str:
    """`text` of the server's without a header value sent to it (a server that echoes the request's headers would
    otherwise show the gateway's credentials for it to the client and the model)."""
    for value in target.headers.values():
        for secret in (value, value.partition(" ")[2]):  # the whole value, and a token after its scheme ("Bearer")
            if len(secret) >= 8:
                text = text.replace(secret, "[credential]")
    return text


def _text(result: CallToolResult) -> str:
    """The result's content as one string: text as it is, other blocks (images, resources) as their JSON; the
    structured content when there is no other."""
    parts = [_block(block) for block in result.content]
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


def _block(block: ContentBlock) -> str:
    if isinstance(block, TextContent):
        return block.text
    return block.model_dump_json(by_alias=True, exclude_none=True)


def _bounded(text: str, limit: int) -> str:
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[:limit].decode(errors="ignore") + f"\n[output cut at {limit} bytes]"


@asynccontextmanager
async def _session(target: Target) -> AsyncIterator[Client]:
    limit = 4 * target.max_output_bytes + 64 * 1024  # the text twice (content and structured), escaped
    transport = _Pinned(httpx2.AsyncHTTPTransport(trust_env=False), target.address, limit)
    http = httpx2.AsyncClient(headers=dict(target.headers), timeout=httpx2.Timeout(target.timeout_s),
                              transport=transport, follow_redirects=False, max_redirects=0, trust_env=False)
    async with http, Client(streamable_http_client(target.url, http_client=http, max_sse_event_size=limit),
                            cache=None, client_info=CLIENT_INFO) as client:
        yield client


class _Pinned(httpx2.AsyncBaseTransport):
    """Every request to the address `access.reach` checked (the name stays the Host header and TLS's server name, so
    the certificate is still checked against it), each answer's body bounded."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, address: str | None, limit: int) -> None:
        self.inner, self.address, self.limit = inner, address, limit

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        if self.address is not None:
            host = request.url.host
            request.url = request.url.copy_with(host=self.address)
            request.extensions = {**request.extensions, "sni_hostname": host}
        response = await self.inner.handle_async_request(request)
        response.stream = _BoundedStream(response.stream, self.limit)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


class _BoundedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: Any, limit: int) -> None:
        self.inner, self.limit = inner, limit

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        async for chunk in self.inner:
            total += len(chunk)
            if total > self.limit:
                raise TooLarge
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()
