"""Mid-stream failover: a generation whose backend fails after its first output goes on, on the
next model the pipeline allows (`Onward`, the pipeline's: which model, under which guard and
permit), asked to continue the text already produced (the conversation plus a partial assistant
turn: `continue_final_message`; a completion's prompt with the text appended). What the layers
above see is one generation: `Failover` is the backend they were given, its outputs the joined
ones, so every streaming API, the output guard and the usage take it as they take any stream.

The seam: the text handed on is what the failed backend produced, its tokens counted, but for
its trailing whitespace, held back (`held`): some templates trim a partial turn's end, and a
model's tokens carry their leading space, so the continuation's first text brings it again
and loses it here when it does. Usage: each part's prompt (the
continued prompt is prefilled again) and each part's output tokens.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import structlog

from engine.types import (
    ChoiceDelta,
    Embeddings,
    EmbedRequest,
    GenerationOutput,
    GenerationRequest,
    Generator,
    ModelInfo,
    TokenLogprob,
)
from gateway.errors import from_exception
from gateway.serving.generation import bounded

log = structlog.get_logger(__name__)
AnswerT = TypeVar("AnswerT")


@dataclass(slots=True)
class Part:
    """One backend's share of the answer: the generation it runs, and its end (its permit given back)."""

    generator: Generator
    request: GenerationRequest
    release: Callable[[], None] = lambda: None
    held: str = ""  # the partial's trailing whitespace, which the continuation's text may repeat
    started: Callable[[], None] = lambda: None  # at its first output: the switch to it happened
    stop: tuple[str, ...] = ()  # the request's stop strings (one begun before the seam may end in this part)
    include_stop: bool = False  # the request's include_stop_str_in_output


# the next part for the text produced so far and its output tokens; None: nothing can continue it
Onward = Callable[[str, int], Awaitable["Part | None"]]


@dataclass(frozen=True, slots=True)
class Prior:
    """The answer's first part, produced elsewhere (a replica that died: `pipeline.dispatch.resume`): the text the
    client has, its output tokens, the answer's bound (the client's, else None: the continued request's own plus
    `tokens`), and the next part's seam (as `Part`'s). The generation given then is that next part, seamed as any
    (held whitespace, stop strings, the bound)."""

    text: str
    tokens: int
    most: int | None = None
    held: str = ""
    stop: tuple[str, ...] = ()
    include_stop: bool = False


async def _nowhere(text: str, tokens: int) -> Part | None:
    return None


class Failover:
    """A backend (`engine.types.Generator`) whose generations go on down the pipeline's chain when
    it fails after its first output."""

    def __init__(self, first: Generator, onward: Onward | None, prior: Prior | None = None) -> None:
        """`prior`: the answer's first part, produced elsewhere: its generations continue it."""
        self.first, self.onward, self.prior = first, onward or _nowhere, prior
        self.switched = False  # a generation went on on another model
        # the first model's permit (the pipeline's, once admitted): given back as soon as it fails,
        # without the answer's tokens (they are not its pace), not held for the rest of the answer
        self.release: Callable[[], None] = lambda: None

    @property
    def info(self) -> ModelInfo:
        return self.first.info

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        part, prior = Part(self.first, request, lambda: self.release()), self.prior
        if prior is not None:
            part = replace(part, held=prior.held, stop=prior.stop, include_stop=prior.include_stop)
        return joined(part, self._onward, prior)

    async def _onward(self, text: str, tokens: int) -> Part | None:
        part = await self.onward(text, tokens)
        self.switched = self.switched or part is not None
        return part

    def unless_switched(self, on_done: Callable[[AnswerT], Awaitable[None]] | None) -> Callable[[AnswerT], Awaitable[None]] | None:
        """The cache's hand-off for an answer this one model gave: a joined answer is no answer of
        the model whose key it would be stored under."""
        if on_done is None:
            return None
        kept = on_done

        async def store(answer: AnswerT) -> None:
            if not self.switched:
                await kept(answer)

        return store

    async def embed(self, request: EmbedRequest) -> Embeddings:
        return await self.first.embed(request)

    async def check_health(self) -> None:
        await self.first.check_health()

    async def shutdown(self) -> None:
        await self.first.shutdown()


class _Seam:
    """The parts so far: the text produced (choice 0: a continued request has one choice), the
    tokens and prompts of the parts before the current one, and what the current one may repeat."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.tokens = 0  # output tokens of the current part
        self.prompt = 0  # the current part's prompt tokens, as it reports them
        self.before_prompt = self.before_tokens = 0  # the parts before it
        self.held = ""
        self.continuable = True  # no tool call a backend parsed, no reasoning: plain text to continue
        self.finished = False  # the answer ended: a failure after it leaves nothing to continue
        self.stops: tuple[str, ...] = ()
        self.include_stop = False
        # the text around the last seam, from as far back as a stop string may begin ("": none to watch),
        # and where the seam is in it: no engine sees a stop string that spans it
        self.window, self.at = "", 0
        self.stopped = False  # a stop string ended across the seam: the answer is over

    def take(self, output: GenerationOutput, estimated: int) -> GenerationOutput:
        """The output counted, then as the joined generation reports it (its usage the parts' sum)."""
        self.prompt = output.prompt_tokens or self.prompt or estimated
        deltas = []
        for delta in output.choices:
            if self.held and delta.text:
                kept = delta.text.removeprefix(self.held[: len(delta.text)])
                dropped = len(delta.text) - len(kept)
                self.held = self.held[dropped:] if kept == "" else ""
                delta = replace(delta, text=kept, logprobs=_without(delta.logprobs, dropped))
            if self.window and delta.text:
                delta = self._stopped(delta)
            self.text.append(delta.text)
            self.tokens += len(delta.token_ids)
            self.continuable = self.continuable and not delta.tool_calls and not delta.reasoning
            self.finished = self.finished or delta.finish_reason is not None
            deltas.append(delta)
        if not self.before_prompt and not self.before_tokens:
            return replace(output, choices=deltas)
        reported = None if output.completion_tokens is None else output.completion_tokens + self.before_tokens
        return replace(output, choices=deltas, prompt_tokens=self.before_prompt + self.prompt,
                       completion_tokens=reported)

    def _stopped(self, delta: ChoiceDelta) -> ChoiceDelta:
        """The delta cut where the first stop string that began before the seam ends."""
        view = self.window + delta.text
        spanning = [(begins, stop) for stop in self.stops if -1 < (begins := view.find(stop)) < self.at]
        if spanning:
            begins, stop = min(spanning)
            end = begins + len(stop) if self.include_stop else begins
            self.window, self.stopped = "", True
            return replace(delta, text=view[self.at : max(end, self.at)], finish_reason="stop", stop_reason=stop)
        self.window = view if len(view) - self.at < max(map(len, self.stops)) - 1 else ""
        return delta

    def after(self, prior: Prior, part: Part, most: int) -> int:
        """Seamed to a first part produced elsewhere, `part` the next: the answer's bound (`most`: the part's own)."""
        self.text, self.tokens = [prior.text], prior.tokens
        self.switch(part)
        return prior.most if prior.most is not None else most + prior.tokens

    def switch(self, part: Part) -> None:
        self.before_prompt += self.prompt
        self.before_tokens += self.tokens
        self.prompt = self.tokens = 0
        self.held, self.stops, self.include_stop = part.held, part.stop, part.include_stop
        text, longest = "".join(self.text), max(map(len, part.stop), default=0)
        self.window = text[max(0, len(text) - longest + 1) :] if longest > 1 else ""
        self.at = len(self.window)


def _without(entries: tuple[TokenLogprob, ...] | None, chars: int) -> tuple[TokenLogprob, ...] | None:
    """The logprobs of a delta whose text lost its first `chars` characters: their tokens too."""
    if not entries or not chars:
        return entries
    kept = []
    for entry in entries:
        cut = min(chars, len(entry.token))
        kept.append(replace(entry, token=entry.token[cut:]))
        chars -= cut
    return tuple(kept)


async def joined(part: Part, onward: Onward, prior: Prior | None = None) -> AsyncGenerator[GenerationOutput, None]:
    """The outputs of `part`, then, when its backend fails after its first output, those of the
    parts `onward` gives for the text so far, until one ends (or none is left: the failure is the
    stream's). A continuing part that fails before its first output (down, or refusing to continue)
    hands the same text on again; one that fails later, the longer text. With `prior`, `part` is
    already a continuing one, of a first part produced elsewhere."""
    seam, first = _Seam(), prior is None
    # the answer's output bound, the first part's: the client's, else its model's default; a continued
    # request that names none would bring the next model's whole default again
    most = part.request.forward.max_tokens if part.request.forward else part.request.sampling.max_tokens
    most = most if prior is None else seam.after(prior, part, most)
    initial = part  # its permit is the stream's
    while True:
        request = part.request
        estimated = request.forward.prompt_tokens if request.forward else len(request.prompt_token_ids)
        outputs = part.generator.generate(request)
        if not first:  # held to what is left of the bound (a remote part to its own share too, as Run holds the first)
            left = most - seam.before_tokens
            outputs = bounded(outputs, request.sampling.n, min(left, request.forward.max_tokens) if request.forward else left)
        started = failed = False
        try:
            async for output in outputs:
                if not started:
                    started = True
                    part.started()
                yield seam.take(output, estimated)
                if seam.stopped:
                    return
            return
        except Exception as exc:
            # before any output the pipeline's fallback decides; a failure that is no backend's, or after the
            # answer's end (nothing to continue), is the stream's
            if (first and not started) or not seam.continuable or seam.finished or \
                    (started and not from_exception(exc).fallible):
                raise
            log.info("stream_failover", failed=part.generator.info.name, error=type(exc).__name__, started=started)
            failure, failed = exc, True
        finally:
            await outputs.aclose()
            if failed or part is not initial:  # the first part's permit is the stream's, given back at its end, unless it failed
                part.release()
        following = await onward("".join(seam.text), seam.before_tokens + seam.tokens)
        if following is None:
            raise failure
        seam.switch(following)
        part, first = following, False
