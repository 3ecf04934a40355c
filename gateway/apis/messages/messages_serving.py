"""Anthropic's Messages API on the chat pipeline: a Messages request becomes a chat request
(`to_chat`: blocks as chat messages, Anthropic's tools and tool_choice as OpenAI's, `output_config`
as structured outputs), which the dispatcher runs as any chat request; this service prepares it with
chat's and answers a Message or Anthropic's event stream (`ContentStream`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import BaseModel

from engine.types import Engine, Task
from gateway.apis.chat import chat_serving as chat
from gateway.apis.chat.chat_serving import PreparedChat
from gateway.apis.messages.messages_wire import (
    AnthropicUsage,
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    Conversation,
    CountTokensRequest,
    InputJSONDelta,
    Message,
    MessageDelta,
    MessageDeltaEvent,
    MessageParam,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageTokensCount,
    PingEvent,
    StopReason,
    TextBlock,
    TextBlockParam,
    TextDelta,
    ToolChoiceTool,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from gateway.errors import InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    JsonSchema,
    ResponseFormat,
    ToolCall,
)
from gateway.serving import tools
from gateway.serving.generation import ChoiceState, Run, hand_over
from gateway.serving.service import OnDone, check_task

CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice → OpenAI's
TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")  # Anthropic's pattern of a tool_use block's id


# --- request: Anthropic's → a chat request ------------------------------------------------------


def _unsupported(block: BaseModel, param: str, where: str, takes: str) -> InvalidRequest:
    """A block of a kind the place it is in does not take (a tool_use block is an assistant's, a
    tool_result block a user's; images and documents are nobody's here)."""
    kind = getattr(block, "type", "this")
    return InvalidRequest(f"{kind} blocks are not supported in {where} (it takes {takes} blocks)", param)


def _texts(blocks: list[Any], param: str, where: str) -> str:
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlockParam):
            raise _unsupported(block, f"{param}.{j}", where, "text")
    return "\n".join(block.text for block in blocks)


def _tool_result(block: ToolResultBlockParam, param: str) -> ChatMessage:
    content = block.content
    text = content if isinstance(content, str) else _texts(content or [], f"{param}.content", "a tool_result's content")
    text = f"Error: {text}" if block.is_error else text
    return ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=text)


def _chat_messages(message: MessageParam, index: int) -> list[ChatMessage]:
    """One Anthropic message as chat messages: a user's tool results become `tool` messages, in
    order; an assistant's tool_use blocks, its tool calls."""
    param = f"messages.{index}.content"
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    assistant = message.role == "assistant"
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlockParam) and assistant:
            calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name, arguments=json.dumps(block.input))))
        elif isinstance(block, ToolResultBlockParam) and not assistant:
            if texts:
                out.append(ChatMessage(role=message.role, content="\n".join(texts)))
                texts = []
            out.append(_tool_result(block, f"{param}.{j}"))
        else:
            where = "an assistant message" if assistant else f"a {message.role} message"
            raise _unsupported(block, f"{param}.{j}", where, "text and tool_use" if assistant else "text and tool_result")
    if assistant:
        return [ChatMessage(role="assistant", content="\n".join(texts) or None, tool_calls=calls or None)]
    if texts or not out:
        out.append(ChatMessage(role=message.role, content="\n".join(texts)))
    return out


def check_tool_blocks(conversation: Conversation) -> None:
    """What Anthropic refuses of tool blocks: a tool_use id outside its pattern, or a tool_result
    that answers no tool_use of the message before it (InvalidRequest, in Anthropic's shape on
    its routes)."""
    previous: set[str] = set()  # the tool_use ids of the previous message
    for i, message in enumerate(conversation.messages):
        blocks = message.content if isinstance(message.content, list) else []
        for j, block in enumerate(blocks):
            param = f"messages.{i}.content.{j}"
            if isinstance(block, ToolUseBlockParam) and not TOOL_USE_ID.fullmatch(block.id):
                raise InvalidRequest(f"{param}.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'",
                                     f"{param}.id")
            if isinstance(block, ToolResultBlockParam) and block.tool_use_id not in previous:
                raise InvalidRequest(
                    f"{param}: unexpected `tool_use_id` found in `tool_result` blocks: {block.tool_use_id}. Each "
                    "`tool_result` block must have a corresponding `tool_use` block in the previous message.",
                    f"{param}.tool_use_id",
                )
        previous = {block.id for block in blocks if isinstance(block, ToolUseBlockParam)}


def chat_messages(conversation: Conversation) -> list[ChatMessage]:
    system = conversation.system
    messages = []
    if system:
        text = system if isinstance(system, str) else _texts(list(system), "system", "system")
        messages.append(ChatMessage(role="system", content=text))
    for i, message in enumerate(conversation.messages):
        messages.extend(_chat_messages(message, i))
    check_tool_blocks(conversation)  # after each block was found in a place that takes it
    return messages


def chat_tools(conversation: Conversation) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of the chat request."""
    fields: dict[str, Any] = {}
    if conversation.tools is not None:
        functions = [{"name": t.name, "description": t.description, "parameters": t.input_schema}
                     for t in conversation.tools]
        fields["tools"] = [{"type": "function", "function": {k: v for k, v in f.items() if v is not None}}
                           for f in functions]
    choice = conversation.tool_choice
    if isinstance(choice, ToolChoiceTool):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        fields["tool_choice"] = CHOICES[choice.type]
    if getattr(choice, "disable_parallel_tool_use", None):
        fields["parallel_tool_calls"] = False
    return fields


def to_chat(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that answers a Messages request. Built without the chat model's own
    validation (the Anthropic request was validated): Anthropic allows more than 4 stop sequences."""
    return ChatCompletionRequest.model_construct(
        model=request.model, messages=chat_messages(request), max_tokens=request.max_tokens,
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        stop=list(request.stop_sequences) if request.stop_sequences else None, stream=request.stream,
        user=request.metadata.user_id if request.metadata else None, response_format=_response_format(request),
        **chat_tools(request),
    )


def _response_format(request: MessagesRequest) -> ResponseFormat | None:
    """`output_config.format` (structured outputs) as OpenAI's json_schema response format."""
    output = request.output_config.format if request.output_config else None
    if output is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchema(name="output", schema=output.schema_))


def count_tokens(request: CountTokensRequest, engine: Engine) -> MessageTokensCount:
    """The prompt's tokens, rendered exactly as /v1/messages renders it."""
    check_task(engine.info, "generate", "/v1/messages/count_tokens")
    as_chat = ChatCompletionRequest.model_construct(
        model=request.model, messages=chat_messages(request), **chat_tools(request)
    )
    prompt = chat.render(as_chat, tools.plan(as_chat), engine.tokenizer)
    return MessageTokensCount(input_tokens=len(prompt.token_ids))


# --- answer: the engine's output → a Message ----------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _stop(state: ChoiceState, called: bool) -> tuple[StopReason, str | None]:
    if state.finish_reason == "length":
        return "max_tokens", None
    if state.finish_reason == "content_filter":  # an output guard cut the answer
        return "refusal", None
    if called:
        return "tool_use", None
    if isinstance(state.stop_reason, str):
        return "stop_sequence", state.stop_reason
    return "end_turn", None


def _usage(run: Run) -> AnthropicUsage:
    """Anthropic counts prompt tokens read from the (prefix) cache apart from input_tokens."""
    cached = run.cached_tokens
    output = sum(state.tokens for state in run.choices)
    return AnthropicUsage(
        input_tokens=run.prompt_tokens - cached, output_tokens=output, cache_read_input_tokens=cached or None
    )


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}  # cut short by max_tokens (stop_reason says so)
    return value if isinstance(value, dict) else {}


def _answer(prepared: PreparedChat, run: Run) -> tuple[Message, list[tools.ToolCall]]:
    state = run.choices[0]
    content, calls = prepared.tools.parse("".join(state.text))
    blocks: list[ContentBlock] = [TextBlock(text=content)] if content else []
    for call in calls:
        block_id = tool_use_id(prepared.id, len(blocks))
        blocks.append(ToolUseBlock(id=block_id, name=call.name, input=_input(call.arguments)))
    reason, sequence = _stop(state, bool(calls))
    message = Message(id=prepared.id, content=blocks, model=prepared.model, stop_reason=reason, stop_sequence=sequence,
                      usage=_usage(run))
    return message, calls


def _start(answer_id: str, model: str, input_tokens: int) -> list[BaseModel]:
    usage = AnthropicUsage(input_tokens=input_tokens, output_tokens=0)
    message = Message(id=answer_id, content=[], model=model, usage=usage)
    return [MessageStartEvent(message=message), PingEvent()]


def _end(answer: Message) -> list[BaseModel]:
    delta = MessageDelta(stop_reason=answer.stop_reason, stop_sequence=answer.stop_sequence)
    return [MessageDeltaEvent(delta=delta, usage=answer.usage)]


# --- stream: the content blocks as events ------------------------------------------------------


def tool_use_id(message_id: str, index: int) -> str:
    """The id of the tool_use block at `index` of a message: the same when streamed and whole."""
    return f"toolu_{message_id.removeprefix('msg_')[:20]}{index:04d}"


class BlockEvents:
    """Content blocks as events, numbered in order; one block open at a time."""

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        self.index = 0
        self.open: Literal["text", "tool_use"] | None = None

    def text(self, piece: str) -> list[BaseModel]:
        if not piece:
            return []
        events: list[BaseModel] = []
        if self.open != "text":
            events = [*self.close(), ContentBlockStartEvent(index=self.index, content_block=TextBlock(text=""))]
            self.open = "text"
        return [*events, ContentBlockDeltaEvent(index=self.index, delta=TextDelta(text=piece))]

    def tool(self, name: str, arguments: str = "", id: str | None = None) -> list[BaseModel]:
        events = self.close()
        block = ToolUseBlock(id=id or tool_use_id(self.message_id, self.index), name=name, input={})
        self.open = "tool_use"
        return [*events, ContentBlockStartEvent(index=self.index, content_block=block), *self.arguments(arguments)]

    def arguments(self, piece: str) -> list[BaseModel]:
        return [ContentBlockDeltaEvent(index=self.index, delta=InputJSONDelta(partial_json=piece))] if piece else []

    def close(self) -> list[BaseModel]:
        if self.open is None:
            return []
        self.open = None
        self.index += 1
        return [ContentBlockStopEvent(index=self.index - 1)]


class ContentStream:
    """One answer's content as events, as its text arrives (one choice: Anthropic has no `n`): per
    tool mode, text deltas (held back where a `<tool_call>` may begin), a named tool's input as
    `input_json_delta`, or the parsed calls as tool_use blocks at the end."""

    def __init__(self, message_id: str, plan: tools.ToolPlan) -> None:
        self.blocks = BlockEvents(message_id)
        self.plan = plan
        self.held = tools.HeldText(plan.mode)  # the text, and how much of it went out as text deltas

    def feed(self, piece: str) -> list[BaseModel]:
        if self.plan.mode == "named":
            start = [] if self.blocks.open else self.blocks.tool(self.plan.named or "")
            return [*start, *self.blocks.arguments(piece)]
        if self.plan.mode == "required":  # the calls come at the end, parsed from the whole text
            return []
        return self.blocks.text(self.held.feed(piece))

    def finish(self, calls: list[tools.ToolCall]) -> list[BaseModel]:
        """What the whole text adds at its end (`calls` parsed from it), then the last block's stop."""
        events: list[BaseModel] = []
        if self.plan.mode == "named":
            events = [] if self.blocks.open else self.blocks.tool(self.plan.named or "")
        elif calls:
            for call in calls:
                events += self.blocks.tool(call.name, call.arguments)
        elif self.plan.mode != "required":
            events = self.blocks.text(self.held.rest(calls=False))
        return [*events, *self.blocks.close()]


class MessagesService:
    """/v1/messages for the dispatcher (`serving.service.Service`): embedded models only."""

    route = "/v1/messages"
    upstream_path: str | None = None
    answer_type = Message
    task: Task = "generate"

    def prepare(
        self, request: ChatCompletionRequest, engine: Engine, default_max_tokens: int | None,
        guard: RequestGuard = UNGUARDED,
    ) -> PreparedChat:
        """Chat's prepare (templates, tools, input guards) under a message id."""
        prepared = chat.prepare(request, engine, default_max_tokens, guard)
        prepared.id = new_message_id()
        return prepared

    async def complete(self, prepared: PreparedChat, on_done: OnDone[Message] | None = None) -> Message:
        run = await chat.start_run(prepared)
        await run.collect()
        answer, _ = _answer(prepared, run)
        await hand_over(on_done, answer, run)
        return answer

    async def stream(
        self, prepared: PreparedChat, on_done: OnDone[Message] | None = None
    ) -> AsyncGenerator[BaseModel, None]:
        """message_start, ping, the content blocks as they come, message_delta (stop reason, usage),
        message_stop: Anthropic's order."""
        run = await chat.start_run(prepared)
        for event in _start(prepared.id, prepared.model, run.prompt_tokens):
            yield event
        content = ContentStream(prepared.id, prepared.tools)
        async for output in run.outputs():
            for delta in output.choices:
                for event in content.feed(delta.text):
                    yield event
        answer, calls = _answer(prepared, run)
        for event in [*content.finish(calls), *_end(answer)]:
            yield event
        await hand_over(on_done, answer, run)
        yield MessageStopEvent()

    async def replay(self, answer: Message, request: ChatCompletionRequest) -> AsyncGenerator[BaseModel, None]:
        """A whole (cached) answer as a stream, under a new id: each block in one delta."""
        answer = self.fresh(answer)
        usage = answer.usage
        for event in _start(answer.id, answer.model, usage.input_tokens + (usage.cache_read_input_tokens or 0)):
            yield event
        blocks = BlockEvents(answer.id)
        for block in answer.content:
            if isinstance(block, TextBlock):
                events = blocks.text(block.text)
            else:
                events = blocks.tool(block.name, json.dumps(block.input), block.id)
            for event in [*events, *blocks.close()]:
                yield event
        for event in [*_end(answer), MessageStopEvent()]:
            yield event

    def fresh(self, answer: Message) -> Message:
        """A cached answer under a new id."""
        return answer.model_copy(update={"id": new_message_id()})

    def renewed(self, raw: bytes) -> bytes | None:
        return None  # its own serializer (the stop fields): the model writes it


MESSAGES = MessagesService()
