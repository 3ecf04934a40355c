"""A Message's content blocks as Anthropic's stream events, while the engine's text arrives:
`BlockEvents` numbers the blocks and keeps one open at a time; `ContentStream` decides per tool mode
(`serving.tools`) what text becomes (text deltas, held back where a `<tool_call>` may begin; a named
tool's input as `input_json_delta`; parsed calls as tool_use blocks at the end). Its tool_use ids are
those of the whole answer (`tool_use_id`), so a streamed answer and a cached one agree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from gateway.apis.messages.messages_wire import (
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    InputJSONDelta,
    TextBlock,
    TextDelta,
    ToolUseBlock,
)
from gateway.serving.tools import HeldText, ToolCall, ToolPlan


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
    """One answer's content as events, as its text arrives (one choice: Anthropic has no `n`)."""

    def __init__(self, message_id: str, plan: ToolPlan) -> None:
        self.blocks = BlockEvents(message_id)
        self.plan = plan
        self.held = HeldText(plan.mode)  # the text, and how much of it went out as text deltas

    def feed(self, piece: str) -> list[BaseModel]:
        if self.plan.mode == "named":
            start = [] if self.blocks.open else self.blocks.tool(self.plan.named or "")
            return [*start, *self.blocks.arguments(piece)]
        if self.plan.mode == "required":  # the calls come at the end, parsed from the whole text
            return []
        return self.blocks.text(self.held.feed(piece))

    def finish(self, calls: list[ToolCall]) -> list[BaseModel]:
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
