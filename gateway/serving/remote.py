"""A remote model's answer, read on its way through, so that remote models get the policies and
measurements embedded ones get.

- Before: `estimate` counts a request's tokens (no tokenizer of the upstream's model here): the
  prompt's text at 4 characters a token (OpenAI's rule of thumb), token-id prompts by their length,
  plus the output budget asked for (max_tokens or max_completion_tokens, times n and the prompts;
  completions' default 16; chat without one: 0, counted after).
- After: `RemoteAnswer` reads the upstream's `usage` (a whole answer's, a stream's usage chunk;
  without one, the estimate and one token per content chunk) and times its chunks (`serving.meter`);
  it rebuilds a deterministic answer whole (a stream's chunks joined per choice) for the cache.
- With an output guard (`guards.relay.RelayGuard`), each field that carries text is guarded as an
  embedded model's is, a stream's chunks held back across chunks; what cannot be read cannot be
  checked and is not passed on (a whole answer that is not JSON is a 502). Without one the events
  pass through as the upstream framed them, byte for byte (fields unknown here included).
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic

import orjson
import structlog
from pydantic import ValidationError

from gateway.errors import BadGateway
from gateway.guards.relay import RelayGuard
from gateway.protocol import sse_wire
from gateway.protocol.openai import ChatCompletion, Completion
from gateway.serving.meter import Meter, Readings
from gateway.serving.service import AnswerT, OnDone
from gateway.telemetry.record import current_trace

log = structlog.get_logger(__name__)
CHARS_PER_TOKEN = 4
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) when a completions request sends none


def estimate(payload: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, output budget) of a request about to be forwarded."""
    prompts = payload.get("prompt", payload.get("input"))
    prompt = _message_tokens(payload.get("messages") or []) + _prompt_tokens(prompts)
    count = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], str | list) else 1
    asked = payload.get("max_completion_tokens") or payload.get("max_tokens")
    if asked is None and "prompt" in payload:
        asked = COMPLETIONS_DEFAULT_MAX_TOKENS
    choices = max(int(payload.get("n") or 1), int(payload.get("best_of") or 1))
    return prompt, int(asked or 0) * choices * count


def _chars(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def _message_tokens(messages: list[dict[str, Any]]) -> int:
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += _chars(content)
        elif isinstance(content, list):
            total += sum(_chars(part.get("text") or "") for part in content if isinstance(part, dict))
        for call in message.get("tool_calls") or ():
            total += _chars(str((call.get("function") or {}).get("arguments") or ""))
    return total


def _prompt_tokens(prompt: object) -> int:
    if isinstance(prompt, str):
        return _chars(prompt)
    if isinstance(prompt, list):
        return sum(1 if isinstance(item, int) else _prompt_tokens(item) for item in prompt)
    return 0


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)
    completion_logprobs: dict[str, list[Any]] = field(default_factory=dict)


class _Joined:
    """A stream's chunks, joined per choice into the whole answer."""

    def __init__(self) -> None:
        self.first: dict[str, Any] | None = None
        self.choices: dict[int, _Choice] = {}
        self.usage: dict[str, Any] | None = None
        self.content_chunks = 0
        self.done = False  # `data: [DONE]` seen
        self.failed = False  # an error event, or a chunk that is not JSON

    def add(self, chunk: dict[str, Any], count: bool = True) -> bool:
        """Take one chunk; True when it carries generated content (counted unless `count` is
        False: a guarded chunk, whose upstream form was counted)."""
        if "error" in chunk:
            self.failed = True
            return False
        self.first = self.first or chunk
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        content = False
        for raw in chunk.get("choices") or ():
            choice = self.choices.setdefault(int(raw.get("index", 0)), _Choice())
            content = self._add_choice(choice, raw) or content
        self.content_chunks += content and count
        return content

    def count(self, chunk: dict[str, Any]) -> bool:
        """Count a chunk as it came (before a guard rewrites it); True when it carries content."""
        content = any(isinstance(raw, dict) and _carries(raw) for raw in chunk.get("choices") or ())
        self.content_chunks += content
        return content

    @staticmethod
    def _add_choice(choice: _Choice, raw: dict[str, Any]) -> bool:
        delta = raw.get("delta")
        text = (delta or {}).get("content") if delta is not None else raw.get("text")
        if text:
            choice.text.append(text)
        for call in (delta or {}).get("tool_calls") or ():
            whole = choice.calls.setdefault(int(call.get("index", 0)), {"type": "function", "function": {}})
            whole["id"] = call.get("id") or whole.get("id")
            function = call.get("function") or {}
            whole["function"]["name"] = function.get("name") or whole["function"].get("name")
            whole["function"]["arguments"] = whole["function"].get("arguments", "") + (function.get("arguments") or "")
        logprobs = raw.get("logprobs")
        if isinstance(logprobs, dict) and delta is not None:
            choice.logprobs.extend(logprobs.get("content") or ())
        elif isinstance(logprobs, dict):
            for name, values in logprobs.items():
                choice.completion_logprobs.setdefault(name, []).extend(values or ())
        choice.finish_reason = raw.get("finish_reason") or choice.finish_reason
        return bool(text or (delta or {}).get("tool_calls"))

    @property
    def complete(self) -> bool:
        return self.done and not self.failed and bool(self.choices) and all(
            c.finish_reason for c in self.choices.values())

    def chat(self, usage: dict[str, int]) -> dict[str, Any]:
        assert self.first is not None
        choices = []
        for index, c in sorted(self.choices.items()):
            calls = [c.calls[i] for i in sorted(c.calls)] or None
            message = {"role": "assistant", "content": "".join(c.text) if c.text or not calls else None,
                       "tool_calls": calls}
            choices.append({"index": index, "message": message, "finish_reason": c.finish_reason,
                            "logprobs": {"content": c.logprobs} if c.logprobs else None})
        return {**self._head("chat.completion"), "choices": choices, "usage": usage}

    def completion(self, usage: dict[str, int]) -> dict[str, Any]:
        choices = [{"index": index, "text": "".join(c.text), "finish_reason": c.finish_reason,
                    "logprobs": c.completion_logprobs or None} for index, c in sorted(self.choices.items())]
        return {**self._head("text_completion"), "choices": choices, "usage": usage}

    def _head(self, kind: str) -> dict[str, Any]:
        assert self.first is not None
        return {"id": self.first.get("id", ""), "object": kind, "created": self.first.get("created", 0),
                "model": self.first.get("model", "")}


def _carries(raw: dict[str, Any]) -> bool:
    """Whether a chunk's choice carries generated content."""
    delta = raw.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("tool_calls"))
    return bool(raw.get("text"))


class RemoteAnswer(Generic[AnswerT]):
    """One forwarded request's answer, watched: usage, latency, in-flight, the cache's copy.
    `on_end` runs once the answer has been passed on (a stream's charge settles there)."""

    def __init__(self, model: str, answer_type: type[AnswerT], prompt_estimate: int,
                 on_done: OnDone[AnswerT] | None = None, on_end: Callable[[], None] | None = None,
                 guard: RelayGuard | None = None, readings: Readings | None = None) -> None:
        self.model, self.answer_type = model, answer_type
        self.guard = guard
        self.prompt_estimate = prompt_estimate
        self.on_done, self.on_end = on_done, on_end
        self.trace = current_trace()
        self.meter = Meter(model, readings)
        self.meter.begin()
        self.joined = _Joined()
        self._counted = False
        self._ended = False

    async def whole(self, status: int, body: bytes) -> bytes:
        """A whole answer (or an error the upstream answered with), as it may be passed on."""
        try:
            if status != 200:
                return body
            self.meter.token()
            data = orjson.loads(body)
            if self.guard is not None:
                data = await self.guard.answer(data)
                body = orjson.dumps(data)
            usage = data.get("usage") or {} if isinstance(data, dict) else {}
            if self.trace is not None and isinstance(data, dict):
                self.trace.finished(c.get("finish_reason") for c in data.get("choices") or () if isinstance(c, dict))
            self.meter.count(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
            if self.on_done is not None:
                await self._store(data)
        except orjson.JSONDecodeError:
            log.warning("upstream_answer_unreadable", model=self.model)
            if self.guard is not None:  # what cannot be read cannot be checked
                raise BadGateway(f"The model '{self.model}' answered with what is not JSON") from None
        finally:
            self.end()
        return body

    async def events(self, events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """The same for a stream already cut into events (one event's lines each); with a guard,
        the events as it rewrites them."""
        try:
            async for event in events:
                if self.guard is None:
                    self.event(event)
                    yield event
                elif (guarded := await self.guarded(event, self.guard)) is not None:
                    yield guarded
            await self._stream_ended()
        except BaseException:  # cut short (its client gone, its upstream failed) once it generated: that is its usage
            if not self._counted and self.meter.first_at is not None:
                self._count(self.prompt_estimate, self.joined.content_chunks)
            raise
        finally:
            self.end()

    async def guarded(self, event: bytes, guard: RelayGuard) -> bytes | None:
        """One event read, then guarded and written again (None: nothing of it to pass on). Data
        that is not JSON is not passed on: it cannot be checked."""
        every = event.split(b"\n")
        lines = [line for line in every if not line.startswith(b"data:")]
        data_lines, kept = len(every) - len(lines), 0  # JSON that is no object counts too (payloads skips it)
        for chunk in sse_wire.payloads(event):
            if chunk == sse_wire.DONE_MARK:
                self.joined.done = True
                lines.append(b"data: [DONE]")
                kept += 1
            elif isinstance(chunk, str):
                self.joined.failed = True
            else:
                if self.joined.count(chunk):
                    self.meter.token()
                guarded = await guard.chunk(chunk)
                if guarded is not None:
                    self.joined.add(guarded, count=False)
                    lines.append(sse_wire.data_line(guarded))
                    kept += 1
        return b"\n".join(lines) if kept or not data_lines else None

    def event(self, event: bytes) -> None:
        for chunk in sse_wire.payloads(event):
            if chunk == sse_wire.DONE_MARK:
                self.joined.done = True
            elif isinstance(chunk, str):
                self.joined.failed = True
            elif self.joined.add(chunk):
                self.meter.token()

    async def _stream_ended(self) -> None:
        joined = self.joined
        usage = joined.usage or {}
        if self.trace is not None:
            self.trace.finished(joined.choices[index].finish_reason for index in sorted(joined.choices))
        prompt = int(usage.get("prompt_tokens") or self.prompt_estimate)
        completion = int(usage.get("completion_tokens") or joined.content_chunks)
        self._count(prompt, completion)
        if self.on_done is None or not joined.complete:
            return
        totals = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.answer_type is ChatCompletion:
            await self._store(joined.chat(totals))
        elif self.answer_type is Completion:
            await self._store(joined.completion(totals))

    def _count(self, prompt: int, completion: int) -> None:
        self._counted = True
        self.meter.count(prompt, completion)

    async def _store(self, data: object) -> None:
        assert self.on_done is not None
        try:
            answer = self.answer_type.model_validate(data)
        except ValidationError as exc:
            log.warning("upstream_answer_not_cached", model=self.model, error=str(exc.errors()[0]["msg"]))
            return
        await self.on_done(answer)

    def end(self) -> None:
        """The answer is passed on (or failed): out of the in-flight gauge, `on_end` run; once."""
        if self._ended:
            return
        self._ended = True
        self.meter.end()
        if self.on_end is not None:
            self.on_end()
