"""Routes beside OpenAI's: vLLM's /tokenize and /detokenize, and a plain native API
(`/generate`, `/stream-generate`) that is a thin shape over the completions service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from gateway import chat, completions, tools
from gateway.disconnect import unless_disconnected
from gateway.protocol import (
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.routes import check_open, json_response, parse, state_of
from gateway.sse import EventStreamResponse, primed


async def tokenize(request: Request) -> Response:
    body = await parse(request, TokenizeRequest)
    engine = state_of(request).models.get_or_default(body.model)
    tokenizer = engine.tokenizer
    if body.messages is not None:
        as_chat = ChatCompletionRequest(model=engine.info.name, messages=body.messages)
        text = chat.render(as_chat, tools.plan(as_chat), tokenizer, body.add_generation_prompt)
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode(body.prompt or "", add_special_tokens=add_special)
    strs = [tokenizer.decode([i]) for i in ids] if body.return_token_strs else None
    return json_response(
        TokenizeResponse(count=len(ids), max_model_len=engine.info.max_model_len, tokens=ids, token_strs=strs)
    )


async def detokenize(request: Request) -> Response:
    body = await parse(request, DetokenizeRequest)
    engine = state_of(request).models.get_or_default(body.model)
    completions.check_vocabulary(body.tokens, engine, "tokens")
    return json_response(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)))


async def _as_completion(request: Request) -> tuple[CompletionRequest, completions.PreparedCompletion]:
    state = state_of(request)
    check_open(state)
    body = await parse(request, GenerateRequest)
    engine = state.models.get_or_default(body.model)
    fields = body.model_dump(exclude_unset=True, exclude={"model"})
    as_completion = CompletionRequest.model_validate({**fields, "model": engine.info.name}, strict=False)
    return as_completion, completions.prepare(as_completion, engine, state.settings.default_max_tokens)


async def generate(request: Request) -> Response:
    _, prepared = await _as_completion(request)
    result = await unless_disconnected(request.receive, completions.complete(prepared))
    choice = result.choices[0]
    return json_response(GenerateResponse(output=choice.text, finish_reason=choice.finish_reason, usage=result.usage))


async def _outputs(chunks: AsyncIterator[Completion]) -> AsyncIterator[GenerateResponse]:
    try:
        async for chunk in chunks:
            for choice in chunk.choices:
                yield GenerateResponse(output=choice.text, finish_reason=choice.finish_reason)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]


async def stream_generate(request: Request) -> Response:
    _, prepared = await _as_completion(request)
    events = await unless_disconnected(request.receive, primed(_outputs(completions.stream(prepared))))
    return EventStreamResponse(events)  # type: ignore[return-value]
