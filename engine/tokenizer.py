"""The engine's Hugging Face tokenizer, narrowed to what the gateway uses, and chat prompts whose client text stays
text (no forged control tokens)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers import Tokenizer  # transformers' fast tokenizers are built on it

from engine.errors import EngineInvalidRequest
from engine.types import ChatPrompt


def map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """`value` (JSON-like: dicts, lists, strings) with every string, dict keys included, changed."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {change(k) if isinstance(k, str) else k: map_strings(v, change) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [map_strings(v, change) for v in value]
    return value


class HFTokenizer:
    """A Hugging Face tokenizer (vLLM's cached one, or transformers' own) behind `engine.types.Tokenizer`.

    `prompt_special_tokens`: how `encode_prompt` (a completion's raw prompt) reads added-token
    spellings: "tokens" as vLLM does, "text" as any other text."""

    def __init__(self, tokenizer: Any, prompt_special_tokens: str = "tokens") -> None:
        self._tokenizer = tokenizer
        self.takes_tools = "tools" in str(getattr(tokenizer, "chat_template", "") or "")
        self.prompt_special_tokens = prompt_special_tokens
        added: dict[str, int] = dict(tokenizer.get_added_vocab())
        self._added = added
        self._spelling = re.compile("|".join(re.escape(s) for s in sorted(added, key=len, reverse=True))) if added else None
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._lstrip = {str(t) for t in decoder.values() if getattr(t, "lstrip", False)}
        self._rstrip = {str(t) for t in decoder.values() if getattr(t, "rstrip", False)}
        self._plain = _without_added_tokens(tokenizer)

    @property
    def added_tokens(self) -> dict[str, int]:
        """Every added token (special or not) by spelling: what `encode` turns from text into a token."""
        return dict(self._added)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_text(self, text: str) -> list[int]:
        """`text` as text: an added token's spelling in it is its characters, not the token."""
        if self._plain is not None:
            return list(self._plain.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion's text prompt: its special-token spellings as `prompt_special_tokens` says
        (the tokenizer's own start and end tokens added either way when asked, as vLLM does)."""
        if self.prompt_special_tokens == "tokens" or self._spelling is None or not self._spelling.search(text):
            return self.encode(text, add_special_tokens)
        ids = self.encode_text(text)
        return self._with_edges(ids) if add_special_tokens else ids

    def _with_edges(self, ids: list[int]) -> list[int]:
        """`ids` between the start and end tokens the tokenizer adds to a text (none for many)."""
        whole, core = self.encode("a", add_special_tokens=True), self.encode("a", add_special_tokens=False)
        for at in range(len(whole) - len(core) + 1):
            if whole[at : at + len(core)] == core:
                return [*whole[:at], *ids, *whole[at + len(core) :]]
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        try:
            return str(self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            ))
        except Exception as exc:  # jinja errors: the messages do not fit the template
            raise EngineInvalidRequest(f"the chat template refused the messages: {exc}", "messages") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> ChatPrompt:
        """The rendered prompt and its ids. Each added-token spelling in a client string is replaced by a per-request
        sentinel before the template renders; the spellings left are the template's markup and become tokens, and
        the text between them (sentinels restored) is encoded without added tokens. When no client string holds a
        spelling the result is the plain encoding, byte for byte."""
        hidden = _Sentinels(self._spelling)
        messages_h, kwargs_h = map_strings(messages, hidden.hide), map_strings(kwargs, hidden.hide)
        if not hidden.spellings:  # no client string spells an added token: as the template renders it
            text = self.render_chat(messages, add_generation_prompt, **kwargs)
            return ChatPrompt(text, self.encode(text, add_special_tokens=False))
        rendered = self.render_chat(messages_h, add_generation_prompt, **kwargs_h)
        return ChatPrompt(hidden.restore(rendered), self.encode_marked(rendered, hidden.restore))

    def encode_marked(self, rendered: str, restore: Callable[[str], str] = lambda text: text) -> list[int]:
        """`rendered`'s added-token spellings as their tokens, the text between them (`restore`d)
        as text: what `encode` does, but for what `restore` puts back."""
        if self._spelling is None:
            return self.encode_text(restore(rendered))
        ids: list[int] = []
        start, strip_left = 0, False
        for match in self._spelling.finditer(rendered):
            spelling = match.group()
            ids += self._run(rendered[start : match.start()], restore, strip_left, spelling in self._lstrip)
            ids.append(self._added[spelling])
            start, strip_left = match.end(), spelling in self._rstrip
        return ids + self._run(rendered[start:], restore, strip_left, False)

    def _run(self, text: str, restore: Callable[[str], str], strip_left: bool, strip_right: bool) -> list[int]:
        if strip_left:
            text = text.lstrip()
        if strip_right:
            text = text.rstrip()
        return self.encode_text(restore(text)) if text else []


class _Sentinels:
    """Added-token spellings in client strings, hidden behind sentinels of one request's nonce."""

    def __init__(self, spelling: re.Pattern[str] | None) -> None:
        self._spelling = spelling
        self._nonce = "s" + os.urandom(8).hex()
        self._marker = re.compile(self._nonce + r"x(\d+)x")
        self.spellings: list[str] = []
        self._index: dict[str, int] = {}

    def hide(self, text: str) -> str:
        if self._spelling is None or not self._spelling.search(text):
            return text
        return self._spelling.sub(self._sentinel, text)

    def _sentinel(self, match: re.Match[str]) -> str:
        spelling = match.group()
        if spelling not in self._index:
            self._index[spelling] = len(self.spellings)
            self.spellings.append(spelling)
        return f"{self._nonce}x{self._index[spelling]}x"

    def restore(self, text: str) -> str:
        if not self.spellings:
            return text
        return self._marker.sub(lambda m: self.spellings[int(m.group(1))], text)


def _without_added_tokens(tokenizer: Any) -> Any:
    """The fast tokenizer's backend with no added tokens (so it encodes their spellings as text);
    None for a tokenizer without one (the slow ones: `split_special_tokens` instead)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
        spec["added_tokens"] = []
        return Tokenizer.from_str(json.dumps(spec))
    except Exception:  # a backend that cannot be rebuilt: fall back to split_special_tokens
        return None
