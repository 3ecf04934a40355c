"""The workload: prompts of random common words fitted to a token count (with the server's own
tokenizer, `POST /tokenize` and `/detokenize`, which the gateway and vLLM's server both offer next
to /v1), grouped into sessions (one per conversation), and the JSON body of each request a session sends."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

from benchmarks.loadgen.client import CLIENT_ERRORS, Client, get_json
from benchmarks.loadgen.results import LoadConfig


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /tokenize and /health live)."""
    return base_url.rstrip("/").removesuffix("/v1")


class ServerTokenizer:
    """Counts tokens with the server's own tokenizer (`POST /tokenize`, `POST /detokenize`)."""

    def __init__(self, client: Client, root: str, model: str) -> None:
        self.client, self.root, self.model = client, root, model

    async def tokenize(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        return list((await get_json(self.client, f"{self.root}/tokenize", body))["tokens"])

    async def detokenize(self, ids: list[int]) -> str:
        answer = await get_json(self.client, f"{self.root}/detokenize", {"model": self.model, "tokens": ids})
        return str(answer["prompt"])

    @classmethod
    async def probe(cls, client: Client, base_url: str, model: str) -> ServerTokenizer | None:
        """The server's tokenizer when it answers (None: count one word as one token)."""
        tokenizer = cls(client, root_url(base_url), model)
        try:
            ids = await tokenizer.tokenize("hello world")
            await tokenizer.detokenize(ids)
        except (*CLIENT_ERRORS, KeyError, TypeError):
            return None
        return tokenizer


async def get_tokenizer(config: LoadConfig, client: Client, model: str) -> ServerTokenizer | None:
    """The server's tokenizer as `config.tokenizer` asks (None: count one word as one token)."""
    if config.tokenizer == "words":
        return None
    tokenizer = await ServerTokenizer.probe(client, config.base_url, model)
    if tokenizer is None and config.tokenizer == "server":
        raise RuntimeError(f"{root_url(config.base_url)}/tokenize is not available")
    return tokenizer


# Common English words; with a BPE tokenizer each is about one token when preceded by a space.
_WORDS = """
time year people way day man thing woman life child world school state family student group country problem hand
part place case week company system program question work government number night point home water room mother area
money story fact month lot right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change morning reason research girl
guy moment air teacher force education foot boy age policy music market sense nation plan college interest death
experience effect use class control care field development role effort rate heart drug show leader light voice wife
"""
WORDS = _WORDS.split()


@dataclass
class Session:
    """What one worker sends: one request per user turn (several for multi-turn chats)."""

    turns: list[str]
    system: str | None = None  # shared-prefix: the common prefix
    input_tokens: int = 0  # estimate of the first request's prompt tokens (without a chat template)


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


MAX_SESSIONS = 50_000  # built up front; a longer run (a time limit with a huge request count) cycles through them


def sessions_needed(config: LoadConfig) -> int:
    """How many sessions a run can start (fewer when `unique_prompts` cycles through a few, and at
    most MAX_SESSIONS: prompts are made before the run, so that making them costs the run nothing)."""
    turns = config.turns if config.prompts == "multi-turn" else 1
    wanted = math.ceil(config.num_requests / turns)
    if config.unique_prompts:
        wanted = min(wanted, config.unique_prompts)
    return max(min(wanted, MAX_SESSIONS), 1)


def request_body(config: LoadConfig, model: str, session: Session, history: list[tuple[str, str]], turn: str) -> dict[str, Any]:
    """The JSON body of one request: the session's shared prefix (chat: the system message), the
    conversation so far, then this turn (completions: the same parts, one per line)."""
    body: dict[str, Any] = {"model": model, "max_tokens": config.output_tokens, "stream": config.stream}
    if config.stream:
        body["stream_options"] = {"include_usage": True}
    said = [(role, text) for user, answer in history for role, text in (("user", user), ("assistant", answer))]
    parts = [*([("system", session.system)] if session.system else []), *said, ("user", turn)]
    if config.endpoint == "chat":
        body["messages"] = [{"role": role, "content": text} for role, text in parts]
    else:
        body["prompt"] = "\n".join(text for _, text in parts)
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body | config.extra_body
