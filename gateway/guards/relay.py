"""Output guards on a remote model's answers: the OpenAI JSON an upstream answers with (a whole
answer, or a stream's chunks) read field by field through the filters that read an embedded
model's text (`stream.OutputGuard`).

Each string a choice carries (content, reasoning, refusal, tool-call arguments, a completion's
text, and any other the upstream adds) is a *slot*: a sliding window of its own. Structural fields
pass as they are; `name`s are checked whole. The tokens of `logprobs` are a slot too (the text
they spell): each goes out once that text has passed, a token inside a redacted span shows the
placeholder, and alternatives that would complete a match are left out. A blocking match in any
slot cuts the choice (`content_filter`); chunks left with nothing to show are not sent.
"""

from __future__ import annotations

from typing import Any

from engine.types import TokenLogprob
from gateway.guards.stream import CONTENT_FILTER, OutputGuard

STRUCTURAL = frozenset({"index", "role", "type", "id", "tool_call_id", "finish_reason", "stop_reason", "logprobs"})
WHOLE = frozenset({"name"})  # sent whole in one chunk: checked at once, never held back
Path = tuple[str | int, ...]


class RelayGuard:
    """The output guard of one relayed answer (whole, or a stream's chunks in order)."""

    def __init__(self, guard: OutputGuard) -> None:
        self.guard = guard
        self.slots: dict[tuple[int, Path], int] = {}  # (choice index, path of the field) → guard slot
        self.cut: set[int] = set()  # choices cut
        self.entries: dict[int, Any] = {}  # a logprob entry's upstream form, by the id it is read under
        self.offsets: dict[int, int] = {}  # completions' next text_offset, by choice
        self.read = 0  # logprob entries read so far (their ids)

    async def answer(self, data: Any) -> Any:
        """A whole answer, guarded (in place)."""
        if isinstance(data, dict) and isinstance(data.get("choices"), list):
            data["choices"] = [c for c in data["choices"] if isinstance(c, dict)]
            for choice in data["choices"]:
                await self._choice(choice, final=True)
        return data

    async def chunk(self, chunk: Any) -> Any | None:
        """One stream chunk, guarded (in place); None: nothing of it to send."""
        if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list) or not chunk["choices"]:
            return chunk  # usage, an error: no model text
        shown = [c for c in chunk["choices"]
                 if isinstance(c, dict) and await self._choice(c, final=c.get("finish_reason") is not None)]
        if not shown and not chunk.get("usage"):
            return None
        chunk["choices"] = shown
        return chunk

    async def _choice(self, raw: dict[str, Any], final: bool) -> bool:
        """Guard one choice (in place); whether it has anything to show."""
        index = raw.get("index", 0) if isinstance(raw.get("index", 0), int) else 0
        if index in self.cut:
            return False
        cut_by_tokens = await self._logprobs(index, raw, final)
        seen: set[Path] = set()
        for key in list(raw):
            if key not in STRUCTURAL:
                raw[key] = await self._value(index, (key,), raw[key], final, seen)
        if final and index not in self.cut:
            await self._flush(index, raw, seen)
        if cut_by_tokens:
            self._cut(index)
        if index in self.cut:
            raw["finish_reason"] = CONTENT_FILTER
        return raw.get("finish_reason") is not None or bool(raw.get("logprobs")) or any(
            _has_text(value) for key, value in raw.items() if key not in STRUCTURAL)

    async def _value(self, index: int, path: Path, value: Any, final: bool, seen: set[Path]) -> Any:
        if isinstance(value, str):
            seen.add(path)
            if index in self.cut:
                return ""
            whole = path[-1] in WHOLE
            slot = self._slot(index, path, moderated=not whole)
            text = await self.guard.feed(slot, value, final or whole)
            if self.guard.filters[slot].cut:
                self._cut(index)
            return text
        if isinstance(value, dict):
            for key in list(value):
                if key not in STRUCTURAL:
                    value[key] = await self._value(index, (*path, key), value[key], final, seen)
            return value
        if isinstance(value, list):
            return [await self._value(index, (*path, _item_key(item, i)), item, final, seen)
                    for i, item in enumerate(value)]
        return value

    async def _flush(self, index: int, raw: dict[str, Any], seen: set[Path]) -> None:
        """A finishing chunk: what the choice's other slots still hold back goes out with it."""
        for (choice, path), slot in list(self.slots.items()):
            if choice != index or path in seen or path[0] == "logprobs":
                continue
            text = await self.guard.feed(slot, "", True)
            if self.guard.filters[slot].cut:
                self._cut(index)
                return
            if text:
                _put(raw, path, text)

    def _slot(self, index: int, path: Path, moderated: bool = False) -> int:
        slot = self.slots.get((index, path))
        if slot is None:
            slot = self.slots[(index, path)] = self.guard.add_slot(moderated)
        return slot

    def _cut(self, index: int) -> None:
        self.cut.add(index)
        for (choice, _), slot in self.slots.items():
            if choice == index:
                choice_filter = self.guard.filters[slot]
                choice_filter.done = choice_filter.cut = True
                choice_filter.pending = ""
                choice_filter.logprobs.drop()

    # --- logprobs -------------------------------------------------------------------------------

    async def _logprobs(self, index: int, raw: dict[str, Any], final: bool) -> bool:
        """The choice's logprobs as they may be shown (in place); True when their tokens spell a
        blocked match (the choice is cut once its fields have been read)."""
        logprobs = raw.get("logprobs")
        if final:  # a finishing chunk without (some of) them: the tokens held back go out with it
            for choice, path in self.slots:
                if choice == index and path[0] == "logprobs":
                    if not isinstance(logprobs, dict):
                        logprobs = raw["logprobs"] = {}
                    name = "tokens" if len(path) == 1 else path[1]
                    if not isinstance(logprobs.get(name), list):
                        logprobs[name] = []
        if not isinstance(logprobs, dict):
            return False
        if "tokens" in logprobs:  # completions: parallel lists
            return await self._completion_logprobs(index, logprobs, final)
        cut = False
        for key, entries in logprobs.items():
            if isinstance(entries, list):
                tokens = [self._read_chat(entry) for entry in entries]
                shown, blocked = await self._tokens(index, ("logprobs", key), tokens, final)
                logprobs[key] = [self._shown_chat(token) for token in shown]
                cut = cut or blocked
        return cut

    async def _tokens(self, index: int, path: Path, tokens: list[TokenLogprob], final: bool
                      ) -> tuple[tuple[TokenLogprob, ...], bool]:
        """The tokens that may go out now, after the text they spell; whether it was cut."""
        slot = self._slot(index, path)
        await self.guard.feed(slot, "".join(token.token for token in tokens), final)
        choice_filter = self.guard.filters[slot]
        return choice_filter.passed_logprobs(tuple(tokens)) or (), choice_filter.cut

    def _read(self, upstream: Any, token: Any, logprob: Any, top: tuple[tuple[int, str, float], ...]) -> TokenLogprob:
        self.read += 1
        self.entries[self.read] = upstream
        return TokenLogprob(self.read, _text(token), logprob, None, top)

    def _read_chat(self, entry: Any) -> TokenLogprob:
        entry = entry if isinstance(entry, dict) else {}
        top = entry.get("top_logprobs") if isinstance(entry.get("top_logprobs"), list) else []
        alternatives = tuple((i, _text(a.get("token")), 0.0) for i, a in enumerate(top) if isinstance(a, dict))
        return self._read(entry, entry.get("token"), entry.get("logprob"), alternatives)

    def _shown_chat(self, token: TokenLogprob) -> dict[str, Any]:
        entry = dict(self.entries.pop(token.token_id))
        if token.token != entry.get("token"):  # inside a redacted span
            entry.update(token=token.token, top_logprobs=[],
                         **({"bytes": list(token.token.encode())} if entry.get("bytes") is not None else {}))
        elif len(token.top) != len(entry.get("top_logprobs") or ()):
            kept = {i for i, _, _ in token.top}
            entry["top_logprobs"] = [a for i, a in enumerate(entry["top_logprobs"]) if i in kept]
        return entry

    async def _completion_logprobs(self, index: int, logprobs: dict[str, Any], final: bool) -> bool:
        columns = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        lists: list[list[Any]] = [logprobs[name] if isinstance(logprobs.get(name), list) else [] for name in columns]
        tokens = []
        for i, token in enumerate(lists[0]):
            logprob, top, offset = (column[i] if i < len(column) else None for column in lists[1:])
            top = top if isinstance(top, dict) else {}
            if isinstance(offset, int):
                self.offsets.setdefault(index, offset)
            tokens.append(self._read((logprob, top), token, logprob, tuple(
                (j, _text(t), 0.0) for j, t in enumerate(top))))
        shown, blocked = await self._tokens(index, ("logprobs",), tokens, final)
        out: dict[str, list[Any]] = {name: [] for name in columns}
        for token in shown:
            logprob, top = self.entries.pop(token.token_id)
            kept = {t for _, t, _ in token.top}
            out["tokens"].append(token.token)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append({t: lp for t, lp in top.items() if t in kept} if top else None)
            offset = self.offsets.get(index, 0)
            out["text_offset"].append(offset)
            self.offsets[index] = offset + len(token.token)
        logprobs.update(out)
        return blocked


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _item_key(item: Any, position: int) -> int:
    """A list item's place in a choice's fields: a streamed tool call's `index`, else its position."""
    index = item.get("index") if isinstance(item, dict) else None
    return index if isinstance(index, int) else position


def _has_text(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value)
    if isinstance(value, dict):
        return any(_has_text(v) for k, v in value.items() if k != "index")
    if isinstance(value, list):
        return any(_has_text(v) for v in value)
    return False


def _put(raw: dict[str, Any], path: Path, text: str) -> None:
    """`text` added at `path` of a chunk's choice (a streamed tool call's item found by its index)."""
    container: Any = raw
    for key, after in zip(path, (*path[1:], None), strict=True):
        if isinstance(container, list):
            found = next((item for item in container if isinstance(item, dict) and item.get("index") == key), None)
            if found is None:
                found = {"index": key}
                container.append(found)
            container = found
            if after is None:
                return  # a string item of a list: not a field a chunk carries
            continue
        if after is None:
            container[key] = (container.get(key) or "") + text
            return
        if not isinstance(container.get(key), dict | list):
            container[key] = [] if isinstance(after, int) else {}
        container = container[key]
