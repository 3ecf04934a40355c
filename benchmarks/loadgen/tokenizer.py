"""Counting prompt tokens with the server's own tokenizer (`POST /tokenize`, `POST /detokenize`),
which the gateway and vLLM's server both offer next to /v1."""

from __future__ import annotations

import httpx

from benchmarks.loadgen.config import LoadConfig


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


async def get_tokenizer(config: LoadConfig, client: httpx.AsyncClient, model: str) -> ServerTokenizer | None:
    """The server's tokenizer as `config.tokenizer` asks (None: count one word as one token)."""
    if config.tokenizer == "words":
        return None
    tokenizer = await ServerTokenizer.probe(client, config.base_url, model)
    if tokenizer is None and config.tokenizer == "server":
        raise RuntimeError(f"{root_url(config.base_url)}/tokenize is not available")
    return tokenizer
