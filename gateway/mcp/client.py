"""STAND-IN for mcp41g's MCP client (deleted once merged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.mcp.access import Target


@dataclass(frozen=True)
class McpTool:
    name: str
    description: str | None
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class ToolOutcome:
    output: str | None
    error: str | None


class McpUnavailable(Exception):
    pass


async def list_tools(target: Target, *, timeout_s: float) -> list[McpTool]:
    raise McpUnavailable("no MCP client yet")


async def call_tool(target: Target, name: str, arguments: dict[str, Any], *, timeout_s: float) -> ToolOutcome:
    return ToolOutcome(None, "no MCP client yet")
