"""Routes beside OpenAI's: vLLM's /tokenize and /detokenize, and a plain native API: `/generate`
and `/stream-generate`, a thin shape over the completions service, and `/chat` (messages in, text
out; SSE with `stream`), the same over the chat service.
"""

from __future__ import annotations

from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from engine.types import Engine
from gateway.apis.chat import chat_serving
from gateway.apis.chat.chat_serving import CHAT
from gateway.apis.completions import completions_serving
from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.apis.native.native_wire import (
    DetokenizeRequest,
    DetokenizeResponse,
    GenerateRequest,
    GenerateResponse,
    NativeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from gateway.pipeline.dispatch import dispatch
from gateway.protocol import openai as p
from gateway.serving import offload, tools
from gateway.web.answers import json_response, respond
from gateway.web.requests import body_size, context, default_model, engine_for, parse, state_of

M = TypeVar("M", bound=BaseModel)


async def tokenize(request: Request) -> Response:
    body = await parse(request, TokenizeRequest)
    engine = engine_for(request, body.model)
    answer = await offload.by_size(body_size(request), _tokenized, body, engine)
    return json_response(answer)


def _tokenized(body: TokenizeRequest, engine: Engine) -> TokenizeResponse:
    tokenizer = engine.tokenizer
    if body.messages is not None:
        as_chat = p.ChatCompletionRequest(model=engine.info.name, messages=body.messages)
        ids = chat_serving.render(as_chat, tools.plan(as_chat), tokenizer, body.add_generation_prompt).token_ids
        if body.add_special_tokens:  # vLLM's: the tokenizer's start token before the rendered prompt
            ids = [*tokenizer.encode("", add_special_tokens=True), *ids]
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer.encode_prompt(body.prompt or "", add_special_tokens=add_special)  # as /v1/completions reads it
    strs = [tokenizer.decode([i]) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=engine.info.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(request: Request) -> Response:
    body = await parse(request, DetokenizeRequest)
    engine = engine_for(request, body.model)
    completions_serving.check_vocabulary(body.tokens, engine, "tokens")
    return json_response(DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens)))


def _as(request: Request, body: GenerateRequest | NativeChatRequest, kind: type[M], **fields: Any) -> M:
    """The native body as the OpenAI request it is (the default model when it names none)."""
    name = body.model or default_model(request)
    given = body.model_dump(exclude_unset=True, exclude={"model"})
    return kind.model_validate({**given, **fields, "model": name}, strict=False)


def _shape(answer: BaseModel | bytes, chunk: type[BaseModel] = p.Completion) -> GenerateResponse:
    """A completion or chat answer (whole, a chunk, or a chunk's JSON as streams encode it) in the
    native shape: its first choice's text."""
    if isinstance(answer, bytes):
        answer = chunk.model_validate_json(answer)
    assert isinstance(answer, p.Completion | p.ChatCompletion | p.ChatCompletionChunk)
    if not answer.choices:
        return GenerateResponse(output="", usage=answer.usage)
    choice = answer.choices[0]
    if isinstance(choice, p.ChatChoice):
        output = choice.message.content
    elif isinstance(choice, p.ChunkChoice):
        output = choice.delta.content
    else:
        output = choice.text
    return GenerateResponse(output=output or "", finish_reason=choice.finish_reason, usage=answer.usage)


async def generate(request: Request) -> Response:
    """The same dispatch as /v1/completions (cache, limits, fallbacks), answered as {"output"}."""
    body = await parse(request, GenerateRequest)
    as_completion = _as(request, body, p.CompletionRequest, stream=request.url.path == "/stream-generate")
    return respond(await dispatch(context(request), state_of(request), as_completion, COMPLETIONS, shape=_shape))


stream_generate = generate  # the path decides: /stream-generate streams
_chat_shape = partial(_shape, chunk=p.ChatCompletionChunk)


async def chat_native(request: Request) -> Response:
    """/chat: the same dispatch as /v1/chat/completions (defaults, cache, limits, fallbacks),
    answered as {"output"}, or streamed as /stream-generate streams when the body says `stream`."""
    as_chat = _as(request, await parse(request, NativeChatRequest), p.ChatCompletionRequest)
    return respond(await dispatch(context(request), state_of(request), as_chat, CHAT, shape=_chat_shape))
