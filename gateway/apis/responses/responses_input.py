"""A Responses request as the chat pipeline takes it: its `input` as items (as a response keeps them),
and the conversation (the `previous_response_id` chain's items, then these) as a chat request's
messages, with `instructions`, `tools`, `tool_choice`, `text.format` and `max_output_tokens` as
chat's fields, and chat's refusals renamed in this API's terms.
"""

from __future__ import annotations

from typing import Any

from gateway.apis.responses.responses_wire import (
    TEXT_PARTS,
    FunctionCallInput,
    FunctionCallOutputInput,
    InputPart,
    MessageInput,
    ResponsesRequest,
    new_id,
)
from gateway.errors import InvalidRequest
from gateway.protocol.openai import ChatCompletionRequest
from gateway.protocol.response_objects import (
    FunctionCallOutput,
    FunctionToolCall,
    InputMessage,
    InputText,
    Item,
    OutputMessage,
    OutputText,
)

# chat's parameter names in its refusals, as the Responses API calls them
RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


def request_items(request: ResponsesRequest) -> list[Item]:
    """The request's input as items (a string is one user message)."""
    if request.input is None:
        return []
    if isinstance(request.input, str):
        return [InputMessage(id=new_id("msg"), role="user", content=[InputText(text=request.input)])]
    return [_item(item, f"input.{i}") for i, item in enumerate(request.input)]


def _item(item: MessageInput | FunctionCallInput | FunctionCallOutputInput, param: str) -> Item:
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
    for item in items:
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
    if request.tools:
        described = {"name", "description", "parameters"}
        fields["tools"] = [{"type": "function", "function": tool.model_dump(include=described, exclude_none=True)}
                           for tool in request.tools]
    choice = request.tool_choice
    if choice is not None and not (choice == "auto" and not request.tools):  # auto with no tools: no choice to make
        named = {"type": "function", "function": {"name": choice.name}} if not isinstance(choice, str) else None
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
    if head in RENAMED:
        return RENAMED[head] if head == "messages" else RENAMED[head] + (f".{rest}" if rest else "")
    return param


def renamed(error: InvalidRequest) -> InvalidRequest:
    """A refusal of the chat pipeline in the Responses API's terms (its parameter names)."""
    param = renamed_param(error.param or "")
    message = error.message
    for chat_name, name in RENAMED.items():
        if chat_name != "messages":
            message = message.replace(chat_name, name)
    error.param, error.message = param or None, message
    error.args = (message,)
    return error
