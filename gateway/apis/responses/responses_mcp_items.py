"""The `mcp` tool's items as the model reads them: an `mcp_call` is a function call and its output (or its error),
a denied approval a call answered with the denial; a tool listing and an approval request not yet answered are not
read at all (the tools are offered as the request's functions)."""

from __future__ import annotations

from gateway.protocol.response_objects import (
    FunctionCallOutput,
    FunctionToolCall,
    Item,
    McpApprovalRequest,
    McpApprovalResponse,
    McpCall,
    McpCallError,
    McpListTools,
)

DENIED = "The user did not approve this tool call; it was not made."


def error_text(error: McpCallError) -> str:
    return str(error.message if error.content is None else error.content)


def for_the_model(items: list[Item]) -> list[Item]:
    """The conversation with its MCP items as function calls and outputs."""
    if not any(isinstance(item, McpCall | McpListTools | McpApprovalRequest | McpApprovalResponse) for item in items):
        return items
    asked = {item.id: item for item in items if isinstance(item, McpApprovalRequest)}
    read: list[Item] = []
    for item in items:
        if isinstance(item, McpCall):
            told = item.output if item.error is None else f"Error: {error_text(item.error)}"
            read += _exchange(item.id, item.name, item.arguments, told or "")
        elif isinstance(item, McpApprovalResponse):
            request = asked.get(item.approval_request_id)
            if request is not None and not item.approve:
                denial = f"{DENIED} Reason: {item.reason}" if item.reason else DENIED
                read += _exchange(request.id, request.name, request.arguments, denial)
        elif not isinstance(item, McpListTools | McpApprovalRequest):
            read.append(item)
    return read


def _exchange(call_id: str, name: str, arguments: str, output: str) -> list[Item]:
    return [FunctionToolCall(id=f"fc_{call_id}", status="completed", call_id=call_id, name=name, arguments=arguments),
            FunctionCallOutput(id=f"fco_{call_id}", call_id=call_id, output=output)]
