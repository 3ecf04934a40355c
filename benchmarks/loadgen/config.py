"""What one run of the load generator does: `LoadConfig`, the settings the CLI and the race fill in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class LoadConfig:
    """One run: the load's shape, the prompts, the request options (the CLI's flags, nearly one for one)."""

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
    keep_records: bool = False  # put every request's record in Result.to_dict()
    ceiling_s: float = 0.0  # after the run: seconds of the same load against the instant endpoint (0: none)
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data.get("api_key"):
            data["api_key"] = "***"
        return data
