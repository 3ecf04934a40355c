"""The gateway on an instant test-double engine: what the gateway itself costs, with no model.

    python -m benchmarks.echo_engine --port 8100 [--token-delay 0] [--lag-probe]

`EchoEngine` implements `engine.types.Engine`: its tokenizer is one token per whitespace-separated
word, and it answers `max_tokens` tokens at once (one output per token, echoing the prompt's words),
so a load test against it measures routing, validation, prompt rendering, SSE framing, logging and
metrics: everything but the model. No vllm import.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/echo_engine.py`: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.types import ChoiceDelta, GenerationOutput, GenerationRequest, ModelInfo

VOCAB_SIZE = 1 << 20
NAME = "echo"


class WordTokenizer:
    """One token per whitespace-separated word; ids are stable hashes, decoding remembers words."""

    takes_tools = False

    def __init__(self, max_words: int = 200_000) -> None:
        self._words: dict[int, str] = {}
        self._ids: dict[str, int] = {}  # words seen, so that encoding is a dict lookup (a real tokenizer is Rust)
        self._max_words = max_words

    def _id(self, word: str) -> int:
        token_id = 16 + zlib.crc32(word.encode()) % (VOCAB_SIZE - 16)
        if len(self._words) < self._max_words:
            self._words.setdefault(token_id, word)
            self._ids[word] = token_id
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._ids
        return [ids[w] if w in ids else self._id(w) for w in text.split()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(self._words.get(t, f"w{t}") for t in token_ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        parts = []
        for message in messages:
            content = message.get("content") or ""
            if isinstance(content, list):  # content parts
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role', 'user')}> {content}")
        return " ".join(parts) + (" <assistant>" if add_generation_prompt else "")


class EchoEngine:
    """An `engine.types.Engine` that answers at once: `max_tokens` outputs of one token each."""

    def __init__(self, name: str = NAME, max_model_len: int = 1 << 16, token_delay: float = 0.0) -> None:
        self._info = ModelInfo(
            name=name, max_model_len=max_model_len, root="echo", created=int(time.time()),
            extra={"vocab_size": VOCAB_SIZE},
        )
        self._tokenizer = WordTokenizer()
        self.token_delay = token_delay
        self.requests = 0

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> WordTokenizer:
        return self._tokenizer

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        self.requests += 1
        n = request.sampling.n
        prompt = request.prompt_token_ids or [16]
        prompt_tokens = len(request.prompt_token_ids)
        total = max(1, request.sampling.max_tokens)
        words = self._tokenizer.decode(prompt[:total]).split() or ["echo"]  # only the words it echoes
        for step in range(total):  # kept lean: the engine's own cost is not what the gateway's benchmarks measure
            await asyncio.sleep(self.token_delay)  # a real engine yields to the loop between outputs
            last = step == total - 1
            word = words[step % len(words)]
            text = word if step == 0 else " " + word
            token_ids = [prompt[step % len(prompt)]]
            finish = "length" if last else None
            if n == 1:
                choices = [ChoiceDelta(0, text, token_ids, finish)]
            else:
                choices = [ChoiceDelta(i, text, token_ids, finish) for i in range(n)]
            yield GenerationOutput(prompt_tokens, choices, last)

    async def abort(self, request_id: str) -> None:
        return None

    async def check_health(self) -> None:
        return None

    async def shutdown(self) -> None:
        return None


def create_echo_app(settings: Any = None, engine: EchoEngine | None = None) -> Any:
    """The real gateway app (`gateway.app.create_app`) serving the echo engine.

    Works with both factory shapes the gateway has had: `engine_starter(engine_settings) -> Engine`
    (the served name comes from `settings.engine.served_model_name`) and
    `engine_factory(settings) -> {name: Engine}`.
    """
    import inspect

    from gateway.app import create_app
    from gateway.settings import Settings

    engine = engine or EchoEngine()
    settings = settings or Settings(warmup=False)
    if getattr(settings, "engine", None) is not None and hasattr(settings.engine, "served_model_name"):
        settings = settings.model_copy(
            update={"engine": settings.engine.model_copy(update={"served_model_name": engine.info.name})}
        )
    parameters = inspect.signature(create_app).parameters
    if "engine_starter" in parameters:
        return create_app(settings, engine_starter=lambda engine_settings: engine)
    return create_app(settings, engine_factory=lambda s: {engine.info.name: engine})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The gateway on an instant echo engine (no model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--name", default=NAME, help="served model name")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds between output tokens")
    p.add_argument("--lag-probe", action="store_true", help="measure the event loop's lag: GET /_bench/lag (benchmarks.lag_probe)")
    args = p.parse_args(argv)

    import uvicorn

    from gateway.settings import Settings

    settings = Settings(warmup=False, host=args.host, port=args.port)  # other settings from GATEWAY_*
    from gateway.telemetry.logs import configure

    configure(settings.log_level, settings.log_format)
    app = create_echo_app(settings, EchoEngine(args.name, token_delay=args.token_delay))
    if args.lag_probe:
        from benchmarks.lag_probe import LagProbe

        app = LagProbe(app)
    from gateway.server.http import server_config

    # served as the gateway serves (`python -m gateway serve`): its HTTP protocol (header timeout and
    # bound, malformed requests answered in the API's shape), connection cap and keep-alive
    uvicorn.Server(server_config(app, settings)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
