"""The texts of a request that the input guards check, and the request rebuilt from the checked
(possibly redacted) texts: chat messages (their text content and earlier tool calls' arguments)
and completion prompts written as text. Requests of other shapes pass unchanged.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel

from gateway.protocol.openai import ChatCompletionRequest, ChatMessage, CompletionRequest, TextPart
from gateway.serving.guards.pipeline import RequestGuard

RequestT = TypeVar("RequestT", bound=BaseModel)
ChatT = TypeVar("ChatT", bound=ChatCompletionRequest)
CompletionT = TypeVar("CompletionT", bound=CompletionRequest)


def message_texts(message: ChatMessage) -> list[str]:
    texts = [message.content] if isinstance(message.content, str) else []
    if isinstance(message.content, list):
        texts += [part.text for part in message.content if isinstance(part, TextPart)]
    texts += [call.function.arguments for call in message.tool_calls or []]
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
    if message.tool_calls:
        update["tool_calls"] = [
            call.model_copy(update={"function": call.function.model_copy(update={"arguments": next(given)})})
            for call in message.tool_calls
        ]
    return message.model_copy(update=update)


def guarded_chat(request: ChatT, guard: RequestGuard) -> ChatT:
    """The request as the engine may see it; a blocked prompt raises ContentPolicyViolation."""
    if not guard.active:
        return request
    per_message = [message_texts(m) for m in request.messages]
    checked = iter(guard.check_input([t for texts in per_message for t in texts], "messages"))
    messages = [with_texts(m, [next(checked) for _ in texts]) for m, texts in zip(request.messages, per_message, strict=True)]
    if messages == request.messages:
        return request
    return request.model_copy(update={"messages": messages})


def guarded_completion(request: CompletionT, guard: RequestGuard) -> CompletionT:
    """Completions whose prompts are text (token-id prompts are checked once decoded, in prepare)."""
    prompt = request.prompt
    if not guard.active:
        return request
    if isinstance(prompt, str):
        return request.model_copy(update={"prompt": guard.check_input([prompt], "prompt")[0]})
    if prompt and all(isinstance(p, str) for p in prompt):
        return request.model_copy(update={"prompt": guard.check_input([str(p) for p in prompt], "prompt")})
    return request


def guarded(request: RequestT, guard: RequestGuard) -> RequestT:
    """Any request the gateway forwards (to a remote upstream), checked as its shape allows."""
    if isinstance(request, ChatCompletionRequest):
        return guarded_chat(request, guard)
    if isinstance(request, CompletionRequest):
        return guarded_completion(request, guard)
    return request
