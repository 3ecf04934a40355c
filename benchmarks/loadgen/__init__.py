"""A load generator for any OpenAI-compatible server (this gateway, vLLM's server, others).

    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000/v1 --concurrency 1 4 16 64 \
        --num-requests 64 --input-tokens 128 --output-tokens 64 --ignore-eos

Load: a fixed number of requests in flight (`--concurrency`, several levels make a sweep), or
Poisson arrivals at `--request-rate` requests per second (with `--concurrency` as a cap). Every run
stops by itself: after `--num-requests` requests or `--duration` seconds, whichever comes first.

Prompts (`--prompts`): `random` (random words fitted to `--input-tokens` tokens with the server's
`/tokenize` when it has one, else one word per token), `shared-prefix` (a long common prefix of
`--prefix-tokens` and a short unique part: prefix caching at work), `multi-turn` (chats of
`--turns` turns, each turn carrying the whole conversation so far).

Per request: time to first token (TTFT), time per output token after the first (TPOT = (e2e -
TTFT) / (output tokens - 1)), inter-token latencies (between stream chunks that carry text), end
to end latency. Output tokens come from the usage the server reports (`stream_options:
{"include_usage": true}`), else from the number of chunks carrying text.

Importable: `await run_load(LoadConfig(...)) -> Result`. No vllm import, no tokenizer needed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx

try:  # orjson is a dependency of the gateway; plain json works too
    import orjson

    def _loads(data: str | bytes) -> Any:
        return orjson.loads(data)

    def _dumps(obj: Any) -> bytes:
        return orjson.dumps(obj)

except ImportError:  # pragma: no cover

    def _loads(data: str | bytes) -> Any:
        return json.loads(data)

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()


RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"

# Common English words; with a BPE tokenizer each is about one token when preceded by a space.
_WORDS_TEXT = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy music market sense nation plan college
interest death experience effect use class control care field development role effort rate heart
drug show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player record
paper space ground form event official matter center couple site project activity star table need
court oil situation cost industry figure street image phone data picture practice piece land
product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population truth song
river garden green blue red small large early young important few public bad same able late hard
major better economic strong possible whole free military true federal international full special
easy clear recent certain personal open difficult available likely short single medical current
wrong private past foreign fine common poor natural significant similar hot dead central happy
serious ready simple left physical general environmental financial democratic dark various entire
close legal religious cold final main huge popular traditional cultural apple river mountain ocean
forest silver golden quiet rapid gentle ancient modern bright narrow wide deep shallow heavy light
soft
"""
WORDS = _WORDS_TEXT.split()


# ----------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    fraction = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


@dataclass
class Stats:
    """mean, p50, p90, p99, min, max of a list of seconds (NaN when empty)."""

    n: int = 0
    mean: float = math.nan
    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan
    min: float = math.nan
    max: float = math.nan

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        values = [v for v in values if v is not None and not math.isnan(v)]
        if not values:
            return cls()
        return cls(
            n=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            min=min(values),
            max=max(values),
        )

    def to_dict(self) -> dict[str, float | int | None]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in dataclasses.asdict(self).items()}


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
    if output_tokens is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


# ----------------------------------------------------------------------------------------------
# Server-Sent Events


class SSEDecoder:
    """Turns lines of a `text/event-stream` into the data of each event (WHATWG rules, data only)."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Feed one line without its newline; return the event's data when a blank line ends it."""
        line = line.removesuffix("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):  # a comment (keep-alive)
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        if not self._data:
            return None
        data = "\n".join(self._data)
        self._data = []
        return data


async def sse_events(lines: AsyncIterable[str]) -> AsyncIterator[str]:
    decoder = SSEDecoder()
    async for line in lines:
        data = decoder.feed(line)
        if data is not None:
            yield data
    tail = decoder.flush()
    if tail is not None:
        yield tail


def _piece_of(choice: dict[str, Any]) -> str:
    """The text a streamed choice carries (completions: text; chat: delta content/reasoning/tools)."""
    text = choice.get("text")
    if text:
        return text
    delta = choice.get("delta")
    if not delta:
        return ""
    content = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    if content:
        return content
    if delta.get("tool_calls"):
        return json.dumps(delta["tool_calls"])
    return ""


class StreamAccumulator:
    """Follows one streamed response: when text arrives, what it says, the usage at the end."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.first: float | None = None
        self.last: float | None = None
        self.itl: list[float] = []
        self.chunks = 0
        self.pieces: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.error: str | None = None
        self.done = False
        self.finish_reason: str | None = None

    def feed(self, data: str, now: float) -> bool:
        """Take one event's data; return True at `[DONE]`."""
        if data.strip() == "[DONE]":
            self.done = True
            return True
        try:
            obj = _loads(data)
        except ValueError:
            self.error = f"undecodable event: {data[:120]!r}"
            return False
        if not isinstance(obj, dict):
            return False
        if obj.get("error"):
            err = obj["error"]
            self.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        text = ""
        for choice in obj.get("choices") or ():
            piece = _piece_of(choice)
            if piece:
                text += piece
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        if text:
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - self.last)  # type: ignore[operator]
            self.last = now
            self.chunks += 1
            self.pieces.append(text)
        return False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


# ----------------------------------------------------------------------------------------------
# Configuration, prompts


@dataclass
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first of GET /models
    endpoint: Literal["chat", "completions"] = "chat"
    concurrency: int | None = 8  # requests in flight; with request_rate: a cap (None: no cap)
    request_rate: float | None = None  # Poisson arrivals per second (None: as fast as concurrency allows)
    num_requests: int = 64
    duration_s: float | None = 300.0  # hard time limit of the measured run
    prompts: Literal["random", "shared-prefix", "multi-turn"] = "random"
    input_tokens: int = 128
    output_tokens: int = 64
    prefix_tokens: int = 512  # shared-prefix: length of the common prefix
    num_prefixes: int = 1  # shared-prefix: how many distinct prefixes
    turns: int = 4  # multi-turn: user turns per conversation
    unique_prompts: int | None = None  # cycle through this many prompts (None: every one new)
    ignore_eos: bool = False  # vLLM's extension: always generate output_tokens tokens
    temperature: float | None = 0.0  # None: the server's default
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    count_headers: list[str] = field(default_factory=lambda: ["x-cache"])
    tokenizer: Literal["auto", "server", "words"] = "auto"
    seed: int = 0
    warmup_requests: int = 0  # sent before the measured run, with their own prompts, not counted
    request_timeout_s: float = 600.0
    progress: bool = False
    keep_records: bool = False  # put every request's record in Result.to_dict()
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data.get("api_key"):
            data["api_key"] = "***"
        return data


@dataclass
class Session:
    """What one worker sends: one request per user turn (several for multi-turn chats)."""

    turns: list[str]
    system: str | None = None  # shared-prefix: the common prefix
    input_tokens: int = 0  # estimate of the first request's prompt tokens (without a chat template)


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /tokenize and /health live)."""
    base = base_url.rstrip("/")
    return base.removesuffix("/v1")


class ServerTokenizer:
    """Counts tokens with the server's own tokenizer (`POST /tokenize`, `POST /detokenize`)."""

    def __init__(self, client: httpx.AsyncClient, root: str, model: str) -> None:
        self.client, self.root, self.model = client, root, model

    async def tokenize(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = await self.client.post(f"{self.root}/tokenize", json=body)
        response.raise_for_status()
        return list(response.json()["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        response = await self.client.post(f"{self.root}/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return response.json()["prompt"]

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, base_url: str, model: str) -> ServerTokenizer | None:
        tokenizer = cls(client, root_url(base_url), model)
        try:
            ids = await tokenizer.tokenize("hello world")
            await tokenizer.detokenize(ids)
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            return None
        return tokenizer


async def fit_text(rng: random.Random, n_tokens: int, tokenizer: ServerTokenizer | None) -> tuple[str, int]:
    """Random words making `n_tokens` tokens (exactly, when the server can count; else 1 word = 1 token)."""
    words = [rng.choice(WORDS) for _ in range(max(n_tokens, 0))]
    text = " ".join(words)
    if tokenizer is None or n_tokens <= 0:
        return text, n_tokens
    count = -1
    for _ in range(6):
        ids = await tokenizer.tokenize(text)
        count = len(ids)
        if count == n_tokens:
            break
        if count > n_tokens:
            text = await tokenizer.detokenize(ids[:n_tokens])
        else:
            text = text + " " + " ".join(rng.choice(WORDS) for _ in range(n_tokens - count))
    return text, count


async def build_sessions(
    config: LoadConfig,
    count: int,
    tokenizer: ServerTokenizer | None,
    seed: int | None = None,
) -> list[Session]:
    """`count` sessions of the configured prompt set, deterministic for a seed."""
    rng = random.Random(config.seed if seed is None else seed)
    prefixes: list[tuple[str, int]] = []
    if config.prompts == "shared-prefix":
        for _ in range(max(1, config.num_prefixes)):
            prefixes.append(await fit_text(rng, config.prefix_tokens, tokenizer))
    turns = config.turns if config.prompts == "multi-turn" else 1
    # one seed per text, drawn up front, so texts can be fitted concurrently and stay deterministic
    seeds = [[rng.getrandbits(64) for _ in range(turns)] for _ in range(count)]
    picks = [rng.randrange(len(prefixes)) if prefixes else 0 for _ in range(count)]
    semaphore = asyncio.Semaphore(16)

    async def one(text_seed: int) -> tuple[str, int]:
        async with semaphore:
            return await fit_text(random.Random(text_seed), config.input_tokens, tokenizer)

    texts = await asyncio.gather(*(one(s) for row in seeds for s in row))
    sessions = []
    for i in range(count):
        row = texts[i * turns : (i + 1) * turns]
        system, prefix_len = prefixes[picks[i]] if prefixes else (None, 0)
        sessions.append(Session([t for t, _ in row], system, prefix_len + row[0][1]))
    return sessions


def request_body(config: LoadConfig, model: str, session: Session, history: list[tuple[str, str]], turn: str) -> dict[str, Any]:
    """The JSON body of one request: the session's turn after the conversation so far."""
    body: dict[str, Any] = {"model": model, "max_tokens": config.output_tokens, "stream": config.stream}
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    if config.endpoint == "chat":
        messages: list[dict[str, str]] = []
        if session.system:
            messages.append({"role": "system", "content": session.system})
        for user, assistant in history:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        messages.append({"role": "user", "content": turn})
        body["messages"] = messages
    else:
        parts = [session.system] if session.system else []
        for user, assistant in history:
            parts += [user, assistant]
        parts.append(turn)
        body["prompt"] = "\n".join(parts)
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


# ----------------------------------------------------------------------------------------------
# Requests


@dataclass
class RequestRecord:
    start: float = 0.0  # seconds since the run started
    ok: bool = False
    cancelled: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int | None = None
    chunks: int = 0
    usage_reported: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.chunks == 0:
            return None
        return tpot(self.e2e, self.ttft, self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("text")
        data["tpot"] = self.tpot
        return data


def _apply_usage(record: RequestRecord, usage: dict[str, Any] | None, fallback_output: int, estimate_input: int) -> None:
    if usage:
        record.usage_reported = True
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.input_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
    else:
        record.output_tokens = fallback_output
        record.input_tokens = estimate_input


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    *,
    count_headers: Sequence[str] = (),
    estimate_input: int = 0,
    origin: float = 0.0,
) -> RequestRecord:
    """Send one request and fill `record` (also when cancelled: then `cancelled` is True)."""
    started = time.perf_counter()
    record.start = started - origin
    content = _dumps(body)
    headers = {"content-type": "application/json"}
    try:
        if body.get("stream"):
            async with client.stream("POST", url, content=content, headers=headers) as response:
                record.status = response.status_code
                record.headers = {h: response.headers[h] for h in count_headers if h in response.headers}
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {detail[:200]}"
                    return record
                acc = StreamAccumulator(started)
                async for data in sse_events(response.aiter_lines()):
                    if acc.feed(data, time.perf_counter()):
                        break
            ended = time.perf_counter()
            record.e2e = ended - started
            record.chunks = acc.chunks
            record.itl = acc.itl
            record.text = acc.text
            record.ttft = (acc.first - started) if acc.first is not None else record.e2e
            _apply_usage(record, acc.usage, acc.chunks, estimate_input)
            if acc.error:
                record.error = acc.error
            elif not acc.done:
                record.error = "stream ended without [DONE]"
            else:
                record.ok = True
        else:
            response = await client.post(url, content=content, headers=headers)
            ended = time.perf_counter()
            record.status = response.status_code
            record.headers = {h: response.headers[h] for h in count_headers if h in response.headers}
            record.e2e = record.ttft = ended - started
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return record
            obj = response.json()
            choices = obj.get("choices") or []
            record.text = "".join(
                (c.get("text") or (c.get("message") or {}).get("content") or "") for c in choices
            )
            _apply_usage(record, obj.get("usage"), 1 if record.text else 0, estimate_input)
            record.ok = True
    except asyncio.CancelledError:
        record.cancelled = True
        record.e2e = time.perf_counter() - started
        raise
    except (httpx.HTTPError, OSError, ValueError) as exc:
        record.e2e = time.perf_counter() - started
        record.error = f"{exc.__class__.__name__}: {exc}"[:300] or exc.__class__.__name__
    return record


# ----------------------------------------------------------------------------------------------
# Results


@dataclass
class Result:
    label: str
    concurrency: int | None
    request_rate: float | None
    duration_s: float
    completed: int
    failed: int
    cancelled: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens of completed requests per second
    input_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    mean_input_tokens: float
    mean_output_tokens: float
    mean_cached_tokens: float | None
    usage_reported: bool
    errors: dict[str, int]
    header_counts: dict[str, dict[str, int]]
    config: dict[str, Any] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)

    def to_dict(self, records: bool = False) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("records",)}
        for name in ("ttft", "tpot", "itl", "e2e"):
            data[name] = getattr(self, name).to_dict()
        if records:
            data["records"] = [r.to_dict() for r in self.records]
        return _clean(data)


def _clean(value: Any) -> Any:
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def aggregate(
    records: Sequence[RequestRecord],
    duration_s: float,
    *,
    label: str = "",
    concurrency: int | None = None,
    request_rate: float | None = None,
    config: dict[str, Any] | None = None,
    keep_records: bool = False,
) -> Result:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and not r.cancelled]
    cancelled = [r for r in records if r.cancelled]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    header_counts: dict[str, Counter[str]] = {}
    for r in records:
        for name, value in r.headers.items():
            header_counts.setdefault(name, Counter())[value] += 1
    return Result(
        label=label,
        concurrency=concurrency,
        request_rate=request_rate,
        duration_s=duration_s,
        completed=len(ok),
        failed=len(failed),
        cancelled=len(cancelled),
        total_input_tokens=in_tokens,
        total_output_tokens=out_tokens,
        request_throughput=len(ok) / duration,
        output_throughput=out_tokens / duration,
        input_throughput=in_tokens / duration,
        total_token_throughput=(in_tokens + out_tokens) / duration,
        ttft=Stats.of([r.ttft for r in ok if r.ttft is not None]),
        tpot=Stats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stats.of([x for r in ok for x in r.itl]),
        e2e=Stats.of([r.e2e for r in ok if r.e2e is not None]),
        mean_input_tokens=in_tokens / len(ok) if ok else math.nan,
        mean_output_tokens=out_tokens / len(ok) if ok else math.nan,
        mean_cached_tokens=(sum(cached) / len(cached)) if cached else None,
        usage_reported=bool(ok) and all(r.usage_reported for r in ok),
        errors=dict(Counter((r.error or "unknown error")[:200] for r in failed)),
        header_counts={k: dict(v) for k, v in header_counts.items()},
        config=config or {},
        records=list(records) if keep_records else [],
    )


# ----------------------------------------------------------------------------------------------
# Running


def make_client(config: LoadConfig, concurrency: int | None = None) -> httpx.AsyncClient:
    headers = dict(config.headers)
    if config.api_key:
        headers["authorization"] = f"Bearer {config.api_key}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=60)
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout)


async def discover_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url.rstrip('/')}/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return models[0]["id"]


async def get_tokenizer(config: LoadConfig, client: httpx.AsyncClient, model: str) -> ServerTokenizer | None:
    if config.tokenizer == "words":
        return None
    tokenizer = await ServerTokenizer.probe(client, config.base_url, model)
    if tokenizer is None and config.tokenizer == "server":
        raise RuntimeError(f"{root_url(config.base_url)}/tokenize is not available")
    return tokenizer


def sessions_needed(config: LoadConfig) -> int:
    turns = config.turns if config.prompts == "multi-turn" else 1
    wanted = math.ceil(config.num_requests / turns)
    if config.unique_prompts:
        wanted = min(wanted, config.unique_prompts)
    return max(wanted, 1)


class _Runner:
    def __init__(self, config: LoadConfig, client: httpx.AsyncClient, model: str, sessions: Sequence[Session]) -> None:
        self.config = config
        self.client = client
        self.model = model
        self.sessions = sessions
        self.url = f"{config.base_url.rstrip('/')}/{'chat/completions' if config.endpoint == 'chat' else 'completions'}"
        self.records: list[RequestRecord] = []
        self.issued = 0
        self.next_session = 0
        self.origin = 0.0
        self.deadline = math.inf
        self.last_end = 0.0
        self.bar: Any = None

    def _take_session(self) -> Session:
        session = self.sessions[self.next_session % len(self.sessions)]
        self.next_session += 1
        return session

    def _may_issue(self) -> bool:
        return self.issued < self.config.num_requests and time.perf_counter() < self.deadline

    async def run_session(self, session: Session) -> None:
        history: list[tuple[str, str]] = []
        for turn in session.turns:
            if not self._may_issue():
                return
            self.issued += 1
            body = request_body(self.config, self.model, session, history, turn)
            record = RequestRecord()
            self.records.append(record)
            estimate = session.input_tokens if not history else 0
            await send_request(
                self.client, self.url, body, record,
                count_headers=self.config.count_headers, estimate_input=estimate, origin=self.origin,
            )
            self.last_end = time.perf_counter()
            if self.bar is not None:
                self.bar.update(1)
            if not record.ok:
                return
            history.append((turn, record.text))

    async def worker(self) -> None:
        while self._may_issue():
            await self.run_session(self._take_session())

    async def arrivals(self, rng: random.Random) -> None:
        """Poisson arrivals of sessions, at most `concurrency` running (when set)."""
        limit = asyncio.Semaphore(self.config.concurrency) if self.config.concurrency else None
        tasks: set[asyncio.Task[None]] = set()

        async def start(session: Session) -> None:
            if limit is None:
                await self.run_session(session)
                return
            async with limit:
                await self.run_session(session)

        try:
            next_at = time.perf_counter()
            launched = 0
            turns = self.config.turns if self.config.prompts == "multi-turn" else 1
            while launched * turns < self.config.num_requests and time.perf_counter() < self.deadline:
                task = asyncio.create_task(start(self._take_session()))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                launched += 1
                next_at += rng.expovariate(self.config.request_rate)  # type: ignore[arg-type]
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> float:
        """Run until the count or the time limit; returns the measured duration in seconds."""
        cfg = self.config
        self.origin = time.perf_counter()
        self.deadline = self.origin + cfg.duration_s if cfg.duration_s else math.inf
        if cfg.request_rate:
            main = asyncio.ensure_future(self.arrivals(random.Random(cfg.seed + 1)))
        else:
            workers = max(1, cfg.concurrency or 1)
            main = asyncio.ensure_future(asyncio.gather(*(self.worker() for _ in range(workers))))
        timeout = None if self.deadline == math.inf else max(0.0, self.deadline - time.perf_counter())
        done, _ = await asyncio.wait({main}, timeout=timeout)
        if not done:  # the time limit: requests still in flight are cancelled and counted as such
            main.cancel()
            await asyncio.gather(main, return_exceptions=True)
            return time.perf_counter() - self.origin
        main.result()
        return (self.last_end or time.perf_counter()) - self.origin


async def run_load(
    config: LoadConfig,
    sessions: Sequence[Session] | None = None,
    client: httpx.AsyncClient | None = None,
    warmup_sessions: Sequence[Session] | None = None,
) -> Result:
    """One measured run at one concurrency (or request rate). Stops after num_requests or duration_s."""
    own = client is None
    client = client or make_client(config, config.concurrency)
    try:
        model = config.model or await discover_model(client, config.base_url)
        if sessions is None or (config.warmup_requests and warmup_sessions is None):
            tokenizer = await get_tokenizer(config, client, model)
            if sessions is None:
                sessions = await build_sessions(config, sessions_needed(config), tokenizer)
            if config.warmup_requests and warmup_sessions is None:
                warm_cfg = dataclasses.replace(config, num_requests=config.warmup_requests)
                warmup_sessions = await build_sessions(warm_cfg, sessions_needed(warm_cfg), tokenizer, seed=config.seed + 7919)
        if config.warmup_requests and warmup_sessions:
            warm_cfg = dataclasses.replace(config, num_requests=config.warmup_requests, duration_s=None)
            await _Runner(warm_cfg, client, model, warmup_sessions).run()
        runner = _Runner(config, client, model, sessions)
        if config.progress:
            from tqdm import tqdm

            runner.bar = tqdm(total=config.num_requests, desc=config.label or f"c={config.concurrency}", unit="req", leave=False)
        try:
            duration = await runner.run()
        finally:
            if runner.bar is not None:
                runner.bar.close()
        return aggregate(
            runner.records,
            duration,
            label=config.label,
            concurrency=config.concurrency,
            request_rate=config.request_rate,
            config={**config.to_dict(), "model": model},
            keep_records=config.keep_records,
        )
    finally:
        if own:
            await client.aclose()


async def run_sweep(config: LoadConfig, levels: Sequence[int], waves: int | None = None) -> list[Result]:
    """One run per concurrency level, each with its own fresh prompts (no prefix-cache help across levels)."""
    results = []
    async with make_client(config, max(levels)) as client:
        for i, level in enumerate(levels):
            n = max(config.num_requests, waves * level) if waves else config.num_requests
            cfg = dataclasses.replace(config, concurrency=level, num_requests=n, seed=config.seed + 1000 * i,
                                      label=config.label or f"c={level}")
            results.append(await run_load(cfg, client=client))
            print(format_result(results[-1]), file=sys.stderr)
    return results


# ----------------------------------------------------------------------------------------------
# Output


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1000:.1f}"


def format_result(r: Result) -> str:
    mode = f"rate={r.request_rate}/s" if r.request_rate else f"concurrency={r.concurrency}"
    lines = [
        f"[{r.label or mode}] {mode}: {r.completed} ok, {r.failed} failed, {r.cancelled} cancelled in {r.duration_s:.2f} s",
        f"  throughput: {r.request_throughput:.2f} req/s, {r.output_throughput:.1f} output tok/s, "
        f"{r.input_throughput:.1f} input tok/s (mean {r.mean_input_tokens:.1f} in / {r.mean_output_tokens:.1f} out"
        + (f", {r.mean_cached_tokens:.1f} cached" if r.mean_cached_tokens is not None else "")
        + (", usage from server" if r.usage_reported else ", output tokens counted as chunks")
        + ")",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s: Stats = getattr(r, name)
        lines.append(f"  {name:5s} ms: mean {_ms(s.mean)}  p50 {_ms(s.p50)}  p90 {_ms(s.p90)}  p99 {_ms(s.p99)}  (n={s.n})")
    if r.errors:
        lines.append("  errors: " + "; ".join(f"{n}x {e}" for e, n in list(r.errors.items())[:5]))
    if r.header_counts:
        lines.append("  headers: " + ", ".join(f"{h}: {dict(c)}" for h, c in r.header_counts.items()))
    return "\n".join(lines)


def plot_sweep(series: dict[str, Sequence[Result]], path: Path, title: str = "") -> Path | None:
    """Latency (TTFT p50/p99, TPOT p50) and output throughput against concurrency, one line per series."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, results in series.items():
        points = sorted((r for r in results if r.concurrency), key=lambda r: r.concurrency)  # type: ignore[arg-type, return-value]
        xs = [r.concurrency for r in points]
        prefix = f"{name} " if len(series) > 1 else ""
        line = lat.plot(xs, [r.ttft.p50 * 1000 for r in points], marker="o", label=f"{prefix}TTFT p50")[0]
        lat.plot(xs, [r.ttft.p99 * 1000 for r in points], marker="^", linestyle="--", color=line.get_color(), label=f"{prefix}TTFT p99")
        lat.plot(xs, [r.tpot.p50 * 1000 for r in points], marker="s", linestyle=":", color=line.get_color(), label=f"{prefix}TPOT p50")
        thr.plot(xs, [r.output_throughput for r in points], marker="o", color=line.get_color(), label=f"{prefix}output tok/s")
    for ax in (lat, thr):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.set_title("latency")
    thr.set_ylim(bottom=0)
    thr.set_ylabel("output tokens / s")
    thr.set_title("throughput")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timestamp() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")


# ----------------------------------------------------------------------------------------------
# CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (with /v1)")
    p.add_argument("--model", help="model name (default: the first of GET /models)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", type=int, nargs="+",
                   help="requests in flight (default 8); several levels: a sweep; with --request-rate: a cap (default none)")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead (concurrency becomes a cap)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (per concurrency level)")
    p.add_argument("--waves", type=int, help="at least WAVES x concurrency requests per level")
    p.add_argument("--duration", type=float, default=300.0, help="time limit of each run in seconds (0: none)")
    p.add_argument("--prompts", choices=["random", "shared-prefix", "multi-turn"], default="random")
    p.add_argument("--input-tokens", type=int, default=128, help="tokens per prompt (per user turn)")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared-prefix: tokens of the common prefix")
    p.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    p.add_argument("--unique-prompts", type=int, help="cycle through this many prompts (1: the same request again)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM): exactly --output-tokens tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (negative: server default)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests (TTFT = e2e)")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    p.add_argument("--api-key")
    p.add_argument("--count-header", action="append", default=None, help="response header whose values are counted (default x-cache)")
    p.add_argument("--tokenizer", choices=["auto", "server", "words"], default="auto",
                   help="count prompt tokens with the server's /tokenize (auto: when present) or as words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests before each run (not measured)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, help="JSON results file (default benchmarks/results/loadgen-<time>.json)")
    p.add_argument("--plot", type=Path, help="PNG plot (default: next to the JSON when several levels are run)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--save-requests", action="store_true", help="put every request's record in the JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def config_from(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        concurrency=args.concurrency[0] if args.concurrency else (None if args.request_rate else 8),
        request_rate=args.request_rate,
        num_requests=args.num_requests,
        duration_s=args.duration or None,
        prompts=args.prompts,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        prefix_tokens=args.prefix_tokens,
        num_prefixes=args.num_prefixes,
        turns=args.turns,
        unique_prompts=args.unique_prompts,
        ignore_eos=args.ignore_eos,
        temperature=None if args.temperature < 0 else args.temperature,
        stream=args.stream,
        extra_body=args.extra_body,
        api_key=args.api_key,
        count_headers=[h.lower() for h in (args.count_header or ["x-cache"])],
        tokenizer=args.tokenizer,
        seed=args.seed,
        warmup_requests=args.warmup,
        request_timeout_s=args.request_timeout,
        progress=args.progress and sys.stderr.isatty(),
        keep_records=args.save_requests,
    )


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = config_from(args)
    if args.request_rate:
        results = [asyncio.run(run_load(dataclasses.replace(config, label=f"rate={args.request_rate}")))]
        print(format_result(results[0]), file=sys.stderr)
    else:
        results = asyncio.run(run_sweep(config, args.concurrency or [8], args.waves))
    stamp = timestamp()
    output = args.output or RESULTS_DIR / f"loadgen-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "tool": "benchmarks.loadgen",
        "started": stamp,
        "argv": sys.argv if argv is None else ["loadgen", *argv],
        "config": config.to_dict(),
        "results": [r.to_dict(records=args.save_requests) for r in results],
    }
    output.write_text(json.dumps(document, indent=2))
    print(f"results: {output}", file=sys.stderr)
    if not args.no_plot and (args.plot or len(results) > 1):
        plot = plot_sweep({"": results}, args.plot or output.with_suffix(".png"), title=args.base_url)
        if plot:
            print(f"plot: {plot}", file=sys.stderr)
    return 0 if all(r.completed for r in results) else 1

