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
        events: list[StreamEvent] = []
        if not isinstance(self._open, OutputMessage):
            events += self._open_message(new_id("msg"))
        assert isinstance(self._open, OutputMessage)
        self._parts.append(delta)
        events.append(OutputTextDelta(sequence_number=self._next(), item_id=self._open.id, output_index=self._index,
                                      content_index=0, delta=delta))
        return events

    def arguments(self, delta: str, name: str) -> list[StreamEvent]:
        """Arguments of a function call; the first delta opens the call."""
        events: list[StreamEvent] = []
        if not isinstance(self._open, FunctionToolCall):
            call = FunctionToolCall(id=new_id("fc"), status="in_progress", call_id=new_id("call"), name=name, arguments="")
            events.append(self._open_call(call))
        assert isinstance(self._open, FunctionToolCall)
        self._parts.append(delta)
        events.append(FunctionCallArgumentsDelta(sequence_number=self._next(), item_id=self._open.id,
                                                 output_index=self._index, delta=delta))
        return events

    def close(self, status: ItemStatus) -> list[StreamEvent]:
        """Finish the item being streamed (nothing when none is open)."""
        item, self._open = self._open, None
        whole, self._parts = "".join(self._parts), []
        if isinstance(item, OutputMessage):
            return self._close_message(item.model_copy(update={"status": status, "content": [OutputText(text=whole)]}))
        if isinstance(item, FunctionToolCall):
            return self._close_call(item.model_copy(update={"status": status, "arguments": whole}))
        return []

    def whole(self, item: OutputMessage | FunctionToolCall) -> list[StreamEvent]:
        """An item known whole at once (parsed tool calls, a cached answer replayed)."""
        if isinstance(item, OutputMessage):
            events = self._open_message(item.id)
            text = "".join(part.text for part in item.content)
            if text:
                events += self.text(text)
            self._open, self._parts = None, []
            return events + self._close_message(item)
        opened = self._open_call(item.model_copy(update={"status": "in_progress", "arguments": ""}))
        delta = FunctionCallArgumentsDelta(sequence_number=self._next(), item_id=item.id, output_index=self._index,
                                           delta=item.arguments)
        self._open = None
        return [opened, delta, *self._close_call(item)]

    def _open_message(self, item_id: str) -> list[StreamEvent]:
        self._open, self._parts = OutputMessage(id=item_id, status="in_progress", content=[]), []
        added = OutputItemEvent(type="response.output_item.added", sequence_number=self._next(),
                                output_index=self._index, item=self._open)
        part = ContentPartEvent(type="response.content_part.added", sequence_number=self._next(), item_id=item_id,
                                output_index=self._index, content_index=0, part=OutputText(text=""))
        return [added, part]

    def _close_message(self, item: OutputMessage) -> list[StreamEvent]:
        index, text = self._index, "".join(part.text for part in item.content)
        events: list[StreamEvent] = [
            OutputTextDone(sequence_number=self._next(), item_id=item.id, output_index=index, content_index=0,
                           text=text),
            ContentPartEvent(type="response.content_part.done", sequence_number=self._next(), item_id=item.id,
                             output_index=index, content_index=0, part=OutputText(text=text)),
            OutputItemEvent(type="response.output_item.done", sequence_number=self._next(), output_index=index,
                            item=item),
        ]
        self.response.output.append(item)
        return events

    def _open_call(self, item: FunctionToolCall) -> OutputItemEvent:
        self._open, self._parts = item, []
        return OutputItemEvent(type="response.output_item.added", sequence_number=self._next(),
                               output_index=self._index, item=item)

    def _close_call(self, item: FunctionToolCall) -> list[StreamEvent]:
        index = self._index
        events: list[StreamEvent] = [
            FunctionCallArgumentsDone(sequence_number=self._next(), item_id=item.id, output_index=index,
                                      name=item.name, arguments=item.arguments),
            OutputItemEvent(type="response.output_item.done", sequence_number=self._next(), output_index=index,
                            item=item),
        ]
        self.response.output.append(item)
        return events
