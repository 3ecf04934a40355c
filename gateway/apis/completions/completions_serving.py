"""Completions: prompt(s) → engine (or the request forwarded to a remote upstream) → Completion or chunks.
Each prompt (`CompletionRequest.prompt_count`) is one engine request of `n` choices, and choice `i` of prompt `p`
is answered as index `p * n + i` (a remote upstream numbers them so itself, in its one request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from engine.types import (
    ChoiceDelta,
    Engine,
    Forward,
    GenerationOutput,
    GenerationRequest,
    Generator,
    SamplingOptions,
    Task,
    TokenLogprob,
)
from gateway.errors import InvalidRequest
from gateway.guards.guarding import UNGUARDED, RequestGuard
from gateway.protocol.openai import Completion, CompletionLogprobs, CompletionRequest, Usage
from gateway.serving.encoding import ChunkEncoder, Renewal
from gateway.serving.generation import (
    ChoiceState,
    Run,
    check_sampling,
    check_token_ids,
    finish_reason,
    hand_over,
    new_id,
    now,
    resolve_max_tokens,
    sampling_options,
)
from gateway.serving.meter import Readings
from gateway.serving.service import OnDone
from gateway.serving.structured import Constraint
from gateway.tenancy.priority import NORMAL, Scheduled


@dataclass(slots=True)
class PreparedCompletion:
    request: CompletionRequest
    engine: Generator
    generations: list[GenerationRequest]
    prompts: list[str]  # each prompt's text, for echo
    model: str  # the name the answer carries: the model (version) that answers
    id: str
    created: int
    guard: RequestGuard = UNGUARDED
    constraint: Constraint | None = None  # completions take no response_format
    scheduled: Scheduled = NORMAL  # its priority (the pipeline's decision, `tenancy.priority`)
    readings: Readings = field(default_factory=Readings)  # what its runs measured, for the pipeline

    def schedule(self, scheduled: Scheduled, readings: Readings) -> None:
        self.scheduled, self.readings = scheduled, readings

    def token_budget(self) -> int:
        return sum(len(g.prompt_token_ids) for g in self.generations) + self.output_tokens()

    def output_tokens(self) -> int:
        return sum(g.sampling.max_tokens * g.sampling.n for g in self.generations)

    def sole(self) -> GenerationRequest | None:
        return self.generations[0] if len(self.generations) == 1 else None


def check_vocabulary(token_ids: list[int], engine: Engine, param: str) -> None:
    check_token_ids(token_ids, engine.info.extra.get("vocab_size"), param)


def _prompts(request: CompletionRequest, engine: Engine) -> list[tuple[str, list[int]]]:
    """Each prompt as (text, token ids)."""
    prompt = request.prompt
    tokenizer = engine.tokenizer
    if isinstance(prompt, str):
        return [(prompt, tokenizer.encode_prompt(prompt))]
    texts = [p for p in prompt if isinstance(p, str)]
    if len(texts) == len(prompt):
        return [(text, tokenizer.encode_prompt(text)) for text in texts]
    singles = [p for p in prompt if isinstance(p, int)]
    token_lists = [singles] if len(singles) == len(prompt) else [p for p in prompt if isinstance(p, list)]
    for ids in token_lists:
        check_vocabulary(ids, engine, "prompt")
    return [(tokenizer.decode(ids), list(ids)) for ids in token_lists]


def _guarded(prompts: list[tuple[str, list[int]]], engine: Engine, guard: RequestGuard) -> list[tuple[str, list[int]]]:
    """Each prompt as the input guards let it through to the engine (text, token ids)."""
    if not guard.active:
        return prompts
    checked = guard.check_input([text for text, _ in prompts], "prompt")
    prompts = [(new, ids if new == text else engine.tokenizer.encode_prompt(new)) for (text, ids), new in zip(prompts, checked, strict=True)]
    guard.check_prompt_tokens(sum(len(ids) for _, ids in prompts), "prompt")
    return prompts


def prepare(
    request: CompletionRequest, engine: Engine, default_max_tokens: int | None, guard: RequestGuard = UNGUARDED
) -> PreparedCompletion:
    if request.suffix:
        raise InvalidRequest("suffix is not supported by this model", "suffix")
    best_of = request.best_of or request.n
    if best_of < request.n:
        raise InvalidRequest("best_of must be greater than or equal to n", "best_of")
    if request.stream and best_of > request.n:
        raise InvalidRequest("best_of cannot be used with stream", "best_of")
    cmpl_id = new_id("cmpl")
    generations, texts = [], []
    prompts = _prompts(request, engine)
    for i, (text, ids) in enumerate(_guarded(prompts, engine, guard)):
        echoed = prompts[i][0]  # echo is the client's own prompt
        if request.truncate_prompt_tokens is not None and len(ids) > request.truncate_prompt_tokens:
            ids = ids[-request.truncate_prompt_tokens :]
            echoed = engine.tokenizer.decode(ids)  # ... as far as the model read it (its logprobs' offsets in it)
        if not ids:  # e.g. "" with a tokenizer that adds no start token: the engine's 400 named no param
            raise InvalidRequest("The prompt is empty: it has no tokens for the model to continue", "prompt")
        max_tokens = resolve_max_tokens(
            request.max_tokens, len(ids), engine.info.max_model_len, default_max_tokens, "max_tokens", "prompt"
        )
        if max_tokens == 0 and not request.echo:
            raise InvalidRequest("max_tokens of 0 is only allowed with echo", "max_tokens")
        check_sampling(request, engine, max(max_tokens, 1))
        sampling = sampling_options(
            request,
            max(max_tokens, 1),
            # best_of ranks choices by cumulative logprob, which the engine keeps only with logprobs on
            logprobs=request.logprobs if best_of == request.n else (request.logprobs or 0),
            prompt_logprobs=request.logprobs if request.echo and request.logprobs is not None else None,
            n=best_of,
            # sampling defaults as in chat; max_tokens stays 16 when unsaid, as OpenAI's and vLLM's completions
            defaults=engine.info.sampling_defaults,
        )
        generations.append(GenerationRequest(f"{cmpl_id}-{i}", ids, sampling, prompt_text=text))
        texts.append(echoed)
    return PreparedCompletion(request, engine, generations, texts, request.model, cmpl_id, now(), guard)


def forwarded(request: CompletionRequest, forward: Forward, backend: Generator, guard: RequestGuard) -> PreparedCompletion:
    """A remote model's request (its input guarded already): one upstream request for every prompt,
    whose choices it numbers itself (echo and best_of its own)."""
    sampling = SamplingOptions(request.max_tokens or 0, n=request.n * request.prompt_count())
    generation = GenerationRequest(new_id("cmpl"), [], sampling, forward=forward)
    return PreparedCompletion(request, backend, [generation], [""], request.model, generation.request_id, now(), guard)


def _logprobs(entries: Sequence[TokenLogprob | None], start_offset: int) -> CompletionLogprobs:
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = start_offset
    for entry in entries:
        token = entry.token if entry else ""
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob if entry else None)  # the first prompt token has none
        result.top_logprobs.append({t: lp for _, t, lp in entry.top} if entry and entry.top else None)
        result.text_offset.append(offset)
        offset += len(token)
    return result


class _Answer:
    """The runs of one completion request and how their choices are numbered and echoed."""

    def __init__(self, prepared: PreparedCompletion) -> None:
        self.prepared = prepared
        priority, readings = prepared.scheduled.priority, prepared.readings
        self.runs = [Run(prepared.engine, g, prepared.guard, priority, readings)
                     for g in prepared.generations]
        remote = prepared.generations[0].forward is not None  # echo, best_of and max_tokens 0 are the upstream's
        self.n = prepared.generations[0].sampling.n if remote else prepared.request.n
        self.zero = prepared.request.max_tokens == 0 and not remote  # echo only: the engine made one token to drop
        self.prompt_logprobs: dict[int, list[TokenLogprob]] = {}

    async def start(self) -> _Answer:
        if len(self.runs) == 1:  # one prompt (nearly always): no task for it (Run.start closes itself on failure)
            await self.runs[0].start()
            return self
        try:
            await asyncio.gather(*(run.start() for run in self.runs))
        except BaseException:
            await asyncio.gather(*(run.close() for run in self.runs), return_exceptions=True)
            raise
        return self

    def index(self, prompt: int, choice: int) -> int:
        return prompt * self.n + choice

    def echo(self, prompt: int) -> str:
        return self.prepared.prompts[prompt] if self.prepared.request.echo else ""

    def note_prompt_logprobs(self, prompt: int, output: GenerationOutput) -> None:
        """Keep the prompt's logprobs (only the first output carries them), for echo."""
        if not output.prompt_logprobs:
            return
        ids = self.prepared.generations[prompt].prompt_token_ids
        decode = cast(Engine, self.prepared.engine).tokenizer.decode  # only the engine reads prompts
        self.prompt_logprobs[prompt] = self.prepared.guard.weighed([  # the alternatives are the model's text
            entry or TokenLogprob(token_id, decode([token_id]), None)
            for token_id, entry in zip(ids, output.prompt_logprobs, strict=False)
        ])

    def choice_logprobs(self, prompt: int, entries: Sequence[TokenLogprob | None]) -> CompletionLogprobs | None:
        if self.prepared.request.logprobs is None:
            return None
        if self.prepared.request.echo:
            entries = [*self.prompt_logprobs.get(prompt, []), *entries]
        return _logprobs(entries, 0)

    def usage_fields(self) -> dict[str, int]:
        """All prompts' (no cached-token details, as OpenAI's completions)."""
        prompt = sum(run.prompt_tokens for run in self.runs)
        completion = 0 if self.zero else sum(run.completion_tokens() for run in self.runs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def text(self, state: ChoiceState) -> str:
        return "" if self.zero else "".join(state.text)


async def complete(prepared: PreparedCompletion, on_done: OnDone[Completion] | None = None) -> Completion:
    await prepared.guard.moderate_input()
    answer = await _Answer(prepared).start()
    try:
        for p, run in enumerate(answer.runs):
            await run.collect(partial(answer.note_prompt_logprobs, p))
    except BaseException:  # one prompt failed (or the client left): the others' engine requests end too
        await asyncio.gather(*(run.close() for run in answer.runs), return_exceptions=True)
        raise
    whole = _whole(answer)
    await hand_over(on_done, whole, *answer.runs)
    return whole


def _whole(answer: _Answer) -> Completion:
    """The answer validated in one step from plain fields (the choices and usage as dicts, not a
    model each: one validator call instead of one per object and their Python layers)."""
    prepared, zero = answer.prepared, answer.zero
    choices = [
        {"index": answer.index(p, rank), "text": answer.echo(p) + answer.text(state),
         "finish_reason": "length" if zero else state.finish_reason,
         "logprobs": answer.choice_logprobs(p, [] if zero else state.logprobs)}
        for p, run in enumerate(answer.runs) for rank, state in enumerate(_best(run.choices, answer.n))
    ]
    return Completion.model_validate({"id": prepared.id, "created": prepared.created, "model": prepared.model,
                                      "choices": choices, "usage": answer.usage_fields()})


def _best(states: list[ChoiceState], n: int) -> list[ChoiceState]:
    """The n most likely of best_of choices (all of them, in order, without best_of)."""
    if len(states) == n:
        return states
    return sorted(states, key=lambda s: s.cumulative_logprob or float("-inf"), reverse=True)[:n]


async def stream(prepared: PreparedCompletion, on_done: OnDone[Completion] | None = None) -> AsyncGenerator[bytes, None]:
    """The chunks of a text_completion stream, already encoded as JSON (api.sse frames them)."""
    await prepared.guard.moderate_input()
    answer = await _Answer(prepared).start()
    options = prepared.request.stream_options
    include_usage = bool(options and options.include_usage)
    chunk = ChunkEncoder(prepared.id, "text_completion", prepared.created, prepared.model)
    async for encoded in _chunks(answer, chunk, prepared.request):
        yield encoded
    if on_done is not None:
        await hand_over(on_done, _whole(answer), *answer.runs)
    if include_usage:
        yield chunk([], Usage(**answer.usage_fields()))


async def _chunks(answer: _Answer, chunk: ChunkEncoder, request: CompletionRequest) -> AsyncGenerator[bytes, None]:
    """The answer's chunks before the usage one."""
    if len(answer.runs) == 1 and not request.echo and request.logprobs is None:  # nearly always: text only
        async for output in answer.runs[0].outputs():
            if output.choices:
                yield chunk([_text_choice(delta) for delta in output.choices])
    else:  # several prompts merged as they come (one prompt: no merging layer)
        single = len(answer.runs) == 1
        outputs = ((0, output) async for output in answer.runs[0].outputs()) if single else _merged(answer)
        async for p, output in outputs:
            if (encoded := _encoded(answer, chunk, p, output)) is not None:
                yield encoded


async def _merged(answer: _Answer) -> AsyncGenerator[tuple[int, GenerationOutput], None]:
    """Outputs of all runs as they come, tagged with their prompt's index."""
    queue: asyncio.Queue[tuple[int, GenerationOutput | None]] = asyncio.Queue()

    async def pump(p: int, run: Run) -> None:
        try:
            async for output in run.outputs():
                queue.put_nowait((p, output))
        finally:
            queue.put_nowait((p, None))  # its end, or its failure

    tasks = [asyncio.create_task(pump(p, run)) for p, run in enumerate(answer.runs)]
    try:
        live = len(tasks)
        while live:
            p, item = await queue.get()
            if item is None:
                live -= 1
                await tasks[p]  # raises its failure
            else:
                yield p, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _encoded(answer: _Answer, chunk: ChunkEncoder, p: int, output: GenerationOutput) -> bytes | None:
    """One engine output of prompt `p` as a chunk (None when it carries no choice)."""
    answer.note_prompt_logprobs(p, output)
    if not output.choices:
        return None
    return chunk([_chunk_choice(answer, p, delta) for delta in output.choices])


def _text_choice(delta: ChoiceDelta) -> dict[str, Any]:
    """One engine delta as a chunk's choice when it carries text only (one prompt, no echo, no
    logprobs): what `_chunk_choice` makes of it, with none of its lookups, per token."""
    if delta.finish_reason:
        return {"index": delta.index, "text": delta.text, "finish_reason": finish_reason(delta.finish_reason)}
    return {"index": delta.index, "text": delta.text}


def _chunk_choice(answer: _Answer, p: int, delta: ChoiceDelta) -> dict[str, Any]:
    """One engine delta of one choice as the CompletionChoice's JSON-ready dict, without pydantic
    for the per-token case (plain text)."""
    request = answer.prepared.request
    zero = answer.zero
    state = answer.runs[p].choices[delta.index]
    prefix = "" if state.started else answer.echo(p)
    choice: dict[str, Any] = {"index": answer.index(p, delta.index), "text": prefix + ("" if zero else delta.text)}
    if delta.finish_reason:
        choice["finish_reason"] = "length" if zero else state.finish_reason
    if request.logprobs is not None:
        entries: list[TokenLogprob | None] = [] if zero else list(delta.logprobs or ())
        if not state.started and request.echo:
            entries = [*answer.prompt_logprobs.get(p, []), *entries]
        logprobs = _logprobs(entries, state.text_offset)
        state.text_offset += sum(len(token) for token in logprobs.tokens)
        choice["logprobs"] = logprobs.model_dump(mode="json")
    state.started = True
    return choice


async def replay(whole: Completion, request: CompletionRequest) -> AsyncGenerator[Completion, None]:
    """A whole (cached) answer as a stream: one chunk per choice."""
    cmpl_id, created = new_id("cmpl"), now()
    for choice in whole.choices:
        yield Completion(id=cmpl_id, created=created, model=whole.model, choices=[choice])
    if request.stream_options and request.stream_options.include_usage:
        yield Completion(id=cmpl_id, created=created, model=whole.model, choices=[], usage=whole.usage)


def fresh(whole: Completion) -> Completion:
    return whole.model_copy(update={"id": new_id("cmpl"), "created": now()})


class CompletionsService:
    """/v1/completions (and the native /generate) for the dispatcher (`serving.service.Service`)."""

    route = "/v1/completions"
    upstream_path = "/completions"
    answer_type = Completion
    task: Task = "generate"

    # the module's functions, as the Service protocol's methods
    prepare = staticmethod(prepare)
    forwarded = staticmethod(forwarded)
    complete = staticmethod(complete)
    stream = staticmethod(stream)
    replay = staticmethod(replay)
    fresh = staticmethod(fresh)
    renewed = Renewal("text_completion", lambda: new_id("cmpl"), now)  # what `fresh` does, on the JSON


COMPLETIONS = CompletionsService()
