"""The Responses API (`/v1/responses`) on the chat pipeline: the request's `input` becomes items (as a
response keeps them), and the conversation (the `previous_response_id` chain's items, or a `conversation`'s
(`Joined`), then these) a chat request, which the dispatcher runs as any (its refusals in this API's terms); this answers a `Response` or its
events (`responses_wire.ResponseEvents`). A cut answer is `incomplete`; a failure after the first event is
`response.failed`. With `store`, a stream stores its response from `response.created` on and again before its
last event (cancelled, with the items done so far, if it stops early); a whole answer is stored by the route.
Storing a completed or incomplete answer also adds the turn to its `conversation`, once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any, Literal, Protocol

import structlog
from pydantic import BaseModel

from engine.types import Engine, Task
from gateway.apis.chat import chat_serving
from gateway.apis.chat.chat_serving import PreparedChat
from gateway.apis.responses import responses_mcp_items
from gateway.apis.responses.responses_wire import (
    TEXT_PARTS,
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionTool,
    InputItem,
    InputPart,
    McpApprovalResponseInput,
    MessageInput,
    ResponseEvents,
    ResponsesRequest,
    ToolChoiceFunction,
    new_id,
)
from gateway.errors import APIError, InvalidRequest, NotFound, from_exception
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.protocol.openai import ChatCompletionRequest, Usage
from gateway.protocol.response_objects import (
    ConversationRef,
    FunctionCallOutput,
    FunctionToolCall,
    IncompleteDetails,
    InputMessage,
    InputText,
    InputTokensDetails,
    Item,
    McpApprovalResponse,
    OutputItem,
    OutputMessage,
    OutputText,
    Response,
    ResponseError,
    ResponseUsage,
    Status,
)
from gateway.serving import tools
from gateway.serving.generation import ChoiceState, Run, hand_over, now
from gateway.serving.service import OnDone
from gateway.stores.responses import RUNNING, OwnedResponses, StoredResponse

log = structlog.get_logger(__name__)
CANCEL_CHECK_S = 1.0  # a background response looks this often for a cancel made on another replica


class Joined(Protocol):
    """The conversation a request continues (`apis.conversations`): where its finished turn goes."""

    async def add(self, given: list[Item], output: list[OutputItem]) -> None: ...


# --- the request: its input as items, the conversation as a chat request ----------------------


# chat's parameter names in its refusals, as the Responses API calls them
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def conversation_of(request: ResponsesRequest) -> ConversationRef | None:
    given = request.conversation
    return ConversationRef(id=given if isinstance(given, str) else given.id) if given is not None else None


def request_items(request: ResponsesRequest) -> list[Item]:
    """The request's input as items (a string is one user message)."""
    return input_items(request.input, "input")


def input_items(given: list[InputItem] | str | None, param: str) -> list[Item]:
    """Input items (the `param` field's) as a response keeps them."""
    if given is None:
        return []
    if isinstance(given, str):
        return [InputMessage(id=new_id("msg"), role="user", content=[InputText(text=given)])]
    return [_item(item, f"{param}.{i}") for i, item in enumerate(given)]


def _item(item: MessageInput | FunctionCallInput | FunctionCallOutputInput | McpApprovalResponseInput,
          param: str) -> Item:
    if isinstance(item, McpApprovalResponseInput):
        return McpApprovalResponse(id=item.id or new_id("mcpr"), approval_request_id=item.approval_request_id,
                                   approve=item.approve, reason=item.reason)
    if isinstance(item, FunctionCallInput):
        return FunctionToolCall(id=item.id or new_id("fc"), status="completed", call_id=item.call_id, name=item.name,
                            arguments=item.arguments)
    if isinstance(item, FunctionCallOutputInput):
        output = item.output if isinstance(item.output, str) else "\n".join(_texts(item.output, f"{param}.output"))
        return FunctionCallOutput(id=item.id or new_id("fco"), call_id=item.call_id, output=output)
    texts = [item.content] if isinstance(item.content, str) else _texts(item.content, f"{param}.content")
    if item.role == "assistant":
        content = [OutputText(text=text) for text in texts]
        return OutputMessage(id=item.id or new_id("msg"), status="completed", content=content)
    return InputMessage(id=item.id or new_id("msg"), role=item.role, content=[InputText(text=t) for t in texts])


def _texts(parts: list[InputPart], param: str) -> list[str]:
    texts = []
    for i, part in enumerate(parts):
        text = part.refusal if part.type == "refusal" else part.text
        if part.type not in (*TEXT_PARTS, "refusal"):
            raise InvalidRequest("Only text content parts are supported by this model", f"{param}.{i}")
        if text is None:
            field = "refusal" if part.type == "refusal" else "text"
            raise InvalidRequest(f"A content part of type {part.type} needs its {field}", f"{param}.{i}")
        texts.append(text)
    return texts


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat messages: function calls join the assistant message before them (or make one),
    their outputs are tool messages."""
    messages: list[dict[str, Any]] = []
    called: set[str] = set()
    for item in responses_mcp_items.for_the_model(items):
        if isinstance(item, InputMessage | OutputMessage):
            messages.append({"role": item.role, "content": "\n".join(part.text for part in item.content)})
        elif isinstance(item, FunctionToolCall):
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            called.add(item.call_id)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif not isinstance(item, FunctionCallOutput):
            continue  # the mcp items `for_the_model` left out
        elif item.call_id not in called:  # OpenAI's refusal of an output that answers no call
            raise InvalidRequest(f"No tool call found for function call output with call_id {item.call_id}.", "input")
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def chat_request(request: ResponsesRequest, conversation: list[Item]) -> ChatCompletionRequest:
    """The chat request that answers `request`, given the whole conversation."""
    messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
    messages += chat_messages(conversation)
    if not messages:
        raise InvalidRequest("Missing required parameter: 'input'", "input")
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream or request.background,
        "temperature": request.temperature, "top_p": request.top_p, "user": request.user,
        "max_completion_tokens": request.max_output_tokens, "parallel_tool_calls": request.parallel_tool_calls,
        "service_tier": request.service_tier, "priority": request.priority,
    }
    functions = [tool for tool in request.tools or [] if isinstance(tool, FunctionTool)]  # mcp tools: `responses_mcp`
    if functions:
        described = {"name", "description", "parameters"}
        fields["tools"] = [{"type": "function", "function": tool.model_dump(include=described, exclude_none=True)}
                           for tool in functions]
    choice = request.tool_choice
    if choice is not None and not (choice == "auto" and not functions):  # auto with no tools: no choice to make
        named = {"type": "function", "function": {"name": choice.name}} if isinstance(choice, ToolChoiceFunction) else None
        fields["tool_choice"] = named or choice
    text_format = request.text.format if request.text else None
    if text_format is not None and text_format.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif text_format is not None and text_format.type == "json_schema":
        given = text_format.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        fields["response_format"] = {"type": "json_schema", "json_schema": given}
    return ChatCompletionRequest.model_validate(fields, strict=False)


def renamed_param(param: str) -> str:
    """A chat field as the Responses API names it."""
    head, _, rest = param.partition(".")
    if head == "tools":  # chat's tools.N.function.parameters is the Responses tools.N.parameters
        return param.replace(".function.", ".")
    if head == "response_format":  # response_format.json_schema.schema is text.format.schema
        return "text.format" + (".schema" if rest.endswith("schema") else "")
    if head == "messages":  # the chat request's messages are the conversation, this request's input
        return "input"
    return RENAMED.get(head, head) + (f".{rest}" if rest else "")


def renamed(error: InvalidRequest) -> InvalidRequest:
    """A refusal of the chat pipeline in the Responses API's terms (its parameter names)."""
    param = renamed_param(error.param or "")
    message = error.message
    for chat_name, name in RENAMED.items():
        message = message.replace(chat_name, name)
    error.param, error.message = param or None, message
    error.args = (message,)
    return error


# --- the answer: a Response, or its events -------------------------------------------------------


def usage_of(usage: Usage) -> ResponseUsage:
    cached = (usage.prompt_tokens_details or {}).get("cached_tokens", 0)
    details = InputTokensDetails(cached_tokens=cached)
    return ResponseUsage(input_tokens=usage.prompt_tokens, input_tokens_details=details,
                         output_tokens=usage.completion_tokens, total_tokens=usage.total_tokens)


def item_status(state: ChoiceState) -> Literal["completed", "incomplete"]:
    """A generation cut short (its output budget spent, or an output guard's cut) ends incomplete."""
    return "incomplete" if state.finish_reason in ("length", "content_filter") else "completed"


def output_items(plan: tools.ToolPlan, state: ChoiceState) -> list[OutputMessage | FunctionToolCall]:
    """The output of a finished generation: a message (its text), then the function calls."""
    status = item_status(state)
    content, calls = plan.parse("".join(state.text))
    items: list[OutputMessage | FunctionToolCall] = []
    if content or not calls:
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[OutputText(text=content or "")]))
    items += [FunctionToolCall(id=new_id("fc"), status=status, call_id=new_id("call"), name=call.name,
                               arguments=call.arguments) for call in calls]
    for item in items[:-1]:  # a cut answer cut its last item only
        item.status = "completed"
    return items


def renewed(item: OutputItem) -> OutputItem:
    """An item of a cached answer under new ids."""
    if isinstance(item, FunctionToolCall):
        return item.model_copy(update={"id": new_id("fc"), "call_id": new_id("call")})
    return item.model_copy(update={"id": new_id("msg")})


class ResponsesService:
    """/v1/responses for the dispatcher (`serving.service.Service`), one per request."""

    route = "/v1/responses"
    upstream_path = ""  # no remote upstream: the conversation and its store live here
    task: Task = "generate"
    answer_type = Response

    def __init__(
        self, request: ResponsesRequest, history: list[Item], mine: OwnedResponses, joined: Joined | None = None
    ) -> None:
        self.request, self.mine = request, mine  # `mine`: the asking tenant's stored responses
        self.input = request_items(request)
        self.items = [*history, *self.input]  # what the model reads, as kept
        self.joined = joined  # the conversation the turn is added to, once answered (`save`)
        self.id, self.created = new_id("resp"), now()
        self.model = request.model
        self.service_tier = "default"  # the tier it ran in (tenancy.priority), once prepared
        self.answer: Response | None = None  # the whole answer, once known (for `save`)
        self.events: ResponseEvents | None = None  # a stream's state (for a cancel)

    def chat_request(self) -> ChatCompletionRequest:
        return chat_request(self.request, self.items)

    # --- the Service protocol ------------------------------------------------------------------

    def prepare(
        self, request: ChatCompletionRequest, engine: Engine, default_max_tokens: int | None,
        guard: RequestGuard = UNGUARDED,
    ) -> PreparedChat:
        try:
            prepared = chat_serving.prepare(request, engine, default_max_tokens, guard)
        except InvalidRequest as error:
            raise renamed(error) from None
        if prepared.constraint is not None:  # its refusals, later in the pipeline, in this API's terms
            prepared.constraint = prepared.constraint.renamed(renamed_param)
        return prepared

    async def complete(self, prepared: PreparedChat, on_done: OnDone[Response] | None = None) -> Response:
        run = await chat_serving.start_run(prepared)
        await run.collect()
        self.model, self.service_tier = prepared.model, prepared.scheduled.tier
        answer = self._finished([*output_items(prepared.tools, run.choices[0])], run.usage(), run.choices[0])
        await hand_over(on_done, answer, run)
        self.answer = answer
        return answer

    def fresh(self, answer: Response) -> Response:
        self.model = answer.model
        fresh = self.skeleton(answer.status)
        fresh.output = [renewed(item) for item in answer.output]
        fresh.usage, fresh.incomplete_details = answer.usage, answer.incomplete_details
        fresh.completed_at = now() if answer.status == "completed" else None
        self.answer = fresh
        return fresh

    def renewed(self, raw: bytes) -> bytes | None:
        return None  # new ids throughout, this request's fields, and kept for `save`: `fresh` does it

    # --- the Response object -------------------------------------------------------------------

    def skeleton(self, status: Status) -> Response:
        """The response with this request's fields, no output yet."""
        r = self.request
        text: dict[str, Any] = {"format": {"type": "text"}}
        if r.text:  # its format (with the schema's own name, `schema`) and verbosity, as given
            text.update(r.text.model_dump(mode="json", by_alias=True, exclude_none=True))
        choice = r.tool_choice.model_dump(mode="json") if isinstance(r.tool_choice, BaseModel) else r.tool_choice
        return Response(
            id=self.id, created_at=self.created, status=status, background=r.background, model=self.model,
            instructions=r.instructions, max_output_tokens=r.max_output_tokens, max_tool_calls=r.max_tool_calls,
            parallel_tool_calls=r.parallel_tool_calls, previous_response_id=r.previous_response_id, store=r.store,
            temperature=1.0 if r.temperature is None else r.temperature, top_p=1.0 if r.top_p is None else r.top_p,
            text=text, tool_choice=choice or "auto", user=r.user, metadata=r.metadata or {},
            service_tier=self.service_tier, conversation=conversation_of(r),
            # an mcp tool's credentials are not echoed, nor stored
            tools=[tool.model_dump(mode="json", exclude_none=True, exclude={"headers", "authorization"})
                   for tool in r.tools or []],
        )

    def _finished(self, output: list[OutputItem], usage: Usage | None, state: ChoiceState) -> Response:
        cut = any(isinstance(item, OutputMessage | FunctionToolCall) and item.status == "incomplete" for item in output)
        response = self.skeleton("incomplete" if cut else "completed")
        response.output = output
        response.usage = usage_of(usage) if usage is not None else None
        if cut:
            reason = "content_filter" if state.finish_reason == "content_filter" else "max_output_tokens"
            response.incomplete_details = IncompleteDetails(reason=reason)
        else:
            response.completed_at = now()
        return response

    async def save(self, response: Response | None = None) -> None:
        """Store the response (the whole answer when none is named), if the request says store."""
        response = response or self.answer
        if self.joined is not None and response is not None and response.status in ("completed", "incomplete"):
            # once, and before the response is stored as ended: who sees it ended finds the turn in the conversation
            joined, self.joined = self.joined, None
            await joined.add(self.input, response.output)
        if self.request.store and response is not None:
            await self.mine.put(StoredResponse(response=response, input_items=self.items))

    async def cancelled(self) -> Response:
        """A background response after its stop: as stored (cancelled by its stream, or ended
        before the stop), or, when its stream never ran, stored now as cancelled."""
        try:
            stored = await self.mine.get(self.id)
            if stored.response.status not in RUNNING:
                return stored.response
        except APIError:
            pass
        response = self._stopped(self.events)
        await self.save(response)
        return response

    def _stopped(self, events: ResponseEvents | None) -> Response:
        """The response as it stands (the items done so far), cancelled."""
        response = events.response.model_copy(deep=True) if events else self.skeleton("cancelled")
        response.status = "cancelled"
        return response

    # --- streams ------------------------------------------------------------------------------

    async def stream(
        self, prepared: PreparedChat, on_done: OnDone[Response] | None = None
    ) -> AsyncGenerator[BaseModel, None]:
        run = await chat_serving.start_run(prepared)  # refusals before the first event
        self.model, self.service_tier = prepared.model, prepared.scheduled.tier
        continued = self.events is not None  # taken over (`apis.takeover`): its first events were sent elsewhere
        events = self.events = self.events or ResponseEvents(self.skeleton("in_progress"))
        if not continued:
            await self.save(events.response)
        try:
            if not continued:
                yield events.lifecycle("response.created")
                yield events.lifecycle("response.in_progress")
            async for event in self._generated(events, prepared, run, on_done):
                yield event
        except (asyncio.CancelledError, GeneratorExit):  # the client went away, or a cancel hung up
            if not events.ended:
                await self.save(self._stopped(events))
            raise
        except Exception as exc:  # after the first event: the stream says it failed
            yield await self._failed(events, exc)

    async def _generated(
        self, events: ResponseEvents, prepared: PreparedChat, run: Run, on_done: OnDone[Response] | None
    ) -> AsyncGenerator[BaseModel, None]:
        plan, checked = prepared.tools, time.monotonic()
        async for output in run.outputs():
            for delta in output.choices:
                for event in self._deltas(events, plan, delta.text):
                    yield event
            if self.request.background and time.monotonic() - checked > CANCEL_CHECK_S:
                checked = time.monotonic()
                if await self._withdrawn():
                    await run.close()
                    return
        for event in self._finish(events, plan, run.choices[0]):
            yield event
        answer = self._finished(events.response.output, run.usage(), run.choices[0])
        await hand_over(on_done, answer, run)
        if not (self.request.background and await self._withdrawn()):
            await self.save(answer)
        yield events.lifecycle("response.completed" if answer.status == "completed" else "response.incomplete", answer)

    @staticmethod
    def _deltas(events: ResponseEvents, plan: tools.ToolPlan, text: str) -> list[BaseModel]:
        if not text or plan.mode in ("auto", "required"):  # calls are read from the whole text, at its end
            return []
        if plan.mode == "named":
            return list(events.arguments(text, plan.named or ""))
        return list(events.text(text))

    @staticmethod
    def _finish(events: ResponseEvents, plan: tools.ToolPlan, state: ChoiceState) -> list[BaseModel]:
        closed: list[BaseModel] = list(events.close(item_status(state)))
        if closed:
            return closed
        # nothing streamed: auto and required calls, or no text at all
        return [event for item in output_items(plan, state) for event in events.whole(item)]

    async def _failed(self, events: ResponseEvents, exc: Exception) -> BaseModel:
        log.warning("response_failed", error=str(exc), error_type=type(exc).__name__)
        failed = events.response.model_copy(deep=True)
        failed.status = "failed"
        failed.error = ResponseError(code="server_error", message=from_exception(exc).message)
        await self.save(failed)
        return events.lifecycle("response.failed", failed)

    async def _withdrawn(self) -> bool:
        """Whether a background response was cancelled or deleted meanwhile (on any replica)."""
        try:
            stored = await self.mine.get(self.id)
        except NotFound:
            return True
        except APIError:  # the store unavailable: keep going
            return False
        return stored.response.status == "cancelled"

    async def replay(self, hit: Response, request: ChatCompletionRequest) -> AsyncGenerator[BaseModel, None]:
        answer = self.fresh(hit)
        events = self.events = ResponseEvents(self.skeleton("in_progress"))
        await self.save(events.response)
        yield events.lifecycle("response.created")
        yield events.lifecycle("response.in_progress")
        for item in answer.output:
            for event in events.whole(item):
                yield event
        await self.save(answer)
        yield events.lifecycle("response.completed" if answer.status == "completed" else "response.incomplete", answer)


async def history_of(mine: OwnedResponses, previous_id: str | None) -> list[Item]:
    """The conversation so far: the previous response's input items, then its output."""
    if previous_id is None:
        return []
    try:
        previous = await mine.get(previous_id)
    except NotFound:
        raise NotFound(f"Previous response with id '{previous_id}' not found.", "previous_response_id") from None
    if previous.response.status in RUNNING:  # its output is not all there yet: the history would lack it
        raise InvalidRequest(
            f"Previous response with id '{previous_id}' is still {previous.response.status}; "
            "continue from it once it has completed", "previous_response_id",
        )
    return [*previous.input_items, *previous.response.output]
