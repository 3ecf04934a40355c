"""Counting prompt tokens with the server's own tokenizer (`POST /tokenize`, `POST /detokenize`),
which the gateway and vLLM's server both offer next to /v1."""

from __future__ import annotations

from benchmarks.loadgen.client import CLIENT_ERRORS, Client, get_json
from benchmarks.loadgen.config import LoadConfig


def root_url(base_url: str) -> str:
    """http://host:port/v1 -> http://host:port (where /tokenize and /health live)."""
    base = base_url.rstrip("/")
    return base.removesuffix("/v1")


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
