"""Every text of a request that the model will read, checked by the input guards, and the request
rebuilt from the checked (possibly redacted) texts.

Every API that generates reaches the engine as a chat request or a completions request: Anthropic's
Messages (system, text blocks, tool_use inputs, tool_result contents) and the Responses API
(instructions, input items, function calls and their outputs, the earlier responses of a
`previous_response_id` chain) are made chat requests before they are prepared, so `chat_texts` is
where they are read too. What a chat request's model reads: each message's text (string content
and text parts), its `name`, its earlier tool calls (the function's name and its arguments, read
as decoded JSON: `\\u0041` escapes are what the model reads as `A`), and the tool definitions (as
the JSON the template or the tool prompt shows). Completion prompts and embedding inputs are their
text; token-id prompts are read decoded where the engine's tokenizer is at hand (`serving.
completions`, `serving.embeddings`), and refused for a remote model, which has none here.
"""

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
CompletionT = TypeVar("CompletionT", bound=CompletionRequest)


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


def _unreadable(guard: RequestGuard, param: str) -> None:
    """Token ids for a remote model: no tokenizer here reads them, so a guard that reads prompts
    refuses them rather than pass what it cannot see."""
    if guard.reads_input:
        guard.refuse("unreadable", param, "token ids cannot be read by the guards for this model; send text")


def guarded_completion(request: CompletionT, guard: RequestGuard) -> CompletionT:
    """Completions whose prompts are text; for an embedded model, token-id prompts are checked once
    decoded (`serving.completions.prepare`), here (a remote model's) they are refused."""
    prompt = request.prompt
    if not guard.active:
        return request
    if isinstance(prompt, str):
        return request.model_copy(update={"prompt": guard.check_input([prompt], "prompt")[0]})
    if prompt and all(isinstance(p, str) for p in prompt):
        return request.model_copy(update={"prompt": guard.check_input([str(p) for p in prompt], "prompt")})
    _unreadable(guard, "prompt")
    return request


def guarded_embeddings(request: EmbeddingRequest, guard: RequestGuard) -> EmbeddingRequest:
    """A remote model's embedding inputs: text checked, token ids refused (as completions')."""
    value = request.input
    if not guard.active:
        return request
    if isinstance(value, str):
        return request.model_copy(update={"input": guard.check_input([value], "input")[0]})
    if value and all(isinstance(v, str) for v in value):
        return request.model_copy(update={"input": guard.check_input([str(v) for v in value], "input")})
    _unreadable(guard, "input")
    return request


def guarded(request: RequestT, guard: RequestGuard) -> RequestT:
    """Any request the gateway forwards (to a remote upstream), checked as its shape allows."""
    if isinstance(request, ChatCompletionRequest):
        return guarded_chat(request, guard)
    if isinstance(request, CompletionRequest):
        return guarded_completion(request, guard)
    if isinstance(request, EmbeddingRequest):
        return guarded_embeddings(request, guard)  # type: ignore[return-value]  # RequestT is EmbeddingRequest here
    return request
