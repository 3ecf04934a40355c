"""Every text of a request that the model will read, checked by the input guards, and the request rebuilt from the
checked (possibly redacted) texts.

Messages and Responses requests are made chat requests before they are prepared, so `chat_texts` reads theirs too: each
message's text and `name`, its earlier tool calls (the name, and the arguments as decoded JSON: `\\u0041` is what the
model reads as `A`) and the tool definitions (as the JSON the template shows). Completion prompts (and a remote
model's `suffix`, the text it writes towards) and embedding inputs are their text; token ids are read decoded by the embedded services and refused for a remote model (no tokenizer here
reads them)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel

from gateway.errors import ContentPolicyViolation
from gateway.guards.guarding import RequestGuard
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest, TextPart

RequestT = TypeVar("RequestT", bound=BaseModel)
ChatT = TypeVar("ChatT", bound=ChatCompletionRequest)


def decoded_json(text: str) -> str:
    """JSON text as its reader sees it (escapes decoded); not JSON: as it is."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return text


def message_texts(message: ChatMessage) -> list[str]:
    texts = [message.content] if isinstance(message.content, str) else []
    if isinstance(message.content, list):
        texts += [part.text for part in message.content if isinstance(part, TextPart)]
    texts += [message.name] if message.name else []
    for call in message.tool_calls or []:
        texts += [call.function.name, decoded_json(call.function.arguments)]
    return texts


def with_texts(message: ChatMessage, texts: list[str]) -> ChatMessage:
    """The message with its texts (in `message_texts`' order) replaced."""
    given = iter(texts)
    update: dict[str, object] = {}
    if isinstance(message.content, str):
        update["content"] = next(given)
    elif isinstance(message.content, list):
        update["content"] = [
            part.model_copy(update={"text": next(given)}) if isinstance(part, TextPart) else part for part in message.content
        ]
    if message.name:
        update["name"] = next(given)
    if message.tool_calls:
        update["tool_calls"] = [
            call.model_copy(update={"function": call.function.model_copy(
                update={"name": next(given), "arguments": next(given)})})
            for call in message.tool_calls
        ]
    return message.model_copy(update=update)


def chat_texts(request: ChatCompletionRequest) -> list[list[str]]:
    """Every text the model will read, per message, then the tool definitions (one text each)."""
    tools = [json.dumps(tool, ensure_ascii=False) for tool in request.tools or []]
    return [*(message_texts(m) for m in request.messages), tools]


def _tool(text: str, original: dict[str, Any]) -> dict[str, Any]:
    if text == json.dumps(original, ensure_ascii=False):
        return original
    try:
        tool = json.loads(text)
    except ValueError:
        tool = None
    if not isinstance(tool, dict):  # a redaction across the JSON's syntax: nothing sane to send
        raise ContentPolicyViolation("The prompt was refused by the content policy: a tool definition", "tools")
    return tool


def guarded_chat(request: ChatT, guard: RequestGuard) -> ChatT:
    """The request as the engine may see it; a blocked prompt raises ContentPolicyViolation."""
    if not guard.active:
        return request
    per_field = chat_texts(request)
    checked = iter(guard.check_input([t for texts in per_field for t in texts], "messages", together=True))
    rebuilt = [[next(checked) for _ in texts] for texts in per_field]
    if rebuilt == per_field:
        return request
    messages = [with_texts(m, texts) for m, texts in zip(request.messages, rebuilt, strict=False)]
    tools = [_tool(text, tool) for text, tool in zip(rebuilt[-1], request.tools or [], strict=True)]
    return request.model_copy(update={"messages": messages, "tools": tools or request.tools})


def _guarded_prompts(request: RequestT, field: str, guard: RequestGuard) -> RequestT:
    """A remote model's completion prompts or embedding inputs: text checked, token ids refused (no
    tokenizer here reads them; an embedded model's are checked decoded, by its service)."""
    value = getattr(request, field)
    if isinstance(value, str):
        return request.model_copy(update={field: guard.check_input([value], field)[0]})
    if value and all(isinstance(v, str) for v in value):
        return request.model_copy(update={field: guard.check_input(list(value), field)})
    if guard.reads_input:
        guard.refuse("unreadable", field, "token ids cannot be read by the guards for this model; send text")
    return request


def guarded(request: RequestT, guard: RequestGuard) -> RequestT:
    """Any request the gateway forwards (to a remote upstream), checked as its shape allows."""
    if isinstance(request, ChatCompletionRequest):
        return guarded_chat(request, guard)
    if isinstance(request, EmbeddingRequest) and guard.active:
        return _guarded_prompts(request, "input", guard)
    if isinstance(request, CompletionRequest) and guard.active:
        request = _guarded_prompts(request, "prompt", guard)
        if request.suffix:  # read by the model as its prompt is (an engine's service refuses it)
            request = request.model_copy(update={"suffix": guard.check_input([request.suffix], "suffix")[0]})
    return request
