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
    field_validator,
    model_serializer,
    model_validator,
)

Status = Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
TEXT_PARTS = ("input_text", "output_text", "text")
INPUT_ITEMS = ("message", "function_call", "function_call_output")


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


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


class InputPart(_Request):
    """A content part of an input message: text (`input_text`, or `output_text` and `refusal` in an
    earlier assistant turn sent back). Images, files and audio are refused when the input is read."""

    type: Literal["input_text", "output_text", "text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    image_url: str | None = None
    file_id: str | None = None
    file_data: str | None = None
    file_url: str | None = None
    filename: str | None = None
    detail: str | None = None
    input_audio: dict[str, Any] | None = None


class MessageInput(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputPart] | str
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallInput(_Request):
    """A call the model made earlier (an item of an earlier response's output, sent back)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None


class FunctionCallOutputInput(_Request):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str
    output: list[InputPart] | str
    id: str | None = None
    status: ItemStatus | None = None


def _item_kind(item: Any) -> str | None:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return kind if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageInput, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON following a schema (named)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or not self.name):
            raise ValueError("a text.format of type json_schema needs a name and a schema")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
Metadata = Annotated[dict[MetadataKey, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str
    input: list[InputItem] | str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Field(ge=16)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    metadata: Metadata | None = None
    user: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    # accepted, with no effect on an open model served here
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    # the request's priority (tenancy.priority), as chat's: OpenAI's tier, vLLM's integer
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = _item_kind(item)
            if kind not in INPUT_ITEMS:
                raise ValueError(f"input[{i}] is a {kind!r} item; this server takes {', '.join(INPUT_ITEMS)} items")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(f"tools[{i}] is a {tool.get('type')!r} tool; this server runs function tools only")
        return value

    @model_validator(mode="after")
    def _modes(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background responses need store set to true")
        if self.background and self.stream:
            raise ValueError("background responses are not streamed here; poll GET /v1/responses/{id} instead")
        return self


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


def _stored_kind(item: Any) -> str | None:
    kind = _item_kind(item)
    role = item.get("role") if isinstance(item, dict) else getattr(item, "role", None)
    return ("output_message" if role == "assistant" else "input_message") if kind == "message" else kind


Item = Annotated[
    Annotated[InputMessage, Tag("input_message")]
    | Annotated[OutputMessage, Tag("output_message")]
    | Annotated[FunctionToolCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")],
    Discriminator(_stored_kind),
]
OutputItem = Annotated[
    Annotated[OutputMessage, Tag("output_message")] | Annotated[FunctionToolCall, Tag("function_call")],
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


class Response(_Out):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    background: bool = False
    completed_at: int | None = None
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


class ResponseDeleted(_Out):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class ResponseItemList(_Out):
    """GET /v1/responses/{id}/input_items: a page of the items the response took as input."""

    object: Literal["list"] = "list"
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool


class InputItemsQuery(_Request):
    """The query of GET /v1/responses/{id}/input_items (values arrive as strings)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    after: str | None = None
    limit: Annotated[int, Field(ge=1, le=100)] = 20
    order: Literal["asc", "desc"] = "desc"


class _Event(BaseModel):
    """A stream event: `type` (also the SSE event name), then `sequence_number` (0, 1, 2, ... in a
    stream). No field of an event is ever null (its response and items keep theirs), so events skip
    `_Out`'s serializer: a delta event is on the per-token path."""

    model_config = ConfigDict(extra="allow")


class ResponseLifecycleEvent(_Event):
    """response.created, response.in_progress, response.completed, response.incomplete, response.failed."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    sequence_number: int
    response: Response


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class OutputTextDelta(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDone(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDelta(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


StreamEvent = (
    ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | OutputTextDelta | OutputTextDone
    | FunctionCallArgumentsDelta | FunctionCallArgumentsDone
)
