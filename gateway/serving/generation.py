"""What chat and completions share: ids, the output budget (context checks), sampling options,
token-id checks, the per-choice state that streaming and aggregation keep, and `Run`: one
generation on either backend (the engine, a remote upstream), guarded and measured.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import structlog
from opentelemetry.trace import Span

from engine.config import SamplingDefaults
from engine.errors import EngineError
from engine.types import (
    ChoiceDelta,
    Engine,
    GenerationOutput,
    GenerationRequest,
    Generator,
    SamplingOptions,
    TokenLogprob,
)
from gateway.errors import ContextLengthExceeded, InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.guards.stream import visible
from gateway.protocol.openai import SamplingFields, Usage
from gateway.serving.meter import Meter, Readings
from gateway.telemetry.record import current_trace
from gateway.telemetry.tracing import headers_of

log = structlog.get_logger(__name__)
AnswerT = TypeVar("AnswerT")


def new_id(prefix: str) -> str:
    # 32 random hex digits, as uuid4().hex; os.urandom directly, as secrets.token_hex does it through
    # two layers of Python (SystemRandom.randbytes)
    return prefix + "-" + os.urandom(16).hex()


def now() -> int:
    return int(time.time())


def resolve_max_tokens(
    requested: int | None, prompt_tokens: int, max_model_len: int, default: int | None, param: str,
    prompt_param: str = "messages",
) -> int:
    """The output budget; a prompt that leaves no room, or a budget past the context, is a 400
    (naming `param`, the output budget, or when the prompt alone fills the context `prompt_param`)."""
    room = max_model_len - prompt_tokens
    if room <= 0 or (requested is not None and requested > room):
        asked = f" and {requested} output tokens" if requested is not None else ""
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + (requested or 0)} tokens ({prompt_tokens} in the "
            f"prompt{asked}). Please reduce the length of the prompt or the output.",
            param=param if requested is not None and room > 0 else prompt_param,
        )
    if requested is not None:
        return requested
    return min(room, default) if default else room


def sampling_options(
    request: SamplingFields,
    max_tokens: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    json_schema: dict[str, Any] | None = None,
    json_object: bool = False,
    compact_json: bool = False,
    n: int | None = None,
    defaults: SamplingDefaults | None = None,
) -> SamplingOptions:
    """Where the request is silent: the model's `defaults` (the models file's over its
    generation_config.json), then OpenAI's (temperature 1, top_p 1, no top_k, min_p or penalties)."""
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    bias = {int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None
    picked = _defaulted(request, defaults or _NO_DEFAULTS)
    top_k = int(picked["top_k"])
    return SamplingOptions(
        max_tokens=max_tokens,
        n=n or request.n,
        temperature=picked["temperature"],
        top_p=picked["top_p"],
        top_k=0 if top_k == -1 else top_k,
        min_p=picked["min_p"],
        seed=request.seed,
        stop=stop,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        presence_penalty=picked["presence_penalty"],
        frequency_penalty=picked["frequency_penalty"],
        repetition_penalty=picked["repetition_penalty"],
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        skip_special_tokens=request.skip_special_tokens,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logit_bias=bias,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        json_schema=json_schema,
        json_object=json_object,
        compact_json=compact_json,
    )


_NO_DEFAULTS = SamplingDefaults()
# the parameters a model's defaults fill where a request is silent, and OpenAI's own after them
_DEFAULTED = (
    ("temperature", 1.0), ("top_p", 1.0), ("top_k", 0.0), ("min_p", 0.0),
    ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
)


def _defaulted(request: SamplingFields, defaults: SamplingDefaults) -> dict[str, float]:
    """Each parameter: the request's when it sent one, else the model's default, else OpenAI's."""
    sent = request.model_fields_set
    picked = {}
    for name, openai_default in _DEFAULTED:
        value = getattr(request, name) if name in sent else None
        if value is None:
            value = getattr(defaults, name)
        picked[name] = openai_default if value is None else float(value)
    return picked


def check_token_ids(token_ids: Iterable[int], vocab_size: int | None, param: str) -> None:
    if vocab_size is None:
        return
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(f"token id {token_id} is outside the vocabulary (0..{vocab_size - 1})", param)


def check_sampling(request: SamplingFields, engine: Engine, max_tokens: int) -> None:
    """What the protocol models cannot check alone: token ids against this model's vocabulary,
    min_tokens against the output budget."""
    if request.logit_bias or request.stop_token_ids:
        vocab_size = engine.info.extra.get("vocab_size")
        check_token_ids((int(key) for key in request.logit_bias or ()), vocab_size, "logit_bias")
        check_token_ids(request.stop_token_ids or (), vocab_size, "stop_token_ids")
    if request.min_tokens > max_tokens:
        raise InvalidRequest(f"min_tokens ({request.min_tokens}) must be at most max_tokens ({max_tokens})", "min_tokens")


def check_schema_numbers(schema: object, param: str) -> None:
    """Free-form JSON of a request (a schema for constrained output, a remote model's tools) goes to msgpack (the
    engine) or orjson (an upstream): integers from -2**63 to 2**64 - 1 only; a larger one is the request's fault (400)."""
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise InvalidRequest(f"{param} holds an integer beyond 64 bits, which the model cannot take", param)


@dataclass(slots=True)
class ChoiceState:
    """One choice's progress across engine outputs: its text so far, tokens and finish."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the engine's: the stop string (or token id) that ended it
    started: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text_offset: int = 0  # characters streamed so far, for completions' logprobs.text_offset
    cumulative_logprob: float | None = None
    failed: bool = False  # the engine ended it with an error (vLLM: a grammar that did not compile)
    reasoning: list[str] = field(default_factory=list)  # a remote upstream's, apart from the text
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # a remote upstream's parsed calls: id, name, arguments

    def add(self, delta: ChoiceDelta) -> None:
        self.text.append(delta.text)
        self.tokens += len(delta.token_ids)
        if delta.reasoning:
            self.reasoning.append(delta.reasoning)
        for call in delta.tool_calls:
            whole = self.calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            whole["id"] = call.id or whole["id"]
            whole["name"] = call.name or whole["name"]
            whole["arguments"] += call.arguments
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.cumulative_logprob is not None:
            self.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            self.finish_reason = finish_reason(delta.finish_reason)
            self.stop_reason = delta.stop_reason
            self.failed = delta.finish_reason == "error"


async def hand_over(on_done: Callable[[AnswerT], Awaitable[None]] | None, answer: AnswerT, *runs: Run) -> None:
    """A whole answer to the cache's hand-off, unless one of its runs judged it not to be kept."""
    reason = next((run.unkeepable for run in runs if run.unkeepable), None)
    if reason is not None:
        log.info("cache_skipped", reason=reason)
    elif on_done is not None:
        await on_done(answer)


class GenerationFailed(EngineError):
    """The engine ended a request with an error before its first token (vLLM's FINISHED_ERROR: for
    a constrained request, a grammar that did not compile). Never answered as an empty 200."""


def finish_reason(engine_reason: str) -> str:
    # vLLM says "abort" for requests it cancelled; OpenAI knows stop, length, tool_calls (a remote
    # upstream's), content_filter (the output guards' cut)
    return engine_reason if engine_reason in ("stop", "length", "content_filter", "tool_calls") else "stop"


class Run:
    """One generation on a backend, started: its outputs, the bookkeeping for usage (the backend's
    own count when it reports one), and its latency metrics (time to first token, inter-token
    latency, time per output token). Every generation's outputs pass the request's output guard
    here, whichever API and backend (the one place: a service hands over the request's guard, not a
    guard of its own making), and the generation ends once it has cut every choice."""

    def __init__(
        self, engine: Generator, request: GenerationRequest, guard: RequestGuard = UNGUARDED, priority: int = 0,
        readings: Readings | None = None, tag: str | None = None,
    ) -> None:
        self.engine = engine
        if priority != request.priority:  # prepared before the pipeline chose its priority
            request = replace(request, priority=priority)
        self.request = request
        # an upstream's logprobs may spell its tool calls: they get a slot of their own
        # `tag`: the text is tool calls from it on, parsed here (an engine's, with tools on `auto`)
        self.guard = guard.output(request.sampling.n, apart=request.forward is not None, json=_json_text(request),
                                  tag=tag if request.forward is None else None)
        prior = getattr(engine, "prior", None)  # a stream taken over: `serving.continuation.Failover`'s first part
        if self.guard is not None and prior is not None:
            self.guard.seen(prior.text)
        self.prompt_tokens = request.forward.prompt_tokens if request.forward else len(request.prompt_token_ids)
        self.cached_tokens = 0
        self.reported: int | None = None  # the completion tokens the backend counted (a remote upstream's usage)
        self._read = False  # an output was read: an upstream that failed before answering counts no tokens
        self.choices = [ChoiceState(i) for i in range(request.sampling.n)]
        self._trace = trace = current_trace()
        self._span: Span | None = None  # traced: the engine's first token, then its decoding (an upstream traces its request)
        if trace is not None and request.forward is None:
            self._span = trace.start("engine.first_token", attributes={"gen_ai.request.id": request.request_id})
            self.request = request = replace(request, trace_headers=headers_of(self._span))
        self._outputs = engine.generate(request)
        if request.forward is not None:
            self._outputs = bounded(self._outputs, request.sampling.n, request.forward.max_tokens)
        self._first: GenerationOutput | None = None
        self._meter = Meter(engine.info.name, readings)
        self.unkeepable: str | None = None  # why the answer must not be cached
        self._closed = False

    async def start(self) -> Run:
        """Wait for the first output, so that the engine's refusals come before any byte is sent."""
        self._meter.begin()
        try:
            self._first = await anext(self._outputs)
        except StopAsyncIteration:
            self._first = None
        except BaseException:
            await self.close()
            raise
        first = self._first
        if first is not None and any(d.finish_reason == "error" and not d.token_ids for d in first.choices):
            await self.close()
            raise GenerationFailed("The engine ended the request with an error before its first token")
        return self

    async def outputs(self) -> AsyncGenerator[GenerationOutput, None]:
        try:
            if self._first is None:
                return
            output, self._first = self._first, None
            if self.guard is None:  # the plain path, per token: nothing in between
                yield self._take(output)
                async for output in self._outputs:
                    yield self._take(output)
                return
            while True:
                yield visible(self._take(await self.guard.apply(output)))
                if self.guard.stopped:
                    return  # the guard cut every choice: closing aborts the engine request
                try:
                    output = await anext(self._outputs)
                except StopAsyncIteration:
                    if (rest := await self._flushed()).choices:
                        yield self._take(rest)
                    return
        finally:
            await self.close()

    async def _flushed(self) -> GenerationOutput:
        """What the output guard still holds of choices the backend left unfinished (a remote
        stream that ended without a finish reason), checked as their end; they stay unfinished."""
        assert self.guard is not None
        ends = [ChoiceDelta(choice.index, "", (), "stop") for choice in self.choices if choice.finish_reason is None]
        rest = await self.guard.apply(GenerationOutput(0, ends, finished=True))
        return visible(replace(rest, choices=[replace(delta, finish_reason=None) for delta in rest.choices]))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._outputs.aclose()
        finally:
            self._finish()

    def _take(self, output: GenerationOutput) -> GenerationOutput:
        self._read = True
        if output.prompt_tokens:
            self.prompt_tokens = output.prompt_tokens
        if output.cached_tokens:
            self.cached_tokens = output.cached_tokens
        if output.completion_tokens is not None:
            self.reported = output.completion_tokens
        tokens = False
        for delta in output.choices:
            self.choices[delta.index].add(delta)
            tokens = tokens or bool(delta.token_ids)
            self._meter.readings.generated += len(delta.token_ids)
        if tokens and self._meter.token() and self._span is not None:
            self._span.end()
            assert self._trace is not None
            self._span = self._trace.start("engine.decode", attributes={"gen_ai.request.id": self.request.request_id})
        return output

    def _finish(self) -> None:
        self._judge()
        self._meter.end()
        prompt, completion = self.prompt_tokens, self.completion_tokens()
        if self._read or self.request.forward is None:  # its prompt estimated, not read: nothing to count
            self._meter.count(prompt, completion, len(self.choices))
        readings = self._meter.readings
        readings.ended = all(choice.finish_reason is not None for choice in self.choices)
        if readings.log_content:
            readings.prompt = self.request.prompt_text
            readings.output.extend("".join(choice.text) for choice in self.choices)
        if self._trace is not None:
            self._trace.finished([choice.finish_reason for choice in self.choices])
        if self._span is not None:
            self._end_span(prompt, completion)

    def _judge(self) -> None:
        """Mark the answer as not to be cached when a choice failed, never finished (a remote
        upstream's stream that ended early), or came out empty although its output was constrained
        (JSON is never empty): `hand_over` reads it."""
        sampling = self.request.sampling
        constrained = sampling.json_schema is not None or sampling.json_object
        for choice in self.choices:
            if choice.failed or choice.finish_reason is None:
                self.unkeepable = "a choice failed, or never finished"
            elif constrained and not "".join(choice.text).strip():
                self.unkeepable = "a constrained choice came out empty"

    def _end_span(self, prompt: int, completion: int) -> None:
        assert self._span is not None
        if self._span.is_recording():
            self._span.set_attributes({"gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion})
            # closed before every choice finished: the client left, or an error
            if any(choice.finish_reason is None for choice in self.choices):
                self._span.set_attribute("gateway.engine.aborted", True)
        self._span.end()
        self._span = None

    async def collect(self, each: Callable[[GenerationOutput], object] | None = None) -> Run:
        """Every output taken (and handed to `each`), then closed: what `outputs` does, without
        its generator layer when there is no output guard (a non-streamed answer)."""
        if self.guard is not None:
            async for output in self.outputs():
                if each is not None:
                    each(output)
            return self
        take = self._take if each is None else (lambda output: each(self._take(output)))
        try:
            first, self._first = self._first, None
            if first is None:
                return self
            take(first)
            async for output in self._outputs:
                take(output)
        finally:
            await self.close()
        return self

    def completion_tokens(self) -> int:
        if self.reported is not None:
            return self.reported
        choices = self.choices
        return choices[0].tokens if len(choices) == 1 else sum(choice.tokens for choice in choices)

    def usage(self) -> Usage:
        return Usage(**self.usage_fields())

    def usage_fields(self) -> dict[str, Any]:
        """The Usage's fields (all four set, the details None without cached tokens)."""
        completion = self.completion_tokens()
        details = {"cached_tokens": self.cached_tokens} if self.cached_tokens else None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": details,
        }


def _json_text(request: GenerationRequest) -> bool:
    """Whether the text the generation writes is JSON: constrained to it (a named or required tool
    call, structured output), or asked of a remote upstream as a response format."""
    if request.forward is not None:
        asked = request.forward.payload.get("response_format")
        return isinstance(asked, dict) and asked.get("type") in ("json_object", "json_schema")
    return request.sampling.json_schema is not None or request.sampling.json_object


async def bounded(outputs: AsyncGenerator[GenerationOutput, None], n: int, most: int) -> AsyncGenerator[GenerationOutput, None]:
    """A remote upstream's outputs (or a continued part's: `serving.continuation`), a choice that
    brings more than the `most` tokens it was allowed ended there ("length", what came past it
    dropped); once every choice is over, so is the request (one that finished every choice itself
    goes on to its usage)."""
    tokens, ended, cut = [0] * n, [False] * n, False
    try:
        async for output in outputs:
            deltas = []
            for delta in output.choices:
                if ended[delta.index]:
                    continue
                tokens[delta.index] += len(delta.token_ids)
                ended[delta.index] = delta.finish_reason is not None or tokens[delta.index] > most
                if tokens[delta.index] > most:
                    cut, delta = True, ChoiceDelta(delta.index, "", (), "length")
                deltas.append(delta)
            yield replace(output, choices=deltas) if cut else output
            if cut and all(ended):
                return
    finally:
        await outputs.aclose()
