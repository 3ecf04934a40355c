"""OpenAI's Responses API as pydantic models, after `openai.types.responses`. Answers keep their nulls as OpenAI sends
them (`_Out`), whatever the serializer is asked."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Tag,
    model_serializer,
)

Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Out(BaseModel):
    """An answer's part: its unset fields are sent as null, as OpenAI does."""

    model_config = ConfigDict(extra="allow")

    @model_serializer(mode="wrap")
    def _keep_nulls(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        ordered: dict[str, Any] = {}
        for name, field in type(self).model_fields.items():
            key = (field.serialization_alias or field.alias or name) if info.by_alias else name
            ordered[key] = data.get(key)
        return {**ordered, **data}


def _item_kind(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


MetadataKey = Annotated[str, Field(max_length=64)]
Metadata = Annotated[dict[MetadataKey, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class InputText(_Out):
    type: Literal["input_text"] = "input_text"
    text: str


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class InputMessage(_Out):
    """A user, system or developer message as a response keeps it among its input items."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer"]
    content: list[InputText]
    status: ItemStatus = "completed"


class OutputMessage(_Out):
    """An assistant message: in a response's output, or among the input items of a later one."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionToolCall(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(_Out):
    id: str
    type: Literal["function_call_output"] = "function_call_output"
    status: ItemStatus = "completed"
    call_id: str
    output: str


class McpListedTool(_Out):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)
    annotations: dict[str, Any] | None = None


class McpListTools(_Out):
    """The tools an MCP server offered (only those the request and the key allow); `error` when it could not be
    listed."""

    id: str
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    server_label: str
    tools: list[McpListedTool] = Field(default_factory=list)
    error: str | None = None


class McpCallError(_Out):
    """Why an MCP call failed, as OpenAI's `McpToolCallError` says it: the tool's own error
    (`mcp_tool_execution_error`), or the server unreachable or refusing (`http_error`)."""

    type: Literal["mcp_tool_execution_error", "http_error", "mcp_protocol_error"]
    content: Any = None
    code: int | None = None
    message: str | None = None


class McpCall(_Out):
    id: str
    type: Literal["mcp_call"] = "mcp_call"
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: McpCallError | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] = "completed"
    approval_request_id: str | None = None


class McpApprovalRequest(_Out):
    id: str
    type: Literal["mcp_approval_request"] = "mcp_approval_request"
    server_label: str
    name: str
    arguments: str


class McpApprovalResponse(_Out):
    """The client's answer to an approval request (an input item)."""

    id: str
    type: Literal["mcp_approval_response"] = "mcp_approval_response"
    approval_request_id: str
    approve: bool
    reason: str | None = None


def _stored_kind(item: Any) -> str | None:
    kind = _item_kind(item)
    role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
    return ("output_message" if role == "assistant" else "input_message") if kind == "message" else kind


Item = Annotated[
    Annotated[InputMessage, Tag("input_message")]
    | Annotated[OutputMessage, Tag("output_message")]
    | Annotated[FunctionToolCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[McpListTools, Tag("mcp_list_tools")]
    | Annotated[McpCall, Tag("mcp_call")]
    | Annotated[McpApprovalRequest, Tag("mcp_approval_request")]
    | Annotated[McpApprovalResponse, Tag("mcp_approval_response")],
    Discriminator(_stored_kind),
]
OutputItem = Annotated[
    Annotated[OutputMessage, Tag("output_message")] | Annotated[FunctionToolCall, Tag("function_call")]
    | Annotated[McpListTools, Tag("mcp_list_tools")] | Annotated[McpCall, Tag("mcp_call")]
    | Annotated[McpApprovalRequest, Tag("mcp_approval_request")],
    Discriminator(_stored_kind),
]


class InputTokensDetails(_Out):
    cached_tokens: int = 0


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseError(_Out):
    code: str
    message: str


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens", "content_filter"]


class ConversationRef(_Out):
    """The conversation a response belongs to (its input and output were added to it)."""

    id: str


class Response(_Out):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    background: bool = False
    completed_at: int | None = None
    conversation: ConversationRef | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float = 1.0
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int = 0
    top_p: float = 1.0
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
