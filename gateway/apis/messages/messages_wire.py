"""Anthropic's Messages API as pydantic models, after the `anthropic` SDK's types. Requests forbid unknown fields;
names OpenAI's module also uses carry an `Anthropic` prefix so /openapi.json has one schema per name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from gateway.protocol.openai import INT64_MAX, _Request, _Response


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlockParam(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlockParam(_Request):
    type: Literal["image", "document"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None


class ToolUseBlockParam(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlockParam(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlockParam | ImageBlockParam, Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


ContentBlockParam = Annotated[
    TextBlockParam | ImageBlockParam | ToolUseBlockParam | ToolResultBlockParam, Field(discriminator="type")
]


class MessageParam(_Request):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(_Request):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class ToolChoiceAuto(_Request):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(_Request):
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(_Request):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(_Request):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class Metadata(_Request):
    user_id: str | None = None


class ThinkingDisabled(_Request):
    """Extended thinking: only `{"type": "disabled"}` (no model here thinks)."""

    type: Literal["disabled"]


class OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    """Structured outputs (`format`); `effort` is accepted and has no effect here."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Conversation(_Request):
    """What /v1/messages and /v1/messages/count_tokens share: the prompt."""

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingDisabled | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(Conversation):
    """POST /v1/messages (the SDK's MessageCreateParams)."""

    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)]
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    temperature: Annotated[float, Field(ge=0, le=1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None  # bounded as OpenAI's: the engine takes int64
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens (the SDK's MessageCountTokensParams)."""


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]  # refusal: an output guard cut it


class TextBlock(_Response):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[TextBlock | ToolUseBlock, Field(discriminator="type")]


class AnthropicUsage(_Response):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = None


class _StopFields(_Response):
    """Anthropic always sends `stop_reason` and `stop_sequence`, null or not (the gateway's encoders drop Nones)."""

    stop_reason: StopReason | None = None
    stop_sequence: str | None = None

    @model_serializer(mode="wrap")
    def _stop_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {**handler(self), "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}


class Message(_StopFields):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    usage: AnthropicUsage


class MessageTokensCount(_Response):
    input_tokens: int


# --- stream events (each is named by its `type` on the wire: `event: <type>`) ------------------


class MessageStartEvent(_Response):
    type: Literal["message_start"] = "message_start"
    message: Message


class ContentBlockStartEvent(_Response):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(_Response):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJSONDelta(_Response):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(_Response):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | InputJSONDelta, Field(discriminator="type")]


class ContentBlockStopEvent(_Response):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(_StopFields):
    pass


class MessageDeltaEvent(_Response):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: AnthropicUsage  # the answer's, cumulative: the SDK takes the input counts from here too


class MessageStopEvent(_Response):
    type: Literal["message_stop"] = "message_stop"


class PingEvent(_Response):
    type: Literal["ping"] = "ping"


class AnthropicError(_Response):
    type: str
    message: str


class AnthropicErrorResponse(_Response):
    type: Literal["error"] = "error"
    error: AnthropicError
