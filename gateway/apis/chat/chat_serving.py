"""Chat completions: messages → chat template → engine (or the request forwarded to a remote
upstream, which renders the prompt and parses tool calls itself) → ChatCompletion or chunks."""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.types import (
    ChatPrompt,
    ChoiceDelta,
    Engine,
    Forward,
    GenerationRequest,
    Generator,
    SamplingOptions,
    Task,
    Tokenizer,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.errors import InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.guards.inbound import guarded_chat
from gateway.protocol.openai import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    ChatTokenLogprob,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    TopLogprob,
    Usage,
)
from gateway.serving import conversation, structured, tools
from gateway.serving.encoding import ChunkEncoder, Renewal
from gateway.serving.generation import (
    ChoiceState,
    GenerationFailed,
    Run,
    check_sampling,
    check_schema_numbers,
    hand_over,
    new_id,
    now,
    resolve_max_tokens,
    sampling_options,
)
from gateway.serving.meter import Readings
from gateway.serving.service import OnDone
from gateway.serving.structured import Constraint
from gateway.serving.tools import HeldText
from gateway.telemetry.record import current_trace
from gateway.tenancy.priority import NORMAL, Scheduled


@dataclass(slots=True)
class PreparedChat:
    request: ChatCompletionRequest
    engine: Generator
    generation: GenerationRequest
    tools: tools.ToolPlan
    model: str  # the name the answer carries: the model (version) that answers
    id: str
    created: int
    guard: RequestGuard = UNGUARDED
    held: dict[int, HeldText] = field(default_factory=dict)  # a stream's text per choice (tool_choice auto)
    constraint: Constraint | None = None  # what the output is constrained to (checked in the pipeline)
    scheduled: Scheduled = NORMAL  # its priority (the pipeline's decision, `tenancy.priority`)
    readings: Readings = field(default_factory=Readings)  # what its run measured, for the pipeline

    def schedule(self, scheduled: Scheduled, readings: Readings) -> None:
        self.scheduled, self.readings = scheduled, readings

    def token_budget(self) -> int:
        return len(self.generation.prompt_token_ids) + self.output_tokens()

    def output_tokens(self) -> int:
        sampling = self.generation.sampling
        return sampling.max_tokens * sampling.n

    def sole(self) -> GenerationRequest:
        return self.generation


def template_messages(messages: list[ChatMessage], takes_tools: bool) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates take them: plain string content, known roles."""
    rendered = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": _text(message, i)}
        if message.name:
            item["name"] = message.name
        if message.tool_calls and takes_tools:
            item["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        elif message.tool_calls:  # the template cannot show calls: write them as the model would
            calls = "\n".join(tools.tagged(call.model_dump()) for call in message.tool_calls)
            item["content"] = f"{item['content']}\n{calls}".strip()
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
            raise InvalidRequest("Only text content parts are supported by this model", f"messages.{index}.content")
        parts.append(part.text)
    return "\n".join(parts)


def render(
    request: ChatCompletionRequest, plan: tools.ToolPlan, tokenizer: Tokenizer, add_generation_prompt: bool = True
) -> ChatPrompt:
    """The prompt's text and token ids. The messages go to the engine's tokenizer as structured
    data, so that the client's text in them is encoded as text: a `<|im_end|>` typed in a message
    is characters, and only the template's own markup becomes control tokens. Messages OpenAI
    refuses (`serving.conversation`) are refused first."""
    conversation.check_messages(request.messages)
    messages = template_messages(request.messages, tokenizer.takes_tools)
    extra: dict[str, Any] = {}
    if plan.active and tokenizer.takes_tools:
        extra["tools"] = [{"type": "function", "function": fn} for fn in plan.functions.values()]
    elif plan.active:
        messages = tools.with_tools_described(messages, plan)
    if request.continue_final_message:  # the last (assistant) turn continued: vLLM's fields, as its server takes them
        extra["continue_final_message"], add_generation_prompt = True, False
    return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt and request.add_generation_prompt,
                                 **extra)


def _constraint(request: ChatCompletionRequest, plan: tools.ToolPlan) -> tuple[dict[str, Any], str, tuple[tuple[Any, str], ...]]:
    """The sampling fields that constrain the output, the request field they come from, and the
    schemas the client sent in it, each with its own field (`serving.structured`)."""
    fmt = request.response_format
    schema = plan.json_schema()
    if schema is not None:
        if fmt is not None and fmt.type != "text":
            raise InvalidRequest("response_format cannot be combined with a forced tool_choice", "response_format")
        check_schema_numbers(schema, "tools")
        # the parameter schemas of the tools a forced call may use, each with its field
        pieces = tuple((tool["function"]["parameters"], f"tools.{i}.function.parameters")
                       for i, tool in enumerate(request.tools or ()) if tool["function"].get("parameters") is not None
                       and (plan.mode == "required" or tool["function"]["name"] == plan.named))
        param = pieces[0][1] if plan.mode == "named" and pieces else "tools"
        # tool calls carry no layout: without free whitespace, small models do not wander off
        return {"json_schema": schema, "compact_json": True}, param, pieces
    if fmt is None or fmt.type == "text":
        return {}, "response_format", ()
    if fmt.type == "json_object":
        return {"json_object": True}, "response_format", ()
    assert fmt.json_schema is not None
    param = "response_format.json_schema.schema"
    check_schema_numbers(fmt.json_schema.schema_, param)
    return {"json_schema": fmt.json_schema.schema_ or {"type": "object"}}, param, ()


def prepare(
    request: ChatCompletionRequest, engine: Engine, default_max_tokens: int | None, guard: RequestGuard = UNGUARDED
) -> PreparedChat:
    """Everything that can refuse the request, done before the engine sees it (the input guards
    too: the engine sees the messages as they let them through)."""
    request = guarded_chat(request, guard)
    plan = tools.plan(request)
    prompt = render(request, plan, engine.tokenizer)
    prompt_ids = prompt.token_ids
    guard.check_prompt_tokens(len(prompt_ids), "messages")
    if request.truncate_prompt_tokens is not None:
        prompt_ids = prompt_ids[-request.truncate_prompt_tokens :]
    param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    defaults = engine.info.sampling_defaults  # the models file's over the model's generation_config.json
    max_tokens = resolve_max_tokens(request.max_completion_tokens or request.max_tokens, len(prompt_ids),
                                    engine.info.max_model_len, defaults.max_tokens or default_max_tokens, param)
    check_sampling(request, engine, max_tokens)
    top = (request.top_logprobs or 0) if request.logprobs else None
    fields, param, pieces = _constraint(request, plan)
    sampling = sampling_options(request, max_tokens, logprobs=top, defaults=defaults, **fields)
    chat_id = new_id("chatcmpl")
    generation = GenerationRequest(chat_id, prompt_ids, sampling, prompt_text=prompt.text)
    constraint = Constraint.of(sampling, param, pieces)
    return PreparedChat(request, engine, generation, plan, request.model, chat_id, now(), guard, constraint=constraint)


def forwarded(request: ChatCompletionRequest, forward: Forward, backend: Generator, guard: RequestGuard) -> PreparedChat:
    """A remote model's request (its input guarded already): the upstream renders the prompt and
    parses its own tool calls, so their text passes through as it parsed it."""
    budget = request.max_completion_tokens or request.max_tokens or 0
    sampling = SamplingOptions(budget, n=request.n)
    generation = GenerationRequest(new_id("chatcmpl"), [], sampling, forward=forward)
    return PreparedChat(request, backend, generation, tools.ToolPlan("none", {}), request.model, generation.request_id,
                        now(), guard)


def _logprobs(entries: Sequence[TokenLogprob | None]) -> ChoiceLogprobs:
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


def _choice(prepared: PreparedChat, state: ChoiceState) -> dict[str, Any]:
    """One choice as the ChatChoice's fields (its message as AssistantMessage's), validated with the answer."""
    content, calls = prepared.tools.parse("".join(state.text))
    message = {"content": content, "tool_calls": [c.as_openai() for c in calls] or None}
    if state.calls:  # parsed by a remote upstream
        message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for _, c in sorted(state.calls.items())]
        message["content"] = content or None
    if state.reasoning:
        message["reasoning_content"] = "".join(state.reasoning)
    return {
        "index": state.index,
        "message": message,
        "finish_reason": _finished(state.index, prepared.tools.finish_reason(calls, state.finish_reason)),
        "logprobs": _logprobs(state.logprobs) if prepared.request.logprobs else None,
    }


def _finished(index: int, reason: str | None) -> str | None:
    """A choice's finish reason as the answer says it (tool_calls for calls), for the request's trace."""
    trace = current_trace()
    if trace is not None:
        trace.finished_as(index, reason)
    return reason


def _answer(prepared: PreparedChat, run: Run) -> ChatCompletion:
    """The answer validated in one step from plain fields (the choices, messages and usage as
    dicts: one validator call instead of one per object and their Python layers)."""
    choices = [_choice(prepared, state) for state in run.choices]
    return ChatCompletion.model_validate({"id": prepared.id, "created": prepared.created, "model": prepared.model,
                                          "choices": choices, "usage": run.usage_fields(),
                                          "service_tier": prepared.scheduled.tier})


async def start_run(prepared: PreparedChat) -> Run:
    """The generation started, after the input moderation, under the request's guard: what every
    service on chat (chat, Messages, Responses) runs."""
    await prepared.guard.moderate_input()
    try:
        tag = tools.TAG if prepared.tools.mode == "auto" else None  # the calls parsed from the text
        return await Run(prepared.engine, prepared.generation, prepared.guard, prepared.scheduled.priority,
                         prepared.readings, tag).start()
    except GenerationFailed as exc:
        if prepared.constraint is None:
            raise
        raise structured.refuse(prepared.constraint.param, "the engine could not compile it") from exc


async def complete(prepared: PreparedChat, on_done: OnDone[ChatCompletion] | None = None) -> ChatCompletion:
    run = await start_run(prepared)
    await run.collect()
    answer = _answer(prepared, run)
    await hand_over(on_done, answer, run)
    return answer


def _chunk_choice(prepared: PreparedChat, state: ChoiceState, delta: ChoiceDelta) -> dict[str, Any] | None:
    """What one engine delta of one choice becomes on the wire (None: nothing yet), as the
    ChunkChoice's JSON-ready dict: plain text, the per-token case, is built without pydantic."""
    plan = prepared.tools
    finish = state.finish_reason if delta.finish_reason else None
    if plan.mode == "auto":
        return _auto_chunk(prepared, state, delta, finish)
    if plan.mode == "required":  # the calls are parsed from the whole text, at its end
        if finish is None:
            return None
        content, calls = plan.parse("".join(state.text))
        return _last_chunk(prepared, state, "assistant", content, calls, finish)
    role = None if state.started else "assistant"
    state.started = True
    logprobs = _logprobs(list(delta.logprobs)) if delta.logprobs else None
    if plan.mode == "named":  # the text is the arguments: stream it as such
        call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
        if role:
            call.update(id=f"call_{uuid.uuid4().hex[:24]}", type="function")
            call["function"]["name"] = plan.named
        choice = ChunkChoice(index=state.index, delta=ChunkDelta(role=role, tool_calls=[call]), finish_reason=finish, logprobs=logprobs)
        return choice.model_dump(mode="json", exclude_none=True)
    text: dict[str, Any] = {"role": role, "content": delta.text} if role else {"content": delta.text}
    if delta.reasoning or delta.tool_calls:
        text = _parsed(delta, role)
    plain: dict[str, Any] = {"index": state.index, "delta": text}
    if finish is not None:
        plain["finish_reason"] = finish
    if logprobs is not None:
        plain["logprobs"] = logprobs.model_dump(mode="json", exclude_none=True)
    return plain


def _parsed(delta: ChoiceDelta, role: str | None) -> dict[str, Any]:
    """A delta whose reasoning and tool calls a remote upstream parsed, as a chunk's delta."""
    body: dict[str, Any] = {"role": role} if role else {}
    if delta.reasoning:
        body["reasoning_content"] = delta.reasoning
    if delta.text or not delta.tool_calls:
        body["content"] = delta.text
    if delta.tool_calls:
        body["tool_calls"] = [_call_piece(call) for call in delta.tool_calls]
    return body


def _call_piece(call: ToolCallDelta) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": call.arguments} if call.name is None else {"name": call.name, "arguments": call.arguments}
    piece: dict[str, Any] = {"index": call.index, "function": function}
    return piece if call.id is None else {**piece, "id": call.id, "type": "function"}


def _auto_chunk(prepared: PreparedChat, state: ChoiceState, delta: ChoiceDelta, finish: str | None) -> dict[str, Any] | None:
    """`tool_choice: auto`: the text streams as it comes, but for what may begin a `<tool_call>`
    (`tools.HeldText`); at the end, the rest of the content and the calls parsed from the whole text."""
    held = prepared.held.setdefault(state.index, HeldText("auto"))
    piece = held.feed(delta.text)
    role = None if state.started else "assistant"
    if finish is None:
        if not piece:
            return None
        state.started = True
        return {"index": state.index, "delta": {"role": role, "content": piece} if role else {"content": piece}}
    _, calls = prepared.tools.parse(held.text)
    state.started = True
    return _last_chunk(prepared, state, role, piece + held.rest(calls=bool(calls)), calls, finish)


def _last_chunk(
    prepared: PreparedChat, state: ChoiceState, role: str | None, content: str | None, calls: list[tools.ToolCall],
    finish: str,
) -> dict[str, Any]:
    """A choice's last chunk: the rest of its content and the calls parsed from its whole text."""
    body = ChunkDelta(role=role, content=content or None, tool_calls=[c.as_openai(i) for i, c in enumerate(calls)] or None)
    reason = _finished(state.index, prepared.tools.finish_reason(calls, finish))
    return ChunkChoice(index=state.index, delta=body, finish_reason=reason).model_dump(mode="json", exclude_none=True)


async def stream(prepared: PreparedChat, on_done: OnDone[ChatCompletion] | None = None) -> AsyncGenerator[bytes, None]:
    """The chunks of a ChatCompletionChunk stream, already encoded as JSON (api.sse frames them)."""
    run = await start_run(prepared)
    options = prepared.request.stream_options
    include_usage = bool(options and options.include_usage)
    continuous = bool(options and options.continuous_usage_stats)
    chunk = ChunkEncoder(prepared.id, "chat.completion.chunk", prepared.created, prepared.model,
                         prepared.scheduled.tier)

    async for output in run.outputs():
        choices = [_chunk_choice(prepared, run.choices[d.index], d) for d in output.choices]
        present = [c for c in choices if c is not None]
        if present:
            yield chunk(present, run.usage() if include_usage and continuous else None)
    if on_done is not None:
        await hand_over(on_done, _answer(prepared, run), run)
    if include_usage:
        yield chunk([], run.usage())


async def replay(answer: ChatCompletion, request: ChatCompletionRequest) -> AsyncGenerator[ChatCompletionChunk, None]:
    """A whole (cached) answer as a stream: per choice its content, then its finish."""
    chat_id, created = new_id("chatcmpl"), now()

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=chat_id, created=created, model=answer.model, choices=choices, usage=usage)

    for choice in answer.choices:
        message = choice.message
        calls = [{**call, "index": i} for i, call in enumerate(message.tool_calls or [])] or None
        reasoning = {"reasoning_content": message.reasoning_content} if hasattr(message, "reasoning_content") else {}
        delta = ChunkDelta(role="assistant", content=message.content, tool_calls=calls, **reasoning)
        yield chunk([ChunkChoice(index=choice.index, delta=delta, logprobs=choice.logprobs)])
        yield chunk([ChunkChoice(index=choice.index, delta=ChunkDelta(), finish_reason=choice.finish_reason)])
    if request.stream_options and request.stream_options.include_usage:
        yield chunk([], answer.usage)


def fresh(answer: ChatCompletion) -> ChatCompletion:
    """A cached answer under a new id and time."""
    return answer.model_copy(update={"id": new_id("chatcmpl"), "created": now()})


class ChatService:
    """/v1/chat/completions for the dispatcher (`serving.service.Service`)."""

    route = "/v1/chat/completions"
    upstream_path = "/chat/completions"
    answer_type = ChatCompletion
    task: Task = "generate"

    # the module's functions, as the Service protocol's methods
    prepare = staticmethod(prepare)
    forwarded = staticmethod(forwarded)
    complete = staticmethod(complete)
    stream = staticmethod(stream)
    replay = staticmethod(replay)
    fresh = staticmethod(fresh)
    renewed = Renewal("chat.completion", lambda: new_id("chatcmpl"), now)  # what `fresh` does, on the JSON


CHAT = ChatService()
