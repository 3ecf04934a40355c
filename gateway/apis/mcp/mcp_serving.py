"""The /mcp gateway's two operations over the servers file's servers: `tools/list` (each server's tools the key may
call, named `<label>__<tool>`) and `tools/call` (the one tool, after the same check), each counted against the key's
requests per minute (a listing asks every server the key may reach). Both go through `gateway.mcp.access`, so a tool
the listing hides cannot be called either; the server's credentials are the gateway's, from the servers file. A server's failure is a tool error, never an HTTP error. Each
call: a metric, a span and a log line (key, server, tool, outcome, duration; its arguments only with log_prompts)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.errors import MAX_PARAM, APIError, RateLimited, bounded
from gateway.mcp import client
from gateway.mcp.access import Target, reach, tool_allowed
from gateway.mcp.servers import SEPARATOR
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import policy_of
from gateway.pipeline.state import GatewayState
from gateway.telemetry import metrics
from gateway.telemetry.tracing import stage

log = structlog.get_logger(__name__)
# per server, the tool names its listings gave: the metric's tool label (any other name a client sends is `other`, so
# that a client cannot grow the series without bound)
_LISTED: dict[str, frozenset[str]] = {}


@dataclass(frozen=True)
class ListedTool:
    name: str  # <label>__<tool>
    description: str | None
    input_schema: dict[str, Any]


@dataclass(frozen=True)
class Called:
    text: str
    is_error: bool


async def list_tools(context: RequestContext, state: GatewayState) -> list[ListedTool]:
    """Every server's tools this key may call; a server that fails or is outside the key's list adds none.
    RateLimited past the key's requests per minute."""
    await state.quota.take_request(policy_of(context, state))
    listings = await asyncio.gather(*(_listed(context, state, label) for label in state.mcp.by_label))
    return [tool for listing in listings for tool in listing]


async def call_tool(context: RequestContext, state: GatewayState, name: str, arguments: dict[str, Any]) -> Called:
    label, _, tool = name.partition(SEPARATOR)
    started = time.perf_counter()
    target = await _target(context, state, label)
    if target is None or not tool_allowed(policy_of(context, state), target.label, tool):
        return _report(context, state, label, tool, arguments, "refused", started, Called(f"Unknown tool: {name}", True))
    try:
        await state.quota.take_request(policy_of(context, state))
    except RateLimited as refused:
        return _report(context, state, label, tool, arguments, "rate_limited", started, Called(refused.message, True))
    with stage(context.record.trace, "mcp.tools/call", **{"mcp.server": label, "mcp.tool": tool}):
        outcome = await client.call_tool(target, tool, arguments, timeout_s=target.timeout_s)
    metrics.MCP_TOOL_CALL_DURATION.labels(server=label).observe(time.perf_counter() - started)
    if outcome.error is not None:
        return _report(context, state, label, tool, arguments, "error", started, Called(outcome.error, True))
    return _report(context, state, label, tool, arguments, "ok", started, Called(outcome.output or "", False))


async def _target(context: RequestContext, state: GatewayState, label: str) -> Target | None:
    """The servers file's server `label` for this key; None when it has none by that name or the key may not reach it
    (both answered alike: a key learns nothing of servers outside its list)."""
    if label not in state.mcp.by_label:
        return None
    try:
        return await reach(policy_of(context, state), servers=state.mcp, server_label=label, server_url=None,
                           headers={})
    except APIError as refused:  # outside the key's list, or a private address the file does not allow
        if refused.status != 403:
            log.warning("mcp_server_refused", server=label, error=refused.message)
        return None


async def _listed(context: RequestContext, state: GatewayState, label: str) -> list[ListedTool]:
    target = await _target(context, state, label)
    if target is None:
        return []
    try:
        tools = await client.list_tools(target, timeout_s=target.timeout_s)
    except client.McpUnavailable:
        return []  # the failure is logged by the client; the other servers' tools are still offered
    _LISTED[label] = frozenset(tool.name for tool in tools)
    policy = policy_of(context, state)
    return [ListedTool(f"{label}{SEPARATOR}{tool.name}", tool.description, tool.input_schema)
            for tool in tools if tool_allowed(policy, target.label, tool.name)]


def _report(context: RequestContext, state: GatewayState, label: str, tool: str, arguments: dict[str, Any],
            outcome: str, started: float, called: Called) -> Called:
    known = label in state.mcp.by_label
    metrics.MCP_TOOL_CALLS.labels(server=label if known else "other",
                                  tool=tool if tool in _LISTED.get(label, ()) else "other", outcome=outcome).inc()
    logged: dict[str, Any] = {"arguments": json.dumps(arguments, ensure_ascii=False)} if state.settings.log_prompts else {}
    log.info("mcp_tool_call", request_id=context.request_id, api_key_id=context.key_id, server=bounded(label, MAX_PARAM),
             tool=bounded(tool, MAX_PARAM),
             outcome=outcome, duration_s=round(time.perf_counter() - started, 4), **logged)
    return called
