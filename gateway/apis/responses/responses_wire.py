"""The Responses API's request, list and stream event models (its answer is `protocol.response_objects`), and the
events of a stream made in order (`ResponseEvents`)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from gateway.protocol.openai import INT64_MAX, _Request, listing, page_of
from gateway.protocol.response_objects import (
    FunctionToolCall,
    Item,
    ItemStatus,
    Metadata,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    _item_kind,
    _Out,
)

TEXT_PARTS = ("input_text", "output_text", "text")
INPUT_ITEMS = ("message", "function_call", "function_call_output", "mcp_approval_response")


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


class McpApprovalResponseInput(_Request):
    """The client's answer to an `mcp_approval_request` of the previous response."""

    type: Literal["mcp_approval_response"]
    approval_request_id: str
    approve: bool
    id: str | None = None
    reason: str | None = None


InputItem = Annotated[
    Annotated[MessageInput, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
    | Annotated[McpApprovalResponseInput, Tag("mcp_approval_response")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class McpToolFilter(_Request):
    tool_names: list[str] | None = None
    read_only: bool | None = None


class McpApprovalFilter(_Request):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpToolParam(_Request):
    """A remote MCP server's tools, offered to the model and called by the gateway (`responses_mcp`)."""

    type: Literal["mcp"]
    server_label: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    server_url: str | None = None
    server_description: str | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None
    connector_id: str | None = None


class ToolChoiceMcp(_Request):
    type: Literal["mcp"]
    server_label: str
    name: str | None = None


def _tool_kind(tool: Any) -> str | None:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return kind if isinstance(kind, str) else None


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


def known_items(value: Any) -> Any:
    """Items of the kinds this server takes, refused by position otherwise (a list's validator, before parsing)."""
    for i, item in enumerate(value if isinstance(value, list) else []):
        kind = _item_kind(item)
        if kind not in INPUT_ITEMS:
            raise ValueError(f"item {i} is a {kind!r} item; this server takes {', '.join(INPUT_ITEMS)} items")
    return value


class ConversationParam(_Request):
    id: str


class ResponsesRequest(_Request):
    """POST /v1/responses."""

    model: str
    input: list[InputItem] | str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | ConversationParam | None = None  # its items come first, the turn is added (apis.conversations)
    max_output_tokens: Annotated[int, Field(ge=16, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    text: TextConfig | None = None
    tools: list[Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[McpToolParam, Tag("mcp")],
                          Discriminator(_tool_kind)]] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceMcp | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
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

    _known_items = field_validator("input", mode="before")(known_items)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            if isinstance(tool, dict) and tool.get("type") not in ("function", "mcp"):
                raise ValueError(f"tools[{i}] is a {tool.get('type')!r} tool; this server runs function and mcp tools")
        return value

    @model_validator(mode="after")
    def _modes(self) -> ResponsesRequest:
        if self.background and not self.store:
            raise ValueError("background responses need store set to true")
        if self.background and self.stream:
            raise ValueError("background responses are not streamed here; poll GET /v1/responses/{id} instead")
        return self


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


def item_page(items: list[Item], query: InputItemsQuery, where: str) -> ResponseItemList:
    """A page of `items` (kept oldest first) as `query` asks; `where`: what holds them, for the refusal of an unknown
    `after`."""
    ordered = items if query.order == "asc" else items[::-1]
    page, more = page_of(ordered, [item.id for item in ordered], query.limit, query.after,
                         missing=f"No item with id '{{1}}' in {where}")
    return listing(ResponseItemList, page, more)


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
    type: str
    sequence_number: int


Lifecycle = Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                    "response.failed"]


class ResponseLifecycleEvent(_Event):
    type: Lifecycle
    response: Response


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(_Event):
    """An event about one output item's content."""

    item_id: str
    output_index: int


class ContentPartEvent(_ItemEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    content_index: int
    part: OutputText


class OutputTextDelta(_ItemEvent):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class OutputTextDone(_ItemEvent):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class FunctionCallArgumentsDelta(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    delta: str


class FunctionCallArgumentsDone(_ItemEvent):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    name: str
    arguments: str


class ItemNote(_ItemEvent):
    """An event about an item the gateway made (an MCP listing, call), its other fields as the kind has them:
    `response.mcp_list_tools.*`, `response.mcp_call.*`, `response.mcp_call_arguments.*`."""

    type: str


StreamEvent = (
    ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | OutputTextDelta | OutputTextDone
    | FunctionCallArgumentsDelta | FunctionCallArgumentsDone | ItemNote
)


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: resp_..., msg_..., fc_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvents:
    """A Responses stream's events, in OpenAI's order, each with the next `sequence_number`:

        response.created, response.in_progress
        per output item:  response.output_item.added
            a message:        response.content_part.added, response.output_text.delta ...,
                              response.output_text.done, response.content_part.done
            a function call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
                          response.output_item.done
        response.completed | response.incomplete | response.failed

    One per stream holds the counter, the response as it grows and the item being streamed; the
    serving code says what happened, this turns it into events."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.sequence = 0
        self.ended = False  # the last event (completed, incomplete, failed) was made
        self._open: OutputMessage | FunctionToolCall | None = None
        self._parts: list[str] = []

    @classmethod
    def resumed(cls, response: Response, sequence: int, message: OutputMessage, text: str) -> ResponseEvents:
        """A stream taken over on another replica (`apis.takeover`): its events before `sequence` were sent, the
        message `message` open with `text` so far."""
        events = cls(response)
        events.sequence, events._open, events._parts = sequence, message, [text]
        return events

    def _next(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    @property
    def _index(self) -> int:
        return len(self.response.output)

    def lifecycle(self, kind: Lifecycle, response: Response | None = None) -> ResponseLifecycleEvent:
        """A lifecycle event carrying the response as it is now (or `response`, the final one)."""
        if response is not None:
            self.response = response
        self.ended = kind in ("response.completed", "response.incomplete", "response.failed")
        snapshot = self.response.model_copy(deep=True)
        return ResponseLifecycleEvent(type=kind, sequence_number=self._next(), response=snapshot)

    def text(self, delta: str) -> list[StreamEvent]:
        """Text of the assistant's message; the first delta opens the message."""
        if isinstance(self._open, OutputMessage):
            return [self._delta(delta)]
        return [*self._opened(OutputMessage(id=new_id("msg"), status="in_progress", content=[])), self._delta(delta)]

    def arguments(self, delta: str, name: str) -> list[StreamEvent]:
        """Arguments of a function call; the first delta opens the call."""
        if isinstance(self._open, FunctionToolCall):
            return [self._delta(delta)]
        call = FunctionToolCall(id=new_id("fc"), status="in_progress", call_id=new_id("call"), name=name, arguments="")
        return [*self._opened(call), self._delta(delta)]

    def close(self, status: ItemStatus) -> list[StreamEvent]:
        """Finish the item being streamed (nothing when none is open)."""
        whole = "".join(self._parts)
        if isinstance(self._open, OutputMessage):
            return self._closed(self._open.model_copy(update={"status": status, "content": [OutputText(text=whole)]}))
        if isinstance(self._open, FunctionToolCall):
            return self._closed(self._open.model_copy(update={"status": status, "arguments": whole}))
        return []

    def whole(self, item: OutputItem) -> list[StreamEvent]:
        """An item known whole at once (parsed tool calls, a cached answer replayed)."""
        if not isinstance(item, OutputMessage | FunctionToolCall):
            return [self.added(item), self.done(item)]
        if isinstance(item, OutputMessage):
            opened = self._opened(OutputMessage(id=item.id, status="in_progress", content=[]))
            text = "".join(part.text for part in item.content)
            deltas = [self._delta(text)] if text else []
        else:
            opened = self._opened(item.model_copy(update={"status": "in_progress", "arguments": ""}))
            deltas = [self._delta(item.arguments)]
        return [*opened, *deltas, *self._closed(item)]

    def added(self, item: OutputItem) -> OutputItemEvent:
        """An item the gateway makes (an MCP listing or call) opened; `about` tells what it does, `done` ends it."""
        return OutputItemEvent(type="response.output_item.added", sequence_number=self._next(),
                               output_index=self._index, item=item)

    def about(self, kind: str, item_id: str, **fields: Any) -> ItemNote:
        return ItemNote(type=kind, sequence_number=self._next(), item_id=item_id, output_index=self._index, **fields)

    def done(self, item: OutputItem) -> OutputItemEvent:
        event = OutputItemEvent(type="response.output_item.done", sequence_number=self._next(),
                                output_index=self._index, item=item)
        self.response.output.append(item)
        return event

    def _opened(self, item: OutputMessage | FunctionToolCall) -> list[StreamEvent]:
        self._open, self._parts = item, []
        events: list[StreamEvent] = [OutputItemEvent(type="response.output_item.added", sequence_number=self._next(),
                                                     output_index=self._index, item=item)]
        if isinstance(item, OutputMessage):
            events.append(ContentPartEvent(type="response.content_part.added", sequence_number=self._next(),
                                           item_id=item.id, output_index=self._index, content_index=0,
                                           part=OutputText(text="")))
        return events

    def _delta(self, delta: str) -> StreamEvent:
        assert self._open is not None
        self._parts.append(delta)
        item_id, index = self._open.id, self._index
        if isinstance(self._open, OutputMessage):
            return OutputTextDelta(sequence_number=self._next(), item_id=item_id, output_index=index, content_index=0,
                                   delta=delta)
        return FunctionCallArgumentsDelta(sequence_number=self._next(), item_id=item_id, output_index=index, delta=delta)

    def _closed(self, item: OutputMessage | FunctionToolCall) -> list[StreamEvent]:
        """The item's closing events; it joins the response's output."""
        self._open, self._parts = None, []
        index = self._index
        events: list[StreamEvent]
        if isinstance(item, OutputMessage):
            text = "".join(part.text for part in item.content)
            events = [
                OutputTextDone(sequence_number=self._next(), item_id=item.id, output_index=index, content_index=0,
                               text=text),
                ContentPartEvent(type="response.content_part.done", sequence_number=self._next(), item_id=item.id,
                                 output_index=index, content_index=0, part=OutputText(text=text)),
            ]
        else:
            events = [FunctionCallArgumentsDone(sequence_number=self._next(), item_id=item.id, output_index=index,
                                                name=item.name, arguments=item.arguments)]
        events.append(OutputItemEvent(type="response.output_item.done", sequence_number=self._next(),
                                      output_index=index, item=item))
        self.response.output.append(item)
        return events
