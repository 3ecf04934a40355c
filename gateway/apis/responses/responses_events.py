"""The Responses API's stream of events, in OpenAI's order, each with the next `sequence_number`:

    response.created, response.in_progress
    per output item:  response.output_item.added
        a message:        response.content_part.added, response.output_text.delta ...,
                          response.output_text.done, response.content_part.done
        a function call:  response.function_call_arguments.delta ..., response.function_call_arguments.done
                      response.output_item.done
    response.completed | response.incomplete | response.failed

One `ResponseEvents` per stream holds the counter, the response as it grows and the item being
streamed; the serving code says what happened, this turns it into events.
"""

from __future__ import annotations

import uuid
from typing import Literal

from gateway.apis.responses.responses_wire import (
    ContentPartEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    OutputItemEvent,
    OutputTextDelta,
    OutputTextDone,
    ResponseLifecycleEvent,
    StreamEvent,
)
from gateway.protocol.response_objects import FunctionToolCall, ItemStatus, OutputMessage, OutputText, Response

Lifecycle = Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                    "response.failed"]


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: resp_..., msg_..., fc_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseEvents:
    def __init__(self, response: Response) -> None:
        self.response = response
        self.sequence = 0
        self.ended = False  # the last event (completed, incomplete, failed) was made
        self._open: OutputMessage | FunctionToolCall | None = None
        self._parts: list[str] = []

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

    def whole(self, item: OutputMessage | FunctionToolCall) -> list[StreamEvent]:
        """An item known whole at once (parsed tool calls, a cached answer replayed)."""
        if isinstance(item, OutputMessage):
            opened = self._opened(OutputMessage(id=item.id, status="in_progress", content=[]))
            text = "".join(part.text for part in item.content)
            deltas = [self._delta(text)] if text else []
        else:
            opened = self._opened(item.model_copy(update={"status": "in_progress", "arguments": ""}))
            deltas = [self._delta(item.arguments)]
        return [*opened, *deltas, *self._closed(item)]

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
