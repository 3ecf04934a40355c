"""A remote model's request, counted before it is forwarded (no tokenizer of the upstream's model
here): the prompt's text at 4 characters a token (OpenAI's rule of thumb), token-id prompts by their
length, plus the output budget asked for (max_tokens or max_completion_tokens, times n and the
prompts; completions' default 16; chat without one: 0, counted after). The upstream's usage, when
it reports one, is the count that stays (`generation.Run`)."""

from __future__ import annotations

import math
from typing import Any

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
