"""The one test double of the engine, for the unit tests and the benchmarks (`python -m
benchmarks.echo_engine` serves it): deterministic, instant, and it records what it was asked.

It "tokenizes" by whitespace-separated words over a growing vocabulary and answers by echoing
words of a fixed reply, one token per output, so tests can predict every chunk. Its records are
bounded (`Recent`), so a benchmark's soak of 100,000 requests does not grow it.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.config import SamplingDefaults
from engine.errors import EngineInvalidRequest, EngineUnavailable
from engine.types import (
    AdapterLoad,
    ChatPrompt,
    ChoiceDelta,
    Embeddings,
    EmbedRequest,
    EngineLoad,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    Task,
    TokenLogprob,
    Verdict,
)

REPLY = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
EMBEDDING_SIZE = 8
KEEP = 10_000  # requests, aborts and finishes remembered


class Recent(list):  # type: ignore[type-arg]
    """A list that forgets its older half past 2 x KEEP items (compares equal to a plain list)."""

    def append(self, item: Any) -> None:
        super().append(item)
        if len(self) > 2 * KEEP:
            del self[:KEEP]


class FakeTokenizer:
    def __init__(self) -> None:
        self.takes_tools = False
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.vocab) + 10
            self.words[self.vocab[word]] = word
        return self.vocab[word]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self._id(w) for w in text.split()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self.words.get(t, "?") for t in token_ids)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encode(text, add_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> str:
        text = " ".join(f"<{m['role']}> {m['content']}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any) -> ChatPrompt:
        text = self.render_chat(messages, add_generation_prompt, **kw)
        return ChatPrompt(text, self.encode(text, add_special_tokens=False))


class FakeEngine:
    def __init__(
        self, name: str = "fake-model", max_model_len: int = 64, delay: float = 0.0, task: Task = "generate",
        matryoshka: bool = False, defaults: SamplingDefaults | None = None, vocab_size: int | None = None,
        max_loras: int | None = None,
    ) -> None:
        """`defaults`: the sampling defaults the model reports (vLLM: its generation config with the
        models file's `defaults` over it). `max_loras`: LoRA on (None: off); a request naming an
        adapter gets the reply's words prefixed with the adapter's name (`name:the`)."""
        self.max_loras = max_loras
        self.adapters: dict[str, str] = {}  # loaded: name → path
        self.adapter_calls: list[tuple[str, str]] = []  # ("load" | "unload", name), in order
        size = EMBEDDING_SIZE if task == "embed" else None
        extra = {"vocab_size": vocab_size} if vocab_size else {}
        self._info = ModelInfo(name=name, max_model_len=max_model_len, root="fake", created=1, task=task,
                               embedding_size=size, matryoshka=matryoshka, extra=extra,
                               sampling_defaults=defaults or SamplingDefaults())
        self.embedded: list[EmbedRequest] = Recent()
        self._tokenizer = FakeTokenizer()
        self.delay = delay
        self.requests: list[GenerationRequest] = Recent()
        self.running: set[str] = set()
        self.aborted: list[str] = Recent()
        self.finished: list[str] = Recent()
        self.dead = False
        self.fail_after: int | None = None  # raise after this many outputs
        self.reply: list[str] | None = None  # pieces to answer with instead of REPLY; then "stop"
        self.alternatives: dict[int, list[str]] = {}  # a reply's step → the other tokens its top logprobs name
        # what `load()` reports: the requests running are its own, the rest as a test sets them
        self.scheduler = EngineLoad(block_size=16, num_blocks=1000)
        self.last_finish = "stop"  # the engine's finish reason of a scripted reply's last piece ("error": vLLM's failure)
        self.prompt_alternatives: dict[int, list[str]] = {}  # a prompt token's place → what the model weighed there

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> FakeTokenizer:
        return self._tokenizer

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        if self.dead:
            raise EngineUnavailable("the fake engine is dead")
        if request.adapter is not None and request.adapter not in self.adapters:
            raise EngineInvalidRequest(f"the adapter '{request.adapter}' is not loaded", "model")
        self.requests.append(request)
        self.running.add(request.request_id)
        sampling = request.sampling
        if self.reply is not None:
            async for output in self._scripted(request):
                yield output
            return
        try:
            for step in range(sampling.max_tokens):
                if self.fail_after is not None and step >= self.fail_after:
                    raise RuntimeError("fake engine failure")
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await asyncio.sleep(0)
                last = step == sampling.max_tokens - 1
                word = REPLY[step % len(REPLY)]
                word = word if request.adapter is None else f"{request.adapter}:{word}"
                text = word if step == 0 else " " + word
                logprobs = None
                if sampling.logprobs is not None:
                    top = tuple((100 + k, f"alt{k}", -1.0 - k) for k in range(sampling.logprobs))
                    logprobs = (TokenLogprob(1000 + step, text, -0.5, 1, top),)
                choices = [
                    ChoiceDelta(i, text, [1000 + step], "length" if last else None, None, logprobs, -float(i * (step + 1)))
                    for i in range(sampling.n)
                ]
                yield GenerationOutput(len(request.prompt_token_ids), choices, finished=last)
            self.finished.append(request.request_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request.request_id)
            raise
        finally:
            self.running.discard(request.request_id)

    async def _scripted(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        """The reply's pieces, up to a piece that is one of the stop strings (vLLM's stop_reason)."""
        pieces = self.reply or [""]
        stop = next((p for p in pieces if p in request.sampling.stop), None)
        pieces = pieces[: pieces.index(stop) + 1] if stop is not None else pieces
        prompt_logprobs = self._prompt_logprobs(request)
        for step, piece in enumerate(pieces):
            await asyncio.sleep(0)
            last = step == len(pieces) - 1
            text = "" if piece == stop else piece
            logprobs = None
            if request.sampling.logprobs is not None:  # the piece is one token, its alternatives after it
                top = ((2000 + step, text, -0.5), *((3000 + k, alt, -2.0) for k, alt in enumerate(self.alternatives.get(step, []))))
                logprobs = (TokenLogprob(2000 + step, text, -0.5, 1, top[: request.sampling.logprobs]),)
            tokens = [] if last and not text and self.last_finish == "error" else [2000 + step]
            choices = [ChoiceDelta(i, text, tokens, self.last_finish if last else None, stop if last else None, logprobs)
                       for i in range(request.sampling.n)]
            yield GenerationOutput(len(request.prompt_token_ids), choices, finished=last,
                                   prompt_logprobs=prompt_logprobs if step == 0 else None)
        self.finished.append(request.request_id)

    def _prompt_logprobs(self, request: GenerationRequest) -> tuple[TokenLogprob | None, ...] | None:
        """vLLM's prompt logprobs: none for the first token, then each token with what the model
        weighed in its place (`prompt_alternatives`)."""
        if request.sampling.prompt_logprobs is None:
            return None
        ids = request.prompt_token_ids
        return (None, *(TokenLogprob(i, self._tokenizer.decode([i]), -1.0, 1, tuple(
            (4000 + k, alt, -2.0) for k, alt in enumerate(self.prompt_alternatives.get(place, [])))) for place, i in
            enumerate(ids) if place > 0))

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """Per input a unit vector that depends on its token ids only (shortened and re-normalised to
        `dimensions`, as a Matryoshka model's)."""
        if self.dead:
            raise EngineUnavailable("the fake engine is dead")
        self.embedded.append(request)
        await asyncio.sleep(self.delay)
        vectors: list[list[float] | str] = []
        for ids in request.inputs:
            vector = [sum(math.sin(t * (k + 1)) for t in ids) for k in range(EMBEDDING_SIZE)][: request.dimensions or EMBEDDING_SIZE]
            norm = math.sqrt(sum(v * v for v in vector)) or 1.0
            vectors.append([v / norm for v in vector])
        return Embeddings(vectors, sum(len(ids) for ids in request.inputs))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    @property
    def healthy(self) -> bool:
        return not self.dead

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(len(self.running), s.waiting, s.kv_cache_usage, s.block_size, s.num_blocks, s.max_lora,
                          s.running_lora_adapters, s.waiting_lora_adapters, s.request_s, s.batch)

    async def check_health(self) -> None:
        if self.dead:
            raise EngineUnavailable("the fake engine is dead")

    async def load_adapter(self, name: str, path: str) -> None:
        """As the vLLM engine: checks the directory (`engine.adapters.read`), refuses a second load."""
        from engine.adapters import AdapterError, read

        if self.max_loras is None:
            raise EngineInvalidRequest(f"the model '{self._info.name}' serves no adapters: its engine runs without LoRA")
        if name in self.adapters:
            raise EngineInvalidRequest(f"the adapter '{name}' is already loaded")
        try:
            read(path)
        except AdapterError as exc:
            raise EngineInvalidRequest(f"the adapter '{name}': {exc}") from exc
        self.adapters[name] = path
        self.adapter_calls.append(("load", name))

    async def unload_adapter(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise EngineInvalidRequest(f"the adapter '{name}' is not loaded")
        self.adapter_calls.append(("unload", name))

    def adapter_load(self) -> AdapterLoad | None:
        if self.max_loras is None:
            return None
        running: dict[str, int] = {}
        for request in self.requests:
            if request.request_id in self.running and request.adapter is not None:
                running[request.adapter] = running.get(request.adapter, 0) + 1
        return AdapterLoad(self.max_loras, running, {}, time.time())

    async def shutdown(self) -> None:
        pass


class HeldEngine(FakeEngine):
    """The fake engine holding every generation before its first token until `go` is set: the
    requests it was given stay running exactly as long as the test says, whatever the machine's speed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.go = asyncio.Event()
        self.held: list[str] = []  # every request it was given (each held until `go`)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        self.held.append(request.request_id)
        self.running.add(request.request_id)  # running, as in vLLM, while held
        try:
            await self.go.wait()
        except BaseException:
            self.running.discard(request.request_id)
            raise
        async for output in super().generate(request):
            yield output


class HeldAfter(FakeEngine):
    """Answers the first `answered` requests; holds every later one until it is cancelled (noted in `aborted`):
    however slow the machine, a cancel or a shutdown finds lines in flight and lines not run."""

    def __init__(self, answered: int) -> None:
        super().__init__()
        self.answered, self.started = answered, 0

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        self.started += 1
        if self.started > self.answered:
            try:
                await asyncio.Event().wait()
            finally:
                self.aborted.append(request.request_id)
        async for output in super().generate(request):
            yield output


class FakeGrammar:
    """A grammar compiler (`engine.types.GrammarCheck`): refuses specs holding one of `refuse`'s
    keys (with its message), takes `delay` seconds (forever for specs holding `hang`), and notes
    what it was asked and what was cancelled."""

    def __init__(self) -> None:
        self.refuse: dict[str, str] = {}
        self.hang = "\0never"
        self.delay = 0.0
        self.checked: list[str] = []
        self.cancelled: list[str] = []
        self.closed = False

    async def check(self, kind: str, spec: str, any_whitespace: bool, timeout_s: float) -> Verdict:
        self.checked.append(spec)
        try:
            if self.hang in spec:
                await asyncio.sleep(timeout_s)
                return Verdict(f"it did not compile within {timeout_s:g} s", timeout_s, timed_out=True)
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled.append(spec)
            raise
        error = next((why for key, why in self.refuse.items() if key in spec), None)
        return Verdict(error)

    async def close(self) -> None:
        self.closed = True


@functools.cache
def _files_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="gateway-files-")


def fake_settings(**overrides: Any):
    """Settings for unit tests: the fake engine's name, no warm-up, no cache unless asked, no heap
    freezing (a full collection per app start-up is seconds over a suite)."""
    import tempfile

    from engine.config import EngineSettings
    from gateway.settings import Settings

    values: dict[str, Any] = {"warmup": False, "freeze_startup_heap": False, "engine": EngineSettings(served_model_name="fake-model")}
    values.setdefault("cache", {"backend": "off"})
    values.setdefault("files", {"dir": _files_dir()})  # never the home directory's
    values.setdefault("batches", {"dir": tempfile.mkdtemp(prefix="gateway-batches-")})  # each app its own
    return Settings(**{**values, **overrides})


HELLO = [{"role": "user", "content": "hi"}]


def chat_body(model: str = "fake-model", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": HELLO, "max_tokens": 3, **extra}


def app_with(engine: FakeEngine | None = None, **settings: Any) -> Any:
    """The app on a fake engine (one, whatever the models file says) with these settings."""
    from gateway.app import create_app

    engine = engine or FakeEngine()
    return create_app(fake_settings(**settings), engine_starter=lambda es: engine)
