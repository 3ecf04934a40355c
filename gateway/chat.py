"""Chat completions: messages → chat template → engine → ChatCompletion or chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from engine.types import Engine, GenerationRequest, TokenLogprob
from gateway.errors import InvalidRequest
from gateway.generation import Run, new_id, now, resolve_max_tokens, sampling_options
from gateway.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChatTokenLogprob,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    TopLogprob,
)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: plain string content, known roles."""
    rendered = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        item["content"] = _text(message, i)
        if message.name:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id:
            item["tool_call_id"] = message.tool_call_id
        rendered.append(item)
    return rendered


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.type != "text":
            raise InvalidRequest(
                "Only text content parts are supported by this model", f"messages.{index}.content"
            )
        parts.append(part.text)
    return "\n".join(parts)


def _structured_output(request: ChatCompletionRequest) -> dict[str, Any]:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_object": True}
    assert fmt.json_schema is not None
    return {"json_schema": fmt.json_schema.schema_ or {"type": "object"}}


@dataclass(slots=True)
class PreparedChat:
    request: ChatCompletionRequest
    engine: Engine
    generation: GenerationRequest
    model: str
    id: str
    created: int


def prepare(request: ChatCompletionRequest, engine: Engine, default_max_tokens: int | None) -> PreparedChat:
    """Everything that can refuse the request, done before the engine sees it."""
    if request.tools and request.tool_choice != "none":
        raise InvalidRequest("Tool calling is not supported by this gateway yet", "tools")
    tokenizer = engine.tokenizer
    prompt = tokenizer.render_chat(template_messages(request.messages), add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    if request.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-request.truncate_prompt_tokens :]
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(
        request.max_completion_tokens or request.max_tokens,
        len(prompt_ids),
        engine.info.max_model_len,
        default_max_tokens,
        param,
    )
    top = (request.top_logprobs or 0) if request.logprobs else None
    sampling = sampling_options(request, max_tokens, logprobs=top, **_structured_output(request))
    chat_id = new_id("chatcmpl")
    generation = GenerationRequest(chat_id, prompt_ids, sampling, prompt_text=prompt)
    return PreparedChat(request, engine, generation, request.model, chat_id, now())


def _logprobs(entries: list[TokenLogprob | None] | tuple) -> ChoiceLogprobs:
    content = [
        ChatTokenLogprob(
            token=e.token,
            logprob=e.logprob,
            bytes=list(e.token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for _, t, lp in e.top],
        )
        for e in entries
        if e is not None
    ]
    return ChoiceLogprobs(content=content)


async def complete(prepared: PreparedChat) -> ChatCompletion:
    run = await Run(prepared.engine, prepared.generation).start()
    await run.collect()
    want_logprobs = prepared.request.logprobs
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content="".join(c.text)),
            finish_reason=c.finish_reason,
            logprobs=_logprobs(c.logprobs) if want_logprobs else None,
        )
        for c in run.choices
    ]
    return ChatCompletion(
        id=prepared.id, created=prepared.created, model=prepared.model, choices=choices, usage=run.usage()
    )


async def stream(prepared: PreparedChat) -> AsyncIterator[ChatCompletionChunk]:
    run = await Run(prepared.engine, prepared.generation).start()
    options = prepared.request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)

    def chunk(choices: list[ChunkChoice], usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=prepared.id, created=prepared.created, model=prepared.model, choices=choices, usage=usage
        )

    async for output in run.outputs():
        choices = []
        for delta in output.choices:
            state = run.choices[delta.index]
            role = None if state.started else "assistant"
            state.started = True
            logprobs = _logprobs(list(delta.logprobs)) if delta.logprobs else None
            choices.append(
                ChunkChoice(
                    index=delta.index,
                    delta=ChunkDelta(role=role, content=delta.text),
                    finish_reason=state.finish_reason if delta.finish_reason else None,
                    logprobs=logprobs,
                )
            )
        if choices:
            yield chunk(choices, run.usage() if include_usage and continuous else None)
    if include_usage:
        yield chunk([], run.usage())
